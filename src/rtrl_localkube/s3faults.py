"""A faulty S3 in front of a real one: an HTTP proxy to moto's server that answers chosen
requests with an S3 error, or at random with errors and cut bodies, so botocore's and the
store's real retry paths run over real HTTP.

Two kinds of fault, as a busy S3 shows them:

- an error response (``503 SlowDown`` by default), with S3's XML error body;
- a *cut body*: the real response's status and headers (its full ``Content-Length``), then
  only part of the body, and the connection closed. The client's read breaks off mid-body,
  after botocore's request loop has returned, which is why the store retries bodies itself.

:meth:`FaultProxy.fail` and :meth:`FaultProxy.cut` inject one or the other into the
requests a matcher picks (the store's tests); :meth:`FaultProxy.chaos` injects both at random
rates from a seed (a stage run under a busy S3, ``bench/s3_faults.py``, the chaos soak).
``log`` records every request. Used by the tests and the benchmarks only; neither image
ships it.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import re
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from email.message import Message
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, NamedTuple

__all__ = ["CUT", "Entry", "FaultProxy", "Matcher", "serve_fault_proxy"]

# (method, path as sent, request headers) -> whether a fault applies to this request.
Matcher = Callable[[str, str, Message], bool]

# The status ``log`` records for a response whose body was cut (its real status is lost).
CUT = -1


class Entry(NamedTuple):
    """One request the proxy answered. ``range`` is the request's Range header ("" without),
    so the tries of one ranged read can be told from the reads of other ranges."""

    method: str
    path: str
    status: int  # CUT for a cut body
    range: str = ""

    @property
    def request(self) -> tuple[str, str, str]:
        return (self.method, self.path, self.range)


@dataclass
class _Fault:
    matches: Matcher
    remaining: int  # negative: forever
    status: int
    code: str


# The bucket in a path-style request path: left out of what a fault is drawn from, so that
# the same seed faults the same requests in a fresh bucket.
_BUCKET_PART = re.compile(r"^/[^/?]*")


@dataclass
class _Chaos:
    error_rate: float
    cut_rate: float
    status: int
    code: str
    seed: int
    tries: dict[tuple[str, str, str], int] = field(default_factory=dict)

    def draw(self, kind: str, request: tuple[str, str, str], attempt: int) -> float:
        """A number in [0, 1) fixed by the seed, the request and its try number."""
        method, path, byte_range = request
        text = f"{self.seed}|{kind}|{method}|{_BUCKET_PART.sub('', path)}|{byte_range}|{attempt}"
        digest = hashlib.sha256(text.encode()).digest()
        return int.from_bytes(digest[:8], "big") / 2**64


@dataclass
class FaultProxy:
    """The proxy's state: which faults to inject, and what it answered (``log``, an
    :class:`Entry` per request in the order answered)."""

    upstream: str  # host:port
    log: list[Entry] = field(default_factory=list)
    faults: list[_Fault] = field(default_factory=list)
    cuts: list[_Fault] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    _chaos: _Chaos | None = None

    def fail(
        self, matches: Matcher, times: int = 1, *, status: int = 503, code: str = "SlowDown"
    ) -> None:
        """Answer the next ``times`` matching requests (-1: all of them) with ``status``."""
        with self.lock:
            self.faults.append(_Fault(matches, times, status, code))

    def cut(self, matches: Matcher, times: int = 1) -> None:
        """Cut the body of the next ``times`` matching responses (-1: all of them)."""
        with self.lock:
            self.cuts.append(_Fault(matches, times, CUT, ""))

    def chaos(
        self,
        error_rate: float,
        cut_rate: float,
        *,
        seed: int = 0,
        status: int = 503,
        code: str = "SlowDown",
    ) -> None:
        """From now on, answer each request with ``status`` at ``error_rate``, and cut the
        body of each other response that has one at ``cut_rate``; (0, 0) stops.

        Whether a fault hits is a function of the seed, the request (method, path without
        the bucket, Range) and how many times it was sent before, not of the order in which
        requests arrive: a client that reads concurrently meets the same faults on every
        run with the same seed."""
        for name, rate in (("error_rate", error_rate), ("cut_rate", cut_rate)):
            if not 0.0 <= rate <= 1.0:
                raise ValueError(f"{name} {rate} is not in [0, 1]")
        with self.lock:
            self._chaos = _Chaos(error_rate, cut_rate, status, code, seed)

    def take_fault(self, method: str, path: str, headers: Message) -> _Fault | None:
        with self.lock:
            for fault in self.faults:
                if fault.remaining != 0 and fault.matches(method, path, headers):
                    fault.remaining -= 1
                    return fault
            chaos = self._chaos
            if chaos is None:
                return None
            request = (method, path, headers.get("Range") or "")
            attempt = chaos.tries[request] = chaos.tries.get(request, 0) + 1
            if chaos.draw("error", request, attempt) < chaos.error_rate:
                return _Fault(lambda *_: True, 0, chaos.status, chaos.code)
        return None

    def take_cut(self, method: str, path: str, headers: Message, body_length: int) -> bool:
        """Whether to cut this response's body (only a body can be cut)."""
        if method == "HEAD" or body_length == 0:
            return False
        with self.lock:
            for fault in self.cuts:
                if fault.remaining != 0 and fault.matches(method, path, headers):
                    fault.remaining -= 1
                    return True
            chaos = self._chaos
            if chaos is None:
                return False
            request = (method, path, headers.get("Range") or "")
            return chaos.draw("cut", request, chaos.tries.get(request, 1)) < chaos.cut_rate

    def record(self, method: str, path: str, status: int, headers: Message) -> None:
        with self.lock:
            self.log.append(Entry(method, path, status, headers.get("Range") or ""))

    def counts(self) -> dict[str, int]:
        """Requests answered, error responses (status >= 500), bodies cut, and the longest
        run of cuts one request met before a try of it succeeded (:meth:`longest_cut_run`)."""
        with self.lock:
            statuses = [entry.status for entry in self.log]
        return {
            "requests": len(statuses),
            "errors": sum(1 for s in statuses if s >= 500),
            "cut": statuses.count(CUT),
            "longest_cut_run": self.longest_cut_run(),
        }

    def longest_cut_run(self) -> int:
        """The most times one request (method, path, range) had its body cut with no
        success in between; error answers between the cuts do not end the run (they are the
        client's own retries of one read). A client that retries a body ``n`` times in all
        survives runs shorter than ``n``."""
        runs: dict[tuple[str, str, str], int] = {}
        longest = 0
        with self.lock:
            entries = list(self.log)
        for entry in entries:
            if entry.status == CUT:
                runs[entry.request] = runs.get(entry.request, 0) + 1
                longest = max(longest, runs[entry.request])
            elif entry.status < 300:
                runs.pop(entry.request, None)
        return longest


