"""From the staged training set to checked rows: which rows a rank trains on, and what
each row becomes for the model.

Kept out of the training loop so the rules are plain functions of their inputs, tested
without a model, and identical on every rank.

Rows to ranks. The stage step writes one Parquet file per data-parallel rank it was asked
for (``train/rank-00003-of-00008.parquet``). When the job runs with exactly that many
ranks, rank ``r`` trains on file ``r``. Otherwise every rank reads all files, in name
order, as one sequence of rows, and keeps rows ``r, r + W, r + 2W, ...`` (W the world
size): deterministic, balanced in rows, and independent of how the stage split them.

Sequences longer than ``max_sequence_length`` keep the whole completion and the end of the
prompt (the context nearest to the completion); a completion longer than the limit keeps its
first tokens after one prompt token. With an empty prompt the first completion token has no
context to be predicted from: it becomes the context of the rest. Rows with no token that
carries loss (all of the completion is tool output) are skipped.

Each row keeps the sampling it was served with (:mod:`~rtrl_trainer.train.sampling`); rows
whose log-probs cannot be matched under it are skipped and counted like the next ones.

Rows holding a token id outside the parent's vocabulary are skipped and counted
(:class:`Skipped`, ``token_out_of_range`` in train.json), not fatal: the stage step
quarantines them when it is given the parent (``--parent``), but a set staged without it, or
by an older stage, may hold one, and failing the run on it would fail every retry of the
cycle. Only when more rows are out than the set's ``max_bad_fraction`` allows does the run
stop (:func:`check_skipped`). Other bad values (lists that disagree, non-finite log-probs or
weights) mean the set was not written by the stage step and stop the run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from numpy.typing import NDArray

from rtrl.core.api.rlcycle import DataSpec
from rtrl.core.results import StageResult
from rtrl.core.shards.checks import TOKEN_OUT_OF_RANGE
from rtrl_trainer import stagedset
from rtrl_trainer.logprobs import DEFAULT, Sampling
from rtrl_trainer.stagedset import ADVANTAGE, PACKED_COLUMNS, advantage_name, parse_rank_name
from rtrl_trainer.train import sampling

# The per-token columns, packed or lists.
LIST_COLUMNS = tuple(PACKED_COLUMNS)
SCALAR_COLUMNS = (ADVANTAGE, "sample_weight")
REQUIRED_COLUMNS = ("interaction_id", *LIST_COLUMNS, *SCALAR_COLUMNS)
# The row's combined reward, as the stage step computed it (the value its advantage comes
# from): read when the rank file has it, for the step's mean_reward, never trained on.
REWARD = "reward"
# Skipped rows named in train.json (the counts cover all of them).
MAX_SKIPPED_EXAMPLES = 5
# The limit on skipped rows of a set whose stage.json does not say (one written by hand).
DEFAULT_MAX_BAD_FRACTION: float = DataSpec.model_fields["max_bad_fraction"].default


class DataError(ValueError):
    """The staged set cannot be trained on; the message names the file and row."""


@dataclass(frozen=True)
class Example:
    """One row, ready for the model. ``input_ids`` is prompt + completion after
    truncation; the completion starts at ``completion_start``; ``logprobs`` and ``mask``
    are per completion token (as kept); ``reward`` is the row's combined reward, None when
    the set has none for it."""

    input_ids: NDArray[np.int64]
    completion_start: int
    logprobs: NDArray[np.float32]
    mask: NDArray[np.bool_]
    advantage: float
    sample_weight: float
    source: str
    reward: float | None = None
    sampling: Sampling = DEFAULT

    @property
    def completion_length(self) -> int:
        return len(self.input_ids) - self.completion_start

    @property
    def tokens(self) -> int:
        """Completion tokens that carry loss."""
        return int(self.mask.sum())


@dataclass
class Skipped:
    """Rows left out because no model could train on them: how many of how many read,
    per reason, and the first few named (``file row N (interaction X): what``)."""

    rows_read: int = 0
    by_reason: dict[str, int] = field(default_factory=dict)
    examples: list[str] = field(default_factory=list)

    @property
    def rows(self) -> int:
        return sum(self.by_reason.values())

    def add(self, reason: str, example: str) -> None:
        """One more row skipped for ``reason``; ``example`` names it (the first few kept)."""
        self.by_reason[reason] = self.by_reason.get(reason, 0) + 1
        if len(self.examples) < MAX_SKIPPED_EXAMPLES:
            self.examples.append(example)

    @staticmethod
    def merged(parts: Sequence[Skipped]) -> Skipped:
        """Every rank's skipped rows as one (in rank order)."""
        by_reason: dict[str, int] = {}
        examples: list[str] = []
        for part in parts:
            for reason, n in part.by_reason.items():
                by_reason[reason] = by_reason.get(reason, 0) + n
            examples.extend(part.examples)
        return Skipped(
            rows_read=sum(p.rows_read for p in parts),
            by_reason=by_reason,
            examples=examples[:MAX_SKIPPED_EXAMPLES],
        )

    def to_dict(self) -> dict[str, Any]:
        return {"rows_skipped": dict(self.by_reason), "skipped_examples": list(self.examples)}


