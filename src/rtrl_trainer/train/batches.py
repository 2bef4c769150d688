"""From a rank's rows (examples.py) to micro-batches: in which order, how many
micro-batches make one optimizer step, and the tensors of one micro-batch.

Kept out of the training loop so the rules are plain functions of their inputs, tested
without a model, and identical on every rank (every collective in the loop relies on all
ranks running the same number of micro-batches).

Steps. An epoch has ``S = ceil(masked tokens of the whole set / batch_tokens)`` optimizer
steps (at least 1, at most the largest rank's row count). Each rank shuffles its rows with
a generator seeded by (seed, epoch, rank), splits them into ``S`` nearly equal parts, and
each part into micro-batches of ``micro_batch_size`` rows. ``gradient_accumulation_steps``
is the largest number of micro-batches any rank has in any step; ranks with fewer fill the
step with empty micro-batches (a forward and backward that contribute zero) so that every
rank runs the same collectives. The schedule is a function of (seed, epoch, rank, step),
so a resumed run skips exactly the micro-batches the interrupted one consumed.

Token budget. With ``micro_batch_tokens`` a step's rows are taken longest first (ties in
the shuffled order) and grouped so that no micro-batch holds more than that many tokens
(lines x the longest line, padding included). Unpacked, a line is one row. Packed
(``packed``: the line width), a micro-batch's rows are packed into lines of at most that
many tokens, first fit longest first (:func:`pack_lines`), back to back with position ids
restarting at each row, so the model's attention keeps each row to itself
(:func:`collate`): the loss is the unpacked one, with almost no compute spent on padding,
and attention stays within lines no wider than the longest row may be. A row longer than
the budget is a micro-batch of its own. The accumulation steps are then the most
micro-batches any rank has in any step of any epoch the run trains (agreed once,
:func:`most_micro_batches`).

The order of rows within a step changes no gradient: the loss of each micro-batch is
already divided by the step's token count over all ranks (loss.py).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from rtrl_trainer.train.examples import DataError, Example

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
    micro_batch_tokens: int | None = None
    packed: int | None = None  # the width of packed lines in tokens; None: unpacked

    @property
    def micro_batches_per_epoch(self) -> int:
        return self.steps_per_epoch * self.gradient_accumulation_steps

    def micro_batch_words(self) -> str:
        """What bounds a micro-batch, in words (the start-of-run line)."""
        if self.micro_batch_tokens is None:
            return f"{self.micro_batch_size} row(s)"
        packed = f" packed in rows of up to {self.packed}" if self.packed else ""
        return f"{self.micro_batch_tokens} tokens{packed}"


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


def row_lengths(examples: Sequence[Example]) -> tuple[int, ...]:
    """Each row's sequence length: what a token budget groups rows by."""
    return tuple(len(e.input_ids) for e in examples)


Lengths = Sequence[int] | Mapping[int, int]
"""Row -> its length."""

Rows = int | Sequence[int]
"""A rank's rows: their count, or each row's length (:func:`row_lengths`; needed with a
token budget)."""


def epoch_micro_batches(
    rows: Rows, schedule: Schedule, *, epoch: int, rank: int
) -> list[list[int]]:
    """Row indices of each micro-batch of ``rank`` in ``epoch``, ``steps_per_epoch *
    gradient_accumulation_steps`` of them; empty lists are filler micro-batches."""
    return [list(batch) for batch in _epoch(_key(rows, schedule), schedule, epoch, rank)]


def _key(rows: Rows, schedule: Schedule) -> int | tuple[int, ...]:
    if schedule.micro_batch_tokens is None:
        return rows if isinstance(rows, int) else len(rows)
    if isinstance(rows, int):
        raise TypeError("a token budget groups rows by length: pass row_lengths(examples)")
    return tuple(rows)


def _step_parts(
    rows: int | tuple[int, ...], schedule: Schedule, epoch: int, rank: int
) -> list[list[list[int]]]:
    """Each step's micro-batches in ``epoch``, before filling up to the accumulation."""
    n_rows = rows if isinstance(rows, int) else len(rows)
    order = np.random.default_rng([schedule.seed, epoch, rank]).permutation(n_rows)
    steps = []
    for part in np.array_split(order, schedule.steps_per_epoch):
        chosen = part.tolist()
        if schedule.micro_batch_tokens is None or isinstance(rows, int):
            size = schedule.micro_batch_size
            steps.append([chosen[i : i + size] for i in range(0, len(chosen), size)])
        else:
            steps.append(_by_tokens(chosen, rows, schedule.micro_batch_tokens, schedule.packed))
    return steps


