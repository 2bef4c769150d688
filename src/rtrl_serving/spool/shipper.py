"""Shipping closed segments: each becomes Parquet files, one per hour its rows belong to,
uploaded to the events store under names fixed by the segment alone.

Segment ``n``'s file for its ``i``-th hour (hours in order) is ``event_file_key(kind, hour,
writer, n * 1000 + i)``: a crash after an upload and before the segment's deletion ships it
again under the same names, replacing its own files, never adding copies. The segment is
deleted only once every file of it was uploaded.

Records are JSON objects, one per record, parsed into Arrow by pyarrow's JSON reader against
the kind's schema (C++, off the GIL: the proxy serving beside it keeps its latency). A record
that does not parse is dropped and counted, never allowed to hold the segment back forever.
Upload failures back off (full jitter, capped) and retry without end; :meth:`Shipper.drain`
bounds the retries by a deadline on shutdown.
"""

from __future__ import annotations

import io
import logging
import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pj
import pyarrow.parquet as pq

from rtrl.core.events import event_file_key
from rtrl.core.store import ObjectStore, redact
from rtrl_serving.spool.records import read_segment
from rtrl_serving.spool.segments import CLOSED_SUFFIX, SegmentDir

log = logging.getLogger(__name__)

# event files per segment: one per hour its rows fall in (a segment lives about a minute; a
# simulation that fakes the serving time may still spread one over many hours)
MAX_HOURS_PER_SEGMENT = 1000
BACKOFF_BASE_S = 0.2
BACKOFF_CAP_S = 30.0

# (table of one segment's rows) -> [(hour, rows of that hour)], hours ascending
Splitter = Callable[[pa.Table], list[tuple[datetime, pa.Table]]]


def by_hour_of(column: str) -> Splitter:
    """Rows split by the UTC hour of the timestamp ``column`` (a row without one goes to
    the hour of the Unix epoch, where it is visible rather than lost)."""

    def split(table: pa.Table) -> list[tuple[datetime, pa.Table]]:
        hours = pc.floor_temporal(table[column], unit="hour").fill_null(0)
        parts = []
        for hour in sorted(pc.unique(hours).to_pylist()):
            mask = pc.equal(hours, pa.scalar(hour, hours.type))
            parts.append((_utc(hour), table.filter(mask)))
        return parts

    return split


def _utc(value: datetime | int) -> datetime:
    if isinstance(value, int):
        return datetime.fromtimestamp(value / 1e6, UTC)
    return value if value.tzinfo else value.replace(tzinfo=UTC)


@dataclass(frozen=True)
class EventKind:
    """What a spool holds: the directory under the events root (``generations`` or
    ``feedback``), the Arrow schema of its files and how its rows split into hours."""

    name: str
    schema: pa.Schema
    split: Splitter


@dataclass
class ShipperStats:
    """Counters written by the shipper's thread only."""

    shipped: int = 0  # records uploaded (once per segment, after its last file)
    shipped_files: int = 0
    shipped_segments: int = 0
    upload_failures: int = 0
    corrupt: int = 0  # records that did not parse against the schema: dropped
    torn: int = 0  # records lost to a torn segment tail (recovery)
    torn_bytes: int = 0
    last_error: str | None = None


