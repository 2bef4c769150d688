"""The group commit: a writer thread appends every queued record to the open segment as soon as
it is queued, and a syncer thread fsyncs the segment at most once per commit window.

Why this shape: a record written to the file is in the kernel's page cache, which survives the
process being killed (SIGKILL, OOM); only a node that loses power loses what was not yet
fsynced. So records are written at once (the loss on SIGKILL is what was still queued in
memory), and the fsync, the expensive part, is paid once per window for every record written
in it (the loss on power failure is bounded by the window). The fsync runs on a thread of its
own, on a duplicate of the segment's descriptor, so that a slow disk (an fsync can take
hundreds of milliseconds on a busy node) never holds back the writes behind it: a first
version that fsynced on the writer's thread lost 8 of 93 events to kill -9 on a loaded
machine, all queued during one fsync. Callers that must not acknowledge before durability
(the feedback service) wait for the record's future, which resolves after its fsync; the
capture proxy does not wait.

A record is written by the caller itself when the segment is free (a write to the page cache:
microseconds), so that nothing is left in memory once ``append`` returns, and queued for the
writer thread only while a rotation or the syncer holds the segment. Segments rotate when they
reach a size or an age (counted from their first record), so events are shipped within about
that age of being served. The next segment is opened as the
previous one closes (and the first one at start), so no record waits for a new file.
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

from rtrl_serving.spool.records import frame
from rtrl_serving.spool.segments import OPEN_SUFFIX, SegmentDir

log = logging.getLogger(__name__)

Waiter = Future[None] | None


class SpoolFull(Exception):  # noqa: N818 (a state callers match on, not an error of theirs)
    """The spool holds its limit of bytes: the record was not taken (and was counted)."""


class SpoolClosed(Exception):  # noqa: N818
    """The spool is closing or closed: no record is taken any more."""


@dataclass
class WriterStats:
    """Counters of the writer side, each written under the writer's lock."""

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
    size: int = 0
    first: float | None = None  # monotonic time of its first record


