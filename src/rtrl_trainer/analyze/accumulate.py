"""Streaming per-unit sums for :func:`rtrl_trainer.analyze.estimate.difference`, look by
look, and the analysis's per-arm statistics built on them (:class:`Arms`).

The analysis reads shards batch by batch; a unit's rows are spread over files and hours,
so its sums are kept by key (a user or session id) until the pass ends. The group-sequential
test needs every metric's variance at every earlier look of the plan too
(:mod:`.looks`), so the sums are kept per (key, look the rows first count at) in a
:class:`~.ledger.Ledger` (:mod:`.ledger`); the covariates come from the pre-exposure rows
(:mod:`.pre_exposure`).
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
from rtrl_trainer.analyze import covariates as cov_model
from rtrl_trainer.analyze.confidence import Estimate
from rtrl_trainer.analyze.estimate import Difference, independent
from rtrl_trainer.analyze.ledger import (
    _ROW,
    _UNIT,
    Keys,
    Ledger,
    PerLook,
    Weighting,
    row_looks,
    unit_looks,
)
from rtrl_trainer.analyze.looks import Looks
from rtrl_trainer.analyze.pre_exposure import Covariates, PreExposure, covariates, first_rows
from rtrl_trainer.monitors import LatencyHistogram
from rtrl_trainer.reward import filled

METRICS = (
    "edit_persistence",
    "dissatisfied_followup_rate",
    "latency_ms",
    "edit_rate",
    "clarification_rate",
    "invalid_tool_call_rate",
    "mean_completion_tokens",
)
PRIMARY = "edit_persistence"
FEEDBACK_MISSING = "feedback_missing_rate"
ROWS_PER_UNIT = "rows_per_unit"


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
    """Everything the analysis keeps while it streams: per-metric sums by unit, look and
    cell, pre-exposure sums by user, first rows, per-step sample-ratio counts, latency
    histograms per look."""

    strata: int
    unit: AssignmentUnit
    looks: Looks
    settle_bins: int = 0  # 5-minute bins from a user's first row to settled rows (0: none)
    # the 5-minute bin each step of the rollout began at (the settled rows' second clock)
    step_bins: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    keys: Keys = field(default_factory=Keys)
    sums: dict[str, Ledger] = field(default_factory=dict)
    pre: PreExposure = field(default_factory=PreExposure)
    window_first: dict[Any, list[Any]] = field(default_factory=dict)  # user -> first row
    # per arm: user -> their first row in that arm (the settled rows' clock)
    arm_first: tuple[dict[Any, list[Any]], dict[Any, list[Any]]] = field(
        default_factory=lambda: ({}, {})
    )
    rows: list[int] = field(default_factory=lambda: [0, 0])  # matured rows per arm, last look
    latency: dict[int, list[LatencyHistogram]] = field(default_factory=dict)  # per look
    # per step: request unit -> [baseline rows, canary rows]; else unit -> [first created,
    # its arm, bit mask of the arms it was seen in]
    srm_rows: list[list[int]] = field(default_factory=list)
    srm_first: list[dict[Any, list[int]]] = field(default_factory=list)
    assigned: np.ndarray = field(default_factory=lambda: np.zeros(0))  # [L, 2, S] rows
    logged_hours: Counter[tuple[int, int]] = field(default_factory=Counter)  # (arm, hour)
    pre_rows: int = 0

    def __post_init__(self) -> None:
        per_row = self.unit == AssignmentUnit.REQUEST
        cells, count = 2 * self.strata, self.looks.count
        # the primary's rows keep their 5-minute bin and arm (the settled rows are chosen by
        # both at the end): tag = 2 bin + arm
        tags = 2 * (int(self.looks.bins(np.array([self.looks.last]))[0]) + 1)
        for name in (*METRICS, FEEDBACK_MISSING):
            width = _ROW if per_row else _UNIT
            self.sums[name] = Ledger(cells, width, count, tags if name == PRIMARY else 1)
        self.sums[ROWS_PER_UNIT] = Ledger(cells, 1, count)
        self.srm_rows = [[0, 0] for _ in range(self.strata)]
        self.srm_first = [{} for _ in range(self.strata)]
        self.assigned = np.zeros((count, 2, self.strata))

    def _add(  # noqa: PLR0917 (where, then what: the rows' keys, looks, cells; x and n)
        self, name: str, ids: np.ndarray, looks: np.ndarray, cells: np.ndarray, x: Any, n: Any,
        *, tags: np.ndarray | None = None,
    ) -> None:  # fmt: skip
        ledger = self.sums[name]
        xs = np.broadcast_to(np.asarray(x, dtype=np.float64), ids.shape)
        ns = np.broadcast_to(np.asarray(n, dtype=np.float64), ids.shape)
        if ledger.width == _ROW:
            columns = [xs, ns, xs * xs, ns * ns, xs * ns, np.ones(ids.shape)]
        else:
            columns = [xs, ns]
        ledger.add(ids, looks, cells, columns, tags)

    def add(
        self, batch: pa.RecordBatch, arm: np.ndarray, stratum: np.ndarray, *, keys: np.ndarray,
        users: np.ndarray, created: np.ndarray, feedback: np.ndarray,
    ) -> None:  # fmt: skip
        """Add rows of the canary window (``arm`` -1: neither arm): each metric at the look
        its row first counts at, the missing-feedback rate from the look the row is judged
        at (and, for feedback that comes later, back out at the look it comes)."""
        count = self.looks.count
        seen = arm >= 0
        if not seen.any():
            return
        judged = self.looks.judged(created)
        arrived = np.searchsorted(self.looks.times, feedback, side="left")
        counted = np.maximum(judged, arrived)
        keep = seen & (judged < count)
        if not keep.any():
            return
        ids_all = np.full(arm.shape, -1, dtype=np.int64)
        ids_all[keep] = self.keys.lookup(keys[keep], users[keep])
        cell = arm * self.strata + stratum
        # missing feedback: judged from the look the row is old enough at, missing until
        # the look its feedback arrives by (if ever)
        missing = (arrived > judged).astype(np.float64)
        self._add(FEEDBACK_MISSING, ids_all[keep], judged[keep], cell[keep], missing[keep], 1.0)
        late = keep & (arrived > judged) & (arrived < count)
        if late.any():
            ledger = self.sums[FEEDBACK_MISSING]
            minus = np.full(int(late.sum()), -1.0)
            zero = np.zeros(minus.shape)
            columns = [minus, zero] if ledger.width == _UNIT else [minus, zero, minus, zero,
                                                                   minus, zero]  # fmt: skip
            ledger.add(ids_all[late], arrived[late], cell[late], columns)
        sel = keep & (counted < count)
        if not sel.any():
            return
        for a in (0, 1):
            self.rows[a] += int(np.count_nonzero(sel & (arm == a)))
        picked = batch.filter(pa.array(sel))
        ids, looks, cells = ids_all[sel], counted[sel], cell[sel]
        bins = 2 * self.looks.bins(created[sel]) + arm[sel]
        values = metric_values(picked)
        for name, (mask, x, n) in values.items():
            tags = bins if name == PRIMARY else None
            if mask is None:
                self._add(name, ids, looks, cells, x, n, tags=tags)
            else:
                self._add(name, ids[mask], looks[mask], cells[mask], x, n,
                          tags=None if tags is None else tags[mask])  # fmt: skip
        known, latency, _ = values["latency_ms"]
        lat = np.asarray(latency, dtype=np.float64)
        lat_arm, lat_look = arm[sel][known], looks[known]
        for j in np.unique(lat_look).tolist():
            hists = self.latency.setdefault(j, [LatencyHistogram(), LatencyHistogram()])
            for a in (0, 1):
                hists[a].add(lat[(lat_look == j) & (lat_arm == a)])

    def add_pre(self, batch: pa.RecordBatch, users: np.ndarray, created: np.ndarray) -> None:
        """The stable arm's rows from before the canary: each user's covariates."""
        self.pre_rows += batch.num_rows
        for name, (mask, x, n) in metric_values(batch).items():
            who = users if mask is None else users[mask]
            self.pre.add(name, who, x, n)
        first_rows(self.pre.first, users, created, strings(batch.column("org"), None),
                   prompt_bins(batch))  # fmt: skip

    def add_assigned(
        self, batch: pa.RecordBatch, arm: np.ndarray, stratum: np.ndarray, *, keys: np.ndarray,
        users: np.ndarray, created: np.ndarray,
    ) -> None:  # fmt: skip
        """Rows created by the last look, counted at assignment (no maturity): the sample
        ratio, the rows per unit, each user's first row in the canary."""
        mine = arm >= 0
        if not mine.any():
            return
        self.count_assigned(np.where(mine, arm, -1), stratum, keys, created)
        looks = self.looks.assigned(created[mine])
        np.add.at(self.assigned, (looks, arm[mine], stratum[mine]), 1.0)
        ids = self.keys.lookup(keys[mine], users[mine])
        cells = (arm * self.strata + stratum)[mine]
        self.sums[ROWS_PER_UNIT].add(ids, looks, cells, [1.0])
        orgs, bins = strings(batch.column("org"), None)[mine], prompt_bins(batch)[mine]
        first_rows(self.window_first, users[mine], created[mine], orgs, bins)
        for a in (0, 1):
            in_arm = arm[mine] == a
            first_rows(self.arm_first[a], users[mine][in_arm], created[mine][in_arm],
                       orgs[in_arm], bins[in_arm])  # fmt: skip
        hours = created[mine] // 3_600_000_000  # the epoch hour: the seal's hours
        for key, count in Counter(zip(arm[mine].tolist(), hours.tolist(), strict=True)).items():
            self.logged_hours[key] += count

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

    # -- at the end of the pass --------------------------------------------------------

    def covariates(self, features: bool = True) -> Covariates:
        return covariates(self.pre, self.window_first, self.keys.covariate_key,
                          features=features)  # fmt: skip

    def per_look(
        self, name: str, covariate: np.ndarray, groups: tuple[np.ndarray, ...] = (),
        select: np.ndarray | None = None, weighting: Weighting | None = None,
    ) -> PerLook:  # fmt: skip
        count = len(self.keys.ids)
        ledger = self.sums[name]
        if self.unit == AssignmentUnit.REQUEST and name != ROWS_PER_UNIT:
            return row_looks(ledger, count, self.looks.count, covariate, self.strata,
                             groups=groups, select=select)  # fmt: skip
        return unit_looks(
            ledger, count, self.looks.count, covariate, self.strata, groups=groups,
            select=select, counts=name == ROWS_PER_UNIT, weighting=weighting,
        )  # fmt: skip

    def settled(self) -> np.ndarray | None:
        """The primary's ledger entries of settled rows: created at least ``settle_bins``
        5-minute bins after their user's first row in the same arm (a user moved from the
        stable arm to the canary at a later step starts anew: the novelty is the canary's)
        and as long after the start of their step, in both arms: a step's canary users
        start their clocks at its start, so without the second clock the baseline's settled
        rows would begin hours earlier in the day than the canary's, and the daily drift
        between those hours would count as a difference (None: no such rule)."""
        if self.settle_bins <= 0:
            return None
        ledger = self.sums[PRIMARY]
        key, _, _ = ledger.entries()
        if key.size == 0:
            return np.zeros(0, dtype=bool)
        first = np.array(
            [[self._first_bin(u, a) for a in (0, 1)] for u in self.keys.covariate_key],
            dtype=np.int64,
        ).reshape(-1, 2)
        tag = ledger.tag[: ledger.size]
        bins, arms = tag // 2, tag % 2
        anonymous = np.array([u == "" for u in self.keys.covariate_key], dtype=bool)
        result: np.ndarray = (bins >= first[key, arms] + self.settle_bins) & ~anonymous[key]
        if self.step_bins.size:
            step = np.maximum(np.searchsorted(self.step_bins, bins, side="right") - 1, 0)
            result &= bins >= self.step_bins[step] + self.settle_bins
        return result

    def _first_bin(self, user: Any, arm: int) -> int:
        found = self.arm_first[arm].get(user)
        if found is None:
            return np.iinfo(np.int64).max // 4
        return int((found[0] - self.looks.since) // 300_000_000)

    def quantile_differences(self) -> Difference | None:
        """The latency p95 at every look (histograms cumulated over the looks)."""
        if not self.latency:
            return None
        cum = [LatencyHistogram(), LatencyHistogram()]
        found = []
        for j in range(self.looks.count):
            for a in (0, 1):
                h = self.latency.get(j)
                if h is not None:
                    cum[a].counts = cum[a].counts + h[a].counts
            b, c = (quantile_estimate(h, 0.95) for h in cum)
            found.append((b, c))
        if found[-1][0] is None or found[-1][1] is None:
            return None
        nan = Estimate(np.nan, np.nan, 0.0)
        rows = [(b or nan, c or nan) for b, c in found]
        return independent(
            np.array([b.value for b, _ in rows]), np.array([b.var for b, _ in rows]),
            np.array([b.n for b, _ in rows]), np.array([c.value for _, c in rows]),
            np.array([c.var for _, c in rows]), np.array([c.n for _, c in rows]),
        )  # fmt: skip


def prompt_bins(batch: pa.RecordBatch) -> np.ndarray:
    return cov_model.prompt_bin(filled(pc.list_value_length(batch.column("prompt_ids")), 0))


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
