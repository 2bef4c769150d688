"""Streaming per-unit sums for :func:`rtrl_trainer.analyze.estimate.difference`, and the
analysis's per-arm statistics built on them (:class:`Arms`).

The analysis reads shards batch by batch; a unit's rows are spread over files and hours,
so its sums are kept by key (a user or session id) until the pass ends, and only then
turned into the Gram matrix the cluster-robust variance needs. With the request as the
unit every row is its own unit and the Gram matrix is block-diagonal: per-row second
moments are summed per key (the user, whose pre-exposure mean is each row's covariate)
instead, so memory grows with the number of users, never with rows.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from rtrl.core.api.rlcycle import AssignmentUnit
from rtrl_trainer.analyze.confidence import Estimate
from rtrl_trainer.analyze.estimate import Difference, N, Q, X, Z, difference, independent
from rtrl_trainer.monitors import LatencyHistogram
from rtrl_trainer.reward import filled

# Per-key columns: x, n (per unit); and xx, nn, xn (per row, request unit only).
_COLUMNS_UNIT = 2
_COLUMNS_ROW = 5


@dataclass
class Keys:
    """Dense integer ids for string keys, shared by every metric of one analysis."""

    ids: dict[Any, int] = field(default_factory=dict)
    covariate_key: list[Any] = field(default_factory=list)  # the user behind each key

    def lookup(self, keys: np.ndarray, users: np.ndarray) -> np.ndarray:
        unique, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
        mapped = np.empty(len(unique), dtype=np.int64)
        for i, (key, row) in enumerate(zip(unique.tolist(), first.tolist(), strict=True)):
            found = self.ids.get(key)
            if found is None:
                found = self.ids[key] = len(self.ids)
                self.covariate_key.append(users[row])
            mapped[i] = found
        return mapped[inverse]


@dataclass
class MetricSums:
    """One metric's sums per (key, cell), the cell being ``arm * strata + stratum``."""

    strata: int
    per_row: bool
    data: np.ndarray = field(default_factory=lambda: np.zeros((0, 0, 0)))
    rows: int = 0  # rows added: the request unit's unit count

    def __post_init__(self) -> None:
        width = _COLUMNS_ROW if self.per_row else _COLUMNS_UNIT
        self.data = np.zeros((0, 2 * self.strata, width))

    def _grow(self, size: int) -> None:
        if self.data.shape[0] >= size:
            return
        width = _COLUMNS_ROW if self.per_row else _COLUMNS_UNIT
        grown = np.zeros((max(size, 2 * self.data.shape[0], 1024), 2 * self.strata, width))
        grown[: self.data.shape[0]] = self.data
        self.data = grown

    def add(self, ids: np.ndarray, cell: np.ndarray, x: Any, n: Any) -> None:
        if ids.size == 0:
            return
        self.rows += int(ids.size)
        xs = np.asarray(x, dtype=np.float64)
        ns = np.broadcast_to(np.asarray(n, dtype=np.float64), xs.shape)
        self._grow(int(ids.max()) + 1)
        columns = [xs, ns, xs * xs, ns * ns, xs * ns] if self.per_row else [xs, ns]
        for column, values in enumerate(columns):
            np.add.at(self.data[:, :, column], (ids, cell), values)

    def finish(self, keys: int, covariate: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
        """(totals [2, S, 3], Gram [6S, 6S], units); ``covariate[k]`` is key k's row
        covariate (its user's pre-exposure mean)."""
        self._grow(keys)
        data = self.data[:keys]
        c = covariate[:keys, None]
        cells = 2 * self.strata
        totals = np.zeros((cells, Q))
        totals[:, X] = data[:, :, 0].sum(axis=0)
        totals[:, N] = data[:, :, 1].sum(axis=0)
        totals[:, Z] = (data[:, :, 1] * c).sum(axis=0)
        gram = np.zeros((cells * Q, cells * Q))
        if self.per_row:
            xx, nn, xn = (data[:, :, i] for i in (2, 3, 4))
            for cell in range(cells):
                block = np.array(
                    [
                        [xx[:, cell].sum(), xn[:, cell].sum(), (c[:, 0] * xn[:, cell]).sum()],
                        [0.0, nn[:, cell].sum(), (c[:, 0] * nn[:, cell]).sum()],
                        [0.0, 0.0, (c[:, 0] ** 2 * nn[:, cell]).sum()],
                    ]
                )
                block = np.triu(block) + np.triu(block, 1).T
                gram[cell * Q : (cell + 1) * Q, cell * Q : (cell + 1) * Q] = block
            units = self.rows
        else:
            vectors = np.zeros((keys, cells * Q))
            vectors[:, X::Q] = data[:, :, 0]
            vectors[:, N::Q] = data[:, :, 1]
            vectors[:, Z::Q] = data[:, :, 1] * c
            active = np.any(data[:, :, 1] != 0, axis=1) | np.any(data[:, :, 0] != 0, axis=1)
            vectors = vectors[active]
            gram = vectors.T @ vectors
            units = int(active.sum())
        return totals.reshape(2, self.strata, Q), gram, units


@dataclass
class PreExposure:
    """Each user's sums of every metric on the stable checkpoint before the canary."""

    sums: dict[str, dict[Any, list[float]]] = field(default_factory=dict)

    def add(self, name: str, users: np.ndarray, x: Any, n: Any) -> None:
        xs = np.asarray(x, dtype=np.float64)
        ns = np.broadcast_to(np.asarray(n, dtype=np.float64), xs.shape)
        if xs.size == 0:
            return
        unique, inverse = np.unique(users, return_inverse=True)
        sx = np.bincount(inverse, xs, len(unique))
        sn = np.bincount(inverse, ns, len(unique))
        table = self.sums.setdefault(name, {})
        for user, a, b in zip(unique.tolist(), sx.tolist(), sn.tolist(), strict=True):
            entry = table.setdefault(user, [0.0, 0.0])
            entry[0] += a
            entry[1] += b

    def covariate(self, name: str, users: list[Any]) -> tuple[np.ndarray, int]:
        """Per key: its user's pre-exposure mean, the overall pre-exposure mean for users
        not seen before (so their covariate carries no information); and how many keys had
        one of their own."""
        table = self.sums.get(name, {})
        total_x = sum(v[0] for v in table.values())
        total_n = sum(v[1] for v in table.values())
        overall = total_x / total_n if total_n > 0 else 0.0
        values = np.full(len(users), overall)
        own = 0
        for i, user in enumerate(users):
            entry = table.get(user)
            if entry is not None and entry[1] > 0:
                values[i] = entry[0] / entry[1]
                own += 1
        return values, own


# --- the analysis's per-arm statistics ------------------------------------------------

# The metrics measured on matured rows: name -> (rows it is measured on, x, n) from a batch.
METRICS = (
    "edit_persistence",
    "dissatisfied_followup_rate",
    "latency_ms",
    "edit_rate",
    "clarification_rate",
    "invalid_tool_call_rate",
    "mean_completion_tokens",
)
FEEDBACK_MISSING = "feedback_missing_rate"


def metric_values(batch: pa.RecordBatch) -> dict[str, tuple[Any, Any, Any]]:
    """Per metric: (the rows it is measured on, as a mask or None for all; x; n)."""
    edit = batch.column("edit_persisted")
    latency = batch.column("latency_ms")
    edit_known = ~_null(edit)
    latency_known = ~_null(latency)
    ones = 1.0
    return {
        "edit_persistence": (edit_known, filled(edit, 0.0)[edit_known], ones),
        "dissatisfied_followup_rate": (
            None, filled(batch.column("dissatisfied_followup"), False), ones
        ),
        "latency_ms": (latency_known, filled(latency, 0.0)[latency_known], ones),
        "edit_rate": (None, filled(batch.column("edits_proposed"), 0) > 0, ones),
        "clarification_rate": (None, filled(batch.column("asked_clarification"), False), ones),
        "invalid_tool_call_rate": (
            None,
            filled(batch.column("invalid_tool_calls"), 0),
            filled(batch.column("tool_calls"), 0),
        ),
        "mean_completion_tokens": (
            None, filled(pc.list_value_length(batch.column("completion_ids")), 0), ones
        ),
    }  # fmt: skip


def _null(array: pa.Array) -> np.ndarray[Any, np.dtype[np.bool_]]:
    return np.asarray(pc.is_null(array).to_numpy(zero_copy_only=False), dtype=bool)


def strings(array: pa.Array, fallback: pa.Array | None) -> np.ndarray:
    """A string column as a numpy object array, nulls replaced from ``fallback`` (or "")."""
    if fallback is not None:
        array = pc.coalesce(array, fallback)
    values: np.ndarray = np.asarray(pc.fill_null(array, "").to_numpy(zero_copy_only=False))
    return values.astype(object)


@dataclass
class Arms:
    """Everything the analysis keeps while it streams: per-metric sums by unit and cell,
    pre-exposure sums by user, per-step sample-ratio counts, latency histograms."""

    strata: int
    unit: AssignmentUnit
    keys: Keys = field(default_factory=Keys)
    sums: dict[str, MetricSums] = field(default_factory=dict)
    pre: PreExposure = field(default_factory=PreExposure)
    rows: list[int] = field(default_factory=lambda: [0, 0])  # matured rows per arm
    latency: list[LatencyHistogram] = field(
        default_factory=lambda: [LatencyHistogram(), LatencyHistogram()]
    )
    # per step: request unit -> [baseline rows, canary rows]; else unit -> [first created,
    # its arm, bit mask of the arms it was seen in]
    srm_rows: list[list[int]] = field(default_factory=list)
    srm_first: list[dict[Any, list[int]]] = field(default_factory=list)
    pre_rows: int = 0

    def __post_init__(self) -> None:
        per_row = self.unit == AssignmentUnit.REQUEST
        for name in (*METRICS, FEEDBACK_MISSING):
            self.sums[name] = MetricSums(self.strata, per_row)
        self.srm_rows = [[0, 0] for _ in range(self.strata)]
        self.srm_first = [{} for _ in range(self.strata)]

    def add(
        self,
        batch: pa.RecordBatch,
        arm: np.ndarray,
        stratum: np.ndarray,
        *,
        keys: np.ndarray,
        users: np.ndarray,
        matured: np.ndarray,
        judged: np.ndarray,
    ) -> None:
        """Add rows of the canary window: ``matured`` ones to the metrics, ``judged`` ones
        (old enough for feedback to have arrived) to the missing-feedback rate."""
        cell = arm * self.strata + stratum
        seen = judged & (arm >= 0)  # matured rows are among these: one key lookup
        if not seen.any():
            return
        seen_ids = self.keys.lookup(keys[seen], users[seen])
        self.sums[FEEDBACK_MISSING].add(seen_ids, cell[seen], ~matured[seen], 1.0)
        sel = matured & (arm >= 0)
        if not sel.any():
            return
        for a in (0, 1):
            self.rows[a] += int(np.count_nonzero(sel & (arm == a)))
        picked = batch.filter(pa.array(sel))
        ids = seen_ids[matured[seen]]
        cells = cell[sel]
        values = metric_values(picked)
        for name, (mask, x, n) in values.items():
            if mask is None:
                self.sums[name].add(ids, cells, x, n)
            else:
                self.sums[name].add(ids[mask], cells[mask], x, n)
        known, latency, _ = values["latency_ms"]
        lat_arm = arm[sel][known]
        for a in (0, 1):
            self.latency[a].add(np.asarray(latency, dtype=np.float64)[lat_arm == a])

    def add_pre(self, batch: pa.RecordBatch, users: np.ndarray) -> None:
        """The stable arm's rows from before the canary: each user's covariates."""
        self.pre_rows += batch.num_rows
        for name, (mask, x, n) in metric_values(batch).items():
            who = users if mask is None else users[mask]
            self.pre.add(name, who, x, n)

    def count_assigned(
        self, arm: np.ndarray, stratum: np.ndarray, keys: np.ndarray, created: np.ndarray
    ) -> None:
        """Sample-ratio counts: every row created in a step, at once (no maturity)."""
        for s in np.unique(stratum[arm >= 0]).tolist():
            mine = (stratum == s) & (arm >= 0)
            if self.unit == AssignmentUnit.REQUEST:
                for a in (0, 1):
                    self.srm_rows[s][a] += int(np.count_nonzero(mine & (arm == a)))
                continue
            # Per unit in this batch: its earliest row's time and arm, and the arms it
            # used; then one dictionary update per unit, not per row.
            k, t, a = keys[mine], created[mine], arm[mine]
            order = np.lexsort((t, k))
            k, t, a = k[order], t[order], a[order]
            starts = np.flatnonzero(np.r_[True, k[1:] != k[:-1]])
            used = np.bitwise_or.reduceat(np.left_shift(1, a), starts)
            first = self.srm_first[s]
            for key, at, arm0, mask in zip(
                k[starts].tolist(),
                t[starts].tolist(),
                a[starts].tolist(),
                used.tolist(),
                strict=True,
            ):
                seen = first.get(key)
                if seen is None:
                    first[key] = [at, arm0, mask]
                    continue
                if at < seen[0]:
                    seen[0], seen[1] = at, arm0
                seen[2] |= mask

    def srm_counts(self) -> tuple[list[int], list[int], list[int]]:
        """Per step: baseline units, canary units, units seen in both arms."""
        if self.unit == AssignmentUnit.REQUEST:
            return [r[0] for r in self.srm_rows], [r[1] for r in self.srm_rows], [0] * self.strata
        base, canary, both = [], [], []
        for first in self.srm_first:
            arms = Counter(entry[1] for entry in first.values())
            base.append(arms[0])
            canary.append(arms[1])
            both.append(sum(1 for entry in first.values() if entry[2] == 3))
        return base, canary, both

    def differences(self, adjust: bool) -> tuple[dict[str, Difference], dict[str, int]]:
        """Every metric's difference, and per metric how many units had a covariate."""
        found: dict[str, Difference] = {}
        covered: dict[str, int] = {}
        count = len(self.keys.ids)
        for name, sums in self.sums.items():
            if adjust and name in self.pre.sums:
                covariate, covered[name] = self.pre.covariate(name, self.keys.covariate_key)
            else:
                covariate, covered[name] = np.zeros(count), 0
            totals, gram, units = sums.finish(count, covariate)
            if not np.any(totals[..., 1] > 0):
                continue
            found[name] = difference(totals, gram, units, adjust=adjust and covered[name] > 0)
        b, c = (quantile_estimate(h, 0.95) for h in self.latency)
        if b is not None and c is not None:
            found["latency_p95_ms"] = independent(b.value, b.var, b.n, c.value, c.var, c.n)
        return found, covered


def quantile_estimate(hist: LatencyHistogram, q: float) -> Estimate | None:
    """The ``q`` quantile of a histogram and its asymptotic variance ``q(1-q) s^2 / n``,
    the sparsity ``s`` by the Siddiqui-Bofinger difference quotient with the Hall-Sheather
    bandwidth (Koenker, Quantile Regression, 2005, section 3.4); floored at the histogram's
    resolution."""
    n = hist.count
    if n < 2:
        return None
    value = hist.quantile(q)
    assert value is not None
    z = NormalDist().inv_cdf(q)
    z_level = NormalDist().inv_cdf(0.975)
    density = math.exp(-z * z / 2) / math.sqrt(2 * math.pi)
    h = n ** (-1 / 3) * z_level ** (2 / 3) * (1.5 * density**2 / (2 * z * z + 1)) ** (1 / 3)
    h = min(h, q * 0.5, (1 - q) * 0.5)
    upper, lower = hist.quantile(q + h), hist.quantile(q - h)
    assert upper is not None and lower is not None
    sparsity = (upper - lower) / (2 * h)
    resolution = value * (hist.GROWTH - 1) / 2
    var = max(q * (1 - q) * sparsity**2 / n, resolution**2 / n)
    return Estimate(value, var, float(n))
