"""A reverse proxy between the operator and the real kube-apiserver that can kill the
operator right after one of its writes: the write is done on the server, the writer never
hears back (what the emulator's ``after_write`` hook did, on the real control plane).

The operator's kubeconfig points at the proxy (plain HTTP on 127.0.0.1; the proxy speaks
TLS to the API server and passes the operator's own bearer token through, so RBAC is the
operator's). Watches stream through chunk by chunk. For each write (POST, PUT, PATCH,
DELETE) the proxy forwards the request, reads the whole answer, records it as a
:class:`Write`, then calls ``after_write``; when that kills the operator (SIGKILL, and
returns once it is gone), the answer goes nowhere.

Every connection belongs to the operator run that opened it (a *generation*);
:meth:`KillProxy.next_generation` (called at each kill) makes the proxy refuse whatever the
dead run's connections still send, so no request of a dead operator reaches the server after
its death: only the ones already in flight, as with a real crash.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import socket
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

WRITES = ("POST", "PUT", "PATCH", "DELETE")
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade"}


@dataclass(frozen=True)
class Write:
    """One write the server answered: ``path`` without the query, the request ``body`` and
    the ``answer`` decoded (None when not JSON), ``at`` (time.monotonic), ``generation``."""

    method: str
    path: str
    body: Any
    status: int
    answer: Any
    at: float
    generation: int

    @property
    def name(self) -> str:
        """The object's name: the answer's, else the path's last part."""
        meta = (self.answer or {}).get("metadata") if isinstance(self.answer, dict) else None
        if isinstance(meta, dict) and meta.get("name") and self.method != "DELETE":
            return str(meta["name"])
        parts = self.path.rstrip("/").split("/")
        return parts[-2] if parts[-1] == "status" else parts[-1]

    @property
    def plural(self) -> str:
        """The resource (``jobs``, ``checkpoints``, ...) the write went to."""
        parts = self.path.split("/")
        at = parts.index("namespaces") + 2 if "namespaces" in parts else len(parts) - 1
        return parts[at] if at < len(parts) else ""

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    def __str__(self) -> str:
        return f"{self.method} {self.path} -> {self.status}"


@dataclass
class Read:
    """A read's method, path (no query) and when it was answered."""

    path: str
    at: float
    generation: int
    watch: bool = False


@dataclass
class KillProxy:
    """The proxy; use as a context manager. ``url``: where the operator connects."""

    upstream: str
    ca_file: Path | None = None  # the server's CA (https); None: an http:// upstream
    after_write: Callable[[Write], None] | None = None
    writes: list[Write] = field(default_factory=list)
    reads: list[Read] = field(default_factory=list)
    generation: int = 0
    errors: list[str] = field(default_factory=list)
    _server: ThreadingHTTPServer | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _open: set[socket.socket] = field(default_factory=set)

    @property
    def url(self) -> str:
        assert self._server is not None, "not started"
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> KillProxy:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        proxy = self

        class Handler(_Handler):
            owner = proxy

        self._server = _Server(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name="killproxy", daemon=True).start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self.next_generation()

    def next_generation(self) -> None:
        """The operator run that owned every open connection is dead: refuse the rest of
        what they send, and cut their streams (the watches upstream end with them)."""
        with self._lock:
            self.generation += 1
            sockets, self._open = list(self._open), set()
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def kubeconfig(self, path: Path, token: str, namespace: str = "default") -> Path:
        """A kubeconfig (0600) for the proxy, with ``token`` (the operator's)."""
        doc = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "proxy", "cluster": {"server": self.url}}],
            "users": [{"name": "operator", "user": {"token": token}}],
            "contexts": [
                {"name": "proxy", "context": {"cluster": "proxy", "user": "operator",
                                               "namespace": namespace}}
            ],
            "current-context": "proxy",
        }  # fmt: skip
        path.write_text(json.dumps(doc))
        path.chmod(0o600)
        return path

    # --- for the handler ---------------------------------------------------------------
    def _connection(self) -> http.client.HTTPConnection:
        split = urllib.parse.urlsplit(self.upstream)
        host = split.hostname or "127.0.0.1"
        if split.scheme == "http":
            return http.client.HTTPConnection(host, split.port, timeout=400)
        context = ssl.create_default_context(
            cafile=None if self.ca_file is None else os.fspath(self.ca_file)
        )
        return http.client.HTTPSConnection(host, split.port, context=context, timeout=400)

    def _adopt(self, sock: socket.socket) -> int:
        with self._lock:
            self._open.add(sock)
            return self.generation

    def _forget(self, sock: socket.socket | None) -> None:
        with self._lock:
            if sock is not None:
                self._open.discard(sock)

    def _current(self, generation: int) -> bool:
        with self._lock:
            return generation == self.generation


