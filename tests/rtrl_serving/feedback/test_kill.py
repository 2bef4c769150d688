"""``rtrl-feedback`` as a process under load, killed: every event that got a 202 is in the
store (SIGKILL loses only what was never acknowledged), and SIGTERM drains in-flight
requests before exiting 0."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rtrl.core.store.s3 import S3Store
from tests.conftest import console_script
from tests.rtrl_serving.feedback.helpers import TOKEN, event, stored_feedback


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Load:
    """Client threads posting batches of fresh events as fast as answers come back,
    recording the event ids of every 202."""

    def __init__(self, port: int, clients: int = 8, batch: int = 20) -> None:
        self.port, self.batch = port, batch
        self.acked: set[str] = set()
        self.sent = 0
        self.errors = 0
        self.codes: dict[int, int] = {}
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._client, daemon=True) for _ in range(clients)]

    def __enter__(self) -> Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(30)

    def _client(self) -> None:
        conn: http.client.HTTPConnection | None = None
        while not self.stop.is_set():
            events = [event() for _ in range(self.batch)]
            body = json.dumps({"events": events})
            try:
                if conn is None:
                    conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
                conn.request(
                    "POST",
                    "/v1/feedback",
                    body=body,
                    headers={
                        "Authorization": f"Bearer {TOKEN}",
                        "Content-Type": "application/json",
                    },
                )
                response = conn.getresponse()
                response.read()
            except OSError:
                with self.lock:
                    self.errors += 1
                if conn is not None:
                    conn.close()
                conn = None
                time.sleep(0.01)
                continue
            with self.lock:
                self.sent += 1
                self.codes[response.status] = self.codes.get(response.status, 0) + 1
                if response.status == 202:
                    self.acked.update(e["event_id"] for e in events)
        if conn is not None:
            conn.close()


@pytest.fixture
def feedback_process(
    s3_bucket: str, tmp_path: Path
) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    token_file = tmp_path / "tokens"
    token_file.write_text(TOKEN + "\n")
    port = free_port()
    env = {
        **os.environ,
        "RTRL_FEEDBACK_LISTEN": f"127.0.0.1:{port}",
        "RTRL_FEEDBACK_EVENTS": f"s3://{s3_bucket}/events/",
        "RTRL_FEEDBACK_TOKEN_FILE": str(token_file),
        "POD_NAME": "rtrl-feedback-test",
    }
    log = (tmp_path / "feedback.log").open("wb")
    process = subprocess.Popen([console_script("rtrl-feedback")], env=env, stdout=log,
                               stderr=subprocess.STDOUT)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                try:
                    conn.request("GET", "/readyz")
                    if conn.getresponse().status == 200:
                        break
                finally:
                    conn.close()
            except OSError:
                time.sleep(0.1)
        else:
            pytest.fail(
                "rtrl-feedback did not become ready: " + (tmp_path / "feedback.log").read_text()
            )
        yield process, port
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()
        log.close()
        assert TOKEN not in (tmp_path / "feedback.log").read_text()


def test_kill_9_under_load_loses_no_acknowledged_event(
    feedback_process: tuple[subprocess.Popen[bytes], int], s3_bucket: str
) -> None:
    process, port = feedback_process
    with Load(port) as load:
        time.sleep(2.0)
        process.send_signal(signal.SIGKILL)
        process.wait()
    stored = set(stored_feedback(S3Store(s3_bucket, "events")).column("event_id").to_pylist())
    assert len(load.acked) > 100, load.codes
    lost = load.acked - stored
    assert not lost, f"{len(lost)} of {len(load.acked)} acknowledged events are not in the store"
    assert load.codes.keys() <= {202}, load.codes


def test_sigterm_answers_requests_in_flight_then_exits_0(
    feedback_process: tuple[subprocess.Popen[bytes], int], s3_bucket: str
) -> None:
    process, port = feedback_process
    with Load(port) as load:
        time.sleep(1.5)
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
    stored = set(stored_feedback(S3Store(s3_bucket, "events")).column("event_id").to_pylist())
    assert len(load.acked) > 100
    assert load.acked <= stored
    assert load.codes.keys() <= {202}, load.codes
