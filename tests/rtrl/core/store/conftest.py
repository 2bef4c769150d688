"""Fixtures for the object-store suite: on the moto S3 server of tests/conftest.py, a
fault-injecting HTTP proxy in front of it, and a ``make_store`` factory parametrised over
both backends so every behaviour is checked on ``file://`` and ``s3://`` alike."""

from __future__ import annotations

import http.client
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from email.message import Message
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import boto3
import pytest

from rtrl.core.store import ObjectStore
from rtrl.core.store.local import LocalStore
from rtrl.core.store.s3 import S3Store

# Recognisable fake credentials: tests assert they never show up in an error.
ACCESS_KEY = "AKIATESTACCESSKEY000"
SECRET_KEY = "s3cr3t-DO-NOT-LEAK-0123456789abcdef"
SESSION_TOKEN = "t0ken-DO-NOT-LEAK-fedcba9876543210"

Matcher = Callable[[str, str, Message], bool]


@pytest.fixture(autouse=True)
def aws_env(
    monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, str]:
    """Dummy credentials through the default chain, and nothing from the host's AWS config;
    returns the credentials so tests can assert they never appear in an error."""
    empty = tmp_path_factory.getbasetemp() / "no-aws-config"
    for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ROLE_ARN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    monkeypatch.setenv("AWS_SESSION_TOKEN", SESSION_TOKEN)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(empty))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(empty))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    return {
        "AWS_ACCESS_KEY_ID": ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        "AWS_SESSION_TOKEN": SESSION_TOKEN,
    }


@dataclass
class _Fault:
    matches: Matcher
    remaining: int  # negative: forever
    status: int
    code: str


@dataclass
class FaultProxy:
    """A forwarding HTTP proxy to moto that answers chosen requests with an S3 error, so
    botocore's real retry path runs over HTTP. ``log`` records (kind, status) per request,
    where kind is ``METHOD path`` as the client sent it."""

    upstream: str  # host:port
    log: list[tuple[str, str, int]] = field(default_factory=list)
    faults: list[_Fault] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def fail(
        self, matches: Matcher, times: int = 1, *, status: int = 503, code: str = "SlowDown"
    ) -> None:
        """Answer the next ``times`` matching requests (-1: all of them) with ``status``."""
        with self.lock:
            self.faults.append(_Fault(matches, times, status, code))

    def take_fault(self, method: str, path: str, headers: Message) -> _Fault | None:
        with self.lock:
            for fault in self.faults:
                if fault.remaining != 0 and fault.matches(method, path, headers):
                    fault.remaining -= 1
                    return fault
        return None

    def record(self, method: str, path: str, status: int) -> None:
        with self.lock:
            self.log.append((method, path, status))


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
            payload = (
                '<?xml version="1.0" encoding="UTF-8"?>\n'
                f"<Error><Code>{fault.code}</Code><Message>injected by the test proxy"
                "</Message><RequestId>proxy</RequestId></Error>"
            ).encode()
            # Recorded before answering: once the client has the answer, the test may read
            # the log at once.
            proxy.record(self.command, self.path, fault.status)
            self.send_response(fault.status)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(payload)
            return
        conn = http.client.HTTPConnection(proxy.upstream, timeout=30)
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
            if body:
                headers["Content-Length"] = str(len(body))
            conn.request(self.command, self.path, body=body, headers=headers)
            response = conn.getresponse()
            data = response.read()
            proxy.record(self.command, self.path, response.status)
            self.send_response(response.status, response.reason)
            for key, value in response.getheaders():
                if key.lower() not in _HOP_BY_HOP:
                    self.send_header(key, value)
            if self.command == "HEAD":
                self.send_header("Content-Length", response.getheader("Content-Length") or "0")
            else:
                self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)
        finally:
            conn.close()

    # http.server dispatches on these names.
    do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _handle  # noqa: N815


class _ProxyServer(ThreadingHTTPServer):
    daemon_threads = True
    proxy: FaultProxy


@pytest.fixture
def fault_proxy(moto_endpoint: str) -> Iterator[tuple[FaultProxy, str]]:
    """(proxy, its endpoint URL), forwarding to the module's moto server."""
    proxy = FaultProxy(upstream=moto_endpoint.removeprefix("http://"))
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


def new_bucket(endpoint: str) -> str:
    name = f"rtrl-test-{uuid.uuid4().hex[:12]}"
    client = boto3.session.Session().client("s3", endpoint_url=endpoint)
    client.create_bucket(Bucket=name)
    client.close()
    return name


StoreFactory = Callable[..., ObjectStore]


@pytest.fixture(params=["file", "s3"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def make_store(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[StoreFactory]:
    """Build a fresh store of the test's backend; keyword arguments are S3Store options
    (ignored for ``file://``), e.g. ``page_size`` or ``multipart_threshold``."""
    stores: list[S3Store] = []

    def factory(**s3_options: Any) -> ObjectStore:
        if backend == "file":
            root = tmp_path / f"store-{uuid.uuid4().hex[:8]}"
            return LocalStore(root)
        endpoint = request.getfixturevalue("moto_endpoint")
        s3_options.setdefault("endpoint_url", endpoint)
        store = S3Store(new_bucket(endpoint), "runs/test-prefix", **s3_options)
        stores.append(store)
        return store

    yield factory
    for store in stores:
        store.client.close()


@pytest.fixture
def store(make_store: StoreFactory) -> ObjectStore:
    return make_store()
