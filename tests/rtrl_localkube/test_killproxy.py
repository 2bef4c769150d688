"""The kill proxy and the fork server, on a small HTTP server of the test's own: a child of
the fork server writes through the proxy and is killed after the write is done and before it
hears back; a watch streams through chunk by chunk; a dead run's later requests never reach
the server."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from rtrl_localkube.forkserver import ForkServer
from rtrl_localkube.killproxy import KillProxy, Write


class Upstream(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    received: list[str] = []

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.received.append(f"POST {self.path} {body.decode()}")
        answer = json.dumps({"metadata": {"name": json.loads(body)["name"]}}).encode()
        self.send_response(201)
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def do_GET(self) -> None:  # a watch: three events, 0.1 s apart
        self.send_response(200)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for n in range(3):
            line = json.dumps({"type": "ADDED", "n": n}).encode() + b"\n"
            self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
            self.wfile.flush()
            time.sleep(0.1)
        self.wfile.write(b"0\r\n\r\n")


@pytest.fixture
def upstream() -> Iterator[str]:
    Upstream.received = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), Upstream)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


WRITER = """
import sys, time, urllib.request
def main(argv):
    for n in range(3):
        req = urllib.request.Request(argv[0] + "/api/v1/namespaces/ns/things",
                                     data=('{"name": "t%d"}' % n).encode(), method="POST")
        with urllib.request.urlopen(req, timeout=10) as response:
            print("answered", response.read().decode(), flush=True)
    return 0
"""


def test_a_child_is_killed_after_its_write_and_never_hears_back(
    upstream: str, tmp_path: Path
) -> None:
    (tmp_path / "writer_mod.py").write_text(WRITER)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    with ForkServer(["writer_mod"], env=env) as server, KillProxy(upstream) as proxy:
        children = []

        def kill(write: Write) -> None:
            children[0].kill()
            children[0].wait(5)
            proxy.next_generation()

        proxy.after_write = kill
        log = tmp_path / "child.log"
        started = time.monotonic()
        children.append(
            server.spawn("writer_mod:main", [proxy.url], env=env, cwd=tmp_path, log=log)
        )
        assert children[0].wait(10) == -9
        assert time.monotonic() - started < 5  # a fork, not a fresh interpreter's imports
        assert Upstream.received == ['POST /api/v1/namespaces/ns/things {"name": "t0"}']
        assert [(w.method, w.plural, w.name, w.status) for w in proxy.writes] == [
            ("POST", "things", "t0", 201)
        ]
        assert "answered" not in log.read_text()  # the write was done; no answer came back


def test_a_watch_streams_through_as_it_comes(upstream: str) -> None:
    import http.client

    with KillProxy(upstream) as proxy:
        port = int(proxy.url.rsplit(":", 1)[1])
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", "/api/v1/things?watch=true")
        response = conn.getresponse()
        first = response.readline()
        arrived = time.monotonic()
        rest = response.read()
        conn.close()
        assert json.loads(first)["n"] == 0
        assert [json.loads(x)["n"] for x in rest.splitlines()] == [1, 2]
        assert time.monotonic() - arrived > 0.15  # the first event came before the others
        assert proxy.reads[0].watch and proxy.reads[0].path == "/api/v1/things"
