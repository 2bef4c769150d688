"""The kubelet stand-in's readiness probes (rtrl_localkube/probes.py) against a real local
HTTP server; the probes under the real controllers are tests/e2e/test_inference_deployment.py's."""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Iterator

import pytest

from rtrl_localkube.probes import ProbeError, ReadinessProber, check_once, probe_port


class Server:
    """A /health endpoint whose status the test sets."""

    def __init__(self) -> None:
        self.status = 503
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(owner.status if self.path == "/health" else 404)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


@pytest.fixture
def server() -> Iterator[Server]:
    srv = Server()
    yield srv
    srv.httpd.shutdown()
    srv.httpd.server_close()


def container(port: int | str, **probe: object) -> dict[str, object]:
    return {
        "name": "vllm",
        "ports": [{"name": "http", "containerPort": 8000}],
        "readinessProbe": {"httpGet": {"path": "/health", "port": port}, **probe},
    }


def test_the_port_is_a_number_or_a_declared_name() -> None:
    assert probe_port(container("http"), "http") == 8000
    assert probe_port(container(9000), 9000) == 9000
    assert probe_port(container("9001"), "9001") == 9001
    with pytest.raises(ProbeError, match="no port of that name"):
        probe_port(container("metrics"), "metrics")


def test_http_status_decides(server: Server) -> None:
    spec = container(server.port)
    probe = spec["readinessProbe"]
    assert isinstance(probe, dict)
    assert not check_once(spec, probe)  # 503
    server.status = 200
    assert check_once(spec, probe)
    server.status = 302
    assert check_once(spec, probe)  # 200-399
    assert not check_once(container(1), container(1)["readinessProbe"])  # type: ignore[arg-type]


def test_tcp_socket_probe(server: Server) -> None:
    spec = {"name": "x", "readinessProbe": {"tcpSocket": {"port": server.port}}}
    assert check_once(spec, spec["readinessProbe"])  # type: ignore[arg-type]


def test_ready_after_successes_unready_after_failures(server: Server) -> None:
    flips: list[bool] = []
    stop = threading.Event()
    spec = container(server.port, periodSeconds=0.05, failureThreshold=2, successThreshold=2)
    prober = ReadinessProber(spec, lambda: flips.append(prober.ready), stop).start()
    try:
        time.sleep(0.3)
        assert not prober.ready and flips == []
        server.status = 200
        deadline = time.monotonic() + 5
        while not prober.ready:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        server.status = 500
        while prober.ready:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert flips == [True, False]
    finally:
        stop.set()
        prober.thread.join(2)
