"""Always-valid confidence intervals for the canary's differences (the decision is :mod:`.rule`).

The operator analyses a canary every few minutes and acts on the first conclusive answer.
A fixed-horizon test looked at that often is wrong far more often than its alpha says
(peeking), so every interval here is a *confidence sequence*: with probability at least
``1 - alpha`` it covers the true difference at every look simultaneously, however many
looks there are and whenever the analysis stops. The one used is the normal-mixture
sequential probability ratio test (mSPRT) of Johari, Pekelis & Walsh, "Always Valid
Inference: Continuous Monitoring of A/B Tests" (Operations Research 70(3), 2022;
arXiv:1512.04922, 2015), whose interval is the normal-mixture boundary of Robbins (1970);
see Howard, Ramdas, McAuliffe & Sekhon, "Time-uniform, nonparametric, nonasymptotic
confidence sequences" (Annals of Statistics 49(2), 2021) for confidence sequences in
general. With ``V`` the variance of the estimated difference and ``tau`` the standard
deviation of the mixing distribution (the effect size the test is tuned to), the interval
is the estimate plus or minus

    sqrt( V (V + tau^2) / tau^2 * (2 log(1/alpha) + log((V + tau^2) / V)) )

which is ``{theta : Lambda(theta) < 1/alpha}`` for the mixture likelihood ratio
``Lambda``; Ville's inequality bounds the chance that it ever excludes the truth by alpha.
The width is near its smallest when ``tau`` is about the effect size that matters, and the
dependence on ``tau`` is only logarithmic.

Per-arm estimates are means or ratios of per-interaction sums (the sufficient statistics
``n, sum x, sum y, sum x^2, sum y^2, sum xy``), their variances by the delta method, so a
ratio metric such as invalid tool calls per tool call is handled with the interaction as
the unit. Relative differences use the delta method once more.

Everything here is pure (numpy only, no I/O, no clock) and works on scalars and on numpy
arrays alike (one element per simulated experiment), so the Job step, the calibration
benchmark and the operator's local demo run the very same decision rule.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from rtrl_trainer.analyze.estimate import Difference, independent, unwrap

# Below this many measured interactions in either arm a metric gets no verdict: the
# normal approximation and the plug-in variance are not to be trusted yet (0 of 20 edits
# persisted has a sample variance of 0).
MIN_SAMPLES = 100
# Below this many events (edits persisted, questions asked, invalid tool calls, ...) in
# either arm a rate gets the verdict ``too-few-events``: the log-scale normal approximation
# needs events, not rows, and a guardrail on a rare event must neither trip nor hold a
# promotion on a handful of them.
MIN_EVENTS = 10


class Estimate(NamedTuple):
    """One arm's estimate of a metric: its value, the variance of that value (not of one
    observation) and the number of interactions it rests on. Floats or arrays."""

    value: Any
    var: Any
    n: Any


@dataclass
class Moments:
    """Sufficient statistics of a ratio metric ``sum x / sum y`` over interactions (a mean
    when every ``y`` is 1). Fields may be floats or arrays of the same shape."""

    n: Any = 0.0
    sx: Any = 0.0
    sy: Any = 0.0
    sxx: Any = 0.0
    syy: Any = 0.0
    sxy: Any = 0.0

    @classmethod
    def of(cls, x: Any, y: Any = None) -> Moments:
        """The statistics of one batch of per-interaction values ``x`` (and ``y``)."""
        xs = np.asarray(x, dtype=np.float64)
        if y is None:
            n = float(xs.size)
            sx = float(xs.sum())
            return cls(n, sx, n, float(np.dot(xs, xs)), n, sx)
        ys = np.asarray(y, dtype=np.float64)
        return cls(
            float(xs.size),
            float(xs.sum()),
            float(ys.sum()),
            float(np.dot(xs, xs)),
            float(np.dot(ys, ys)),
            float(np.dot(xs, ys)),
        )

    def add(self, other: Moments) -> None:
        self.n = self.n + other.n
        self.sx = self.sx + other.sx
        self.sy = self.sy + other.sy
        self.sxx = self.sxx + other.sxx
        self.syy = self.syy + other.syy
        self.sxy = self.sxy + other.sxy

    def estimate(self) -> Estimate:
        """The ratio and its delta-method variance (NaN where undefined: fewer than two
        interactions, or ``sum y`` of 0)."""
        with np.errstate(all="ignore"):
            n = np.asarray(self.n, dtype=np.float64)
            sy = np.asarray(self.sy, dtype=np.float64)
            ratio = self.sx / sy
            x_bar, y_bar = self.sx / n, sy / n
            cxx = self.sxx / n - x_bar * x_bar
            cyy = self.syy / n - y_bar * y_bar
            cxy = self.sxy / n - x_bar * y_bar
            spread = np.maximum(cxx - 2 * ratio * cxy + ratio * ratio * cyy, 0.0)
            var = np.where(n >= 2, spread / (n - 1) / (y_bar * y_bar), np.nan)
        return Estimate(unwrap(ratio), unwrap(var), unwrap(n))


def cs_radius(variance: Any, alpha: float, tau: Any) -> Any:
    """Half-width of the normal-mixture confidence sequence at level ``1 - alpha`` for an
    estimate with variance ``variance``, mixing standard deviation ``tau`` (same units)."""
    with np.errstate(all="ignore"):
        v = np.asarray(variance, dtype=np.float64)
        t2 = np.asarray(tau, dtype=np.float64) ** 2
        radius = np.sqrt(v * (v + t2) / t2 * (2 * math.log(1 / alpha) + np.log((v + t2) / v)))
        radius = np.where(v == 0, 0.0, radius)
    return unwrap(radius)


def always_valid_ci(  # noqa: PLR0917 (the textbook argument list, as in the papers)
    mean_a: Any,
    var_a: Any,
    n_a: Any,
    mean_b: Any,
    var_b: Any,
    n_b: Any,
    alpha: float,
    tau: Any,
) -> tuple[Any, Any, Any]:
    """(difference ``b - a``, low, high): the mSPRT confidence sequence for the difference of
    two means, from each arm's mean, per-observation variance and count; ``tau`` is the
    mixing standard deviation in the metric's units."""
    with np.errstate(all="ignore"):
        v = np.asarray(var_a) / np.asarray(n_a) + np.asarray(var_b) / np.asarray(n_b)
    diff = unwrap(np.asarray(mean_b, dtype=np.float64) - np.asarray(mean_a, dtype=np.float64))
    radius = cs_radius(v, alpha, tau)
    return diff, unwrap(np.asarray(diff) - radius), unwrap(np.asarray(diff) + radius)


