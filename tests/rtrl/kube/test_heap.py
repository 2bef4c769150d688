"""The operator gives its freed heap back to the OS (rtrl.kube.heap): memory a burst
allocated and freed between objects still alive is resident until trimmed."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

from rtrl.kube import heap

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_a_burst_freed_between_live_objects_goes_back_to_the_os() -> None:
    # 2 KiB objects come from glibc's heap (CPython's own allocator takes <= 512 bytes);
    # every 32nd stays alive, as the watch cache keeps some of what a listing decoded
    burst = [bytes(2048) for _ in range(40_000)]
    kept = burst[::32]
    del burst
    before = rss_mb()
    assert heap.trim()
    after = rss_mb()
    assert before - after > 30, (before, after)  # of the ~80 MB freed
    assert len(kept) == 1250  # alive until here: the holes between them stay mapped


def test_the_trimmer_runs_in_one_daemon_thread() -> None:
    heap.keep_trimmed(interval=3600)
    heap.keep_trimmed(interval=3600)
    trimmers = [t for t in threading.enumerate() if t.name == "rtrl-heap-trim"]
    assert len(trimmers) == 1 and trimmers[0].daemon
