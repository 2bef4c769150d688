"""The analysis's one streaming pass over the shards of the two arms (and of the
checkpoints before the baseline, for covariates): only their Hive partitions are listed,
every row goes through the validating reader, so bad files and rows are quarantined and
counted exactly as the stage step does. Per arm it accumulates per-unit sums
(:class:`~rtrl_trainer.analyze.accumulate.Arms`), so memory does not grow with the rows."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from rtrl.core.api.common import parse_duration
from rtrl.core.api.rlcycle import AssignmentUnit
from rtrl.core.shards import REQUIRED_COLUMNS, ValidatingReader, list_files
from rtrl.core.shards.layout import parse_partitions
from rtrl.core.store import open_store
from rtrl.core.store.local import LocalStore
from rtrl_trainer.analyze.accumulate import Arms, strings
from rtrl_trainer.analyze.config import AnalyzeConfig
from rtrl_trainer.analyze.looks import from_us
from rtrl_trainer.analyze.reconcile import Served, count_served
from rtrl_trainer.progress import Progress
from rtrl_trainer.quarantine import Quarantined
from rtrl_trainer.reward import filled
from rtrl_trainer.spec_file import ConfigError

_INT64_MAX = np.iinfo(np.int64).max


def _us(value: datetime) -> int:
    delta = value.astimezone(UTC) - datetime(1970, 1, 1, tzinfo=UTC)
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


def _mask(array: pa.Array) -> np.ndarray[Any, np.dtype[np.bool_]]:
    values: np.ndarray[Any, np.dtype[np.bool_]] = filled(array, False).astype(np.bool_)
    return values


def _other_orgs(org: pa.Array, config: AnalyzeConfig) -> np.ndarray[Any, np.dtype[np.bool_]] | None:
    """Rows of organisations this analysis leaves out (another than ``--org``, or one of
    ``--exclude-org``); None when it leaves none out."""
    if config.org is None and not config.exclude_orgs:
        return None
    out = np.zeros(len(org), dtype=np.bool_)
    if config.org is not None:
        out |= ~_mask(pc.equal(org, config.org))
    if config.exclude_orgs:
        out |= _mask(pc.is_in(org, value_set=pa.array(config.exclude_orgs, pa.string())))
    return out


def _times(array: pa.Array, fill: int) -> np.ndarray[Any, np.dtype[np.int64]]:
    values: np.ndarray[Any, np.dtype[np.int64]] = filled(array.cast(pa.int64()), fill)
    return values


@dataclass
class Scan:
    arms: Arms
    selection: Quarantined
    excluded: Counter[str] = field(default_factory=Counter)
    bad_by_arm: Counter[str] = field(default_factory=Counter)
    served: Served | None = None  # the capture proxy's counts (--events)


UNIT_COLUMN = {AssignmentUnit.USER: "user_id", AssignmentUnit.SESSION: "session_id"}


def scan(config: AnalyzeConfig) -> Scan:
    store = open_store(config.data.shards, endpoint_url=config.endpoint_url)
    if isinstance(store, LocalStore) and not store.root.is_dir():
        raise ConfigError(f"data.shards: {store.root} is not a directory")
    key = config.data.checkpoint_partition
    unit = config.rollout.unit
    extra = ["session_id"] if unit == AssignmentUnit.SESSION else []
    partitions: dict[str, set[str]] = {
        key: {config.baseline, config.canary, *config.pre_exposure_from}
    }
    if config.since is not None:
        # Nothing created before the pre-exposure window is used: skip its date partitions
        # (created_at's UTC date, or a later one such as an ingestion date; files without
        # a date in their path are read).
        first = config.since - timedelta(
            seconds=parse_duration(config.rollout.analysis.pre_exposure)
        )
        days = (config.now.astimezone(UTC).date() - first.astimezone(UTC).date()).days
        partitions["date"] = {
            (first.astimezone(UTC).date() + timedelta(days=d)).isoformat() for d in range(days + 1)
        }
    reader = ValidatingReader(
        store,
        partitions=partitions,
        columns=[*REQUIRED_COLUMNS, *extra] if extra else None,
        require=extra,  # an analysis by session cannot use a file without sessions
    )
    selection = Quarantined(report=reader.report)
    steps = config.step_starts
    looks = config.looks
    starts = np.array([_us(at) for at in steps], dtype=np.int64)
    arms = Arms(len(steps), unit, looks, config.settle_bins, step_bins=looks.bins(starts))
    result = Scan(arms, selection)
    as_of = looks.last  # the data judged are those of the last look of the plan
    cutoff = as_of - looks.maturity
    since = _us(config.since) if config.since is not None else None
    pre_since = (
        since - int(parse_duration(config.rollout.analysis.pre_exposure) * 1_000_000)
        if since is not None
        else None
    )
    path_checkpoints: dict[str, str | None] = {}
    # Listed once more for the count (a LIST per thousand files, next to a GET per file).
    total = sum(1 for _ in list_files(store, partitions=partitions))
    progress = Progress("analyze", "reading shards", total=total, unit="files")
    progress.start()
    rows = 0
    for good in reader:
        batch = good
        file = reader.report.files[-1]
        if file.key not in path_checkpoints:
            path_checkpoints[file.key] = parse_partitions(file.key).get(key)
        rows += batch.num_rows
        progress.update(len(reader.report.files), rows=rows)
        expected = path_checkpoints[file.key]
        ckpt = batch.column("checkpoint_id")
        if expected is not None:
            mismatch = _mask(pc.not_equal(ckpt, expected))
            if mismatch.any():
                selection.mismatched[file.url] += int(np.count_nonzero(mismatch))
                batch = batch.filter(pa.array(~mismatch))
                ckpt = batch.column("checkpoint_id")
        others = _other_orgs(batch.column("org"), config)
        if others is not None and others.any():
            result.excluded["other_orgs"] += int(np.count_nonzero(others))
            batch = batch.filter(pa.array(~others))
            ckpt = batch.column("checkpoint_id")
        if batch.num_rows == 0:
            continue
        created = _times(batch.column("created_at"), 0)
        feedback = _times(batch.column("feedback_at"), _INT64_MAX)
        arm = np.where(
            _mask(pc.equal(ckpt, config.canary)),
            1,
            np.where(_mask(pc.equal(ckpt, config.baseline)), 0, -1),
        )
        # the serving lineage before the canary: stable rows, covariates only
        earlier = arm == 0
        if config.pre_exposure_from:
            earlier |= _mask(pc.is_in(ckpt, pa.array(config.pre_exposure_from)))
        users = strings(batch.column("user_id"), None)
        window = np.ones(batch.num_rows, dtype=bool)
        if since is not None:
            window = created >= since
            before = ~window
            pre = before & earlier & (created <= cutoff) & (feedback <= as_of)
            if pre_since is not None:
                pre &= created >= pre_since
            if pre.any():
                arms.add_pre(batch.filter(pa.array(pre)), users[pre], created[pre])
            result.excluded["before_since"] += int(np.count_nonzero(before & ~pre & (arm >= 0)))
        old_enough = created <= cutoff
        matured = window & old_enough & (feedback <= as_of)
        result.excluded["too_recent"] += int(np.count_nonzero(window & ~old_enough))
        result.excluded["immature"] += int(np.count_nonzero(window & old_enough & ~matured))
        if unit == AssignmentUnit.REQUEST:
            keys = users
        else:
            keys = strings(batch.column(UNIT_COLUMN[unit]), batch.column("interaction_id"))
        stratum = np.maximum(np.searchsorted(starts, created, side="right") - 1, 0)
        assigned = window & (created <= as_of)
        if assigned.any():
            arms.add_assigned(
                batch, np.where(assigned, arm, -1), stratum, keys=keys, users=users,
                created=created,
            )  # fmt: skip
        arms.add(
            batch, np.where(window, arm, -1), stratum,
            keys=keys, users=users, created=created, feedback=feedback,
        )  # fmt: skip
    progress.update(len(reader.report.files))
    progress.end(rows=rows)
    if config.events is not None and config.since is not None:
        result.served = count_served(
            open_store(config.events, endpoint_url=config.endpoint_url), store,
            since=config.since, until=from_us(as_of),
            checkpoints=(config.baseline, config.canary), org=config.org,
            exclude_orgs=config.exclude_orgs,
        )  # fmt: skip
    for file in reader.report.files:
        served_by = parse_partitions(file.key).get(key)
        lost = file.rows_bad + selection.mismatched.get(file.url, 0)
        if lost and served_by is not None:
            result.bad_by_arm[served_by] += lost
    return result
