"""The seal step, top to bottom: find the hours to seal, seal each, count late feedback.

For each hour of ``--lookback`` (from ``now``) with generation events:

- already sealed (its marker exists): count the feedback files that arrived after the
  marker (not in its list): late feedback, never trained on;
- sealable (``rtrl.core.events.sealable``: every signal's maturity and ``--delay`` past the
  hour's end) and not sealed: seal it;
- otherwise it waits for a later run.

Sealing one hour: fetch its event files (generations, and the feedback partition of the
same hour) to the scratch directory (a ``file://`` store is read in place), join them
(:mod:`~rtrl_trainer.seal.join`), write the rows (:mod:`~rtrl_trainer.seal.rows`) with
``write_shards`` under the hour's own file prefix, delete files of that prefix this run
did not write (left by a run that crashed, with inputs since grown), and write the marker
last. A crash anywhere before the marker leaves the hour unsealed; the rerun writes the
same names with the same contents (the same inputs in the same order give the same rows
in the same order).
"""

from __future__ import annotations

import shutil
import tempfile
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from rtrl.core.events import (
    FEEDBACK_DIR,
    GENERATIONS_DIR,
    SealMarker,
    hour_of,
    hour_partition,
    parse_hour_partition,
    seal_marker_key,
    sealed_shard_prefix,
)
from rtrl.core.events.layout import sealable
from rtrl.core.shards import write_shards
from rtrl.core.shards.layout import partition_segment
from rtrl.core.store import ObjectNotFound, ObjectStore, open_store
from rtrl.core.store.local import LocalStore
from rtrl_trainer.progress import Progress
from rtrl_trainer.read_ahead import read_ahead
from rtrl_trainer.seal.config import SealConfig
from rtrl_trainer.seal.join import HourJoin
from rtrl_trainer.seal.rows import sealed_batches

# Rows per batch read from a generation file (~30 MB of tokens at most): fewer, larger
# batches cost less per row, and memory still holds only a few.
BATCH_ROWS = 65_536
DOWNLOAD_THREADS = 8

# The counts of a sealed hour, in the order the summary names them.
COUNTS = (
    "generations", "sealed", "duplicates", "invalid", "outside_hour", "unverified",
    "engine_errors", "no_completion", "feedback_events", "feedback_used",
    "feedback_duplicates", "feedback_conflicts", "feedback_invalid", "orphans", "late",
    "before_served", "unknown_signal",
)  # fmt: skip


class SealError(Exception):
    """The seal cannot run (an event file that is not Parquet, ...)."""


@dataclass
class SealResult:
    sealed: list[dict[str, Any]] = field(default_factory=list)  # per hour sealed now
    waiting: list[str] = field(default_factory=list)  # hours not yet sealable
    already: int = 0  # hours sealed by an earlier run
    late_files: int = 0  # feedback files after their hour's marker
    late_events: int = 0
    totals: Counter[str] = field(default_factory=Counter)

    def doc(self) -> dict[str, Any]:
        return {
            "hours_sealed": [h["hour"] for h in self.sealed],
            "hours_waiting": self.waiting,
            "hours_already_sealed": self.already,
            "counts": {name: self.totals.get(name, 0) for name in COUNTS},
            "late_feedback_files": self.late_files,
            "late_feedback_events": self.late_events,
            "hours": self.sealed,
        }

    def summary(self) -> str:
        c = self.totals
        text = (
            f"seal: sealed {len(self.sealed)} hour(s): {c['sealed']} interactions, "
            f"{c['duplicates']} duplicate(s), {c['unverified']} unverified, "
            f"{c['engine_errors']} engine error(s), {c['no_completion']} without completion; "
            f"feedback: {c['feedback_used']} value(s) used, {c['late']} late, "
            f"{c['orphans']} orphan(s), {c['feedback_conflicts']} conflict(s), "
            f"{c['feedback_duplicates']} duplicate(s)"
        )
        text += f"; {len(self.waiting)} hour(s) waiting, {self.already} sealed before"
        if self.late_files:
            text += (
                f", {self.late_events} feedback event(s) in {self.late_files} file(s) "
                "arrived after their hour was sealed"
            )
        return text


