"""The group commit: one thread appends every queued record to the open segment as soon as it
is queued, and fsyncs at most once per commit window.

Why this shape: a record written to the file is in the kernel's page cache, which survives the
process being killed (SIGKILL, OOM); only a node that loses power loses what was not yet
fsynced. So the thread writes at once (the loss on SIGKILL is what was still queued in memory,
milliseconds), and pays the fsync, the expensive part, once per window for every record
written in it (the loss on power failure is bounded by the window). Callers that must not
acknowledge before durability (the feedback service) wait for the record's future, which
resolves after its fsync; the capture proxy does not wait.

Segments rotate when they reach a size or an age (counted from their first record), so
events are shipped within about that age of being served.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

from rtrl_serving.spool.records import frame
from rtrl_serving.spool.segments import OPEN_SUFFIX, SegmentDir

log = logging.getLogger(__name__)


class SpoolFull(Exception):  # noqa: N818 (a state callers match on, not an error of theirs)
    """The spool holds its limit of bytes: the record was not taken (and was counted)."""


class SpoolClosed(Exception):  # noqa: N818
    """The spool is closing or closed: no record is taken any more."""


@dataclass
class WriterStats:
    """Counters of the writer side; each is written under the writer's lock or by its thread."""

    appended: int = 0  # records taken
    appended_bytes: int = 0
    durable: int = 0  # records fsynced
    dropped_full: int = 0  # refused: the spool held its limit
    dropped_io: int = 0  # taken, then lost to a write error
    commits: int = 0  # fsyncs
    segments_closed: int = 0
    commit_seconds: list[float] = field(default_factory=list)  # recent fsync durations


@dataclass
class _Open:
    number: int
    fd: int
    size: int
    opened: float  # monotonic time of its first record


