"""``rtrl-job stage``: from logged interactions to a clean, rewarded, on-policy training set.

The first half of every cycle. It reads the interaction shards the serving checkpoint
produced, keeps the rows that are good and ready, rewards them, measures how the checkpoint
behaved, and writes the training set split for the trainer's data-parallel ranks, plus
``stage.json``, the summary the operator reads. One pass over the shards:

1. **Select** (pass 1). Stream the shards through the validating reader (bad files and rows
   are quarantined and counted by reason; duplicate ``interaction_id``s are dropped there,
   first good one kept), listing only the Hive partitions of the serving checkpoint and,
   when admitted, the previous one. Keep a row when

   - its ``checkpoint_id`` is the serving checkpoint (on-policy), or the previous one when
     ``data.maxOffPolicyFraction`` > 0 (off-policy, admitted below). Rows of checkpoints
     given with ``--exclude-checkpoint`` (rolled back) are never kept, even if named as
     previous; a row whose ``checkpoint_id`` disagrees with its file's ``checkpoint=`` path
     is quarantined as ``checkpoint_mismatch`` (which one served it is unknown, so its
     log-probs cannot be trusted as on- or off-policy);
   - its org passes ``data.population`` (``orgs`` / ``excludeOrgs``; a null org is in no
     listed org);
   - it was created at or after ``now - data.window`` (when a window is set);
   - it is *ready*: created at least ``data.maturity`` before ``now`` (else ``too_recent``)
     and its feedback is final, ``feedback_at`` set and not after ``now`` (else
     ``immature``);
   - it became ready after ``--since``: ``max(created_at + maturity, feedback_at) > since``
     (else ``already_staged``).

   ``since`` is a readiness watermark: the operator passes the previous stage's ``now``
   (reported as ``next_since``), so the intervals ``(since, now]`` of consecutive cycles
   partition time and every interaction is staged exactly once, in the cycle in which it
   became ready, however late its feedback arrived. Immature and too-recent rows are
   therefore not lost: a later cycle picks them up.

   The reader runs a batch ahead on a thread of its own (:mod:`rtrl_trainer.read_ahead`).
   Token ids are stored in two bytes when every file's footer declares them within
   0-65535 (:func:`token_id_type`, decided before the first row; each id is checked as it
   is packed, and a row that contradicts its footer is quarantined as
   ``statistics_mismatch``), else in four.

   Rewards (:mod:`rtrl_trainer.reward`) and behaviour monitors
   (:mod:`rtrl_trainer.monitors`) are computed per batch, and the selected rows, with
   their rewards, are dealt round-robin to ``train/rank-RRRRR-of-NNNNN.parquet`` as they
   come, each rank file encoded by a worker thread (:mod:`rtrl_trainer.stage_write`;
   hashed and flushed to disk as it grows, since its bytes are final once written; the
   advantages, in a file of their own per rank, come in step 3). Only when
   previous-checkpoint rows are admissible do the selected rows wait in a local scratch
   file instead (Arrow IPC with zstd-compressed buffers, not re-encoded on the way in or
   out): which of those rows enter the set is known only once all are read.

2. **Decide.** If more than ``data.maxBadFraction`` of the rows read were bad, fail (exit
   1) and commit only ``stage.json`` with ``ok: false``. Admit previous-checkpoint rows up
   to ``maxOffPolicyFraction`` of the final set, choosing them by a hash of their
   ``interaction_id`` (the same rows on every rerun). Below ``minInteractions`` or
   ``minTokens`` the set is insufficient: ``stage.json`` says so, no training set is
   written, and that is not an error (exit 0).

3. **Advantages.** (With a scratch file, first stream it and deal its on-policy and
   admitted rows to the rank files, in the order they were read.) Compute the advantages
   with the whole set's baselines and standard deviation and write each rank's advantage
   file (``train/rank-RRRRR-of-NNNNN.advantage.parquet``: one ``advantage`` column, the
   rank file's rows in its order).

4. **Commit** everything through the object store's commit protocol (manifest last), so a
   reader never sees a half-written training set. A ``file://`` output store had the files
   written in place under hidden temp names: they are renamed, not copied (the rank files
   were hashed and made durable while written). Files depend
   only on the inputs; timing sits under ``timing`` in ``stage.json``, so a rerun gives
   identical files otherwise.

Memory is bounded by a few batches whatever the number of rows, plus 8 bytes per row in the
reader's duplicate set and 20 bytes per eligible previous-checkpoint row (their hashes,
rewards, strata and lengths, needed to choose them after pass 1). Each row's reward and
stratum wait for step 3 in a side file on local disk (8 bytes a row), not in memory.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from rtrl.core.api.common import parse_duration
from rtrl.core.cliargs import fraction, non_negative_int, positive_int
from rtrl.core.shards import INTERACTION_SCHEMA, ValidatingReader, list_files
from rtrl.core.shards.dedup import hash_strings
from rtrl.core.shards.layout import PartitionFilter, parse_partitions
from rtrl.core.shards.report import FileReport, ValidationReport
from rtrl.core.shards.statistics import TOKEN_ID_COLUMNS, declared_range
from rtrl.core.store import ObjectStore, open_store
from rtrl.core.store.local import LocalStore
from rtrl_trainer.config import StageConfig, build_config, format_time, time_arg
from rtrl_trainer.monitors import MONITOR_COLUMNS, Monitors
from rtrl_trainer.packed import (
    NARROW_TOKEN_IDS,
    PACKED_COLUMNS,
    element_type,
    fits_narrow,
    pack,
    packed_field,
    packed_lengths,
    rows_not_narrow,
)
from rtrl_trainer.read_ahead import read_ahead
from rtrl_trainer.reward import RunningStats, Strata, filled, rewards
from rtrl_trainer.runner import run_step
from rtrl_trainer.spec_file import ConfigError
from rtrl_trainer.stage_write import (
    HELDOUT_DIR,
    Ranks,
    Staging,
    Worker,
    parquet_writer,
)

RESULT_NAME = "stage.json"
HELDOUT_NAME = f"{HELDOUT_DIR}/part-00000.parquet"
DEFAULT_HELDOUT_FRACTION = 0.05
CHECKPOINT_MISMATCH = "checkpoint_mismatch"
# A row holding a token id outside the range its file's footer declares, when the set's
# token ids were narrowed on the strength of those declarations.
STATISTICS_MISMATCH = "statistics_mismatch"
WIDE_TOKEN_IDS = PACKED_COLUMNS["prompt_ids"]
# Bad files listed in stage.json; the counts cover all of them.
MAX_BAD_FILES = 100

SCRATCH_COMPRESSION = "zstd"

_CANON = {f.name: f for f in INTERACTION_SCHEMA}
CARRIED_COLUMNS = (
    "interaction_id",
    "checkpoint_id",
    "org",
    "prompt_ids",
    "completion_ids",
    "completion_logprobs",
    "completion_mask",
)
# The held-out split: what the eval step's replay and behaviour suites read (the
# interaction as logged, with its signals), never trained on.
HELDOUT_COLUMNS: tuple[str, ...] = tuple(dict.fromkeys((*CARRIED_COLUMNS, *MONITOR_COLUMNS)))


def _fields(names: tuple[str, ...], tokens: str) -> list[pa.Field]:
    """Canonical fields of ``names``, the per-token ones packed (token ids as ``tokens``)."""
    return [
        packed_field(name, nullable=False, dtype=tokens if name in TOKEN_ID_COLUMNS else None)
        if name in PACKED_COLUMNS
        else _CANON[name]
        for name in names
    ]


def scratch_schema(tokens: str = WIDE_TOKEN_IDS) -> pa.Schema:
    """The selected rows as pass 1 hands them on (per-token columns packed)."""
    return pa.schema(
        [
            *_fields(CARRIED_COLUMNS, tokens),
            pa.field("reward", pa.float32()),
            pa.field("stratum", pa.int32()),
            pa.field("on_policy", pa.bool_()),
        ]
    )


def train_schema(tokens: str = WIDE_TOKEN_IDS) -> pa.Schema:
    """The training set: what the trainer reads, one file per data-parallel rank, and next
    to each its advantage file (``advantage``, float32, same rows in the same order; see
    rtrl_trainer.stage_write). Its per-token columns are packed
    (:mod:`rtrl_trainer.packed`): cheaper to encode than lists."""
    return pa.schema(
        [
            *_fields(CARRIED_COLUMNS, tokens),
            pa.field("reward", pa.float32()),
            # 1.0 for every row: the trainer importance-weights per token from the logged
            # log-probs (off-policy rows included); this column is where a per-row weight
            # (e.g. rebalancing orgs) would go without changing the trainer's reader.
            pa.field("sample_weight", pa.float32()),
            pa.field("on_policy", pa.bool_()),
        ]
    )


def heldout_schema(tokens: str = WIDE_TOKEN_IDS) -> pa.Schema:
    """The held-out file: the interaction as logged, with its signals."""
    return pa.schema(_fields(HELDOUT_COLUMNS, tokens))


def token_id_type(store: ObjectStore, partitions: PartitionFilter | None = None) -> str:
    """How the set stores token ids: two bytes when every file of the set declares (in
    its footer's statistics) ids within 0-65535, else four. Decided before the first row
    is written, since a file's schema cannot change; the rows are checked as they are
    packed (:data:`STATISTICS_MISMATCH`)."""
    declared = declared_range(store, list_files(store, partitions=partitions))
    if declared is not None and declared.low >= 0 and declared.high <= 0xFFFF:
        return NARROW_TOKEN_IDS
    return WIDE_TOKEN_IDS


_INT64_MAX = np.iinfo(np.int64).max


class StageError(Exception):
    """The step cannot produce a training set (too much bad data); exit status 1."""


# --- pass 1: select, reward, monitor -------------------------------------------------------


@dataclass
class Selection:
    """What pass 1 found: counts by outcome, on-policy statistics, and the eligible
    previous-checkpoint rows (whose admission is decided once their number is known)."""

    report: ValidationReport
    strata: Strata
    monitors: Monitors = field(default_factory=Monitors)
    mismatched: Counter[str] = field(default_factory=Counter)  # file url -> rows
    undeclared: Counter[str] = field(default_factory=Counter)  # file url -> rows
    excluded: Counter[str] = field(default_factory=Counter)
    immature: int = 0
    too_recent: int = 0
    on_rows: int = 0
    on_tokens: int = 0
    on_stats: RunningStats = field(default_factory=RunningStats)
    prev_hashes: list[npt.NDArray[np.uint64]] = field(default_factory=list)
    prev_rewards: list[npt.NDArray[np.float32]] = field(default_factory=list)
    prev_codes: list[npt.NDArray[np.int32]] = field(default_factory=list)
    prev_tokens: list[npt.NDArray[np.int32]] = field(default_factory=list)
    heldout: int = 0


def _us(value: datetime) -> int:
    """Microseconds since the epoch, the unit of the canonical timestamps."""
    delta = value.astimezone(UTC) - datetime(1970, 1, 1, tzinfo=UTC)
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


def _mask(array: pa.Array) -> npt.NDArray[np.bool_]:
    return filled(array, False).astype(np.bool_, copy=False)


def _timestamps(array: pa.Array, fill: int) -> npt.NDArray[np.int64]:
    values: npt.NDArray[np.int64] = filled(array.cast(pa.int64()), fill)
    return values


def _population(org: pa.Array, config: StageConfig) -> npt.NDArray[np.bool_] | None:
    """Rows whose org passes ``data.population``; None when every row does."""
    population = config.data.population
    if population is None:
        return None
    keep: npt.NDArray[np.bool_] | None = None
    if population.orgs:
        keep = _mask(pc.is_in(org, value_set=pa.array(population.orgs, pa.string())))
    if population.exclude_orgs:
        banned = _mask(pc.is_in(org, value_set=pa.array(population.exclude_orgs, pa.string())))
        keep = ~banned if keep is None else keep & ~banned
    return keep


def _count(selection: Selection, name: str, rows: npt.NDArray[np.bool_]) -> None:
    n = int(np.count_nonzero(rows))
    if n:
        selection.excluded[name] += n


def _select_batch(
    batch: pa.RecordBatch, config: StageConfig, selection: Selection
) -> tuple[npt.NDArray[np.bool_], npt.NDArray[np.bool_]]:
    """(selected, on-policy) row masks of one good batch; counts what is left out."""
    ckpt = batch.column("checkpoint_id")
    on = _mask(pc.equal(ckpt, config.checkpoint))
    keep = on.copy()
    if config.admits_previous:
        keep |= _mask(pc.equal(ckpt, config.previous_checkpoint))
    if config.exclude_checkpoints:
        rolled_back = _mask(pc.is_in(ckpt, value_set=pa.array(config.exclude_checkpoints)))
        _count(selection, "rolled_back", rolled_back)
        _count(selection, "other_checkpoint", ~keep & ~rolled_back)
    else:
        _count(selection, "other_checkpoint", ~keep)

    population = _population(batch.column("org"), config)
    if population is not None:
        _count(selection, "population", keep & ~population)
        keep &= population

    created = _timestamps(batch.column("created_at"), 0)
    window_start = config.window_start
    if window_start is not None:
        stale = keep & (created < _us(window_start))
        _count(selection, "outside_window", stale)
        keep &= ~stale

    now = _us(config.now)
    maturity = round(parse_duration(config.data.maturity) * 1_000_000)
    recent = keep & (created > now - maturity)
    selection.too_recent += int(np.count_nonzero(recent))
    keep &= ~recent

    feedback = _timestamps(batch.column("feedback_at"), _INT64_MAX)
    unripe = keep & (feedback > now)
    selection.immature += int(np.count_nonzero(unripe))
    keep &= ~unripe

    if config.since is not None:
        ready_at = np.maximum(created + maturity, feedback)
        staged = keep & (ready_at <= _us(config.since))
        _count(selection, "already_staged", staged)
        keep &= ~staged
    return keep, on


def _quarantine_mismatched(
    batch: pa.RecordBatch, path_checkpoint: str | None, file: FileReport, selection: Selection
) -> pa.RecordBatch:
    """``batch`` without the rows whose ``checkpoint_id`` contradicts the file's path."""
    if path_checkpoint is None:
        return batch
    mismatch = _mask(pc.not_equal(batch.column("checkpoint_id"), path_checkpoint))
    n = int(np.count_nonzero(mismatch))
    if n == 0:
        return batch
    selection.mismatched[file.url] += n
    return batch.filter(pa.array(~mismatch))


def _quarantine_undeclared(
    batch: pa.RecordBatch, file: FileReport, selection: Selection
) -> pa.RecordBatch:
    """``batch`` without the rows whose token ids do not fit the narrow type that the
    footers' statistics promised (:data:`STATISTICS_MISMATCH`); one pass when all fit."""
    outside: npt.NDArray[np.bool_] | None = None
    for name in TOKEN_ID_COLUMNS:
        column = batch.column(name)
        if not fits_narrow(column):
            rows = rows_not_narrow(column)
            outside = rows if outside is None else outside | rows
    if outside is None:
        return batch
    selection.undeclared[file.url] += int(np.count_nonzero(outside))
    return batch.filter(pa.array(~outside))


def _rows(mask: npt.NDArray[np.bool_]) -> pa.Array:
    """Row indices of ``mask``, for ``take``."""
    return pa.array(np.flatnonzero(mask).astype(np.int64))


def _held_out(ids: pa.Array, fraction: float) -> npt.NDArray[np.bool_]:
    """Whether each interaction belongs to the held-out split: its 64-bit id hash falls in
    the lowest ``fraction`` of the hash range (deterministic, independent of files)."""
    if fraction <= 0:
        return np.zeros(len(ids), dtype=bool)
    threshold = np.uint64(min(fraction, 1.0) * float(np.iinfo(np.uint64).max))
    held: npt.NDArray[np.bool_] = hash_strings(ids) < threshold
    return held


def shard_partitions(config: StageConfig) -> dict[str, set[str]]:
    """The Hive partitions the step reads: the serving checkpoint's, and the previous
    one's when its rows are admissible."""
    wanted = {config.checkpoint}
    if config.admits_previous:
        assert config.previous_checkpoint is not None
        wanted.add(config.previous_checkpoint)
    return {config.data.checkpoint_partition: wanted}


def select(
    config: StageConfig,
    store: ObjectStore,
    sink: Callable[[pa.RecordBatch], None],
    heldout: Path | None = None,
    tokens: str = WIDE_TOKEN_IDS,
) -> Selection:
    """Pass 1: stream the shards, pass the selected rows (with rewards, as scratch-schema
    batches, token ids as ``tokens``) to ``sink``, and write the held-out on-policy rows
    (``config.heldout_fraction``) to ``heldout``."""
    key = config.data.checkpoint_partition
    reader = ValidatingReader(store, partitions=shard_partitions(config))
    strata = Strata(by_org=config.reward.baseline == "org")
    selection = Selection(report=reader.report, strata=strata)
    path_checkpoints: dict[str, str | None] = {}
    schema = scratch_schema(tokens)
    with contextlib.ExitStack() as stack:
        heldout_writer = None
        if heldout is not None:
            # Written on a worker thread, overlapping the reading (both release the GIL).
            held_schema = heldout_schema(tokens)
            heldout_writer = stack.enter_context(parquet_writer(heldout, held_schema))
            # Leaving the stack waits for the worker before the writer writes its footer.
            background = stack.enter_context(Worker("stage-heldout"))
        # The next batch is decoded and checked while this one is selected and packed.
        for file, good in read_ahead(reader.batches_by_file(), "stage-read"):
            if file.key not in path_checkpoints:
                path_checkpoints[file.key] = parse_partitions(file.key).get(key)
            batch = _quarantine_mismatched(good, path_checkpoints[file.key], file, selection)
            batch, packed = _packed_checked(batch, tokens, file, selection)
            keep, on = _select_batch(batch, config, selection)
            if not keep.any():
                continue
            if heldout_writer is not None:
                held = (
                    keep & on & _held_out(batch.column("interaction_id"), config.heldout_fraction)
                )
                if held.any():
                    rows = _rows(held)
                    columns = [a.take(rows) for a in _columns(batch, packed, HELDOUT_COLUMNS)]
                    table = pa.Table.from_arrays(columns, schema=held_schema)
                    background.submit(heldout_writer.write_table, table)
                    selection.heldout += int(np.count_nonzero(held))
                    keep &= ~held
                    if not keep.any():
                        continue
            sink(_reward_batch(batch, packed, keep, on, config, selection, schema))
    return selection


def _packed_checked(
    batch: pa.RecordBatch, tokens: str, file: FileReport, selection: Selection
) -> tuple[pa.RecordBatch, dict[str, pa.Array]]:
    """The batch and its per-token columns packed (:func:`_packed`), less the rows whose
    token ids do not fit the narrow type their file's footer promised (packing checks
    every id; only a batch that fails is looked at row by row)."""
    try:
        return batch, _packed(batch, tokens)
    except ValueError:
        if tokens != NARROW_TOKEN_IDS:
            raise
    batch = _quarantine_undeclared(batch, file, selection)
    return batch, _packed(batch, tokens)


def _packed(batch: pa.RecordBatch, tokens: str) -> dict[str, pa.Array]:
    """The per-token columns of a canonical batch, packed (token ids as ``tokens``), once
    for both the held-out and the training rows."""
    return {
        name: pack(batch.column(name), tokens if name in TOKEN_ID_COLUMNS else dtype)
        for name, dtype in PACKED_COLUMNS.items()
    }


def _columns(
    batch: pa.RecordBatch, packed: dict[str, pa.Array], names: tuple[str, ...]
) -> list[pa.Array]:
    """The columns ``names`` of a batch, the per-token ones from ``packed``."""
    return [packed[name] if name in packed else batch.column(name) for name in names]


def _reward_batch(  # noqa: PLR0917 (one batch's parts, named at the one call)
    batch: pa.RecordBatch,
    packed: dict[str, pa.Array],
    keep: npt.NDArray[np.bool_],
    on: npt.NDArray[np.bool_],
    config: StageConfig,
    selection: Selection,
    schema: pa.Schema,
) -> pa.RecordBatch:
    """Rewards, strata and monitors of the rows ``keep`` of one good batch (``on``: which
    rows are on-policy); the scratch batch (``schema``) of those rows, per-token columns
    from ``packed``.

    Rewards, strata and lengths are computed for the whole batch with numpy and indexed;
    only the carried columns are copied, packed first: gathering a packed row is one
    ``memcpy``, where a list column's rows are gathered element by element."""
    reward = rewards(batch, config.reward)
    codes = selection.strata.encode(batch.column("org"))
    lengths = filled(pc.list_value_length(batch.column("completion_ids")), 0)
    arrays = _columns(batch, packed, CARRIED_COLUMNS)
    # The monitors describe the serving checkpoint's behaviour: its own rows only.
    monitored = keep & on
    signals = batch.select(MONITOR_COLUMNS)
    if not monitored.all():
        signals = signals.take(_rows(monitored))
    if not keep.all():
        # Filter, not take: Arrow copies each run of kept rows at once (~15% faster here).
        mask = pa.array(keep)
        arrays = [array.filter(mask) for array in arrays]
        reward, codes, lengths, on = reward[keep], codes[keep], lengths[keep], on[keep]
    if not on.all():
        previous = ~on
        ids = arrays[CARRIED_COLUMNS.index("interaction_id")].take(_rows(previous))
        selection.prev_hashes.append(hash_strings(ids))
        selection.prev_rewards.append(reward[previous])
        selection.prev_codes.append(codes[previous])
        selection.prev_tokens.append(lengths[previous].astype(np.int32))
    selection.monitors.update(signals, lengths[on])
    selection.on_rows += signals.num_rows
    selection.on_tokens += int(lengths[on].sum(dtype=np.int64))
    selection.on_stats.update(reward[on])
    selection.strata.add(codes[on], reward[on])
    arrays += [pa.array(reward), pa.array(codes), pa.array(on)]
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


# --- decide: quarantine verdict, off-policy admission, sufficiency ---------------------------


@dataclass(frozen=True)
class Quarantine:
    rows_read: int
    rows_bad: int
    files_total: int
    files_bad: int
    by_reason: dict[str, int]  # rows per reason (a row failing two checks counts twice)
    files_by_reason: dict[str, int]  # files with at least one problem of each reason
    bad_files: list[dict[str, Any]]

    @property
    def bad_fraction(self) -> float:
        if self.rows_read:
            return self.rows_bad / self.rows_read
        # Files whose footers could not even be read have no row count: all of it is bad.
        return 1.0 if self.files_bad else 0.0


def quarantine(selection: Selection) -> Quarantine:
    """The reader's quarantine plus the rows this step itself quarantined (rows that
    contradict their file's path or footer), per reason and per file."""
    report = selection.report
    by_reason = dict(report.rows_by_reason)
    files_by_reason = dict(report.files_by_reason)
    own = {CHECKPOINT_MISMATCH: selection.mismatched, STATISTICS_MISMATCH: selection.undeclared}
    for reason, per_file in own.items():
        if per_file:
            by_reason[reason] = sum(per_file.values())
            files_by_reason[reason] = len(per_file)
    bad_files: list[dict[str, Any]] = []
    files_bad = 0
    for file in report.files:
        lost = {reason: n for reason, per_file in own.items() if (n := per_file.get(file.url))}
        if file.status == "ok" and not lost:
            continue
        files_bad += 1
        if len(bad_files) < MAX_BAD_FILES:
            entry = file.to_dict()
            for reason, n in lost.items():
                entry["rows_bad"] += n
                entry["rows_by_reason"][reason] = n
                entry["reasons"].append(reason)
                if entry["status"] == "ok":
                    entry["status"] = "bad"
            bad_files.append(entry)
    return Quarantine(
        rows_read=report.rows_total,
        rows_bad=report.rows_bad + sum(sum(per_file.values()) for per_file in own.values()),
        files_total=report.files_total,
        files_bad=files_bad,
        by_reason=by_reason,
        files_by_reason=files_by_reason,
        bad_files=bad_files,
    )


def _percent(value: float) -> str:
    return f"{100 * value:.3g}%"


def quarantine_message(q: Quarantine, limit: float) -> str:
    """``3.2% of rows are bad (limit 1%): list_length_mismatch=12; 2 of 40 files bad
    (unreadable=1, list_length_mismatch=1)``"""
    text = f"{_percent(q.bad_fraction)} of rows are bad (limit {_percent(limit)})"
    if q.by_reason:
        text += ": " + ", ".join(f"{reason}={n}" for reason, n in q.by_reason.items())
    if q.files_bad:
        reasons = ", ".join(f"{reason}={n}" for reason, n in q.files_by_reason.items())
        text += f"; {q.files_bad} of {q.files_total} files bad ({reasons})"
    return text


@dataclass(frozen=True)
class Admission:
    """Which previous-checkpoint rows enter the set: those whose id hash is at most
    ``threshold`` (None: all of them)."""

    eligible: int
    admitted: int
    threshold: int | None
    tokens: int
    stats: RunningStats


def admit_previous(selection: Selection, fraction: float) -> Admission:
    """Admit off-policy rows up to ``fraction`` of the final set, smallest id hashes first
    (a fixed pseudo-random subset: identical on every rerun, unbiased by time or file)."""
    if not selection.prev_hashes:
        return Admission(0, 0, None, 0, RunningStats())
    hashes = np.concatenate(selection.prev_hashes)
    values = np.concatenate(selection.prev_rewards)
    codes = np.concatenate(selection.prev_codes)
    tokens = np.concatenate(selection.prev_tokens)
    eligible = int(hashes.size)
    if fraction >= 1:
        cap = eligible
    else:
        # off / (on + off) <= fraction; the epsilon absorbs rounding of e.g. 0.1 / 0.9.
        cap = min(eligible, math.floor(fraction * selection.on_rows / (1 - fraction) + 1e-9))
    threshold: int | None = None
    if cap < eligible:
        if cap == 0:
            keep = np.zeros(eligible, dtype=np.bool_)
            threshold = -1
        else:
            threshold = int(np.partition(hashes, cap - 1)[cap - 1])
            keep = hashes <= np.uint64(threshold)
        values, codes, tokens = values[keep], codes[keep], tokens[keep]
    stats = RunningStats()
    stats.update(values)
    selection.strata.add(codes, values)
    return Admission(eligible, int(values.size), threshold, int(tokens.sum(dtype=np.int64)), stats)


# --- pass 2: advantages, rank files --------------------------------------------------------


def train_batch(batch: pa.RecordBatch, schema: pa.Schema) -> pa.RecordBatch:
    """A scratch-schema batch (selected rows with rewards) as a batch of a rank file
    (``schema``: :func:`train_schema`)."""
    arrays = [batch.column(name) for name in CARRIED_COLUMNS]
    arrays += [
        batch.column("reward"),
        pa.repeat(pa.scalar(1.0, pa.float32()), batch.num_rows),
        batch.column("on_policy"),
    ]
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def deal(ranks: Ranks, batch: pa.RecordBatch, rows: npt.NDArray[np.int64] | None = None) -> None:
    """Deal ``rows`` of a scratch-schema batch (None: all) to the rank files."""
    strata = batch.column("stratum").to_numpy()
    tokens = element_type(batch.schema.field("completion_ids"))
    lengths = packed_lengths(batch.column("completion_ids"), tokens)
    ranks.deal(train_batch(batch, ranks.schema), strata, lengths, rows)


def write_ranks(ranks: Ranks, *, scratch: Path, admission: Admission) -> None:
    """Pass 2, when previous-checkpoint rows were eligible: deal the scratch file's
    on-policy rows and the admitted previous ones, in the order they were read."""
    with pa.OSFile(os.fspath(scratch), "rb") as source:
        for batch in pa.ipc.open_stream(source):
            rows = _training_rows(batch, admission.threshold)
            deal(ranks, batch, rows)


def _training_rows(batch: pa.RecordBatch, threshold: int | None) -> npt.NDArray[np.int64] | None:
    """The rows of a scratch batch that enter the training set: on-policy, or within the
    off-policy admission (id hash at most ``threshold``); None for all rows."""
    if threshold is None:
        return None
    keep = batch.column("on_policy").to_numpy(zero_copy_only=False)
    if keep.all():
        return None
    previous = np.flatnonzero(~keep)
    if threshold >= 0:
        hashes = hash_strings(batch.column("interaction_id").take(pa.array(previous)))
        keep[previous[hashes <= np.uint64(threshold)]] = True
    rows: npt.NDArray[np.int64] = np.flatnonzero(keep)
    return rows


# --- the step ------------------------------------------------------------------------------


def _summary_document(config: StageConfig) -> dict[str, Any]:
    return {
        "ok": True,
        "sufficient": False,
        "message": "",
        "checkpoint": config.checkpoint,
        "previous_checkpoint": config.previous_checkpoint,
        "excluded_checkpoints": list(config.exclude_checkpoints),
        "shards": config.data.shards,
        "out": config.out,
        "now": format_time(config.now),
        "since": format_time(config.since),
        "cutoff": format_time(config.cutoff),
        "window_start": format_time(config.window_start),
        "next_since": format_time(config.now),
        "maturity": config.data.maturity,
    }


def stage(config: StageConfig, *, work_dir: Path | None = None) -> dict[str, Any]:
    """Run the stage step; return the ``stage.json`` document it committed.

    Raises :class:`StageError` (after committing a ``stage.json`` with ``ok: false``) when
    too much of the data is bad, and :class:`StoreError` when the store fails.
    """
    clock = time.perf_counter()
    shards = open_store(config.data.shards, endpoint_url=config.endpoint_url)
    if isinstance(shards, LocalStore) and not shards.root.is_dir():
        raise ConfigError(f"data.shards: {shards.root} is not a directory")
    out = open_store(config.out, endpoint_url=config.endpoint_url)
    doc = _summary_document(config)
    with (
        tempfile.TemporaryDirectory(prefix="rtrl-stage-", dir=work_dir) as tmp,
        Staging(out, Path(tmp)) as staging,
    ):
        tmp_dir = Path(tmp)
        heldout = staging.path(HELDOUT_NAME) if config.heldout_fraction > 0 else None
        token_ids = token_id_type(shards, shard_partitions(config))
        ranks = Ranks(config.ranks, staging, tmp_dir, train_schema(token_ids))
        scratch: Path | None = None
        with ranks:
            if config.admits_previous:
                # Which previous-checkpoint rows enter the set is known only once all are
                # read: the selected rows wait in a scratch file (Arrow IPC, zstd buffers:
                # not re-encoded on the way in or out), dealt to the ranks in pass 2.
                scratch = tmp_dir / "selected.arrow"
                options = pa.ipc.IpcWriteOptions(compression=SCRATCH_COMPRESSION)
                with (
                    pa.OSFile(os.fspath(scratch), "wb") as sink,
                    pa.ipc.new_stream(sink, scratch_schema(token_ids), options=options) as writer,
                    Worker("stage-scratch") as background,
                ):
                    selection = select(
                        config,
                        shards,
                        lambda b: background.submit(writer.write_batch, b),
                        heldout,
                        token_ids,
                    )
            else:
                # Every selected row enters the set: straight to the rank files.
                selection = select(config, shards, lambda b: deal(ranks, b), heldout, token_ids)
                ranks.close()
            select_seconds = time.perf_counter() - clock
            q = quarantine(selection)
            limit = config.data.max_bad_fraction
            doc.update(
                {
                    "rows_read": q.rows_read,
                    "rows_bad": q.rows_bad,
                    "bad_fraction": q.bad_fraction,
                    "max_bad_fraction": limit,
                    "files_total": q.files_total,
                    "files_bad": q.files_bad,
                    "quarantined": q.by_reason,
                    "files_by_reason": q.files_by_reason,
                    "immature": selection.immature,
                    "too_recent": selection.too_recent,
                    "token_ids": np.dtype(token_ids).name,
                }
            )
            admission = admit_previous(selection, config.data.max_off_policy_fraction)
            excluded = Counter(selection.excluded)
            if admission.eligible > admission.admitted:
                excluded["off_policy_cap"] += admission.eligible - admission.admitted
            stats = RunningStats()
            stats.merge(selection.on_stats)
            stats.merge(admission.stats)
            used = selection.on_rows + admission.admitted
            tokens = selection.on_tokens + admission.tokens
            doc.update(
                {
                    "excluded": dict(sorted(excluded.items())),
                    "eligible": {"on_policy": selection.on_rows, "previous": admission.eligible},
                    "interactions_used": used,
                    "tokens_used": tokens,
                    "on_policy_interactions": selection.on_rows,
                    "heldout_fraction": config.heldout_fraction,
                    "heldout_interactions": selection.heldout,
                    "heldout_file": None,
                    "off_policy_interactions": admission.admitted,
                    "on_policy_fraction": selection.on_rows / used if used else None,
                    "min_interactions": config.data.min_interactions,
                    "min_tokens": config.data.min_tokens,
                    "reward_spec": config.reward.to_k8s(),
                    "reward": stats.to_dict(),
                    "advantage": RunningStats().to_dict(),
                    "baselines": selection.strata.describe(),
                    "missing_signals": dict(selection.monitors.missing),
                    "monitors": selection.monitors.result(),
                    "ranks": [],
                    "files": [],
                }
            )
            keys: list[str] = []
            if q.bad_fraction > limit:
                doc["ok"] = False
                doc["message"] = quarantine_message(q, limit)
            elif used < config.data.min_interactions or tokens < config.data.min_tokens:
                doc["message"] = (
                    f"insufficient data: {used} interactions (minimum "
                    f"{config.data.min_interactions}), {tokens} completion tokens (minimum "
                    f"{config.data.min_tokens}); {selection.immature} immature and "
                    f"{selection.too_recent} too recent wait for a later cycle"
                )
            else:
                if scratch is not None:
                    write_ranks(ranks, scratch=scratch, admission=admission)
                    ranks.close()
                summary, adv_stats = ranks.write_advantages(selection.strata.baselines(), stats.std)
                keys = ranks.keys()
                doc["sufficient"] = True
                doc["ranks"] = summary
                doc["files"] = list(keys)
                doc["message"] = (
                    f"{used} interactions, {tokens} completion tokens, "
                    f"{doc['on_policy_fraction']:.1%} on-policy, in {config.ranks} rank file(s)"
                )
                doc["advantage"] = adv_stats.to_dict()
                if heldout is not None:
                    keys.append(HELDOUT_NAME)
                    doc["heldout_file"] = HELDOUT_NAME
        if scratch is not None:
            scratch.unlink()  # before the upload: the disk held both only while needed
        doc["quarantined_files"] = q.bad_files
        seconds = time.perf_counter() - clock
        doc["timing"] = {
            "seconds": round(seconds, 3),
            "select_seconds": round(select_seconds, 3),
            "write_seconds": round(seconds - select_seconds, 3),
            "rows_per_second": round(q.rows_read / seconds) if seconds > 0 else None,
        }
        staging.path(RESULT_NAME).write_text(json.dumps(doc, indent=2, allow_nan=False) + "\n")
        metadata = {
            "step": "stage",
            "ok": doc["ok"],
            "sufficient": doc["sufficient"],
            "checkpoint": config.checkpoint,
            "interactions": used,
            "tokens": tokens,
        }
        staging.commit([*keys, RESULT_NAME], metadata, ranks.entries())
    if not doc["ok"]:
        raise StageError(doc["message"])
    return doc


# --- command line --------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Select the matured interactions the serving checkpoint produced, quarantine bad "
        "data, reward them, compute behaviour monitors, and commit the training set (one "
        "Parquet file per rank) and stage.json to --out. Exit 0 when it ran (enough data or "
        "not: see stage.json), 1 when it failed (too much bad data, store errors), 2 for "
        "usage and config errors."
    )
    parser.add_argument("--shards", metavar="URI", help="shard source (sets data.shards)")
    parser.add_argument("--checkpoint", metavar="ID", required=True, help="serving checkpoint")
    parser.add_argument("--out", metavar="URI", required=True, help="where to commit the set")
    parser.add_argument(
        "--config",
        metavar="FILE",
        type=Path,
        help="YAML/JSON: an RLCycle, its spec, or a mapping with data and/or reward",
    )
    parser.add_argument(
        "--now", type=time_arg, metavar="ISO8601", help="the cycle's time (default: the clock)"
    )
    parser.add_argument(
        "--since",
        type=time_arg,
        metavar="ISO8601",
        help="skip rows that became ready at or before this (the previous stage's next_since)",
    )
    parser.add_argument("--maturity", metavar="DURATION", help="sets data.maturity, e.g. 1h")
    parser.add_argument(
        "--max-bad-fraction", type=fraction, metavar="F", help="sets data.maxBadFraction"
    )
    parser.add_argument(
        "--min-interactions", type=positive_int, metavar="N", help="sets data.minInteractions"
    )
    parser.add_argument(
        "--min-tokens", type=non_negative_int, metavar="N", help="sets data.minTokens"
    )
    parser.add_argument(
        "--ranks", type=positive_int, default=1, metavar="N", help="data-parallel ranks"
    )
    parser.add_argument(
        "--heldout-fraction",
        type=fraction,
        default=DEFAULT_HELDOUT_FRACTION,
        metavar="F",
        help="share of on-policy interactions held out for eval, never trained on "
        f"(default {DEFAULT_HELDOUT_FRACTION})",
    )
    parser.add_argument(
        "--previous-checkpoint",
        metavar="ID",
        help="admit its rows up to data.maxOffPolicyFraction of the set",
    )
    parser.add_argument(
        "--exclude-checkpoint",
        action="append",
        default=[],
        metavar="ID",
        help="a rolled-back checkpoint: its rows are never staged (repeatable)",
    )
    parser.add_argument(
        "--endpoint-url",
        metavar="URL",
        help="S3-compatible endpoint (default: $AWS_ENDPOINT_URL, else AWS)",
    )
    parser.add_argument(
        "--work-dir",
        type=Path,
        metavar="DIR",
        help="local scratch directory (default: $TMPDIR); needs about the set's size",
    )


def run(args: argparse.Namespace) -> int:
    """``rtrl-job stage``: build the config, run the step, print a one-line summary."""
    return run_step("stage", lambda: _run(args), failures=(StageError,))


def _run(args: argparse.Namespace) -> str:
    now = args.now if args.now is not None else datetime.now(UTC).replace(microsecond=0)
    if args.work_dir is not None and not args.work_dir.is_dir():
        raise ConfigError(f"--work-dir {args.work_dir}: not a directory")
    config = build_config(
        config_file=args.config,
        checkpoint=args.checkpoint,
        out=args.out,
        now=now,
        shards=args.shards,
        maturity=args.maturity,
        max_bad_fraction=args.max_bad_fraction,
        min_interactions=args.min_interactions,
        min_tokens=args.min_tokens,
        since=args.since,
        previous_checkpoint=args.previous_checkpoint,
        exclude_checkpoints=args.exclude_checkpoint,
        ranks=args.ranks,
        endpoint_url=args.endpoint_url,
        heldout_fraction=args.heldout_fraction,
    )
    doc = stage(config, work_dir=args.work_dir)
    verdict = "sufficient" if doc["sufficient"] else "insufficient"
    return f"stage: {verdict}: {doc['message']} -> {config.out}"
