"""The canary's statistics: always-valid confidence intervals and the decision they support.

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

The sample-ratio-mismatch check is sequential too: a beta-binomial mixture likelihood
ratio for the canary's share (the two-arm case of Lindon & Malek, "Anytime-Valid Inference
for Multinomial Count Data", NeurIPS 2022), exact for any number of interactions.

Everything here is pure (numpy only, no I/O, no clock) and works on scalars and on numpy
arrays alike (one element per simulated experiment), so the Job step, the calibration
benchmark and the operator's local demo run the very same decision rule.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from rtrl.core.api.rlcycle import AnalysisSpec, Band, GuardrailsSpec, InconclusivePolicy
from rtrl_trainer.ab_estimate import Difference, independent

METHOD = {
    "name": "mSPRT normal-mixture confidence sequences (always valid), Bonferroni across metrics",
    "citation": (
        "Johari, Pekelis & Walsh, Always Valid Inference: Continuous Monitoring of A/B Tests, "
        "Operations Research 70(3), 2022 (arXiv:1512.04922); Howard, Ramdas, McAuliffe & "
        "Sekhon, Time-uniform, nonparametric, nonasymptotic confidence sequences, Annals of "
        "Statistics 49(2), 2021; sample ratio: Lindon & Malek, Anytime-Valid Inference for "
        "Multinomial Count Data, NeurIPS 2022"
    ),
}

# Below this many measured interactions in either arm a metric gets no verdict: the
# normal approximation and the plug-in variance are not to be trusted yet (0 of 20 edits
# persisted has a sample variance of 0).
MIN_SAMPLES = 100
# Below this many events (edits persisted, questions asked, invalid tool calls, ...) in
# either arm a rate gets the verdict ``too-few-events``: the log-scale normal approximation
# needs events, not rows, and a guardrail on a rare event must neither trip nor hold a
# promotion on a handful of them.
MIN_EVENTS = 10
# Share of alpha spent on the goal metrics (split equally between them); the guardrails
# share the rest equally. Weighted Bonferroni: the family-wise error of all verdicts,
# over all looks, stays <= alpha. A guardrail only trips when its interval lies beyond
# its band, so its real error under "no change" is far below its share.
GOAL_ALPHA_SHARE = 0.8
GUARDRAIL_TAU_FLOOR = 0.5

# Verdict codes (arrays of these in vectorised use). A guardrail is ``tripped`` when its
# interval lies wholly beyond its band, and ``beyond`` when only its estimate does: the
# evidence is not conclusive yet, but promoting on it would ship a behaviour change the band
# says is not tolerated, so it holds promotion (as a threshold on the measured value does in
# Argo Rollouts or Flagger) while the test goes on.
INCONCLUSIVE, BETTER, WORSE, OK, TRIPPED, BEYOND, FEW_EVENTS = 0, 1, 2, 3, 4, 5, 6
VERDICTS = ("inconclusive", "better", "worse", "ok", "tripped", "beyond", "too-few-events")

# Decision codes.
CONTINUE, PROMOTE, ROLLBACK = 0, 1, 2
DECISIONS = ("continue", "promote", "rollback")

# Why the decision was taken.
NO_CAUSE, SRM, GUARDRAIL, GOAL_WORSE, PRIMARY_BETTER = 0, 1, 2, 3, 4
POLICY_ROLLBACK, NON_INFERIOR, NOT_NON_INFERIOR, HOLD, HELD, HELD_SRM = 5, 6, 7, 8, 9, 10

# A promotion waits while the sample-ratio test's evidence against the configured split is
# strong (Bayes factor >= 10, p <= 0.1) though not yet conclusive (srmAlpha): the arms may
# not be comparable, and the test needs more assignments to tell. Under a correct split the
# Bayes factor is a martingale that drifts to 0, so this rarely waits long; when rows are
# being lost it keeps a fast-improving canary from being promoted before the loss is seen.
SRM_HOLD_P = 0.1


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
        return Estimate(_out(ratio), _out(var), _out(n))


def _out(value: Any) -> Any:
    """A 0-d array as a float; arrays as they are."""
    array = np.asarray(value, dtype=np.float64)
    return float(array) if array.ndim == 0 else array


def cs_radius(variance: Any, alpha: float, tau: Any) -> Any:
    """Half-width of the normal-mixture confidence sequence at level ``1 - alpha`` for an
    estimate with variance ``variance``, mixing standard deviation ``tau`` (same units)."""
    with np.errstate(all="ignore"):
        v = np.asarray(variance, dtype=np.float64)
        t2 = np.asarray(tau, dtype=np.float64) ** 2
        radius = np.sqrt(v * (v + t2) / t2 * (2 * math.log(1 / alpha) + np.log((v + t2) / v)))
        radius = np.where(v == 0, 0.0, radius)
    return _out(radius)


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
    diff = _out(np.asarray(mean_b, dtype=np.float64) - np.asarray(mean_a, dtype=np.float64))
    radius = cs_radius(v, alpha, tau)
    return diff, _out(np.asarray(diff) - radius), _out(np.asarray(diff) + radius)


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


def compare(diff: Difference, alpha: float, tau: float, *, events: bool = False) -> Comparison:
    """Always-valid intervals for the canary's absolute and relative difference; ``tau`` is
    the relative effect size the test is tuned to (the absolute interval mixes over
    ``tau`` times the baseline, the relative one over ``log(1 + tau)`` on the log scale,
    so its bounds ``exp(log ratio -+ radius) - 1`` never fall below -100%). ``events``:
    the metric is a rate, judged only with ``MIN_EVENTS`` events in each arm."""
    with np.errstate(all="ignore"):
        b, c = np.asarray(diff.baseline, np.float64), np.asarray(diff.canary, np.float64)
        d = np.asarray(diff.difference, np.float64)
        abs_radius = np.asarray(cs_radius(diff.var, alpha, tau * np.abs(b)))
        log_ratio = np.asarray(diff.log_ratio, np.float64)
        log_radius = np.asarray(cs_radius(diff.log_var, alpha, math.log1p(tau)))
        rel = np.expm1(log_ratio)
        few = np.zeros(np.shape(rel), dtype=bool)
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
    return Comparison(
        _out(b),
        _out(c),
        _out(d),
        _out(d - abs_radius),
        _out(d + abs_radius),
        _out(rel),
        _out(np.expm1(log_ratio - log_radius)),
        _out(np.expm1(log_ratio + log_radius)),
        enough if enough.ndim else bool(enough),
        few if few.ndim else bool(few),
        _out(diff.variance_reduction),
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


# --- the metrics and their roles -----------------------------------------------------------


@dataclass(frozen=True)
class Metric:
    """One metric the canary is judged on. ``tau`` (relative) is the effect size its test
    is tuned to: the smallest change worth detecting."""

    name: str
    kind: str  # "goal" or "guardrail"
    higher_is_better: bool
    tau: float
    unit: str = ""
    band: Band | None = None
    alpha: float = 0.0
    events: bool = False  # a rate of events: judged only with MIN_EVENTS in each arm


# The goals, primary first: promotion needs evidence that edit persistence improved.
GOALS: tuple[Metric, ...] = (
    Metric("edit_persistence", "goal", True, 0.02, events=True),
    Metric("dissatisfied_followup_rate", "goal", False, 0.03, events=True),
    Metric("latency_ms", "goal", False, 0.05, unit=" ms"),
)
PRIMARY = GOALS[0].name

# GuardrailsSpec field -> (metric name, higher is better).
GUARDRAILS: dict[str, tuple[str, bool]] = {
    "edit_rate": ("edit_rate", True),
    "clarification_rate": ("clarification_rate", False),
    "invalid_tool_call_rate": ("invalid_tool_call_rate", False),
    "mean_completion_tokens": ("mean_completion_tokens", True),
    "latency_p95": ("latency_p95_ms", False),
    "feedback_missing_rate": ("feedback_missing_rate", False),
}
# Guardrails that are rates of events.
EVENT_RATES = frozenset(
    {"edit_rate", "clarification_rate", "invalid_tool_call_rate", "feedback_missing_rate"}
)


def plan(analysis: AnalysisSpec, guardrails: GuardrailsSpec) -> list[Metric]:
    """The metrics judged under this spec, each with its share of ``analysis.alpha``."""
    bands = [
        (name, higher, band)
        for field_name, (name, higher) in GUARDRAILS.items()
        if (band := getattr(guardrails, field_name)) is not None
    ]
    goal_share = GOAL_ALPHA_SHARE if bands else 1.0
    goal_alpha = analysis.alpha * goal_share / len(GOALS)
    metrics = [
        Metric(m.name, m.kind, m.higher_is_better, m.tau, m.unit, alpha=goal_alpha, events=m.events)
        for m in GOALS
    ]
    for name, higher, band in bands:
        # Tuned to the band, or to GUARDRAIL_TAU_FLOOR if that is wider: a guardrail watches
        # for behaviour changes that may be large (a hack), on events that may be rare. With
        # few events (variance V far above tau^2) the interval's width grows like V / tau,
        # so a 10% mixing spread gives intervals like [-99%, +7590%] at 20 events; 0.5 gives
        # [-75%, +300%] there, and at thousands of events the width is within 3% of the
        # band-tuned one (tau enters it logarithmically).
        band_width = max(band.max_relative_drop or 0.0, band.max_relative_rise or 0.0) or 0.05
        width = max(band_width, GUARDRAIL_TAU_FLOOR)
        metrics.append(
            Metric(
                name,
                "guardrail",
                higher,
                width,
                " ms" if name.endswith("_ms") else "",
                band=band,
                alpha=analysis.alpha * (1 - goal_share) / len(bands),
                events=name in EVENT_RATES,
            )
        )
    return metrics


def verdict(metric: Metric, cmp: Comparison) -> Any:
    """Verdict code(s) of one metric from its relative always-valid interval."""
    enough = np.asarray(cmp.enough)
    low, high = np.asarray(cmp.rel_low), np.asarray(cmp.rel_high)
    if metric.kind == "goal":
        up, down = low > 0, high < 0
        better, worse = (up, down) if metric.higher_is_better else (down, up)
        code = np.where(better, BETTER, np.where(worse, WORSE, INCONCLUSIVE))
        few = np.where(np.asarray(cmp.few_events), FEW_EVENTS, INCONCLUSIVE)
        return _code(np.where(enough, code, few))
    band = metric.band
    rel = np.asarray(cmp.relative)
    tripped = np.zeros(enough.shape, dtype=bool)
    beyond = np.zeros(enough.shape, dtype=bool)
    if band is not None and band.max_relative_drop is not None:
        tripped |= high < -band.max_relative_drop
        beyond |= rel < -band.max_relative_drop
    if band is not None and band.max_relative_rise is not None:
        tripped |= low > band.max_relative_rise
        beyond |= rel > band.max_relative_rise
    code = np.where(tripped, TRIPPED, np.where(beyond, BEYOND, OK))
    return _code(np.where(enough, code, np.where(np.asarray(cmp.few_events), FEW_EVENTS, OK)))


def non_inferior(metric: Metric, cmp: Comparison, margin: float) -> Any:
    """Whether the interval excludes a relative harm bigger than ``margin``."""
    low, high = np.asarray(cmp.rel_low), np.asarray(cmp.rel_high)
    ok = low > -margin if metric.higher_is_better else high < margin
    result = np.asarray(cmp.enough) & ok
    return result if result.ndim else bool(result)


def _code(value: Any) -> Any:
    array = np.asarray(value, dtype=np.int64)
    return int(array) if array.ndim == 0 else array


# --- sample ratio mismatch -----------------------------------------------------------------


class SrmResult(NamedTuple):
    expected_canary_share: Any
    observed_canary_share: Any
    p_value: Any
    mismatch: Any


# The mixture's spread around the expected share, relative to the smaller arm's share: tuned
# to the shifts that matter, a few percent of the arm's units lost (3% of canary rows lost
# moves a 50% share by 1.5% of it, a 5% share by 2.9%); larger mismatches are caught anyway,
# the sensitivity falls off only logarithmically.
SRM_RELATIVE_SPREAD = 0.03

_lgamma = np.vectorize(math.lgamma, otypes=[np.float64])


def srm_log_bf(n_baseline: Any, n_canary: Any, expected_share: float) -> Any:
    """Log Bayes factor of the beta-binomial mixture against the binomial at
    ``expected_share``: a nonnegative martingale (in exp) under the null."""
    p0 = float(expected_share)
    nb = np.asarray(n_baseline, dtype=np.float64)
    nc = np.asarray(n_canary, dtype=np.float64)
    spread = SRM_RELATIVE_SPREAD * min(p0, 1 - p0)
    kappa = max(p0 * (1 - p0) / spread**2 - 1, 1.0)
    a, b = kappa * p0, kappa * (1 - p0)
    log_beta_prior = math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b)
    log_beta_post = _lgamma(a + nc) + _lgamma(b + nb) - _lgamma(a + b + nb + nc)
    return log_beta_post - log_beta_prior - nc * math.log(p0) - nb * math.log(1 - p0)


def srm_test(n_baseline: Any, n_canary: Any, expected_share: float, alpha: float) -> SrmResult:
    """Anytime-valid test that the canary's share of units is ``expected_share``.

    The p-value is ``1 / BF`` (capped at 1), BF the beta-binomial mixture against the
    binomial at ``expected_share``: a nonnegative martingale under the null, so the chance
    that it ever reaches ``1 / alpha`` is at most alpha (Ville), at any number of looks.
    """
    return srm_steps([n_baseline], [n_canary], [expected_share], alpha)


def srm_steps(
    n_baseline: Sequence[Any], n_canary: Sequence[Any], shares: Sequence[float], alpha: float
) -> SrmResult:
    """The sample-ratio test over every canary step so far: per step, the units assigned
    to each arm (counted at assignment, without waiting for feedback) against that step's
    share. Each step's Bayes factor is a test martingale that starts at 1 when the step
    starts; chained, their product is one over the whole canary (Ville's inequality
    applies to it), so evidence from earlier steps is kept. The observed share is the
    current (last) step's."""
    log_bf: Any = 0.0
    for nb, nc, share in zip(n_baseline, n_canary, shares, strict=True):
        log_bf = log_bf + srm_log_bf(nb, nc, share)
    nb_last = np.asarray(n_baseline[-1], dtype=np.float64)
    nc_last = np.asarray(n_canary[-1], dtype=np.float64)
    total = nb_last + nc_last
    with np.errstate(all="ignore"):
        p_value = np.minimum(1.0, np.exp(-np.asarray(log_bf)))
        observed = np.where(total > 0, nc_last / total, np.nan)
    mismatch = p_value <= alpha
    return SrmResult(
        float(shares[-1]),
        _out(observed),
        _out(p_value),
        mismatch if mismatch.ndim else bool(mismatch),
    )


