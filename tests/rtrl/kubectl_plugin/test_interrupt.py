"""Ctrl-C during `kubectl rtrl status --watch`: the SIGINT handler only sets a flag, and the
watch's pause ends within a tenth of a second of it, with no KeyboardInterrupt."""

from __future__ import annotations

import os
import signal
import threading
import time

from rtrl.kubectl_plugin.live import interruptible


def test_ctrl_c_ends_the_pause_and_raises_nothing() -> None:
    previous = signal.getsignal(signal.SIGINT)
    with interruptible() as stop:
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()
        started = time.monotonic()
        stop.wait(10)
        waited = time.monotonic() - started
        assert stop.is_set()
    assert waited < 2, waited
    assert signal.getsignal(signal.SIGINT) is previous  # the handler is put back


def test_without_ctrl_c_the_pause_lasts_its_time() -> None:
    with interruptible() as stop:
        started = time.monotonic()
        stop.wait(0.3)
        assert 0.29 <= time.monotonic() - started < 2
        assert not stop.is_set()