_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "server", "date"}


class _ProxyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as S3 does; botocore reuses connections
    server: _ProxyServer

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _handle(self) -> None:
        proxy = self.server.proxy
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        fault = proxy.take_fault(self.command, self.path, self.headers)
        if fault is not None:
            self._send_error(fault)
            return
        conn = http.client.HTTPConnection(proxy.upstream, timeout=30)
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
            if body:
                headers["Content-Length"] = str(len(body))
            conn.request(self.command, self.path, body=body, headers=headers)
            response = conn.getresponse()
            data = response.read()
            cut = proxy.take_cut(self.command, self.path, self.headers, len(data))
            # Recorded before answering: once the client has the answer, a test may read
            # the log at once.
            proxy.record(self.command, self.path, CUT if cut else response.status, self.headers)
            self.send_response(response.status, response.reason)
            for key, value in response.getheaders():
                if key.lower() not in _HOP_BY_HOP:
                    self.send_header(key, value)
            if self.command == "HEAD":
                self.send_header("Content-Length", response.getheader("Content-Length") or "0")
            else:
                self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command == "HEAD":
                return
            if cut:
                self._send_cut(data)
            else:
                self.wfile.write(data)
        finally:
            conn.close()

    def _send_error(self, fault: _Fault) -> None:
        proxy = self.server.proxy
        payload = (
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            f"<Error><Code>{fault.code}</Code><Message>injected by the fault proxy"
            "</Message><RequestId>proxy</RequestId></Error>"
        ).encode()
        proxy.record(self.command, self.path, fault.status, self.headers)
        self.send_response(fault.status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(payload)

    def _send_cut(self, data: bytes) -> None:
        """Half the body (at least one byte short), then the connection closed: what the
        client sees when S3 or the network drops a response mid-body."""
        self.wfile.write(data[: len(data) // 2])
        self.wfile.flush()
        self.close_connection = True
        with contextlib.suppress(OSError):  # the client may have left first
            self.connection.shutdown(socket.SHUT_RDWR)

    # http.server dispatches on these names.
    do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _handle  # noqa: N815


class _ProxyServer(ThreadingHTTPServer):
    daemon_threads = True
    proxy: FaultProxy


@contextmanager
def serve_fault_proxy(upstream: str) -> Iterator[tuple[FaultProxy, str]]:
    """(proxy, its endpoint URL) in front of ``upstream`` (``http://host:port``), served on
    127.0.0.1 on a thread until the block ends."""
    proxy = FaultProxy(upstream=upstream.removeprefix("http://"))
    server = _ProxyServer(("127.0.0.1", 0), _ProxyHandler)
    server.proxy = proxy
    # A short poll interval keeps shutdown (once per test) from costing half a second.
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    host, port = server.server_address[:2]
    try:
        yield proxy, f"http://{host!s}:{port}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
