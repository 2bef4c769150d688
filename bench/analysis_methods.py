"""The canary analysis, look by look, on simulated canaries: today's (mixture intervals, CUPED
on each user's own history) and the alternatives measured against it, all through the analyze
step's own functions (:mod:`rtrl_trainer.analyze`: ``estimate.difference``, ``sequential``,
``covariates``, ``srm``, ``rule.judge``), vectorised over the canaries of a chunk."""

from __future__ import annotations

from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Any

import numpy as np
from bench.analysis_population import METRICS, Look, Users
from bench.analysis_stats import Sums, own_history, predicted, srm_counts, unit_sums

from rtrl.core.api.rlcycle import AnalysisSpec, Band, GuardrailsSpec
from rtrl_trainer.analyze.confidence import judgeable
from rtrl_trainer.analyze.estimate import Difference, difference
from rtrl_trainer.analyze.reconcile import logged_per_served, rows_per_share
from rtrl_trainer.analyze.rule import CONTINUE, PROMOTE, Metric, judge, plan
from rtrl_trainer.analyze.sequential import DEFAULT_RHO, Boundaries
from rtrl_trainer.analyze.srm import SRM_HOLD_P, srm_steps
from rtrl_trainer.analyze.weights import random_effect, unit_weights

PRIMARY = "edit_persistence"
SETTLED = "edit_persistence (settled)"
ROWS = "rows_per_unit"
LOGGED = "logged_per_served"
SEAL_DELAY_H = 10 / 60  # the seal's --delay


@dataclass(frozen=True)
class Method:
    """One way of analysing: the intervals, the covariate, the novelty and lost-row rules."""

    label: str
    boundary: str = "gst"  # or "mixture"
    rho: float = DEFAULT_RHO  # spending exponent (0: O'Brien-Fleming's shape)
    tau_scale: float = 1.0  # mixture: the mixing sd, times the metric's tau
    covariate: str = "predicted"  # "own": each user's history (today); "none"
    novelty: bool = True  # promotion needs the effect among settled rows too
    weighted: bool = False  # promotion on the precision-weighted primary (user unit)
    settled_alpha: float = 0.05  # the novelty rule's test
    rows_band: float | None = None  # rows-per-unit guardrail: the relative drop or rise
    reconcile: bool = True  # logged rows against the capture proxy's served requests
    srm_hold: bool = True


TODAY = Method("mixture, own history (today)", boundary="mixture", covariate="own",
               novelty=False, rows_band=None, reconcile=False)  # fmt: skip