# --- the decision --------------------------------------------------------------------------


@dataclass
class Judgement:
    """The decision code(s), why, and every metric's comparison and verdict."""

    decision: Any
    cause: Any
    comparisons: dict[str, Comparison] = field(default_factory=dict)
    verdicts: dict[str, Any] = field(default_factory=dict)
    non_inferior: Any = False


def judge(
    metrics: Sequence[Metric],
    diffs: Mapping[str, Difference],
    *,
    srm_mismatch: Any = False,
    srm_suspect: Any = False,
    max_duration_reached: bool = False,
    policy: InconclusivePolicy = InconclusivePolicy.ROLLBACK,
    margin: float = 0.0,
) -> Judgement:
    """The decision rule, vectorised over experiments (every input may be an array).

    1. a sample ratio mismatch: rollback;
    2. a guardrail tripped (its interval for the relative change lies beyond its band):
       rollback;
    3. a goal significantly worse: rollback;
    4. the primary goal (edit persistence) significantly better: promote, unless a
       guardrail's estimate is beyond its band (verdict ``beyond``), or the sample-ratio
       evidence is suspect (``srm_suspect``: p <= SRM_HOLD_P): then continue, the promotion
       held until the guardrail trips or its estimate comes back (the test trips or clears);
    5. otherwise continue, or at the maximum duration the inconclusive policy: rollback;
       promote-if-non-inferior (promote when every goal's interval excludes a relative harm
       bigger than ``margin`` and no guardrail is ``beyond``, else rollback); hold
       (continue).
    Holding only ever turns a promotion into a continuation, so the chance of a false
    promotion stays within alpha.
    A metric missing from ``diffs`` gets no verdict (inconclusive / ok).
    """
    srm = np.asarray(srm_mismatch, dtype=bool)
    shape = srm.shape
    tripped = np.zeros(shape, dtype=bool)
    beyond = np.zeros(shape, dtype=bool)
    worse = np.zeros(shape, dtype=bool)
    better = np.zeros(shape, dtype=bool)
    noninf = np.ones(shape, dtype=bool)
    judgement = Judgement(decision=CONTINUE, cause=NO_CAUSE)
    nan = independent(np.nan, np.nan, 0.0, np.nan, np.nan, 0.0)
    for metric in metrics:
        cmp = compare(diffs.get(metric.name, nan), metric.alpha, metric.tau, events=metric.events)
        code = verdict(metric, cmp)
        judgement.comparisons[metric.name] = cmp
        judgement.verdicts[metric.name] = code
        codes = np.asarray(code)
        if metric.kind == "guardrail":
            tripped = tripped | (codes == TRIPPED)
            beyond = beyond | (codes == BEYOND)
            continue
        worse = worse | (codes == WORSE)
        if metric.name == PRIMARY:
            better = better | (codes == BETTER)
        noninf = noninf & np.asarray(non_inferior(metric, cmp, margin))
    decision = np.full(
        np.broadcast_shapes(shape, tripped.shape, beyond.shape, better.shape), CONTINUE
    )
    cause = np.full(decision.shape, NO_CAUSE)
    suspect = np.asarray(srm_suspect, dtype=bool)
    noninf = noninf & ~beyond & ~suspect
    for mask, code, why in (
        (better, PROMOTE, PRIMARY_BETTER),
        (better & suspect, CONTINUE, HELD_SRM),
        (better & beyond, CONTINUE, HELD),
        (worse, ROLLBACK, GOAL_WORSE),
        (tripped, ROLLBACK, GUARDRAIL),
        (srm, ROLLBACK, SRM),
    ):
        # Later rules override earlier ones: SRM outranks everything.
        decision = np.where(mask, code, decision)
        cause = np.where(mask, why, cause)
    if max_duration_reached:
        open_ = decision == CONTINUE
        if policy == InconclusivePolicy.ROLLBACK:
            decision = np.where(open_, ROLLBACK, decision)
            cause = np.where(open_, POLICY_ROLLBACK, cause)
        elif policy == InconclusivePolicy.PROMOTE_IF_NON_INFERIOR:
            decision = np.where(open_, np.where(noninf, PROMOTE, ROLLBACK), decision)
            cause = np.where(open_, np.where(noninf, NON_INFERIOR, NOT_NON_INFERIOR), cause)
        else:
            cause = np.where(open_, HOLD, cause)
    judgement.decision = _code(decision)
    judgement.cause = _code(cause)
    judgement.non_inferior = noninf if noninf.ndim else bool(noninf)
    return judgement