@dataclass(frozen=True)
class RankData:
    """What one rank trains on, and what it noticed while reading."""

    examples: list[Example]
    rows_truncated: int
    files: list[str]
    skipped: Skipped = field(default_factory=Skipped)


def max_bad_fraction(stage: StageResult) -> float:
    """The share of rows that may be skipped: the limit the stage applied to the shards
    (stage.json ``max_bad_fraction``, the RLCycle's ``data.maxBadFraction``)."""
    value = stage.max_bad_fraction
    return DEFAULT_MAX_BAD_FRACTION if value is None else value


def check_skipped(skipped: Skipped, limit: float) -> None:
    """:class:`DataError` when too many rows were skipped: more than ``limit`` of the rows
    read. One row never stops a run, whatever the size of the set."""
    if skipped.rows <= 1 or skipped.rows <= limit * skipped.rows_read:
        return
    share = skipped.rows / skipped.rows_read if skipped.rows_read else 1.0
    reasons = ", ".join(f"{reason}={n}" for reason, n in skipped.by_reason.items())
    example = f"; first: {skipped.examples[0]}" if skipped.examples else ""
    raise DataError(
        f"{skipped.rows} of {skipped.rows_read} rows cannot be trained on ({share:.3g} of "
        f"the set, limit {limit:.3g}: stage.json max_bad_fraction): {reasons}{example}"
    )


def assign_files(names: Sequence[str], world_size: int) -> tuple[bool, list[str]]:
    """(one file per rank, the files in order). Names are the staged set's
    ``train/rank-*.parquet`` keys; others are ignored."""
    parsed = sorted((n, p) for n in names if (p := parse_rank_name(n)) is not None)
    if not parsed:
        raise DataError("the staged set has no train/rank-*.parquet files")
    files = [n for n, _ in parsed]
    ranks = [rank for _, (rank, _) in parsed]
    declared = {total for _, (_, total) in parsed}
    one_per_rank = ranks == list(range(world_size)) and declared == {world_size}
    return one_per_rank, files


def read_rank(
    paths: Sequence[tuple[str, Path]],
    *,
    rank: int,
    world_size: int,
    one_per_rank: bool,
    vocab_size: int,
    max_sequence_length: int,
) -> RankData:
    """Read and check the rows of ``rank``. ``paths``: (name in the set, local file), all
    files of the set in name order. Rows with a token id outside the vocabulary are
    skipped and counted (:class:`Skipped`); :class:`DataError` names the file and row of
    the first other bad row: list lengths that disagree, non-finite log-probs, advantages
    or weights, negative weights."""
    examples: list[Example] = []
    truncated = 0
    used: list[str] = []
    skipped: list[Skipped] = []
    offset = 0  # global row index of the current file's first row (striding mode)
    for index, (name, path) in enumerate(paths):
        if one_per_rank and index != rank:
            continue
        table = _read_table(name, path)
        n = table.num_rows
        if one_per_rank:
            keep = np.arange(n)
        else:
            first = (rank - offset) % world_size
            keep = np.arange(first, n, world_size)
            offset += n
        if len(keep) == 0:
            continue
        used.append(name)
        rows, cut, left_out = _examples(table, name, keep, vocab_size, max_sequence_length)
        examples.extend(rows)
        truncated += cut
        skipped.append(left_out)
    return RankData(
        examples=examples,
        rows_truncated=truncated,
        files=used,
        skipped=Skipped.merged(skipped),
    )


