"""The spool: records appended to local disk with a group commit, shipped to the events store
as Parquet files with deterministic names; bounded, recovered on start, drained on shutdown.

Usage (the capture proxy; the feedback service could do the same with ``wait=True``)::

    spool = Spool(Path("/var/spool/rtrl-capture"), store, GENERATIONS, writer_name=pod)
    spool.start()                      # recovers what a previous container left, ships it
    spool.append(json_bytes)           # never blocks on the disk; SpoolFull when at its limit
    ...
    spool.close(timeout=25)            # SIGTERM: fsync, close the segment, ship everything

When the spool holds ``max_bytes`` (the store has been unreachable for long), new records are
refused and counted (``dropped_full``): serving goes on, the loss is visible in the metrics,
and nothing blocks. Recovery on start closes the segment a killed process left open, after
cutting its torn last record (counted as ``torn``), and ships it with the rest.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

from rtrl.core.store import ObjectStore
from rtrl_serving.spool.records import truncate_torn_tail
from rtrl_serving.spool.segments import OPEN_SUFFIX, SegmentDir
from rtrl_serving.spool.shipper import EventKind, Shipper, remove_scratch
from rtrl_serving.spool.writer import GroupCommitWriter

log = logging.getLogger(__name__)

DEFAULT_COMMIT_MS = 50.0
DEFAULT_SEGMENT_BYTES = 16 << 20
DEFAULT_SEGMENT_AGE_S = 60.0
DEFAULT_MAX_BYTES = 1 << 30


@dataclass(frozen=True)
class SpoolSnapshot:
    """The spool's counters at one moment (for /metrics)."""

    appended: int
    durable: int
    shipped: int
    shipped_files: int
    dropped_full: int
    dropped_io: int
    corrupt: int
    torn: int
    upload_failures: int
    held_bytes: int  # on disk and queued, not yet shipped
    backlog_segments: int
    commits: int


class Spool:
    """See the module docstring."""

    def __init__(
        self,
        directory: Path,
        store: ObjectStore,
        kind: EventKind,
        *,
        writer_name: str | None = None,
        commit_ms: float = DEFAULT_COMMIT_MS,
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        segment_age_s: float = DEFAULT_SEGMENT_AGE_S,
        max_bytes: int = DEFAULT_MAX_BYTES,
    ) -> None:
        self.segdir = SegmentDir(directory, writer_name)
        self.recovered = self._recover()
        self.shipper = Shipper(self.segdir, store, kind)
        self.shipper.stats.torn = self.recovered[0]
        self.shipper.stats.torn_bytes = self.recovered[1]
        self.writer = GroupCommitWriter(
            self.segdir,
            commit_s=commit_ms / 1000.0,
            segment_bytes=segment_bytes,
            segment_age_s=segment_age_s,
            max_bytes=max_bytes,
            held_bytes=self.shipper.closed_bytes,
            on_closed=self.shipper.segment_closed,
        )
        self._started = False

    @property
    def writer_id(self) -> str:
        return self.segdir.writer

    def _recover(self) -> tuple[int, int]:
        """Close the segments a previous process left open (torn tails cut); returns the
        torn records (at most one per segment) and bytes dropped."""
        remove_scratch(self.segdir)
        torn = torn_bytes = 0
        for number, suffix in self.segdir.listing():
            if suffix != OPEN_SUFFIX:
                continue
            contents = truncate_torn_tail(self.segdir.path(number, OPEN_SUFFIX))
            if contents.torn_bytes:
                torn += 1
                torn_bytes += contents.torn_bytes
                log.warning("segment %d: dropped a torn last record (%d bytes)",
                            number, contents.torn_bytes)  # fmt: skip
            if contents.records:
                self.segdir.close_segment(number)
            else:
                self.segdir.path(number, OPEN_SUFFIX).unlink()
        pending = self.segdir.closed()
        if pending:
            log.info("recovered %d unshipped segments", len(pending))
        return torn, torn_bytes

    def start(self, *, ship: bool = True) -> None:
        """Start the writer and, unless ``ship`` is False (tests and tools that look at the
        segments), the shipper."""
        self.writer.start()
        if ship:
            self.shipper.start()
        self._started = ship

    def append(self, payload: bytes, *, wait: bool = False) -> Future[None] | None:
        """Queue one record (a JSON object of the kind's schema, UTF-8); see
        :meth:`GroupCommitWriter.append`."""
        return self.writer.append(payload, wait=wait)

    def close(self, timeout: float) -> bool:
        """Flush and ship everything within ``timeout`` seconds; True when all was shipped."""
        deadline = time.monotonic() + timeout
        self.writer.close(max(0.0, deadline - time.monotonic()))
        if not self._started:
            return not self.segdir.closed()
        return self.shipper.drain(deadline)

    def writable(self) -> str | None:
        """None when records can be taken, else why not (for readiness)."""
        if not self.writer.alive:
            return "the spool writer is not running"
        if self.writer.error:
            return self.writer.error
        return None

    def snapshot(self) -> SpoolSnapshot:
        w, s = self.writer.stats, self.shipper.stats
        return SpoolSnapshot(
            appended=w.appended,
            durable=w.durable,
            shipped=s.shipped,
            shipped_files=s.shipped_files,
            dropped_full=w.dropped_full,
            dropped_io=w.dropped_io,
            corrupt=s.corrupt,
            torn=s.torn,
            upload_failures=s.upload_failures,
            held_bytes=self.shipper.closed_bytes() + self.writer.pending_bytes(),
            backlog_segments=self.shipper.backlog(),
            commits=w.commits,
        )
