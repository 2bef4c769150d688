"""Client load on a capture proxy: threads sending chat and completion requests, streamed and
not, recording which responses arrived whole (their interaction ids) and when."""

from __future__ import annotations

import http.client
import json
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit


@dataclass
class LoadResult:
    completed: dict[str, float] = field(default_factory=dict)  # id -> monotonic time received
    failed: int = 0  # refused, reset or cut off
    lock: threading.Lock = field(default_factory=threading.Lock)


def _one(base: str, number: int) -> list[str]:
    """One request; the ids of its response when it arrived whole, else raises."""
    parts = urlsplit(base)
    stream = number % 2 == 0
    if number % 3 == 0:
        path = "/v1/completions"
        body = {"model": "tiny", "prompt": f"task {number}:", "max_tokens": 24, "stream": stream}
    else:
        path = "/v1/chat/completions"
        body = {"model": "tiny", "messages": [{"role": "user", "content": f"task {number}"}],
                "max_tokens": 24, "stream": stream}  # fmt: skip
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        ids = [i for i in (resp.getheader("X-Rtrl-Interaction-Id") or "").split(",") if i]
    finally:
        conn.close()
    if resp.status != 200 or not ids:
        raise ConnectionError(f"status {resp.status}")
    if stream and not data.endswith(b"data: [DONE]\n\n"):
        raise ConnectionError("the stream was cut off")
    if not stream:
        json.loads(data)
    return ids


def run_load(
    base: str, workers: int, stop: threading.Event, result: LoadResult
) -> list[threading.Thread]:
    """Start ``workers`` threads sending requests until ``stop`` is set."""
    counter = iter(range(10**9))
    counter_lock = threading.Lock()

    def work() -> None:
        while not stop.is_set():
            with counter_lock:
                number = next(counter)
            try:
                ids = _one(base, number)
            except (OSError, http.client.HTTPException, ValueError):
                with result.lock:
                    result.failed += 1
                time.sleep(0.05)
                continue
            now = time.monotonic()
            with result.lock:
                for interaction_id in ids:
                    result.completed[interaction_id] = now

    threads = [threading.Thread(target=work, daemon=True) for _ in range(workers)]
    for thread in threads:
        thread.start()
    return threads