# --- the scalar front end: rows and reasons ------------------------------------------------


@dataclass
class Analysis:
    """One analysis, as ``analysis.json`` reports it."""

    decision: str
    reasons: list[str]
    metrics: list[dict[str, Any]]
    srm: dict[str, Any]
    missing: list[str]


def _num(value: float, unit: str) -> str:
    if unit or abs(value) >= 100:
        return f"{value:.1f}{unit}"
    return f"{value:.3f}"


def _pct(value: float) -> str:
    return f"{100 * value:+.1f}%"


def _finite(value: Any) -> float | None:
    number = float(value)
    return number if math.isfinite(number) else None


def _band_text(band: Band) -> str:
    parts = []
    if band.max_relative_drop is not None:
        parts.append(f"drop <= {100 * band.max_relative_drop:g}%")
    if band.max_relative_rise is not None:
        parts.append(f"rise <= {100 * band.max_relative_rise:g}%")
    return ", ".join(parts)


def describe(metric: Metric, cmp: Comparison, code: int) -> str:
    """``edit_persistence: canary 0.614 vs 0.600 (+2.3%), always-valid 98.7% CI [+0.4%,
    +4.2%]: better``"""
    text = f"{metric.name}: canary {_num(cmp.canary, metric.unit)} vs " + _num(
        cmp.baseline, metric.unit
    )
    if math.isfinite(cmp.relative) and cmp.few_events:
        text += f" ({_pct(cmp.relative)})"  # a handful of events: no interval worth printing
    elif math.isfinite(cmp.relative):
        level = f"{100 * (1 - metric.alpha):.3g}%"
        text += (
            f" ({_pct(cmp.relative)}), always-valid {level} CI "
            f"[{_pct(cmp.rel_low)}, {_pct(cmp.rel_high)}]"
        )
    if metric.band is not None:
        text += f", band {_band_text(metric.band)}"
    if cmp.few_events:
        text += f" (fewer than {MIN_EVENTS} events in an arm: no verdict yet)"
    elif not cmp.enough:
        text += f" (fewer than {MIN_SAMPLES} samples in an arm: no verdict yet)"
    return f"{text}: {VERDICTS[code]}"


