"""Giving the operator's freed heap back to the OS.

CPython frees an object's memory into glibc's heap, which returns only the heap's free top
to the OS: what a burst (kopf's initial listing of 12,000 objects, a re-list after the API
server restarts) allocated and freed stays resident between the objects still alive. At
1,000 RLCycles that was 30 MB of the operator's 389 MB (bench/scale.py). ``malloc_trim(0)``
gives every wholly free page back; it took 5-8 ms on that heap, so a thread of its own runs
it every :data:`TRIM_SECONDS`. Elsewhere than glibc nothing is done.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import sys
import threading
import time
from typing import Any

log = logging.getLogger("rtrl.operator")
TRIM_SECONDS = 30.0
_started = threading.Event()


@functools.cache
def _malloc_trim() -> Any:
    name = ctypes.util.find_library("c")
    if not sys.platform.startswith("linux") or name is None:
        return None
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim", None)
    except OSError:
        return None


def trim() -> bool:
    """Give glibc's free heap pages back to the OS; False where there is no glibc."""
    malloc_trim = _malloc_trim()
    if malloc_trim is None:
        return False
    malloc_trim(0)
    return True


def keep_trimmed(interval: float = TRIM_SECONDS) -> None:
    """Trim every ``interval`` seconds from a daemon thread, once per process."""
    if _started.is_set() or _malloc_trim() is None:
        return
    _started.set()

    def loop() -> None:
        while True:
            time.sleep(interval)
            try:
                trim()
            except Exception:  # never the operator's end: only memory not given back
                log.exception("giving the freed heap back to the OS failed")

    threading.Thread(target=loop, name="rtrl-heap-trim", daemon=True).start()