def _by_tokens(
    chosen: list[int], lengths: tuple[int, ...], budget: int, packed: int | None
) -> list[list[int]]:
    """``chosen`` rows grouped into micro-batches of at most ``budget`` tokens, longest
    first (see the module docstring)."""
    batches: list[list[int]] = []
    for row in sorted(chosen, key=lambda r: -lengths[r]):  # stable: ties stay shuffled
        if batches and _cost([*batches[-1], row], lengths, packed) <= budget:
            batches[-1].append(row)
        else:
            batches.append([row])
    return batches


def _cost(rows: Sequence[int], lengths: Lengths, packed: int | None) -> int:
    """Tokens a micro-batch of ``rows`` puts through the model, padding included."""
    if not packed:
        return len(rows) * max(lengths[r] for r in rows)
    lines = pack_lines(rows, lengths, packed)
    return len(lines) * max(sum(lengths[r] for r in line) for line in lines)


def pack_lines(rows: Sequence[int], lengths: Lengths, width: int) -> list[list[int]]:
    """``rows`` packed into lines of at most ``width`` tokens: longest first, each into the
    first line with room (a row longer than ``width`` is a line of its own). A function of
    the rows and their lengths alone, so the schedule and :func:`collate` agree on it."""
    lines: list[list[int]] = []
    room: list[int] = []
    for row in sorted(rows, key=lambda r: -lengths[r]):
        fit = next((i for i, left in enumerate(room) if lengths[row] <= left), None)
        if fit is None:
            lines.append([row])
            room.append(width - lengths[row])
        else:
            lines[fit].append(row)
            room[fit] -= lengths[row]
    return lines


@functools.lru_cache(maxsize=4)
def _epoch(
    rows: int | tuple[int, ...], schedule: Schedule, epoch: int, rank: int
) -> tuple[tuple[int, ...], ...]:
    out: list[tuple[int, ...]] = []
    for batches in _step_parts(rows, schedule, epoch, rank):
        if len(batches) > schedule.gradient_accumulation_steps:
            raise AssertionError("schedule too small for this rank's rows")
        batches += [[] for _ in range(schedule.gradient_accumulation_steps - len(batches))]
        out.extend(tuple(b) for b in batches)
    return tuple(out)


def most_micro_batches(lengths: Sequence[int], schedule: Schedule, *, rank: int) -> int:
    """The most micro-batches this rank has in any step of the epochs the run trains, under
    the schedule's token budget (the accumulation steps are the most over all ranks)."""
    epochs = math.ceil(schedule.total_steps / schedule.steps_per_epoch)
    key = _key(lengths, schedule)
    return max(
        (len(b) for e in range(epochs) for b in _step_parts(key, schedule, e, rank)), default=1
    )


def step_micro_batches(rows: Rows, schedule: Schedule, *, step: int, rank: int) -> list[list[int]]:
    """The micro-batches of optimizer step ``step`` (1-based, across epochs)."""
    epoch, index = divmod(step - 1, schedule.steps_per_epoch)
    batches = epoch_micro_batches(rows, schedule, epoch=epoch, rank=rank)
    gas = schedule.gradient_accumulation_steps
    return batches[index * gas : (index + 1) * gas]


def step_tokens(examples: Sequence[Example], schedule: Schedule, *, rank: int) -> list[int]:
    """This rank's masked tokens in each of the schedule's steps (summed over ranks, the
    token-mean normaliser of each step)."""
    counts = []
    lengths = row_lengths(examples)
    for step in range(1, schedule.total_steps + 1):
        batches = step_micro_batches(lengths, schedule, step=step, rank=rank)
        counts.append(sum(examples[i].tokens for batch in batches for i in batch))
    return counts


# --- collation ----------------------------------------------------------------------------


@dataclass
class MicroBatch:
    """Model inputs and per-token loss inputs of one micro-batch.

    The loss grid covers sequence positions ``first .. L-2`` (logits at position p predict
    token p+1): ``first`` is the earliest completion start minus one, so the model computes
    logits only from there (``logits_to_keep``), which skips the prompt-only positions.
    Packed (``position_ids`` set), a line holds several rows back to back.
    """

    input_ids: torch.Tensor  # (B, L)
    first: int
    targets: torch.Tensor  # (B, K)
    mask: torch.Tensor  # (B, K) bool
    logp_serve: torch.Tensor  # (B, K)
    advantages: torch.Tensor  # (B, K); (1,) for a filler
    sample_weight: torch.Tensor  # (B, K); (1,) for a filler
    rows: list[int]
    columns: list[slice]  # per row: grid columns of its completion tokens
    input_tokens: int  # real (unpadded) sequence tokens
    position_ids: torch.Tensor | None = None  # (B, L) packed: restarting at each row
    lines: list[int] | None = None  # per row: its line of the batch (None: row i, line i)
    # Each position's sampling (rtrl_trainer.logprobs), (B, K) each: temperature, top_p,
    # top_k of its row; None when every row of the batch was sampled at the defaults.
    sampling: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @property
    def tokens(self) -> int:
        """Tokens that carry loss."""
        return int(self.mask.sum())

    def _lines(self) -> list[int]:
        return self.lines if self.lines is not None else list(range(len(self.columns)))

    def scatter(self, per_row: Sequence[np.ndarray], fill: float = 0.0) -> torch.Tensor:
        """Per-row completion values (e.g. cached log-probs) placed on the loss grid."""
        grid = torch.full(self.targets.shape, fill, dtype=torch.float32)
        for line, values, cols in zip(self._lines(), per_row, self.columns, strict=True):
            grid[line, cols] = torch.from_numpy(np.asarray(values, dtype=np.float32))
        return grid.to(self.targets.device)

    def gather(self, grid: torch.Tensor) -> list[np.ndarray]:
        """The inverse of :meth:`scatter`: each row's completion values from the grid."""
        host = grid.detach().float().cpu().numpy()
        places = zip(self._lines(), self.columns, strict=True)
        return [host[line, cols].copy() for line, cols in places]


