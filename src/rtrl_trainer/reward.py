"""Rewards and advantages from implicit feedback, vectorised over Arrow batches.

Logged data has one completion per context, so there is no group to compare against: the
reward of an interaction is a weighted sum of its feedback signals (the RLCycle's
``RewardSpec``), and its advantage is that reward minus a baseline (the batch mean, or the
mean of its stratum: its org), divided by the standard deviation of all rewards of the
training set. These are pure functions on Arrow and numpy, so the stage step, the benchmark
and the tests compute the very same numbers.

The reward of one interaction::

    r = editPersisted        * edit_persisted
      + dissatisfiedFollowup * dissatisfied_followup
      + latency              * latency_ms / latencyScaleMs
      + invalidToolCall      * [invalid_tool_calls > 0]
      + askedClarification   * asked_clarification
    r = clip(r, -clip, clip)

An interaction with an invalid tool call keeps its row and gets the (negative)
``invalidToolCall`` term: dropping such rows taught a production model to emit broken tool
calls on tasks it expected to fail, since a broken call then cost nothing.

Missing-signal rule. Signals come from clients that do not all report everything, and a
missing signal must neither crash the step nor drop the row (dropping would bias the set
towards well-instrumented clients). A null signal contributes what "nothing happened" would:

- ``edit_persisted`` null counts 0: no edit to keep (a clarifying question), or a matured
  row whose edit could not be measured; it earns no persistence reward.
- ``dissatisfied_followup`` and ``asked_clarification`` null count false.
- ``latency_ms`` null contributes 0 (no latency penalty, nothing is known).
- ``tool_calls`` and ``invalid_tool_calls`` null count 0 (no invalid call known).

The behaviour monitors apply the same rule, and stage.json counts the nulls per signal so
a client that stops reporting one shows up.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from rtrl.core.api.rlcycle import RewardSpec

F32Array = npt.NDArray[np.float32]
F64Array = npt.NDArray[np.float64]
I32Array = npt.NDArray[np.int32]
BoolArray = npt.NDArray[np.bool_]

# Below this standard deviation all rewards are equal (up to float32 rounding): there is
# nothing to prefer, and dividing would turn rounding noise into large advantages.
MIN_STD = 1e-6

SIGNAL_COLUMNS: tuple[str, ...] = (
    "edit_persisted",
    "dissatisfied_followup",
    "latency_ms",
    "tool_calls",
    "invalid_tool_calls",
    "asked_clarification",
)


def filled(array: pa.Array | pa.ChunkedArray, fill: Any) -> npt.NDArray[Any]:
    """A column as numpy with nulls replaced by ``fill`` (the missing-signal rule)."""
    if array.null_count:
        array = pc.fill_null(array, fill)
    values: npt.NDArray[Any] = array.to_numpy(zero_copy_only=False)
    return values


def rewards(batch: pa.RecordBatch | pa.Table, spec: RewardSpec) -> F32Array:
    """The clipped reward of every row of a canonical batch, as float32 (the type the
    training set stores; statistics are computed from these stored values)."""
    r = spec.edit_persisted * filled(batch.column("edit_persisted"), 0.0).astype(np.float64)
    if spec.dissatisfied_followup:
        r += spec.dissatisfied_followup * filled(batch.column("dissatisfied_followup"), False)
    if spec.latency:
        latency = filled(batch.column("latency_ms"), 0.0)
        r += (spec.latency / spec.latency_scale_ms) * latency
    if spec.invalid_tool_call:
        r += spec.invalid_tool_call * (filled(batch.column("invalid_tool_calls"), 0) > 0)
    if spec.asked_clarification:
        r += spec.asked_clarification * filled(batch.column("asked_clarification"), False)
    np.clip(r, -spec.clip, spec.clip, out=r)
    return r.astype(np.float32)


@dataclass
class RunningStats:
    """Count, mean, variance, min and max of a stream of values, merged batch by batch
    (Chan et al.'s parallel update: no catastrophic cancellation over millions of rows)."""

    count: int = 0
    mean: float = 0.0
    m2: float = 0.0
    min: float = float("inf")
    max: float = float("-inf")

    def update(self, values: npt.NDArray[Any]) -> None:
        n = int(values.size)
        if n == 0:
            return
        v = values.astype(np.float64, copy=False)
        mean = float(v.mean())
        m2 = float(np.square(v - mean).sum())
        self.merge(RunningStats(n, mean, m2, float(v.min()), float(v.max())))

    def merge(self, other: RunningStats) -> None:
        if other.count == 0:
            return
        total = self.count + other.count
        delta = other.mean - self.mean
        self.mean += delta * other.count / total
        self.m2 += other.m2 + delta * delta * self.count * other.count / total
        self.count = total
        self.min = min(self.min, other.min)
        self.max = max(self.max, other.max)

    @property
    def std(self) -> float:
        """Population standard deviation (0 for fewer than two values)."""
        return float(np.sqrt(self.m2 / self.count)) if self.count > 1 else 0.0

    def to_dict(self) -> dict[str, float | None]:
        if self.count == 0:
            return {"mean": None, "std": None, "min": None, "max": None}
        return {"mean": self.mean, "std": self.std, "min": self.min, "max": self.max}


@dataclass
class Strata:
    """Reward sums and counts per stratum, for per-stratum baselines.

    Strata get dense integer codes in order of first appearance (so reruns number them
    identically); a null org is a stratum of its own. With ``by_org`` False there is one
    stratum, the whole batch.
    """

    by_org: bool
    codes: dict[str | None, int] = field(default_factory=dict)
    sums: list[float] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)

    def encode(self, org: pa.Array | pa.ChunkedArray) -> I32Array:
        """The stratum code of every row (registering new strata)."""
        n = len(org)
        if not self.by_org:
            self._code(None)
            return np.zeros(n, dtype=np.int32)
        encoded = pc.dictionary_encode(org)
        if isinstance(encoded, pa.ChunkedArray):
            encoded = encoded.combine_chunks()
        lookup = np.array(
            [self._code(v) for v in encoded.dictionary.to_pylist()] + [self._code(None)],
            dtype=np.int32,
        )
        # Null indices (null orgs) point at the last entry of the lookup: the null stratum.
        indices = filled(encoded.indices, len(lookup) - 1).astype(np.int64)
        codes: I32Array = lookup[indices]
        return codes

    def _code(self, key: str | None) -> int:
        code = self.codes.get(key)
        if code is None:
            code = self.codes[key] = len(self.codes)
            self.sums.append(0.0)
            self.counts.append(0)
        return code

    def add(self, codes: I32Array, values: F32Array) -> None:
        """Add ``values`` (rewards) to their rows' strata."""
        if codes.size == 0:
            return
        size = len(self.codes)
        sums = np.bincount(codes, weights=values.astype(np.float64), minlength=size)
        counts = np.bincount(codes, minlength=size)
        for code in np.flatnonzero(counts):
            self.sums[code] += float(sums[code])
            self.counts[code] += int(counts[code])

    def baselines(self) -> F64Array:
        """The mean reward of each stratum, indexed by code (0 for an empty stratum)."""
        sums = np.asarray(self.sums, dtype=np.float64)
        counts = np.asarray(self.counts, dtype=np.float64)
        out: F64Array = np.divide(sums, counts, out=np.zeros_like(sums), where=counts > 0)
        return out

    def describe(self) -> list[dict[str, Any]]:
        """Each non-empty stratum with its row count and baseline: largest first, then by
        org, the null org last."""
        baselines = self.baselines()
        rows = [
            {"org": key, "rows": self.counts[code], "baseline": float(baselines[code])}
            for key, code in self.codes.items()
            if self.counts[code]
        ]
        if not self.by_org:
            for row in rows:
                del row["org"]
        return sorted(
            rows, key=lambda row: (-int(row["rows"]), row.get("org") is None, row.get("org") or "")
        )


def advantages(
    values: F32Array, codes: I32Array | Sequence[int], baselines: F64Array, std: float
) -> F32Array:
    """``(reward - baseline of its stratum) / std``, as float32; all zeros when ``std`` is
    (numerically) zero, since then no interaction is better than another."""
    if std < MIN_STD:
        return np.zeros(len(values), dtype=np.float32)
    base = baselines[np.asarray(codes, dtype=np.int64)]
    out: F32Array = ((values.astype(np.float64) - base) / std).astype(np.float32)
    return out