def seal(config: SealConfig) -> SealResult:
    """Run the step; raises StoreError when a store fails (a rerun resumes)."""
    events = open_store(config.events, endpoint_url=config.endpoint_url)
    feedback = (
        events
        if config.feedback_events == config.events
        else open_store(config.feedback_events, endpoint_url=config.endpoint_url)
    )
    shards = open_store(config.shards, endpoint_url=config.endpoint_url)
    result = SealResult()
    hours = event_hours(events, GENERATIONS_DIR, config.now, config.lookback)
    markers = sealed_hours(shards, config.now, config.lookback)
    todo: list[datetime] = []
    for hour in sorted(hours):
        if hour in markers:
            result.already += 1
            _count_late(feedback, shards, hour, result)
        elif sealable(hour, config.now, config.longest_maturity, config.delay):
            todo.append(hour)
        else:
            result.waiting.append(hour.isoformat())
    progress = Progress("seal", "sealing hours", total=len(todo), unit="hours")
    progress.start()
    for done, hour in enumerate(todo, 1):
        counts = seal_hour(config, events, feedback, shards, hour, hours[hour])
        result.sealed.append({"hour": hour.isoformat(), "counts": counts})
        result.totals.update(counts)
        progress.update(done, interactions=result.totals["sealed"])
    progress.end(interactions=result.totals["sealed"])
    return result


def _dates(now: datetime, lookback: timedelta) -> Iterator[str]:
    day = hour_of(now - lookback).date()
    while day <= now.date():
        yield f"date={day:%Y-%m-%d}/"
        day += timedelta(days=1)


def event_hours(
    store: ObjectStore, kind: str, now: datetime, lookback: timedelta
) -> dict[datetime, list[str]]:
    """The hours of ``lookback`` before ``now`` with event files of ``kind``, each with its
    files' keys in key order (one listing per day)."""
    found: dict[datetime, list[str]] = {}
    start = hour_of(now - lookback)
    for day in _dates(now, lookback):
        for info in store.list(f"{kind}/{day}"):
            hour = parse_hour_partition(info.key)
            name = info.key.rpartition("/")[2]
            if hour is None or hour < start or not name.endswith(".parquet"):
                continue
            if name.startswith((".", "_")):
                continue
            found.setdefault(hour, []).append(info.key)
    return found


def sealed_hours(shards: ObjectStore, now: datetime, lookback: timedelta) -> set[datetime]:
    """The hours of ``lookback`` that have a seal marker."""
    found: set[datetime] = set()
    for day in _dates(now, lookback):
        for info in shards.list(f"_sealed/{day}"):
            hour = parse_hour_partition(info.key)
            if hour is not None and info.key == seal_marker_key(hour):
                found.add(hour)
    return found


def _count_late(
    feedback: ObjectStore, shards: ObjectStore, hour: datetime, result: SealResult
) -> None:
    key = seal_marker_key(hour)
    try:
        marker = SealMarker.from_json(shards.get_bytes(key))
    except (ValueError, KeyError, TypeError) as exc:
        raise SealError(f"{shards.url(key)}: not a seal marker ({exc})") from exc
    read = set(marker.feedback)
    prefix = f"{FEEDBACK_DIR}/{hour_partition(hour)}/"
    for info in feedback.list(prefix):
        if info.key in read or not info.key.endswith(".parquet"):
            continue
        result.late_files += 1
        with feedback.open_input(info.key) as handle:
            result.late_events += pq.read_metadata(handle).num_rows


def _local_copies(store: ObjectStore, keys: list[str], directory: Path) -> list[Path]:
    """Local paths of ``keys``: in place for a file:// store, else downloaded (named by
    their index, so the order of the paths is the order of the keys)."""
    if isinstance(store, LocalStore):
        return [store.root.joinpath(*key.split("/")) for key in keys]
    directory.mkdir(parents=True, exist_ok=True)
    paths = [directory / f"{index:06d}.parquet" for index in range(len(keys))]
    with ThreadPoolExecutor(DOWNLOAD_THREADS, thread_name_prefix="seal-fetch") as pool:
        list(pool.map(store.get_file, keys, paths))
    return paths