def collate(
    examples: Sequence[Example],
    rows: Sequence[int],
    *,
    device: torch.device,
    pad_id: int = 0,
    packed: int | None = None,
) -> MicroBatch:
    """A micro-batch of ``rows``, one per line, right-padded; or ``packed`` into lines of
    at most that many tokens (:func:`pack_lines`); or a filler micro-batch when empty.

    No attention mask is passed to the model: padding sits after every real token and
    attention is causal, so no real position can see it. Packed, the position ids restart
    at each row; without an attention mask a Hugging Face model reads the restarts as
    packed sequences and keeps each row's attention to itself (transformers' masking_utils,
    find_packed_sequence_indices).
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
    lengths = {i: len(examples[i].input_ids) for i in rows}
    lines = pack_lines(rows, lengths, packed) if packed else [[i] for i in rows]
    order = [i for line in lines for i in line]
    line_of = [n for n, line in enumerate(lines) for _ in line]
    offsets: list[int] = []
    for line in lines:
        offsets.extend(np.cumsum([0] + [lengths[i] for i in line[:-1]]).tolist())
    length = max(sum(lengths[i] for i in line) for line in lines)
    # The grid starts at the earliest completion of any line (each line's first row).
    first = max(0, min(examples[line[0]].completion_start for line in lines) - 1)
    ids = np.full((len(lines), length), pad_id, dtype=np.int64)
    # Packed, padding gets position 0: a sequence of its own, seen by nothing real.
    positions = np.zeros((len(lines), length), dtype=np.int64)
    grid = (len(lines), length - 1 - first)
    mask = np.zeros(grid, dtype=np.bool_)
    serve = np.zeros(grid, dtype=np.float32)
    advantages = np.zeros(grid, dtype=np.float32)
    weights = np.zeros(grid, dtype=np.float32)
    sampled = not all(examples[i].sampling.is_default for i in order)
    temperature = np.ones(grid, dtype=np.float32) if sampled else None
    top_p = np.ones(grid, dtype=np.float32) if sampled else None
    top_k = np.zeros(grid, dtype=np.int64) if sampled else None
    columns = []
    for i, n, offset in zip(order, line_of, offsets, strict=True):
        e = examples[i]
        ids[n, offset : offset + lengths[i]] = e.input_ids
        positions[n, offset : offset + lengths[i]] = np.arange(lengths[i])
        # Completion token j sits at position completion_start + j and is predicted by the
        # logits at the position before it (completion_start >= 1 by construction). Packed,
        # the last token of a row "predicts" the next row's first, a prompt token: the mask
        # is false there, as everywhere outside the completions.
        start = offset + e.completion_start - 1 - first
        cols = slice(start, start + e.completion_length)
        mask[n, cols] = e.mask
        serve[n, cols] = e.logprobs
        advantages[n, cols] = e.advantage
        weights[n, cols] = e.sample_weight
        if temperature is not None and top_p is not None and top_k is not None:
            temperature[n, cols] = e.sampling.temperature
            top_p[n, cols] = e.sampling.top_p
            top_k[n, cols] = e.sampling.top_k
        columns.append(cols)
    input_ids = torch.from_numpy(ids)
    return MicroBatch(
        input_ids=input_ids.to(device),
        first=first,
        targets=input_ids[:, first + 1 :].to(device),
        mask=torch.from_numpy(mask).to(device),
        logp_serve=torch.from_numpy(serve).to(device),
        advantages=torch.from_numpy(advantages).to(device),
        sample_weight=torch.from_numpy(weights).to(device),
        rows=order,
        columns=columns,
        input_tokens=sum(lengths.values()),
        position_ids=torch.from_numpy(positions).to(device) if packed else None,
        lines=line_of,
        sampling=None
        if temperature is None or top_p is None or top_k is None
        else (
            torch.from_numpy(temperature).to(device),
            torch.from_numpy(top_p).to(device),
            torch.from_numpy(top_k).to(device),
        ),
    )