class Comparison(NamedTuple):
    """Canary against baseline for one metric (floats or arrays). The relative fields are
    NaN where a level is not positive; ``enough`` says whether verdicts may be drawn and
    ``few_events`` whether it is a rate with too few events in an arm for one."""

    baseline: Any
    canary: Any
    difference: Any
    ci_low: Any
    ci_high: Any
    relative: Any
    rel_low: Any
    rel_high: Any
    enough: Any
    few_events: Any = False
    variance_reduction: Any = 0.0


def judgeable(diff: Difference, *, events: bool = False) -> tuple[Any, Any]:
    """(enough, few_events): whether a verdict may be drawn on this difference (at least
    ``MIN_SAMPLES`` rows per arm, a positive baseline, finite variances, and for a rate
    ``MIN_EVENTS`` events per arm), and whether it is a rate short of events."""
    with np.errstate(all="ignore"):
        b = np.asarray(diff.baseline, np.float64)
        c = np.asarray(diff.canary, np.float64)
        few = np.zeros(np.shape(np.asarray(diff.log_ratio)), dtype=bool)
        if events:
            counts = np.minimum(
                np.asarray(diff.events_baseline, np.float64),
                np.asarray(diff.events_canary, np.float64),
            )
            few = np.where(np.isnan(counts), False, counts < MIN_EVENTS)
        enough = (
            (np.asarray(diff.n_baseline) >= MIN_SAMPLES)
            & (np.asarray(diff.n_canary) >= MIN_SAMPLES)
            & (b > 0)
            & np.isfinite(np.asarray(diff.log_var, np.float64))
            & np.isfinite(c)
            & ~few
        )
    return enough, few


def compare(
    diff: Difference,
    alpha: float,
    tau: float,
    *,
    events: bool = False,
    boundary: Any = None,
    boundary_abs: Any = None,
) -> Comparison:
    """Intervals for the canary's absolute and relative difference.

    With ``boundary`` (the group-sequential boundary of this look, :mod:`.sequential`; on
    the log scale, ``boundary_abs`` on the absolute one, the same when not given) each is
    the estimate plus or minus the boundary times its standard error: a repeated
    confidence interval. Without, the always-valid mixture interval: ``tau`` is the
    relative effect size it is tuned to (the absolute interval mixes over ``tau`` times the
    baseline, the relative one over ``log(1 + tau)`` on the log scale). The relative bounds
    are ``exp(log ratio -+ radius) - 1``, never below -100%. ``events``: the metric is a
    rate, judged only with ``MIN_EVENTS`` events in each arm."""
    with np.errstate(all="ignore"):
        b = np.asarray(diff.baseline, np.float64)
        d = np.asarray(diff.difference, np.float64)
        log_ratio = np.asarray(diff.log_ratio, np.float64)
        if boundary is None:
            abs_radius = np.asarray(cs_radius(diff.var, alpha, tau * np.abs(b)))
            log_radius = np.asarray(cs_radius(diff.log_var, alpha, math.log1p(tau)))
        else:
            z_log = np.asarray(boundary, np.float64)
            z_abs = z_log if boundary_abs is None else np.asarray(boundary_abs, np.float64)
            abs_radius = z_abs * np.sqrt(np.asarray(diff.var, np.float64))
            log_radius = z_log * np.sqrt(np.asarray(diff.log_var, np.float64))
        rel = np.expm1(log_ratio)
        enough, few = judgeable(diff, events=events)
    return Comparison(
        unwrap(b),
        unwrap(diff.canary),
        unwrap(d),
        unwrap(d - abs_radius),
        unwrap(d + abs_radius),
        unwrap(rel),
        unwrap(np.expm1(log_ratio - log_radius)),
        unwrap(np.expm1(log_ratio + log_radius)),
        enough if enough.ndim else bool(enough),
        few if few.ndim else bool(few),
        unwrap(diff.variance_reduction),
    )


def from_estimates(
    base: Mapping[str, Estimate], canary: Mapping[str, Estimate]
) -> dict[str, Difference]:
    """Differences of independent per-arm estimates (rows as the unit, one stratum, no
    covariate): for per-request data summarised per arm, and for quantiles. A rate's
    events are its value times its count."""
    found: dict[str, Difference] = {}
    for name in base.keys() & canary.keys():
        b, c = base[name], canary[name]
        with np.errstate(all="ignore"):
            events = (np.asarray(b.value) * np.asarray(b.n), np.asarray(c.value) * np.asarray(c.n))
        found[name] = independent(b.value, b.var, b.n, c.value, c.var, c.n, *events)
    return found
