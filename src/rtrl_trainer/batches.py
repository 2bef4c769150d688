"""From the staged training set to micro-batches: which rows a rank trains on, in which
order, and how many micro-batches make one optimizer step.

Kept out of the training loop so the rules are plain functions of their inputs, tested
without a model, and identical on every rank (every collective in the loop relies on all
ranks running the same number of micro-batches).

Rows to ranks. The stage step writes one Parquet file per data-parallel rank it was asked
for (``train/rank-00003-of-00008.parquet``). When the job runs with exactly that many
ranks, rank ``r`` trains on file ``r``. Otherwise every rank reads all files, in name
order, as one sequence of rows, and keeps rows ``r, r + W, r + 2W, ...`` (W the world
size): deterministic, balanced in rows, and independent of how the stage split them.

Steps. An epoch has ``S = ceil(masked tokens of the whole set / batch_tokens)`` optimizer
steps (at least 1, at most the largest rank's row count). Each rank shuffles its rows with
a generator seeded by (seed, epoch, rank), splits them into ``S`` nearly equal parts, and
each part into micro-batches of ``micro_batch_size`` rows. ``gradient_accumulation_steps``
is the largest number of micro-batches any rank has in any step; ranks with fewer fill the
step with empty micro-batches (a forward and backward that contribute zero) so that every
rank runs the same collectives. The schedule is a function of (seed, epoch, rank, step),
so a resumed run skips exactly the micro-batches the interrupted one consumed.

Sequences longer than ``max_sequence_length`` keep the whole completion and the end of the
prompt (the context nearest to the completion); a completion longer than the limit keeps its
first tokens after one prompt token. With an empty prompt the first completion token has no
context to be predicted from: it becomes the context of the rest. Rows with no token that
carries loss (all of the completion is tool output) are skipped.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from numpy.typing import NDArray

from rtrl_trainer import packed
from rtrl_trainer.packed import PACKED_COLUMNS
from rtrl_trainer.stage_write import ADVANTAGE, advantage_name, with_advantages

RANK_FILE = re.compile(r"^train/rank-(\d{5})-of-(\d{5})\.parquet$")
LIST_COLUMNS = ("prompt_ids", "completion_ids", "completion_logprobs", "completion_mask")
SCALAR_COLUMNS = ("advantage", "sample_weight")
REQUIRED_COLUMNS = ("interaction_id", *LIST_COLUMNS, *SCALAR_COLUMNS)


class DataError(ValueError):
    """The staged set cannot be trained on; the message names the file and row."""


@dataclass(frozen=True)
class Example:
    """One row, ready for the model. ``input_ids`` is prompt + completion after
    truncation; the completion starts at ``completion_start``; ``logprobs`` and ``mask``
    are per completion token (as kept)."""

    input_ids: NDArray[np.int64]
    completion_start: int
    logprobs: NDArray[np.float32]
    mask: NDArray[np.bool_]
    advantage: float
    sample_weight: float
    source: str

    @property
    def completion_length(self) -> int:
        return len(self.input_ids) - self.completion_start

    @property
    def tokens(self) -> int:
        """Completion tokens that carry loss."""
        return int(self.mask.sum())


@dataclass(frozen=True)
class RankData:
    """What one rank trains on, and what it noticed while reading."""

    examples: list[Example]
    rows_truncated: int
    files: list[str]


def assign_files(names: Sequence[str], world_size: int) -> tuple[bool, list[str]]:
    """(one file per rank, the files in order). Names are the staged set's
    ``train/rank-*.parquet`` keys; others are ignored."""
    files = sorted(n for n in names if RANK_FILE.match(n))
    if not files:
        raise DataError("the staged set has no train/rank-*.parquet files")
    parsed = [RANK_FILE.match(n) for n in files]
    ranks = [int(m.group(1)) for m in parsed if m]
    declared = {int(m.group(2)) for m in parsed if m}
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
    files of the set in name order. :class:`DataError` names the file and row of the first
    bad row: token ids outside the vocabulary, list lengths that disagree, non-finite
    log-probs, advantages or weights, negative weights."""
    examples: list[Example] = []
    truncated = 0
    used: list[str] = []
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
        rows, cut = _examples(table, name, keep, vocab_size, max_sequence_length)
        examples.extend(rows)
        truncated += cut
    return RankData(examples=examples, rows_truncated=truncated, files=used)