def decide(
    diffs: Mapping[str, Difference],
    analysis: AnalysisSpec,
    guardrails: GuardrailsSpec,
    *,
    srm: SrmResult | None = None,
    max_duration_reached: bool = False,
) -> Analysis:
    """The decision for one canary from each arm's estimates, with reasons and metric rows
    (see :func:`judge` for the rule)."""
    metrics = plan(analysis, guardrails)
    mismatch = bool(srm.mismatch) if srm is not None else False
    suspect = bool(srm.p_value <= SRM_HOLD_P) if srm is not None else False
    j = judge(
        metrics,
        diffs,
        srm_mismatch=mismatch,
        srm_suspect=suspect,
        max_duration_reached=max_duration_reached,
        policy=analysis.inconclusive,
        margin=analysis.non_inferiority_margin,
    )
    rows: list[dict[str, Any]] = []
    lines: list[str] = []
    missing: list[str] = []
    for metric in metrics:
        cmp = j.comparisons[metric.name]
        code = int(j.verdicts[metric.name])
        found = diffs.get(metric.name)
        if found is None or not all(
            math.isfinite(float(v)) for v in (cmp.baseline, cmp.canary, cmp.ci_low, cmp.ci_high)
        ):
            missing.append(metric.name)
            lines.append(f"{metric.name}: not measured in both arms: {VERDICTS[code]}")
            continue
        lines.append(describe(metric, cmp, code))
        row: dict[str, Any] = {
            "name": metric.name,
            "kind": metric.kind,
            "baseline": float(cmp.baseline),
            "canary": float(cmp.canary),
            "difference": float(cmp.difference),
            "ci_low": float(cmp.ci_low),
            "ci_high": float(cmp.ci_high),
            "relative_difference": _finite(cmp.relative),
            # too few events: the log-scale interval spans orders of magnitude and says
            # nothing; the verdict says why there is none
            "relative_ci_low": None if cmp.few_events else _finite(cmp.rel_low),
            "relative_ci_high": None if cmp.few_events else _finite(cmp.rel_high),
            "verdict": VERDICTS[code],
            "higher_is_better": metric.higher_is_better,
            "alpha": metric.alpha,
            "tau": metric.tau,
            "baseline_samples": int(found.n_baseline),
            "canary_samples": int(found.n_canary),
            "variance_reduction": _finite(cmp.variance_reduction),
        }
        if metric.band is not None:
            row["band"] = metric.band.to_k8s()
        rows.append(row)
    cause = int(j.cause)
    beyond = [m.name for m in metrics if j.verdicts[m.name] == BEYOND]
    held = f" ({', '.join(beyond)} beyond its band)" if beyond else ""
    lead: list[str] = []
    if cause == SRM and srm is not None:
        lead.append(
            f"sample ratio mismatch: canary share {100 * srm.observed_canary_share:.2f}% vs "
            f"configured {100 * srm.expected_canary_share:g}% (anytime-valid p = "
            f"{srm.p_value:.2g} <= srmAlpha {analysis.srm_alpha:g}): the arms are not "
            "comparable"
        )
    elif cause == GUARDRAIL:
        tripped = [m.name for m in metrics if j.verdicts[m.name] == TRIPPED]
        lead.append(f"guardrail tripped: {', '.join(tripped)} moved beyond its band")
    elif cause == GOAL_WORSE:
        worse = [m.name for m in metrics if m.kind == "goal" and j.verdicts[m.name] == WORSE]
        lead.append(f"goal significantly worse: {', '.join(worse)}")
    elif cause == PRIMARY_BETTER:
        lead.append(f"{PRIMARY} significantly better and no goal worse, no guardrail tripped")
    elif cause == HELD:
        lead.append(
            f"promotion held: {PRIMARY} significantly better, but the estimate of "
            f"{', '.join(beyond)} is beyond its band; the analysis goes on until the guardrail "
            "trips, its estimate comes back within the band, or maxDuration"
        )
    elif cause == HELD_SRM and srm is not None:
        lead.append(
            f"promotion held: {PRIMARY} significantly better, but the sample ratio is suspect: "
            f"canary share {100 * srm.observed_canary_share:.2f}% vs configured "
            f"{100 * srm.expected_canary_share:g}% (anytime-valid p = {srm.p_value:.2g}, "
            f"mismatch at srmAlpha {analysis.srm_alpha:g}); the analysis goes on until the "
            "sample-ratio test trips or clears, or maxDuration"
        )
    elif cause == POLICY_ROLLBACK:
        lead.append(f"inconclusive at maxDuration{held}: policy rollback")
    elif cause == NON_INFERIOR:
        lead.append(
            "inconclusive at maxDuration: policy promote-if-non-inferior: every goal's interval "
            f"excludes a relative harm above {100 * analysis.non_inferiority_margin:g}%"
        )
    elif cause == NOT_NON_INFERIOR:
        lead.append(
            f"inconclusive at maxDuration{held}: policy promote-if-non-inferior: "
            f"non-inferiority (margin {100 * analysis.non_inferiority_margin:g}%) not shown for "
            "every goal, or a guardrail beyond its band"
        )
    elif cause == HOLD:
        lead.append(f"inconclusive at maxDuration{held}: policy hold")
    else:
        lead.append("inconclusive: no goal significantly better or worse yet")
    srm_doc: dict[str, Any] = {
        "expected_canary_share": None,
        "observed_canary_share": None,
        "p_value": None,
        "mismatch": False,
        "alpha": analysis.srm_alpha,
    }
    if srm is not None:
        srm_doc.update(
            expected_canary_share=float(srm.expected_canary_share),
            observed_canary_share=_finite(srm.observed_canary_share),
            p_value=float(srm.p_value),
            mismatch=bool(srm.mismatch),
        )
    return Analysis(DECISIONS[int(j.decision)], lead + lines, rows, srm_doc, missing)
