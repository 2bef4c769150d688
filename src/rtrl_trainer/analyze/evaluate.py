"""From one pass's sums to what the decision rule judges at the last look: every metric's
difference with its covariate, the boundary of the group-sequential test replayed over the
plan's looks, the primary goal among settled rows, and the lost-row guardrails."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rtrl.core.api.common import parse_duration
from rtrl.core.api.rlcycle import AnalysisSpec, AssignmentUnit, GuardrailsSpec
from rtrl_trainer.analyze.accumulate import (
    FEEDBACK_MISSING,
    METRICS,
    PRIMARY,
    ROWS_PER_UNIT,
    Arms,
)
from rtrl_trainer.analyze.confidence import judgeable
from rtrl_trainer.analyze.estimate import Difference
from rtrl_trainer.analyze.ledger import Weighting
from rtrl_trainer.analyze.reconcile import NAME as LOGGED
from rtrl_trainer.analyze.reconcile import logged_per_served, rows_per_share
from rtrl_trainer.analyze.rule import Metric
from rtrl_trainer.analyze.sequential import normal_quantile, replay

P95 = "latency_p95_ms"


def at(diff: Difference, look: int) -> Difference:
    """One look of a :class:`Difference` over looks (its parts' reductions are the last
    look's already)."""
    fields = [np.asarray(v)[look] if np.ndim(v) else v for v in diff[:-1]]
    values = [float(f) if np.ndim(f) == 0 else f for f in fields]
    return Difference._make([*values, diff.part_reduction])


@dataclass
class Evaluation:
    """What the decision rule needs at the last look, and what analysis.json reports."""

    diffs: dict[str, Difference]  # last look
    # per metric: the boundary on the log and absolute scales (inf: no verdict at this look),
    # and the last finite ones of the plan to print then; None: mixture intervals
    boundaries: dict[str, tuple[float, float, float, float]] | None
    settled: Difference | None = None
    settled_boundary: tuple[float, float, float, float] | None = None
    # the primary goal precision-weighted (the evidence that promotes), and its boundaries
    promote: Difference | None = None
    promote_boundary: tuple[float, float, float, float] | None = None
    with_history: dict[str, int] = field(default_factory=dict)  # units with own history
    units: dict[str, int] = field(default_factory=dict)  # units with a covariate
    pre_users: dict[str, int] = field(default_factory=dict)  # users the model was fitted on


def evaluate(
    arms: Arms, metrics: list[Metric], spec: AnalysisSpec, guardrails: GuardrailsSpec, *,
    shares: list[float], served: dict[str, np.ndarray] | None = None,
) -> Evaluation:  # fmt: skip
    """Every metric's differences at every look, the boundaries of the last (when the
    group-sequential test is planned), and the settled primary."""
    looks = arms.looks
    adjust = spec.variance_reduction
    covs = arms.covariates() if adjust else None
    count = len(arms.keys.ids)
    every: dict[str, Difference] = {}
    result = Evaluation({}, None)
    for name in (*METRICS, FEEDBACK_MISSING):
        cov = covs.values.get(name) if covs is not None else None
        returning = covs.returning.get(name) if covs is not None else None
        groups = () if returning is None else (~returning, returning)
        per = arms.per_look(name, np.zeros(count) if cov is None else cov, groups)
        if not np.any(per.totals[-1, ..., 1] > 0):
            continue
        every[name] = per.difference(adjust=cov is not None)
        if covs is not None and cov is not None and returning is not None:
            result.with_history[name] = int(returning.sum())
            result.units[name] = count
            result.pre_users[name] = covs.pre_users.get(name, 0)
    names = {m.name for m in metrics}
    if ROWS_PER_UNIT in names:
        if arms.unit == AssignmentUnit.REQUEST:
            every[ROWS_PER_UNIT] = rows_per_share(np.cumsum(arms.assigned, axis=0), shares)
        else:
            rate = pre_rate(arms, spec)
            every[ROWS_PER_UNIT] = arms.per_look(ROWS_PER_UNIT, rate).difference(adjust=True)
    if P95 in names:
        found = arms.quantile_differences()
        if found is not None:
            every[P95] = found
    if LOGGED in names and served is not None:
        every[LOGGED] = logged_per_served(
            served["served"][:, 0], served["logged"][:, 0], served["served"][:, 1],
            served["logged"][:, 1],
        )  # fmt: skip
    settled_every = None
    promote_every = None
    select = arms.settled()
    weighting = None
    if PRIMARY in every:
        cov = covs.values.get(PRIMARY) if covs is not None else None
        within = covs.within.get(PRIMARY, 0.0) if covs is not None else 0.0
        if (
            spec.precision_weighting and arms.unit != AssignmentUnit.REQUEST
            and cov is not None and covs is not None and within > 0
        ):  # fmt: skip
            weighting = Weighting(covs.returning[PRIMARY].astype(np.int64), within)
            promote_every = arms.per_look(PRIMARY, cov, weighting=weighting).difference(True)
        if select is not None:
            per = arms.per_look(
                PRIMARY, np.zeros(count) if cov is None else cov, select=select,
                weighting=weighting,
            )  # fmt: skip
            settled_every = per.difference(adjust=cov is not None)
    result.diffs = {name: at(d, -1) for name, d in every.items()}
    if settled_every is not None:
        result.settled = at(settled_every, -1)
    if promote_every is not None:
        result.promote = at(promote_every, -1)
    if looks.planned:
        rho = spec.spending_exponent
        result.boundaries = {}
        for metric in metrics:
            d = every.get(metric.name)
            if d is None:
                continue
            result.boundaries[metric.name] = boundary(d, metric.alpha, metric.events,
                                                      looks.fractions, rho)  # fmt: skip
        if settled_every is not None:
            result.settled_boundary = boundary(
                settled_every, spec.alpha, True, looks.fractions, rho
            )
        if promote_every is not None:
            primary = next(m for m in metrics if m.name == PRIMARY)
            result.promote_boundary = boundary(
                promote_every, primary.alpha, primary.events, looks.fractions, rho
            )
    return result


def boundary(
    d: Difference, alpha: float, events: bool, fractions: np.ndarray, rho: float
) -> tuple[float, float, float, float]:
    """The boundary of the last look on the log scale and on the absolute one, each replayed
    over the looks from the information (1 / variance) the data gave at each; and the ones
    to print when the last look gives no verdict (``inf``): the last finite boundary of the
    plan, or the fixed-horizon ``z`` at ``alpha`` before any."""
    enough, _ = judgeable(d, events=events)
    enough = np.broadcast_to(np.asarray(enough), np.shape(fractions))
    fixed = normal_quantile(1 - alpha / 2)
    found = []
    for var in (d.log_var, d.var):
        with np.errstate(divide="ignore", invalid="ignore"):
            info = 1 / np.asarray(var, dtype=np.float64)
        z = replay(alpha, fractions, np.broadcast_to(info, np.shape(fractions)), enough, rho=rho)
        finite = z[np.isfinite(z)]
        found.append((float(z[-1]), float(finite[-1]) if finite.size else fixed))
    (z_log, shown_log), (z_abs, shown_abs) = found
    return z_log, z_abs, shown_log, shown_abs


def pre_rate(arms: Arms, spec: AnalysisSpec) -> np.ndarray:
    """Each key's user's rows per hour on the stable arm before the canary (the overall
    mean of users with history for those without): the covariate of rows per unit."""
    hours = parse_duration(spec.pre_exposure) / 3600
    table = arms.pre.sums.get("dissatisfied_followup_rate", {})
    rows = np.array([table.get(u, (0.0, 0.0, 0.0))[2] for u in arms.keys.covariate_key])
    seen = rows > 0
    overall = rows[seen].mean() if seen.any() else 0.0
    result: np.ndarray = np.where(seen, rows, overall) / hours
    return result


def describe_parts(diff: Difference) -> dict[str, Any]:
    """The variance reduction among new and among returning units."""
    parts = diff.part_reduction
    if len(parts) != 2:
        return {}
    new, old = (float(p) if np.isfinite(p) else None for p in parts)
    return {"variance_reduction_new": new, "variance_reduction_returning": old}
