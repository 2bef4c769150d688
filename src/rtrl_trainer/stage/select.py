"""Pass 1 of the stage step: stream the shards, select, quarantine, reward and monitor.

See :mod:`rtrl_trainer.stage` for the rules a row must pass. The selected rows leave as
scratch-schema batches (:func:`scratch_schema`: the carried columns packed, with reward,
stratum and on-policy flag) to a sink: the rank files directly, or a scratch file when
previous-checkpoint rows wait for their admission.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from rtrl.core.api.common import parse_duration
from rtrl.core.shards import CANONICAL_COLUMNS, ValidatingReader, list_files
from rtrl.core.shards.dedup import hash_strings
from rtrl.core.shards.layout import PartitionFilter, parse_partitions
from rtrl.core.shards.report import FileReport
from rtrl.core.shards.sampling import unmatched
from rtrl.core.shards.statistics import TOKEN_ID_COLUMNS, declared_range
from rtrl.core.store import ObjectStore
from rtrl_trainer.monitors import MONITOR_COLUMNS, Monitors
from rtrl_trainer.progress import Progress
from rtrl_trainer.quarantine import Quarantined
from rtrl_trainer.read_ahead import read_ahead
from rtrl_trainer.reward import RunningStats, Strata, filled, rewards
from rtrl_trainer.stage.config import StageConfig
from rtrl_trainer.stage.ranks import parquet_writer
from rtrl_trainer.stage.workers import Worker
from rtrl_trainer.stagedset import (
    CARRIED_COLUMNS,
    HELDOUT_COLUMNS,
    NARROW_TOKEN_IDS,
    PACKED_COLUMNS,
    WIDE_TOKEN_IDS,
    fits_narrow,
    heldout_schema,
    pack,
    rows_not_narrow,
    set_fields,
)


def scratch_schema(tokens: str = WIDE_TOKEN_IDS) -> pa.Schema:
    """The selected rows as pass 1 hands them on (per-token columns packed)."""
    return pa.schema(
        [
            *set_fields(CARRIED_COLUMNS, tokens),
            pa.field("reward", pa.float32()),
            pa.field("stratum", pa.int32()),
            pa.field("on_policy", pa.bool_()),
        ]
    )


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


# --- pass 1: select, reward, monitor -------------------------------------------------------


@dataclass(kw_only=True)
class Selection(Quarantined):
    """What pass 1 found: what it quarantined, counts by outcome, on-policy statistics,
    and the eligible previous-checkpoint rows (whose admission is decided once their
    number is known)."""

    strata: Strata
    monitors: Monitors = field(default_factory=Monitors)
    excluded: Counter[str] = field(default_factory=Counter)
    # Ready rows whose logged log-probs cannot be matched, by reason
    # (rtrl.core.shards.sampling.UNMATCHED_REASONS): valid data, never trained on.
    refused: Counter[str] = field(default_factory=Counter)
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
    batch: pa.RecordBatch, config: StageConfig, selection: Selection, vocab_size: int | None
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

    # Last: a row is refused once, in the cycle it would have been staged in.
    for reason, rows in unmatched(batch, vocab_size).items():
        refused = keep & rows
        n = int(np.count_nonzero(refused))
        if n:
            selection.refused[reason] += n
            keep &= ~rows
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
    *,
    vocab_size: int | None = None,
    unfaithful: frozenset[str] = frozenset(),
) -> Selection:
    """Pass 1: stream the shards, pass the selected rows (with rewards, as scratch-schema
    batches, token ids as ``tokens``) to ``sink``, and write the held-out on-policy rows
    (``config.heldout_fraction``) to ``heldout``. Token ids at or beyond ``vocab_size``
    (the parent's vocabulary), like negative ones, are quarantined by the reader; so are
    the rows of the partitions (directories) in ``unfaithful``, which failed the fidelity
    gate (:mod:`rtrl_trainer.stage.fidelity`)."""
    key = config.data.checkpoint_partition
    partitions = shard_partitions(config)
    reader = ValidatingReader(
        store, columns=CANONICAL_COLUMNS, partitions=partitions, vocab_size=vocab_size
    )
    # Listed once more for the count (a LIST per thousand files, next to a GET per file).
    total = sum(1 for _ in list_files(store, partitions=partitions))
    progress = Progress("stage", "reading shards", total=total, unit="files")
    progress.start()
    files, rows = 0, 0
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
                files += 1
            rows += good.num_rows
            progress.update(files, rows=rows)
            if unfaithful and file.key.rpartition("/")[0] in unfaithful:
                selection.unfaithful[file.url] += good.num_rows
                continue
            batch = _quarantine_mismatched(good, path_checkpoints[file.key], file, selection)
            batch, packed = _packed_checked(batch, tokens, file, selection)
            keep, on = _select_batch(batch, config, selection, vocab_size)
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
    progress.update(len(reader.report.files))
    progress.end(rows=rows)
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
