"""Off-policy admission: which previous-checkpoint rows enter the set, and (pass 2) dealing
the scratch file's on-policy and admitted rows to the rank files in the order they were
read.

Rows of the previous checkpoint are admitted up to ``data.maxOffPolicyFraction`` of the
final set, by a hash of their ``interaction_id``: the same rows on every rerun.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from rtrl.core.shards.dedup import hash_strings
from rtrl_trainer.reward import RunningStats
from rtrl_trainer.stage.ranks import Ranks, deal
from rtrl_trainer.stage.select import Selection


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