class Shipper:
    """Uploads the closed segments of ``segdir`` to ``store`` (the events root)."""

    def __init__(self, segdir: SegmentDir, store: ObjectStore, kind: EventKind) -> None:
        self.segdir = segdir
        self.store = store
        self.kind = kind
        self.stats = ShipperStats()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._deadline: float | None = None
        self._closed_bytes = {n: self.segdir.path(n, CLOSED_SUFFIX).stat().st_size
                              for n in self.segdir.closed()}  # fmt: skip
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="spool-shipper", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def closed_bytes(self) -> int:
        """Bytes of closed segments not yet shipped."""
        with self._lock:
            return sum(self._closed_bytes.values())

    def backlog(self) -> int:
        with self._lock:
            return len(self._closed_bytes)

    def segment_closed(self, number: int, size: int) -> None:
        with self._lock:
            self._closed_bytes[number] = size
        self._wake.set()

    def drain(self, deadline: float) -> bool:
        """Ship what is closed until ``deadline`` (monotonic), then stop; True when nothing
        was left behind."""
        self._deadline = deadline
        self._stop.set()
        self._wake.set()
        if self._thread.ident is not None:
            self._thread.join(max(0.0, deadline - time.monotonic()) + 1.0)
        return self.backlog() == 0

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # --- the thread ----------------------------------------------------------------------

    def _run(self) -> None:
        failures = 0
        while True:
            pending = self.segdir.closed()
            if not pending:
                if self._stop.is_set():
                    return
                self._wake.wait(1.0)
                self._wake.clear()
                continue
            try:
                self.ship_segment(pending[0])
                failures = 0
            except Exception as exc:  # any failure: retry later, never lose the segment
                failures += 1
                self.stats.upload_failures += 1
                self.stats.last_error = redact(f"{type(exc).__name__}: {exc}")
                log.warning("shipping segment %d failed (try %d): %s",
                            pending[0], failures, self.stats.last_error)  # fmt: skip
                pause = random.uniform(0, min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2 ** (failures - 1)))
                if self._deadline is not None:
                    pause = min(pause, self._deadline - time.monotonic())
                    if pause <= 0:
                        log.error("shutdown deadline passed: %d segments left unshipped",
                                  len(pending))  # fmt: skip
                        return
                self._wake.wait(pause)
                self._wake.clear()

    def ship_segment(self, number: int) -> None:
        """Upload segment ``number``'s files (idempotently) and delete the segment."""
        path = self.segdir.path(number, CLOSED_SUFFIX)
        contents = read_segment(path)
        if contents.torn_bytes:  # closed segments are whole; recovery cut torn tails
            log.error("segment %d has %d bytes past its last whole record",
                      number, contents.torn_bytes)  # fmt: skip
        table, corrupt = self._parse(contents.records)
        parts = self.kind.split(table) if table.num_rows else []
        if len(parts) > MAX_HOURS_PER_SEGMENT:
            raise ValueError(f"segment {number} spans {len(parts)} hours")
        for index, (hour, part) in enumerate(parts):
            key = event_file_key(self.kind.name, hour, self.segdir.writer, number * 1000 + index)
            local = self.segdir.ship / f"{number:012d}-{index:03d}.parquet"
            try:
                pq.write_table(part, local, compression="zstd")
                self.store.put_file(key, local)
            finally:
                local.unlink(missing_ok=True)
        path.unlink()
        with self._lock:
            self._closed_bytes.pop(number, None)
        self.stats.corrupt += corrupt
        self.stats.shipped += table.num_rows
        self.stats.shipped_files += len(parts)
        self.stats.shipped_segments += 1

    def _parse(self, records: list[bytes]) -> tuple[pa.Table, int]:
        """The records as one table of the kind's schema, and how many did not parse."""
        if not records:
            return self.kind.schema.empty_table(), 0
        try:
            return self._read_json(b"\n".join(records)), 0
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            pass
        good = []
        for record in records:  # find the bad ones: each record on its own
            try:
                good.append(self._read_json(record))
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
                log.error("dropping a spooled record that does not parse: %s", str(exc)[:200])
        table = pa.concat_tables(good) if good else self.kind.schema.empty_table()
        return table, len(records) - len(good)

    def _read_json(self, data: bytes) -> pa.Table:
        # A record must fit in one block: the reader cannot split an object across blocks.
        block = max(1 << 20, min(len(data) + 1, 1 << 30))
        table = pj.read_json(
            io.BytesIO(data),
            read_options=pj.ReadOptions(block_size=block, use_threads=False),
            parse_options=pj.ParseOptions(
                explicit_schema=self.kind.schema, unexpected_field_behavior="error"
            ),
        )
        return table.select(self.kind.schema.names).cast(self.kind.schema)


def remove_scratch(segdir: SegmentDir) -> None:
    """Delete Parquet scratch files a killed process left behind."""
    for entry in os.listdir(segdir.ship):
        Path(segdir.ship / entry).unlink(missing_ok=True)
