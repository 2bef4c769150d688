"""A local append-only spool with group commit, shipped to the events store as Parquet files
with deterministic names (:mod:`rtrl.core.events.layout`).

- :mod:`~rtrl_serving.spool.records`: the framing of records on disk (length, crc32, payload),
  torn-tail detection.
- :mod:`~rtrl_serving.spool.segments`: the spool directory: writer id, segment numbering.
- :mod:`~rtrl_serving.spool.writer`: the group commit (write at once, fsync per window, rotate).
- :mod:`~rtrl_serving.spool.shipper`: closed segments to Parquet per hour, uploaded with retries.
- :mod:`~rtrl_serving.spool.spool`: the :class:`Spool` tying them together, recovery, drain.
"""

from rtrl_serving.spool.shipper import EventKind, by_hour_of
from rtrl_serving.spool.spool import (
    DEFAULT_COMMIT_MS,
    DEFAULT_MAX_BYTES,
    DEFAULT_SEGMENT_AGE_S,
    DEFAULT_SEGMENT_BYTES,
    Spool,
    SpoolSnapshot,
)
from rtrl_serving.spool.writer import SpoolClosed, SpoolFull

__all__ = [
    "DEFAULT_COMMIT_MS",
    "DEFAULT_MAX_BYTES",
    "DEFAULT_SEGMENT_AGE_S",
    "DEFAULT_SEGMENT_BYTES",
    "EventKind",
    "Spool",
    "SpoolClosed",
    "SpoolFull",
    "SpoolSnapshot",
    "by_hour_of",
]
