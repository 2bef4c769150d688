"""Host memory of this process: the resident set now and its peak, and a way to measure
the peak of one phase (loading the policy) rather than of the whole process.

Host memory is what limits the model a training pod can hold (every rank of a node shares
it), so the train step reports it per rank in its log and in train.json. Linux keeps the
peak resident set (VmHWM, also getrusage's ru_maxrss); writing ``5`` to
``/proc/self/clear_refs`` resets it, so that a phase's own peak can be read. Where that is
not allowed a phase's peak is the process's since it started, and says so.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import resource
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

_STATUS = Path("/proc/self/status")
# glibc's mallopt parameter, and the ceiling of its own dynamic threshold (64-bit).
_M_MMAP_THRESHOLD = -3
_GLIBC_MMAP_THRESHOLD_MAX = 32 * 1024 * 1024
_CLEAR_REFS = Path("/proc/self/clear_refs")
# The highest peak seen before a reset: the process's peak is the larger of it and now's.
_before_resets = {"peak": 0}


def _status_bytes(field: str) -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def rss_bytes() -> int:
    """The resident set now (0 where the platform does not say)."""
    return _status_bytes("VmRSS") or 0


def peak_bytes() -> int:
    """The peak resident set since the process started, or since the last reset."""
    peak = _status_bytes("VmHWM")
    if peak is not None:
        return peak
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss if sys.platform == "darwin" else maxrss * 1024  # bytes on macOS, else kB


def process_peak_bytes() -> int:
    """The peak resident set since the process started, across resets."""
    return max(_before_resets["peak"], peak_bytes())


def reset_peak() -> bool:
    """Reset the peak resident set to the current one; False where it cannot be."""
    _before_resets["peak"] = process_peak_bytes()
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return True


@dataclass
class PhaseMemory:
    """One phase of this process: the resident set before it and its peak during it
    (``peak_is_phase`` False: the process's peak, the reset not being allowed)."""

    before: int
    peak_is_phase: bool
    peak: int = 0

    @classmethod
    def start(cls) -> PhaseMemory:
        before = rss_bytes()
        return cls(before=before, peak_is_phase=reset_peak())

    def stop(self) -> PhaseMemory:
        self.peak = peak_bytes()
        return self

    @property
    def growth(self) -> int:
        """How far the phase raised the resident set above where it started."""
        return max(0, self.peak - self.before)


@contextmanager
def freed_to_the_os(threshold: int = 64 * 1024) -> Iterator[None]:
    """While inside, every allocation of ``threshold`` bytes or more is its own mapping,
    given back to the OS when freed (glibc; elsewhere nothing changes).

    Loading into partitions allocates each whole tensor and frees it once its partition is
    kept; glibc otherwise serves such sizes from its heap after the first is freed (its
    threshold adapts upward), and the holes the kept partitions leave between them are
    never given back: measured, as much resident memory again as the partitions of two
    ranks. On leaving, the threshold is fixed at glibc's own ceiling and the heap's free
    top is given back (``malloc_trim``)."""
    libc = _libc()
    if libc is None:
        yield
        return
    libc.mallopt(_M_MMAP_THRESHOLD, threshold)
    try:
        yield
    finally:
        libc.mallopt(_M_MMAP_THRESHOLD, _GLIBC_MMAP_THRESHOLD_MAX)
        libc.malloc_trim(0)


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if not sys.platform.startswith("linux") or name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    if not all(hasattr(libc, f) for f in ("mallopt", "malloc_trim")):
        return None
    return libc
