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
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
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