def _read_table(name: str, path: Path) -> pa.Table:
    """The rank file's rows with their advantages: from its advantage file (as the stage
    step writes them), or from its own ``advantage`` column (a set written by hand); and
    its ``reward`` column when it has one."""
    try:
        schema = pq.read_schema(path)
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{name}: not a readable Parquet file ({exc})") from None
    side = path.with_name(Path(advantage_name(name)).name)
    separate = ADVANTAGE not in schema.names and side.exists()
    missing = [c for c in REQUIRED_COLUMNS if c not in schema.names]
    if separate:
        missing.remove(ADVANTAGE)
    if missing:
        nor = f" (and no {advantage_name(name)})" if ADVANTAGE in missing else ""
        raise DataError(f"{name}: missing column(s) {', '.join(missing)}{nor}")
    columns = [c for c in (*REQUIRED_COLUMNS, REWARD, *sampling.COLUMNS) if c in schema.names]
    try:
        table = pq.read_table(path, columns=columns)
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{name}: cannot read ({exc})") from None
    if not separate:
        return table
    try:
        return stagedset.with_advantages(table, pq.read_table(side, columns=[ADVANTAGE]), name)
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise DataError(f"{advantage_name(name)}: cannot be used ({exc})") from None


def _flat(table: pa.Table, column: str, name: str) -> tuple[NDArray[np.int64], np.ndarray]:
    """(offsets, values) of a per-token column, packed (binary, as the stage writes it) or
    a list; nulls rejected."""
    array = table.column(column).combine_chunks()
    if array.null_count:
        row = int(np.flatnonzero(array.is_null().to_numpy(zero_copy_only=False))[0])
        raise DataError(f"{name} row {row}: {column} is null")
    dtype = PACKED_COLUMNS[column]
    if pa.types.is_binary(array.type) or pa.types.is_large_binary(array.type):
        # The file says how its elements are stored (token ids: int32, or uint16 when the
        # whole set fits); a packed column without that metadata has the wide type.
        field = table.schema.field(column)
        if field.metadata and stagedset.METADATA_KEY in field.metadata:
            try:
                dtype = stagedset.element_type(field)
            except stagedset.PackedError as exc:
                raise DataError(f"{name}: {exc}") from None
        try:
            return stagedset.flat(array, dtype)
        except stagedset.PackedError as exc:
            raise DataError(
                f"{name} row {exc.row}: {column} is not packed {dtype} ({exc.detail})"
            ) from None
    if not pa.types.is_list(array.type) and not pa.types.is_large_list(array.type):
        raise DataError(f"{name}: {column} is {array.type}, expected packed {dtype} or a list")
    offsets = array.offsets.to_numpy().astype(np.int64)
    values = array.values.slice(offsets[0], offsets[-1] - offsets[0])
    if values.null_count:
        flat = int(np.flatnonzero(values.is_null().to_numpy(zero_copy_only=False))[0])
        row = int(np.searchsorted(offsets, flat + offsets[0], side="right") - 1)
        raise DataError(f"{name} row {row}: {column} has a null element")
    return offsets - offsets[0], values.to_numpy(zero_copy_only=False)