@dataclass
class Outcome:
    decision: np.ndarray
    cause: np.ndarray
    hours: np.ndarray
    interactions: np.ndarray
    first_better: np.ndarray
    # per decision look: hours, matured interactions, fixed-horizon promote and rollback
    fixed: list[tuple[float, np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=list)
    # per look: variance reduction of the primary, for new and returning users (means)
    reduction: dict[str, list[float]] = field(default_factory=dict)

    @classmethod
    def empty(cls, e: int) -> Outcome:
        return cls(
            np.full(e, CONTINUE), np.zeros(e, dtype=np.int64), np.full(e, np.inf),
            np.zeros(e), np.full(e, np.inf),
        )  # fmt: skip

    def record(self, look: Look, decision: Any, cause: Any, better: Any) -> None:
        decision = np.asarray(decision)
        open_ = self.decision == CONTINUE
        new = open_ & ((decision != CONTINUE) | look.last)
        self.decision[new] = decision[new]
        self.cause[new] = np.asarray(cause)[new]
        self.hours[new] = look.hours
        self.interactions[new] = look.matured[new]
        b = np.asarray(better, dtype=bool) & np.isinf(self.first_better)
        self.first_better[b] = look.hours

    def join(self, other: Outcome) -> Outcome:
        fixed = [
            (h, np.concatenate([r, r2]), np.concatenate([p, p2]), np.concatenate([b, b2]))
            for (h, r, p, b), (_, r2, p2, b2) in zip(self.fixed, other.fixed, strict=True)
        ]
        return Outcome(
            *(np.concatenate([getattr(self, f), getattr(other, f)]) for f in (
                "decision", "cause", "hours", "interactions", "first_better"
            )),
            fixed=fixed,
            reduction={k: v + other.reduction.get(k, []) for k, v in self.reduction.items()},
        )  # fmt: skip


COVARIATES = ("own", "predicted")


class SharedBoundaries:
    """The group-sequential tests of a chunk, shared by the methods that judge the same
    metric with the same covariate, alpha and spending (their boundaries are identical):
    each advances once per look."""

    def __init__(self, e: int) -> None:
        self.e = e
        self.tests: dict[tuple[Any, ...], Boundaries] = {}
        self.last: dict[tuple[Any, ...], tuple[float, np.ndarray]] = {}

    def look(  # noqa: PLR0917 (the test's key and settings, then this look's data)
        self, key: tuple[Any, ...], alpha: float, rho: float, hours: float, t: float,
        diff: Difference, events: bool,
    ) -> np.ndarray:  # fmt: skip
        done = self.last.get(key)
        if done is not None and done[0] == hours:
            return done[1]
        test = self.tests.get(key)
        if test is None:
            test = self.tests[key] = Boundaries(alpha, (self.e,), rho=rho)
        enough, _ = judgeable(diff, events=events)
        with np.errstate(all="ignore"):
            z = test.look(t, 1 / np.asarray(diff.log_var), enough)
        self.last[key] = (hours, z)
        return z


class LookStats:
    """Every metric's sums at one look, shared by the methods (computed on first use)."""

    def __init__(self, look: Look, unit: str, covs: dict[str, dict[str, np.ndarray]],
                 shared: SharedBoundaries | None = None) -> None:  # fmt: skip
        self.look, self.unit, self.covs = look, unit, covs
        self.shared = shared if shared is not None else SharedBoundaries(look.matured.size)
        self._sums: dict[str, Sums] = {}
        self._diffs: dict[tuple[str, str], Difference] = {}

    def _metric_sums(self, name: str) -> Sums:
        if name not in self._sums:
            look = self.look
            zero = np.zeros(look.users.rate.shape)
            columns = [self.covs[c].get(name, zero) for c in COVARIATES]
            if name == SETTLED:
                x, n, xx = look.settled_x, look.settled_n, look.settled_x
                columns = [self.covs[c][PRIMARY] for c in COVARIATES]
            elif name == ROWS:
                x, n = look.rows, (look.rows > 0).astype(np.float64)
                xx = x * x
                columns = [self.covs[c][ROWS] for c in COVARIATES]
            else:
                x, n, xx = look.x[name], look.n[name], look.xx[name]
            self._sums[name] = unit_sums(x, n, xx, columns, unit=self.unit,
                                         bucket=look.users.bucket)  # fmt: skip
        return self._sums[name]

    def weighted(self, name: str, covariate: str) -> Difference:
        """The precision-weighted difference (:mod:`rtrl_trainer.analyze.weights`): each
        user's rows scaled by ``1 / (1 + rho n)``, ``rho`` per group (with and without
        history) from the look's own units, arms pooled."""
        key = (name, covariate, "weighted")
        if key not in self._diffs:
            look = self.look
            base = PRIMARY if name == SETTLED else name
            if name == SETTLED:
                x, n = look.settled_x, look.settled_n
            else:
                x, n = look.x[name], look.n[name]
            c = self.covs[covariate][base]
            groups = (look.users.pre_rows > 0).astype(np.int64)
            xu, nu = x.sum(axis=(0, 1)), n.sum(axis=(0, 1))
            _, rho = random_effect(xu, nu, c, groups, self.covs["within"][base])
            w = unit_weights(nu, groups, rho)[None, None]
            zero = np.zeros(look.users.rate.shape)
            columns = [self.covs[v].get(base, zero) for v in COVARIATES]
            sums = unit_sums(x * w, n * w, x * w, columns, unit=self.unit,
                             bucket=look.users.bucket)  # fmt: skip
            index = COVARIATES.index(covariate)
            self._diffs[key] = difference(*sums.pick(index), adjust=True)
        return self._diffs[key]

    def diff(self, name: str, covariate: str) -> Difference:
        key = (name, covariate)
        if key not in self._diffs:
            if name == ROWS and self.unit == "request":
                counts = np.moveaxis(self.look.rows.sum(-1), -1, 0)  # [e, 2, S]
                self._diffs[key] = rows_per_share(counts, self.look.shares)
                return self._diffs[key]
            sums = self._metric_sums(name)
            has = name in (SETTLED, ROWS) or name in self.covs.get(covariate, {})
            index = COVARIATES.index(covariate) if covariate in COVARIATES and has else None
            self._diffs[key] = difference(*sums.pick(index), adjust=index is not None)
        return self._diffs[key]

    def split(self, name: str, covariate: str) -> tuple[float, float]:
        """The metric's variance reduction among new and among returning users (their
        contributions to the variance of the difference, adjusted against unadjusted),
        means over the chunk."""
        look = self.look
        columns = [self.covs[c][name] for c in COVARIATES]
        parts = []
        for group in (look.users.new, ~look.users.new):
            mask = group[None, None].astype(np.float64)
            sums = unit_sums(
                look.x[name] * mask, look.n[name] * mask, look.xx[name] * mask, columns,
                unit=self.unit, bucket=look.users.bucket,
            )  # fmt: skip
            parts.append(sums.pick(COVARIATES.index(covariate))[1])
        d = difference(*self._metric_sums(name).pick(COVARIATES.index(covariate)),
                       parts=tuple(parts))  # fmt: skip
        with np.errstate(all="ignore"):
            return (float(np.nanmean(d.part_reduction[0])), float(np.nanmean(d.part_reduction[1])))


def reconciled(look: Look, maturity: float) -> Difference:
    """Each arm's logged rows per served request over the hours sealed by this look (an
    hour is sealed once its last row matured and the seal's delay passed)."""
    sealed = int(np.floor(look.hours - 1 - maturity - SEAL_DELAY_H + 1e-9)) + 1
    sealed = max(0, min(sealed, look.served.shape[1]))
    served = look.served[:, :sealed].sum(axis=1)
    logged = look.logged[:, :sealed].sum(axis=1)
    return logged_per_served(served[0], logged[0], served[1], logged[1])


class Analysis:
    """One method, advancing over a chunk of canaries look by look."""

    def __init__(self, method: Method, unit: str, e: int, max_hours: float = 24.0) -> None:
        self.method, self.unit = method, unit
        self.max_hours = max_hours
        guards = GuardrailsSpec(
            rows_per_unit=None if method.rows_band is None
            else Band(max_relative_drop=method.rows_band, max_relative_rise=method.rows_band)
        )  # fmt: skip
        self.spec = AnalysisSpec()
        self.maturity = 1.0
        self.metrics: list[Metric] = plan(
            self.spec, guards, unmeasured=() if method.reconcile else (LOGGED,)
        )
        self.primary = next(m for m in self.metrics if m.name == PRIMARY)
        self.tests = {m.name: Boundaries(m.alpha, (e,), rho=method.rho) for m in self.metrics} | {
            SETTLED: Boundaries(self.primary.alpha, (e,), rho=method.rho)
        }
        self.out = Outcome.empty(e)
        self.last: Any = None  # the last decision look's differences, boundaries, judgement

    def look(self, stats: LookStats) -> None:
        look, m = stats.look, self.method
        cov = m.covariate
        diffs = {
            name: stats.diff(name, cov)
            for name in (*METRICS, *((ROWS,) if m.rows_band is not None else ()))
        }
        if m.reconcile:
            diffs[LOGGED] = reconciled(look, self.maturity)
        weighted = m.weighted and self.unit == "user"
        settled = None
        if m.novelty:
            settled = stats.weighted(SETTLED, cov) if weighted else stats.diff(SETTLED, cov)
        promote = stats.weighted(PRIMARY, cov) if weighted else None
        promote_z = None
        boundaries = None
        settled_z = None
        if m.boundary == "gst":
            t = look.hours / self.max_hours
            boundaries = {}
            for metric in self.metrics:
                d = diffs.get(metric.name)
                if d is None:
                    continue
                key = (metric.name, cov, metric.alpha, m.rho)
                z = stats.shared.look(key, metric.alpha, m.rho, look.hours, t, d, metric.events)
                boundaries[metric.name] = (z, z)
            if promote is not None:
                key = ("weighted", cov, self.primary.alpha, m.rho)
                promote_z = stats.shared.look(key, self.primary.alpha, m.rho, look.hours, t,
                                              promote, True)  # fmt: skip
            if settled is not None:
                key = (SETTLED, cov, m.settled_alpha, m.rho, weighted)
                settled_z = stats.shared.look(key, m.settled_alpha, m.rho, look.hours, t,
                                              settled, True)  # fmt: skip
        if not look.decides:
            return
        metrics = self.metrics
        if m.boundary == "mixture" and m.tau_scale != 1.0:
            metrics = [_scaled(x, m.tau_scale) for x in metrics]
        base, cand = srm_counts(look, self.unit)
        srm = srm_steps(base, cand, look.shares, self.spec.srm_alpha)
        j = judge(
            metrics, diffs, boundaries=boundaries, settled=settled, settled_boundary=settled_z,
            settled_alpha=m.settled_alpha, promote=promote, promote_boundary=promote_z,
            srm_mismatch=srm.mismatch,
            srm_suspect=(np.asarray(srm.p_value) <= SRM_HOLD_P) if m.srm_hold else False,
            max_duration_reached=look.last,
        )  # fmt: skip
        self.last = (diffs, boundaries, settled, settled_z, j, promote, promote_z)
        self.out.record(look, j.decision, j.cause, np.asarray(j.verdicts[PRIMARY]) == 1)
        self.out.fixed.append(
            (look.hours, look.matured.copy(), *fixed_test(diffs, self.primary.alpha, promote))
        )


def _scaled(metric: Metric, scale: float) -> Metric:
    from dataclasses import replace

    return replace(metric, tau=metric.tau * scale)


def fixed_test(
    diffs: dict[str, Difference], alpha: float, promote: Difference | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(promote, rollback) of a fixed-horizon z-test on the goals at this look with the same
    estimators and the sequential rule's logic (promote: edit persistence better, by the
    precision-weighted estimate where the method promotes on it, and no goal worse): what a
    team would run once at a horizon chosen in advance."""
    z = NormalDist().inv_cdf(1 - alpha / 2)
    worse: Any = False
    better: Any = False

    def bounds(d: Difference) -> tuple[np.ndarray, np.ndarray]:
        radius = z * np.sqrt(np.asarray(d.log_var))
        return np.asarray(d.log_ratio) - radius > 0, np.asarray(d.log_ratio) + radius < 0

    for name in ("edit_persistence", "dissatisfied_followup_rate", "latency_ms"):
        up, down = bounds(diffs[name])
        worse = worse | (down if name == "edit_persistence" else up)
        if name == "edit_persistence":
            better = up if promote is None else bounds(promote)[0]
    return np.asarray(better & ~worse), np.asarray(worse)


def covariates_of(users: Users) -> dict[str, dict[str, np.ndarray]]:
    """Per covariate variant, per metric: each user's covariate (a chunk's, once)."""
    own: dict[str, np.ndarray] = {}
    pred: dict[str, np.ndarray] = {}
    within: dict[str, np.ndarray] = {}
    for name in METRICS:
        o = own_history(users, name)
        if o is not None:
            own[name] = o
            p = predicted(users, name)
            assert p is not None
            pred[name], within[name] = p
    # rows per unit: the user's usual rate (rows an hour before the canary); the overall
    # mean for users without history (activity is not predicted from org or prompts)
    rate = users.pre_rate
    overall = rate.sum(-1, keepdims=True) / np.maximum(
        (users.pre_rows > 0).sum(-1, keepdims=True), 1
    )
    own[ROWS] = pred[ROWS] = np.where(users.pre_rows > 0, rate, overall)
    return {"own": own, "predicted": pred, "within": within}


PROMOTED = PROMOTE