def _read_table(name: str, path: Path) -> pa.Table:
    """The rank file's rows with their advantages: from its advantage file (as the stage
    step writes them), or from its own ``advantage`` column (a set written by hand)."""
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
    columns = [c for c in REQUIRED_COLUMNS if c in schema.names]
    try:
        table = pq.read_table(path, columns=columns)
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{name}: cannot read ({exc})") from None
    if not separate:
        return table
    try:
        return with_advantages(table, pq.read_table(side, columns=[ADVANTAGE]), name)
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
        if field.metadata and packed.METADATA_KEY in field.metadata:
            try:
                dtype = packed.element_type(field)
            except packed.PackedError as exc:
                raise DataError(f"{name}: {exc}") from None
        try:
            return packed.flat(array, dtype)
        except packed.PackedError as exc:
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
) -> tuple[list[Example], int]:
    ids = table.column("interaction_id").to_pylist()
    lists = {c: _flat(table, c, name) for c in LIST_COLUMNS}

    def where(row: int) -> str:
        return f"{name} row {row} (interaction {ids[row]})"

    for column in ("prompt_ids", "completion_ids"):
        offsets, values = lists[column]
        if not np.issubdtype(values.dtype, np.integer):
            raise DataError(f"{name}: {column} holds {values.dtype}, expected integer token ids")
        bad = np.flatnonzero((values < 0) | (values >= vocab_size))
        if len(bad):
            row = int(np.searchsorted(offsets, bad[0], side="right") - 1)
            raise DataError(
                f"{where(row)}: {column} has token id {int(values[bad[0]])}, outside the "
                f"model's vocabulary of {vocab_size}"
            )
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

    p_off, p_ids = lists["prompt_ids"]
    c_ids = lists["completion_ids"][1]
    out: list[Example] = []
    truncated = 0
    for row in keep.tolist():
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
            )
        )
    return out, truncated


# --- the schedule -------------------------------------------------------------------------


@dataclass(frozen=True)
class Schedule:
    """How the data becomes optimizer steps; the same on every rank."""

    world_size: int
    micro_batch_size: int
    steps_per_epoch: int
    gradient_accumulation_steps: int
    epochs: int
    total_steps: int
    seed: int

    @property
    def micro_batches_per_epoch(self) -> int:
        return self.steps_per_epoch * self.gradient_accumulation_steps


def make_schedule(
    rows_per_rank: Sequence[int],
    total_tokens: int,
    *,
    batch_tokens: int,
    micro_batch_size: int,
    epochs: int,
    max_steps: int | None,
    seed: int,
) -> Schedule:
    """The schedule for ranks holding ``rows_per_rank`` rows and ``total_tokens`` masked
    completion tokens in all."""
    most = max(rows_per_rank)
    if most == 0 or total_tokens <= 0:
        raise DataError("the staged set has no completion tokens to train on")
    steps = min(max(1, math.ceil(total_tokens / batch_tokens)), most)
    gas = math.ceil(math.ceil(most / steps) / micro_batch_size)
    total = steps * epochs if max_steps is None else min(steps * epochs, max_steps)
    return Schedule(
        world_size=len(rows_per_rank),
        micro_batch_size=micro_batch_size,
        steps_per_epoch=steps,
        gradient_accumulation_steps=gas,
        epochs=epochs,
        total_steps=total,
        seed=seed,
    )


def epoch_micro_batches(
    n_rows: int, schedule: Schedule, *, epoch: int, rank: int
) -> list[list[int]]:
    """Row indices of each micro-batch of ``rank`` in ``epoch``, ``steps_per_epoch *
    gradient_accumulation_steps`` of them; empty lists are filler micro-batches."""
    return [list(batch) for batch in _epoch(n_rows, schedule, epoch, rank)]


@functools.lru_cache(maxsize=4)
def _epoch(n_rows: int, schedule: Schedule, epoch: int, rank: int) -> tuple[tuple[int, ...], ...]:
    order = np.random.default_rng([schedule.seed, epoch, rank]).permutation(n_rows)
    out: list[tuple[int, ...]] = []
    for part in np.array_split(order, schedule.steps_per_epoch):
        rows = part.tolist()
        batches = [
            rows[i : i + schedule.micro_batch_size]
            for i in range(0, len(rows), schedule.micro_batch_size)
        ]
        if len(batches) > schedule.gradient_accumulation_steps:
            raise AssertionError("schedule too small for this rank's rows")
        batches += [[] for _ in range(schedule.gradient_accumulation_steps - len(batches))]
        out.extend(tuple(b) for b in batches)
    return tuple(out)


def step_micro_batches(n_rows: int, schedule: Schedule, *, step: int, rank: int) -> list[list[int]]:
    """The micro-batches of optimizer step ``step`` (1-based, across epochs)."""
    epoch, index = divmod(step - 1, schedule.steps_per_epoch)
    batches = epoch_micro_batches(n_rows, schedule, epoch=epoch, rank=rank)
    gas = schedule.gradient_accumulation_steps
    return batches[index * gas : (index + 1) * gas]