def _examples(
    table: pa.Table, name: str, keep: NDArray[np.int64], vocab_size: int, max_len: int
) -> tuple[list[Example], int, Skipped]:
    """(the examples of rows ``keep``, how many were truncated, the rows of ``keep``
    skipped: a token id outside the vocabulary, log-probs that cannot be matched)."""
    ids = table.column("interaction_id").to_pylist()
    lists = {c: _flat(table, c, name) for c in LIST_COLUMNS}

    def where(row: int) -> str:
        return f"{name} row {row} (interaction {ids[row]})"

    # Row -> (column, its first id outside the vocabulary).
    out_of_range: dict[int, tuple[str, int]] = {}
    for column in ("prompt_ids", "completion_ids"):
        offsets, values = lists[column]
        if not np.issubdtype(values.dtype, np.integer):
            raise DataError(f"{name}: {column} holds {values.dtype}, expected integer token ids")
        bad = np.flatnonzero((values < 0) | (values >= vocab_size))
        if not len(bad):
            continue
        rows = np.searchsorted(offsets, bad, side="right") - 1
        rows, first = np.unique(rows, return_index=True)  # each row's first bad position
        for row, position in zip(rows.tolist(), bad[first].tolist(), strict=True):
            out_of_range.setdefault(row, (column, int(values[position])))
    c_off = lists["completion_ids"][0]
    for column in ("completion_logprobs", "completion_mask"):
        offsets = lists[column][0]
        if not np.array_equal(offsets, c_off):
            row = int(np.flatnonzero(np.diff(offsets) != np.diff(c_off))[0])
            raise DataError(f"{where(row)}: {column} and completion_ids differ in length")
    logprobs = lists["completion_logprobs"][1].astype(np.float32)
    masks = lists["completion_mask"][1].astype(np.bool_)
    bad = np.flatnonzero(~np.isfinite(logprobs) & masks)
    if len(bad):
        row = int(np.searchsorted(c_off, bad[0], side="right") - 1)
        raise DataError(f"{where(row)}: completion_logprobs has a non-finite value")
    scalars = {}
    for column in SCALAR_COLUMNS:
        array = table.column(column).combine_chunks()
        if array.null_count:
            row = int(np.flatnonzero(array.is_null().to_numpy(zero_copy_only=False))[0])
            raise DataError(f"{where(row)}: {column} is null")
        values = array.to_numpy(zero_copy_only=False).astype(np.float64)
        bad = np.flatnonzero(~np.isfinite(values))
        if len(bad):
            raise DataError(f"{where(int(bad[0]))}: {column} is not finite")
        scalars[column] = values
    negative = np.flatnonzero(scalars["sample_weight"] < 0)
    if len(negative):
        raise DataError(f"{where(int(negative[0]))}: sample_weight is negative")
    rewards = _rewards(table)
    try:
        samplings = sampling.read(table, vocab_size)
    except sampling.SamplingError as exc:
        raise DataError(f"{where(exc.row)}: {exc}") from None

    p_off, p_ids = lists["prompt_ids"]
    c_ids = lists["completion_ids"][1]
    out: list[Example] = []
    truncated = 0
    skipped = Skipped(rows_read=len(keep))
    for row in keep.tolist():
        if row in out_of_range:
            column, value = out_of_range[row]
            what = f"{column} has token id {value}, outside the model's vocabulary of {vocab_size}"
            skipped.add(TOKEN_OUT_OF_RANGE, f"{where(row)}: {what}")
            continue
        if row in samplings.unmatched:
            skipped.add(samplings.unmatched[row], f"{where(row)}: log-probs cannot be matched")
            continue
        prompt = p_ids[p_off[row] : p_off[row + 1]]
        completion = c_ids[c_off[row] : c_off[row + 1]]
        lp = logprobs[c_off[row] : c_off[row + 1]]
        mask = masks[c_off[row] : c_off[row + 1]]
        if len(prompt) == 0:
            # Nothing predicts the first token: it becomes the context of the rest.
            prompt, completion, lp, mask = completion[:1], completion[1:], lp[1:], mask[1:]
        if len(prompt) + len(completion) > max_len:
            truncated += 1
            if len(completion) >= max_len:
                prompt = prompt[-1:]
                keep_c = max_len - 1
                completion, lp, mask = completion[:keep_c], lp[:keep_c], mask[:keep_c]
            else:
                prompt = prompt[len(prompt) - (max_len - len(completion)) :]
        if not mask.any():
            continue  # no token carries loss: nothing to learn, no compute spent
        out.append(
            Example(
                input_ids=np.concatenate([prompt, completion]).astype(np.int64),
                completion_start=len(prompt),
                logprobs=np.ascontiguousarray(lp, dtype=np.float32),
                mask=np.ascontiguousarray(mask, dtype=np.bool_),
                advantage=float(scalars["advantage"][row]),
                sample_weight=float(scalars["sample_weight"][row]),
                source=f"{name} row {row}",
                reward=rewards[row],
                sampling=samplings.rows[row],
            )
        )
    return out, truncated, skipped


def _rewards(table: pa.Table) -> list[float | None]:
    """Each row's reward; None for all rows when the file has no numeric ``reward``
    column (a set written without one), and for a row whose reward is null or not finite.
    Rewards are only watched, so none of this stops a run."""
    if REWARD not in table.column_names:
        return [None] * table.num_rows
    array = table.column(REWARD).combine_chunks()
    if not (pa.types.is_floating(array.type) or pa.types.is_integer(array.type)):
        return [None] * table.num_rows
    values = array.to_numpy(zero_copy_only=False).astype(np.float64)  # nulls: NaN
    return [v if math.isfinite(v) else None for v in values.tolist()]