def _readable(paths: list[Path], keys: list[str]) -> None:
    for path, key in zip(paths, keys, strict=True):
        try:
            pq.read_metadata(path)
        except Exception as exc:
            raise SealError(f"event file {key}: not Parquet ({exc})") from exc


def seal_hour(  # noqa: PLR0917 (the step's stores, then the hour)
    config: SealConfig,
    events: ObjectStore,
    feedback: ObjectStore,
    shards: ObjectStore,
    hour: datetime,
    generation_keys: list[str],
) -> dict[str, int]:
    """Seal one hour (see the module's docstring); returns its counts."""
    try:
        feedback_keys = [
            info.key
            for info in feedback.list(f"{FEEDBACK_DIR}/{hour_partition(hour)}/")
            if info.key.endswith(".parquet") and not info.key.rpartition("/")[2].startswith(".")
        ]
    except ObjectNotFound:
        feedback_keys = []
    scratch = Path(tempfile.mkdtemp(prefix="rtrl-seal-", dir=config.work_dir))
    try:
        generations = _local_copies(events, generation_keys, scratch / "generations")
        feedback_paths = _local_copies(feedback, feedback_keys, scratch / "feedback")
        _readable(generations, generation_keys)
        _readable(feedback_paths, feedback_keys)
        join = HourJoin(
            memory_limit=config.memory_limit,
            threads=config.threads,
            spill=scratch / "spill",
        )
        try:
            counts, written, checkpoints = _join_and_write(
                join, config, hour, generations, feedback_paths, shards
            )
        except (duckdb.Error, pa.ArrowException) as exc:
            raise SealError(
                f"hour {hour_partition(hour)}: the event files cannot be joined: "
                + " ".join(str(exc).split())[:500]
            ) from exc
        finally:
            join.close()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    files = []
    for key in written:
        with shards.open_input(key) as handle:
            files.append({"key": key, "rows": pq.read_metadata(handle).num_rows})
    counts["sealed"] = sum(f["rows"] for f in files)
    _delete_leftovers(shards, hour, checkpoints, set(written))
    marker = SealMarker(
        hour=hour,
        sealed_at=config.now.astimezone(UTC),
        files=files,
        generations=list(generation_keys),
        feedback=feedback_keys,
        counts={name: counts.get(name, 0) for name in COUNTS},
    )
    shards.put_bytes(seal_marker_key(hour), marker.to_json())
    return dict(marker.counts)


def _join_and_write(  # noqa: PLR0917 (one hour's inputs and outputs)
    join: HourJoin,
    config: SealConfig,
    hour: datetime,
    generations: list[Path],
    feedback: list[Path],
    shards: ObjectStore,
) -> tuple[Counter[str], list[str], list[str | None]]:
    """Join the hour and write its shards; (counts, keys written, the hour's checkpoints)."""
    join.build(hour, generations, feedback, config.maturity)
    counts = Counter(join.counts())
    rows = sealed_batches(
        join.decisions(BATCH_ROWS),
        generations,
        final_after=config.longest_maturity,
        sealed_at=config.now,
        counts=counts,
        batch_size=BATCH_ROWS,
    )
    # the next rows are read and taken on a thread while these are encoded
    written = write_shards(
        read_ahead(rows, "seal-rows"), shards, file_prefix=sealed_shard_prefix(hour)
    )
    return counts, written, join.checkpoints()


def _delete_leftovers(
    shards: ObjectStore, hour: datetime, checkpoints: list[str | None], written: set[str]
) -> None:
    """Delete files of this hour's prefix that this run did not write: a crashed run's,
    whose inputs were fewer or more (the marker does not exist yet, so nothing lists
    them)."""
    prefix = sealed_shard_prefix(hour)
    for checkpoint in checkpoints:
        directory = f"{partition_segment('checkpoint', checkpoint)}/{hour_partition(hour)}/"
        for info in shards.list(directory):
            name = info.key.rpartition("/")[2]
            if name.startswith(f"{prefix}-") and info.key not in written:
                shards.delete(info.key)