class GroupCommitWriter:
    """Appends framed records to the open segment of ``segdir``; see the module docstring.

    Locks: ``_io`` guards the open segment's descriptor (writes, the syncer's dup, rotation);
    ``_lock`` (with its two conditions) the queue and the counters. ``_io`` is taken first
    where both are held; :meth:`append` takes only ``_lock``."""

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
        self._io = threading.Lock()
        self._lock = threading.Lock()
        self._queued = threading.Condition(self._lock)  # the writer waits for records
        self._written = threading.Condition(self._lock)  # the syncer waits for writes
        self._pending: list[tuple[bytes, Waiter]] = []
        self._pending_bytes = 0
        self._inflight_bytes = 0  # taken from the queue, not yet in the open segment's size
        self._open: _Open | None = None
        self._unsynced: list[Waiter] = []
        self._last_sync = time.monotonic()
        self._stopping = False
        self._sync_stop = False
        self._writer = threading.Thread(target=self._run, name="spool-writer", daemon=True)
        self._syncer = threading.Thread(target=self._sync_loop, name="spool-syncer", daemon=True)

    def start(self) -> None:
        with self._io:
            self._open = self._new_segment()
        self._last_sync = time.monotonic()
        self._writer.start()
        self._syncer.start()

    # --- the caller's side ---------------------------------------------------------------

    def append(self, payload: bytes, *, wait: bool = False) -> Future[None] | None:
        """Queue ``payload``; returns a future that resolves once it is fsynced when ``wait``,
        else None. Raises :class:`SpoolFull` (counted) when the spool holds its limit and
        :class:`SpoolClosed` once :meth:`close` began."""
        record = frame(payload)
        future: Waiter = Future() if wait else None
        with self._lock:
            if self._stopping:
                raise SpoolClosed("the spool is closing")
            held = self._held_bytes() + self._unshipped_locked()
            if held + len(record) > self.max_bytes:
                self.stats.dropped_full += 1
                raise SpoolFull(f"the spool holds {held} bytes, its limit is {self.max_bytes}")
            self.stats.appended += 1
            self.stats.appended_bytes += len(record)
            # Written here and now when the segment is free (the common case: a write to the
            # page cache, microseconds), so that a record is on its way to disk before the
            # caller goes on; queued for the writer thread while a rotation or the syncer's
            # dup holds it. (Taking _io without blocking cannot invert the lock order.)
            direct = not self._pending and self._open is not None and self._io.acquire(False)
            if direct:
                self._inflight_bytes += len(record)
            else:
                self._pending.append((record, future))
                self._pending_bytes += len(record)
                self._queued.notify()
        if direct:
            try:
                due = self._write_locked([(record, future)])
            finally:
                self._io.release()
            if due:  # the writer learns the segment's new deadline, or closes it now
                with self._lock:
                    self._queued.notify()
        return future

    def _unshipped_locked(self) -> int:
        open_bytes = self._open.size if self._open else 0
        return self._pending_bytes + self._inflight_bytes + open_bytes

    def pending_bytes(self) -> int:
        """Bytes queued, being written or in the open segment."""
        with self._lock:
            return self._unshipped_locked()

    def close(self, timeout: float | None = None) -> None:
        """Take no more records, write and fsync what is queued, close the open segment."""
        with self._lock:
            self._stopping = True
            self._queued.notify()
        if self._writer.ident is not None:
            self._writer.join(timeout)
        with self._lock:
            self._sync_stop = True
            self._written.notify()
        if self._syncer.ident is not None:
            self._syncer.join(timeout)

    @property
    def alive(self) -> bool:
        return self._writer.is_alive()

    # --- the writer thread ---------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._pending and not self._stopping and not self._rotation_due():
                    timeout = self._rotation_deadline()
                    if timeout is not None and timeout <= 0:
                        break
                    self._queued.wait(timeout)
                batch, self._pending = self._pending, []
                self._inflight_bytes += self._pending_bytes
                self._pending_bytes = 0
                stopping = self._stopping
            if batch:
                self._write(batch)
            if stopping or self._rotation_due():
                self._rotate(reopen=not stopping)
            if stopping:
                with self._lock:
                    if not self._pending:
                        return

    def _rotation_deadline(self) -> float | None:
        """Seconds until the open segment is due to close by age, None without a record."""
        current = self._open
        if current is None or current.first is None:
            return None
        return current.first + self.segment_age_s - time.monotonic()

    def _rotation_due(self) -> bool:
        current = self._open
        if current is None or current.first is None:
            return False
        too_old = time.monotonic() - current.first >= self.segment_age_s
        return current.size >= self.segment_bytes or too_old

    def _new_segment(self) -> _Open:
        number = self.segdir.next_number()
        path = self.segdir.path(number, OPEN_SUFFIX)
        return _Open(number, os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644))

    def _write(self, batch: list[tuple[bytes, Waiter]]) -> None:
        with self._io:
            self._write_locked(batch)

    def _write_locked(self, batch: list[tuple[bytes, Waiter]]) -> bool:
        """Write ``batch`` (its bytes counted in flight) to the open segment; ``_io`` held.
        Whether the writer thread must look at the segment again: it was empty (the writer
        waits without a deadline until it holds a record) or it is now due to close by size.
        Waking the writer for every record instead costs a thread switch per record, on the
        caller's thread (the proxy's event loop)."""
        data = b"".join(record for record, _ in batch)
        try:
            if self._open is None:  # a write error closed the last one
                self._open = self._new_segment()
            view = memoryview(data)
            while view:
                written = os.write(self._open.fd, view)
                view = view[written:]
        except OSError as exc:
            self._lost(batch, exc, len(data))
            return True
        with self._lock:  # from in flight to the segment's size in one step
            self._open.size += len(data)
            due = self._open.first is None or self._open.size >= self.segment_bytes
            if self._open.first is None:
                self._open.first = time.monotonic()
            self._inflight_bytes -= len(data)
            self._unsynced.extend(future for _, future in batch)
            self._written.notify()
        self.error = None
        return due

    def _lost(self, batch: list[tuple[bytes, Waiter]], exc: OSError, size: int) -> None:
        """A write failed (ENOSPC, EIO; ``_io`` held): the batch is lost, counted, its waiters
        told; the segment is closed as far as the disk lets it (its torn tail is dropped when
        shipped or recovered) and the next write opens a fresh one."""
        self.error = f"cannot write the spool segment: {exc.strerror or exc}"
        log.error("%s; %d records lost", self.error, len(batch))
        with self._lock:
            self._inflight_bytes -= size
            self.stats.dropped_io += len(batch)
        for _, future in batch:
            if future is not None:
                future.set_exception(OSError(self.error))
        with contextlib.suppress(OSError):
            self._close_segment_locked()

    # --- rotation ------------------------------------------------------------------------

    def _rotate(self, *, reopen: bool) -> None:
        with self._io:
            try:
                self._close_segment_locked()
                if reopen:
                    self._open = self._new_segment()
            except OSError as exc:
                self.error = f"cannot rotate the spool segment: {exc.strerror or exc}"
                log.error("%s", self.error)

    def _close_segment_locked(self) -> None:
        """Fsync, close and rename the open segment (``_io`` held); its bytes pass to the
        shipper's count in the same step as they leave the open segment's."""
        current = self._open
        if current is None:
            return
        with self._lock:
            waiters, self._unsynced = self._unsynced, []
        try:
            if waiters:
                self._fsync(current.fd, waiters)
        finally:
            os.close(current.fd)
        # ``_open`` keeps pointing at the closed descriptor (nobody writes without ``_io``)
        # until its bytes are counted by the shipper: in no moment may they be in neither
        # count, or append() lets the spool overfill
        try:
            if current.size == 0:
                self.segdir.path(current.number, OPEN_SUFFIX).unlink(missing_ok=True)
            else:
                self.segdir.close_segment(current.number)
                with self._lock:
                    self._open = None
                    self._on_closed(current.number, current.size)
                    self.stats.segments_closed += 1
        finally:
            with self._lock:
                self._open = None

    # --- the syncer thread ---------------------------------------------------------------

    def _sync_loop(self) -> None:
        while True:
            with self._lock:
                while not self._unsynced and not self._sync_stop:
                    self._written.wait()
                if self._sync_stop and not self._unsynced:
                    return
                # the window: at most one fsync per commit_s (shorter once closing)
                window_end = self._last_sync + self.commit_s
                delay = 0.0 if self._sync_stop else window_end - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            with self._io:
                if self._open is None:
                    continue  # a rotation took (and synced) them
                fd = os.dup(self._open.fd)
                with self._lock:
                    waiters, self._unsynced = self._unsynced, []
            try:
                self._fsync(fd, waiters)
            finally:
                os.close(fd)

    def _fsync(self, fd: int, waiters: list[Waiter]) -> None:
        """fdatasync ``fd`` for ``waiters`` (records already written to it) and tell them."""
        started = time.monotonic()
        try:
            os.fdatasync(fd)
        except OSError as exc:
            self.error = f"cannot fsync the spool segment: {exc.strerror or exc}"
            log.error("%s", self.error)
            for future in waiters:
                if future is not None:
                    future.set_exception(OSError(self.error))
            return
        finished = time.monotonic()
        with self._lock:
            self._last_sync = finished
            self.stats.commits += 1
            self.stats.durable += len(waiters)
            self.stats.commit_seconds = [*self.stats.commit_seconds[-255:], finished - started]
        for future in waiters:
            if future is not None:
                future.set_result(None)