class _Server(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client gone mid-request (a killed operator) is no error worth a traceback."""


class _Handler(BaseHTTPRequestHandler):
    owner: KillProxy
    protocol_version = "HTTP/1.1"
    generation = -1

    upstream: http.client.HTTPConnection | None = None

    def setup(self) -> None:
        super().setup()
        self.generation = self.owner._adopt(self.connection)

    def finish(self) -> None:
        with contextlib.suppress(OSError):
            super().finish()
        self.owner._forget(self.connection)
        if self.upstream is not None:
            self.owner._forget(self.upstream.sock)
            self.upstream.close()

    def _upstream(self) -> http.client.HTTPConnection:
        """One connection to the server per client connection, as the client keeps it."""
        if self.upstream is None:
            self.upstream = self.owner._connection()
            self.upstream.connect()
            if self.upstream.sock is not None:
                self.owner._adopt(self.upstream.sock)
        return self.upstream

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self._forward()

    do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = do_GET  # noqa: N815

    def _forward(self) -> None:
        owner = self.owner
        length = int(self.headers.get("Content-Length") or 0)
        data = self.rfile.read(length) if length else None
        if not owner._current(self.generation):
            self.close_connection = True  # a dead run's request: it never reaches the server
            return
        headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
        headers["Host"] = urllib.parse.urlsplit(owner.upstream).netloc
        try:
            conn = self._upstream()
            conn.request(self.command, self.path, body=data, headers=headers)
            response = conn.getresponse()
            path = self.path.split("?")[0]
            if self.command in WRITES:
                self._answer_write(response, path, data)
            else:
                watch = "watch=" in self.path
                owner.reads.append(Read(path, time.monotonic(), self.generation, watch))
                self._relay(response)
        except (OSError, http.client.HTTPException) as exc:
            self.close_connection = True
            if owner._current(self.generation):
                owner.errors.append(f"{self.command} {self.path}: {exc!r}")

    def _answer_write(self, response: http.client.HTTPResponse, path: str, data: Any) -> None:
        owner = self.owner
        raw = response.read()
        write = Write(
            self.command, path, _json(data), response.status, _json(raw), time.monotonic(),
            self.generation,
        )  # fmt: skip
        owner.writes.append(write)
        if owner.after_write is not None:
            try:
                owner.after_write(write)
            except Exception as exc:  # never answer for a broken hook: say so to the test
                owner.errors.append(f"after_write({write}): {exc!r}")
        if not owner._current(self.generation):
            self.close_connection = True  # killed: the writer never hears back
            return
        self._head(response, len(raw))
        self.wfile.write(raw)

    def _head(self, response: http.client.HTTPResponse, length: int | None) -> None:
        self.send_response_only(response.status, response.reason)
        for key, value in response.getheaders():
            if key.lower() not in HOP_BY_HOP and key.lower() != "content-length":
                self.send_header(key, value)
        if length is None:
            self.send_header("Transfer-Encoding", "chunked")
        else:
            self.send_header("Content-Length", str(length))
        self.end_headers()

    def _relay(self, response: http.client.HTTPResponse) -> None:
        """A read's answer; a chunked one (a watch) is relayed chunk by chunk as it comes."""
        if response.getheader("Transfer-Encoding", "").lower() != "chunked":
            raw = response.read()
            self._head(response, len(raw))
            self.wfile.write(raw)
            return
        self._head(response, None)
        while True:
            chunk = response.read1(65536)
            if not chunk:
                break
            self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


def _json(raw: bytes | None) -> Any:
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return None


__all__ = ["KillProxy", "Read", "Write"]
