"""Where events and sealed hours live in the stores, by name only.

Under the events root (``spec.capture.events``)::

    generations/date=2026-12-03/hour=14/<writer>-<seq>.parquet  (the hour it was served)
    feedback/date=2026-12-03/hour=14/<writer>-<seq>.parquet     (its interaction's hour)

``<writer>`` names the process that wrote the file (a pod name and a random suffix kept in
its spool, so a restarted container continues its own numbering) and ``<seq>`` counts its
files: a name is fixed before the first upload attempt, so a retried upload replaces itself.

Under the shard root (``spec.data.shards``), the seal step writes an hour's interactions as
ordinary shards (``checkpoint=<id>/date=/hour=/sealed-<YYYYMMDDHH>-00000.parquet``) and
then, last, its marker ``_sealed/date=2026-12-03/hour=14.json`` (:class:`SealMarker`): the
files it wrote, the event files it read and what it counted. A stage reading sealed data
reads exactly the files the markers list.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

GENERATIONS_DIR = "generations"
FEEDBACK_DIR = "feedback"
SEALED_DIR = "_sealed"
MARKER_VERSION = 1

_WRITER = re.compile(r"^[a-z0-9][a-z0-9-]{0,126}$")
_HOUR = re.compile(r"date=(\d{4}-\d{2}-\d{2})/hour=(\d{2})")


def hour_of(moment: datetime) -> datetime:
    """The start of the UTC hour holding ``moment``."""
    return moment.astimezone(UTC).replace(minute=0, second=0, microsecond=0)


def hour_partition(hour: datetime) -> str:
    """``date=YYYY-MM-DD/hour=HH`` of the UTC hour holding ``hour``."""
    start = hour_of(hour)
    return f"date={start:%Y-%m-%d}/hour={start:%H}"


def parse_hour_partition(key: str) -> datetime | None:
    """The hour of the first ``date=/hour=`` pair in ``key``, or None."""
    found = _HOUR.search(key)
    if found is None:
        return None
    return datetime.strptime(f"{found[1]} {found[2]}", "%Y-%m-%d %H").replace(tzinfo=UTC)


def event_file_key(kind: str, hour: datetime, writer: str, seq: int) -> str:
    """The key of one event file under the events root; ``kind`` is ``generations`` or
    ``feedback``. ``writer`` is lower-case letters, digits and dashes."""
    if kind not in (GENERATIONS_DIR, FEEDBACK_DIR):
        raise ValueError(f"event kind {kind!r} is neither {GENERATIONS_DIR} nor {FEEDBACK_DIR}")
    if not _WRITER.match(writer):
        raise ValueError(f"writer id {writer!r}: lower-case letters, digits and '-' only")
    if not 0 <= seq < 10**12:
        raise ValueError(f"sequence number {seq} out of range")
    return f"{kind}/{hour_partition(hour)}/{writer}-{seq:012d}.parquet"


def seal_marker_key(hour: datetime) -> str:
    """The marker of a sealed hour, under the shard root."""
    start = hour_of(hour)
    return f"{SEALED_DIR}/date={start:%Y-%m-%d}/hour={start:%H}.json"


def sealed_shard_prefix(hour: datetime) -> str:
    """The ``file_prefix`` of the shards the seal writes for ``hour`` (write_shards)."""
    return f"sealed-{hour_of(hour):%Y%m%d%H}"


@dataclass
class SealMarker:
    """What the seal of one hour wrote, read and counted; written last, so its presence
    means the hour's shards are complete."""

    hour: datetime
    sealed_at: datetime
    files: list[dict[str, Any]] = field(default_factory=list)  # {"key", "rows"} under the root
    generations: list[str] = field(default_factory=list)  # event files read
    feedback: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    version: int = MARKER_VERSION

    def to_json(self) -> bytes:
        data = asdict(self)
        data["hour"] = hour_of(self.hour).isoformat()
        data["sealed_at"] = self.sealed_at.astimezone(UTC).isoformat()
        return (json.dumps(data, indent=1, sort_keys=True) + "\n").encode()

    @classmethod
    def from_json(cls, raw: bytes) -> SealMarker:
        data = json.loads(raw)
        if not isinstance(data, dict) or data.get("version") != MARKER_VERSION:
            raise ValueError(f"not a version {MARKER_VERSION} seal marker")
        return cls(
            hour=datetime.fromisoformat(data["hour"]),
            sealed_at=datetime.fromisoformat(data["sealed_at"]),
            files=list(data.get("files") or []),
            generations=list(data.get("generations") or []),
            feedback=list(data.get("feedback") or []),
            counts={str(k): int(v) for k, v in (data.get("counts") or {}).items()},
        )


def sealable(hour: datetime, now: datetime, longest_maturity: timedelta, delay: timedelta) -> bool:
    """Whether ``hour`` may be sealed at ``now``: every interaction served in it has passed
    its longest signal maturity, plus ``delay`` for the last events to be shipped."""
    return hour_of(hour) + timedelta(hours=1) + longest_maturity + delay <= now