class GroupCommitWriter:
    """Appends framed records to the open segment of ``segdir``; see the module docstring."""

    def __init__(
        self,
        segdir: SegmentDir,
        *,
        commit_s: float,
        segment_bytes: int,
        segment_age_s: float,
        max_bytes: int,
        held_bytes: Callable[[], int],
        on_closed: Callable[[int, int], None],
    ) -> None:
        self.segdir = segdir
        self.commit_s = max(0.0, commit_s)
        self.segment_bytes = segment_bytes
        self.segment_age_s = segment_age_s
        self.max_bytes = max_bytes
        self._held_bytes = held_bytes  # bytes on disk not yet shipped (closed segments)
        self._on_closed = on_closed  # (segment number, bytes) once a segment is closed
        self.stats = WriterStats()
        self.error: str | None = None  # the last write error, until a write succeeds
        self._cond = threading.Condition()
        self._pending: list[tuple[bytes, Future[None] | None]] = []
        self._pending_bytes = 0
        self._inflight_bytes = 0  # taken from the queue, not yet in the open segment's size
        self._open: _Open | None = None
        self._unsynced: list[Future[None] | None] = []
        self._last_sync = time.monotonic()
        self._stopping = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="spool-writer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    # --- the caller's side ---------------------------------------------------------------

    def append(self, payload: bytes, *, wait: bool = False) -> Future[None] | None:
        """Queue ``payload``; returns a future that resolves once it is fsynced when ``wait``,
        else None. Raises :class:`SpoolFull` (counted) when the spool holds its limit and
        :class:`SpoolClosed` once :meth:`close` began."""
        record = frame(payload)
        future: Future[None] | None = Future() if wait else None
        with self._cond:
            if self._stopping:
                raise SpoolClosed("the spool is closing")
            open_bytes = self._open.size if self._open else 0
            held = self._held_bytes() + open_bytes + self._pending_bytes + self._inflight_bytes
            if held + len(record) > self.max_bytes:
                self.stats.dropped_full += 1
                raise SpoolFull(f"the spool holds {held} bytes, its limit is {self.max_bytes}")
            self._pending.append((record, future))
            self._pending_bytes += len(record)
            self.stats.appended += 1
            self.stats.appended_bytes += len(record)
            self._cond.notify()
        return future

    def pending_bytes(self) -> int:
        with self._cond:
            open_bytes = self._open.size if self._open else 0
            return self._pending_bytes + self._inflight_bytes + open_bytes

    def close(self, timeout: float | None = None) -> None:
        """Take no more records, write and fsync what is queued, close the open segment."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # --- the thread ----------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._stopping:
                    timeout = self._next_deadline()
                    if timeout is not None and timeout <= 0:
                        break
                    self._cond.wait(timeout)
                batch, self._pending = self._pending, []
                self._inflight_bytes, self._pending_bytes = self._pending_bytes, 0
                stopping = self._stopping
            if batch:
                self._write(batch)
            now = time.monotonic()
            if self._unsynced and (stopping or now - self._last_sync >= self.commit_s):
                self._sync()
            if self._open is not None and (stopping or self._rotation_due(now)):
                self._rotate()
            if stopping:
                with self._cond:
                    if not self._pending:
                        self._closed = True
                        return

    def _next_deadline(self) -> float | None:
        """Seconds until the next fsync or rotation is due, None when nothing is due."""
        now = time.monotonic()
        deadlines = []
        if self._unsynced:
            deadlines.append(self._last_sync + self.commit_s - now)
        if self._open is not None:
            deadlines.append(self._open.opened + self.segment_age_s - now)
        return min(deadlines) if deadlines else None

    def _rotation_due(self, now: float) -> bool:
        assert self._open is not None
        return (
            self._open.size >= self.segment_bytes or now - self._open.opened >= self.segment_age_s
        )

    def _write(self, batch: list[tuple[bytes, Future[None] | None]]) -> None:
        data = b"".join(record for record, _ in batch)
        try:
            if self._open is None:
                number = self.segdir.next_number()
                path = self.segdir.path(number, OPEN_SUFFIX)
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                self._open = _Open(number, fd, 0, time.monotonic())
            view = memoryview(data)
            while view:
                written = os.write(self._open.fd, view)
                view = view[written:]
            with self._cond:  # from in flight to the segment's size in one step
                self._open.size += len(data)
                self._inflight_bytes = 0
            self.error = None
        except OSError as exc:
            with self._cond:
                self._inflight_bytes = 0
            # The records are lost (ENOSPC, EIO): counted, and their waiters told. The open
            # segment may hold part of the batch: close it; its torn tail is dropped on ship.
            self.error = f"cannot write the spool segment: {exc.strerror or exc}"
            log.error("%s; %d records lost", self.error, len(batch))
            self.stats.dropped_io += len(batch)
            for _, future in batch:
                if future is not None:
                    future.set_exception(OSError(self.error))
            if self._open is not None:
                try:
                    self._rotate()
                except OSError:  # the disk refuses even that: the next start recovers it
                    if self._open is not None:
                        with contextlib.suppress(OSError):
                            os.close(self._open.fd)
                        self._open = None
            return
        self._unsynced.extend(future for _, future in batch)

    def _sync(self) -> None:
        assert self._open is not None
        started = time.monotonic()
        try:
            os.fdatasync(self._open.fd)
        except OSError as exc:
            self.error = f"cannot fsync the spool segment: {exc.strerror or exc}"
            log.error("%s", self.error)
            for future in self._unsynced:
                if future is not None:
                    future.set_exception(OSError(self.error))
            self._unsynced = []
            return
        self._last_sync = time.monotonic()
        stats = self.stats
        stats.commits += 1
        stats.durable += len(self._unsynced)
        stats.commit_seconds = [*stats.commit_seconds[-255:], self._last_sync - started]
        for future in self._unsynced:
            if future is not None:
                future.set_result(None)
        self._unsynced = []

    def _rotate(self) -> None:
        current = self._open
        assert current is not None
        if self._unsynced:
            self._sync()
        os.close(current.fd)
        if current.size == 0:
            Path(self.segdir.path(current.number, OPEN_SUFFIX)).unlink(missing_ok=True)
            self._open = None
            return
        try:
            self.segdir.close_segment(current.number)
        except OSError:
            with self._cond:
                self._open = None  # left .open on disk: the next start recovers it
            raise
        # its bytes move from the open segment to the shipper's count in one step, so that
        # append() never finds them in neither and overfills the spool
        with self._cond:
            self._open = None
            self._on_closed(current.number, current.size)
        self.stats.segments_closed += 1