def step_tokens(examples: Sequence[Example], schedule: Schedule, *, rank: int) -> list[int]:
    """This rank's masked tokens in each of the schedule's steps (summed over ranks, the
    token-mean normaliser of each step)."""
    counts = []
    for step in range(1, schedule.total_steps + 1):
        batches = step_micro_batches(len(examples), schedule, step=step, rank=rank)
        counts.append(sum(examples[i].tokens for batch in batches for i in batch))
    return counts


# --- collation ----------------------------------------------------------------------------


@dataclass
class MicroBatch:
    """Model inputs and per-token loss inputs of one micro-batch.

    The loss grid covers sequence positions ``first .. L-2`` (logits at position p predict
    token p+1): ``first`` is the earliest completion start minus one, so the model computes
    logits only from there (``logits_to_keep``), which skips the prompt-only positions.
    """

    input_ids: torch.Tensor  # (B, L)
    first: int
    targets: torch.Tensor  # (B, K)
    mask: torch.Tensor  # (B, K) bool
    logp_serve: torch.Tensor  # (B, K)
    advantages: torch.Tensor  # (B,)
    sample_weight: torch.Tensor  # (B,)
    rows: list[int]
    columns: list[slice]  # per row: grid columns of its completion tokens

    input_tokens: int  # real (unpadded) sequence tokens

    @property
    def tokens(self) -> int:
        """Tokens that carry loss."""
        return int(self.mask.sum())

    def scatter(self, per_row: Sequence[np.ndarray], fill: float = 0.0) -> torch.Tensor:
        """Per-row completion values (e.g. cached log-probs) placed on the loss grid."""
        grid = torch.full(self.targets.shape, fill, dtype=torch.float32)
        for i, (values, cols) in enumerate(zip(per_row, self.columns, strict=True)):
            grid[i, cols] = torch.from_numpy(np.asarray(values, dtype=np.float32))
        return grid.to(self.targets.device)

    def gather(self, grid: torch.Tensor) -> list[np.ndarray]:
        """The inverse of :meth:`scatter`: each row's completion values from the grid."""
        host = grid.detach().float().cpu().numpy()
        return [host[i, cols].copy() for i, cols in enumerate(self.columns)]


def collate(
    examples: Sequence[Example], rows: Sequence[int], *, device: torch.device, pad_id: int = 0
) -> MicroBatch:
    """A micro-batch of ``rows`` (right-padded), or a filler micro-batch when empty.

    No attention mask is passed to the model: padding sits after every real token and
    attention is causal, so no real position can see it.
    """
    if not rows:
        # Filler: one 2-token sequence of padding whose loss is zero but connected to every
        # parameter, so the backward (and ZeRO's gradient reduction) runs like a real one.
        empty = torch.zeros((1, 1), dtype=torch.float32)
        return MicroBatch(
            input_ids=torch.full((1, 2), pad_id, dtype=torch.long, device=device),
            first=0,
            targets=torch.full((1, 1), pad_id, dtype=torch.long, device=device),
            mask=torch.zeros((1, 1), dtype=torch.bool, device=device),
            logp_serve=empty.to(device),
            advantages=torch.zeros(1, device=device),
            sample_weight=torch.zeros(1, device=device),
            rows=[],
            columns=[slice(0, 0)],
            input_tokens=0,
        )
    chosen = [examples[i] for i in rows]
    length = max(len(e.input_ids) for e in chosen)
    first = max(0, min(e.completion_start for e in chosen) - 1)
    width = length - 1 - first
    ids = np.full((len(chosen), length), pad_id, dtype=np.int64)
    mask = np.zeros((len(chosen), width), dtype=np.bool_)
    serve = np.zeros((len(chosen), width), dtype=np.float32)
    columns = []
    for i, e in enumerate(chosen):
        ids[i, : len(e.input_ids)] = e.input_ids
        # Completion token j sits at position completion_start + j and is predicted by the
        # logits at the position before it (completion_start >= 1 by construction).
        start = e.completion_start - 1 - first
        cols = slice(start, start + e.completion_length)
        mask[i, cols] = e.mask
        serve[i, cols] = e.logprobs
        columns.append(cols)
    input_ids = torch.from_numpy(ids)
    return MicroBatch(
        input_ids=input_ids.to(device),
        first=first,
        targets=input_ids[:, first + 1 :].to(device),
        mask=torch.from_numpy(mask).to(device),
        logp_serve=torch.from_numpy(serve).to(device),
        advantages=torch.tensor([e.advantage for e in chosen], dtype=torch.float32).to(device),
        sample_weight=torch.tensor([e.sample_weight for e in chosen], dtype=torch.float32).to(
            device
        ),
        rows=list(rows),
        columns=columns,
        input_tokens=sum(len(e.input_ids) for e in chosen),
    )
