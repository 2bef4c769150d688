"""The canary's decision rule: which metrics are judged, each one's verdict, and the
decision they support (promote, rollback or continue).

Every verdict rests on an always-valid interval (:mod:`.confidence`), alpha split across
the metrics by weighted Bonferroni, so the family-wise error over all looks stays within
``analysis.alpha``. Pure numpy, vectorised over simulated experiments, so the Job step and
the calibration benchmark run the very same rule.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rtrl.core.api.checkpoint import Decision
from rtrl.core.api.rlcycle import (
    AnalysisSpec,
    Band,
    GuardrailsSpec,
    InconclusivePolicy,
    SequentialTest,
)
from rtrl.core.results import CauseKind
from rtrl_trainer.analyze.confidence import Comparison, compare
from rtrl_trainer.analyze.estimate import Difference, independent

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
GROUP_SEQUENTIAL_METHOD = {
    "name": "group-sequential repeated confidence intervals, alpha spent over the planned "
    "analyses (alpha t^rho of calendar time), Bonferroni across metrics",
    "citation": (
        "Lan & DeMets, Discrete sequential boundaries for clinical trials, Biometrika 70(3), "
        "1983; Kim & DeMets, Design and analysis of group sequential tests based on the type "
        "I error spending rate function, Biometrika 74(1), 1987; Jennison & Turnbull, Group "
        "Sequential Methods with Applications to Clinical Trials, 2000; covariates: Deng, Xu, "
        "Kohavi & Walker, WSDM 2013 (CUPED), Tang et al., CUPAC, 2020; sample ratio: Lindon & "
        "Malek, Anytime-Valid Inference for Multinomial Count Data, NeurIPS 2022"
    ),
}


def method_of(analysis: AnalysisSpec) -> dict[str, str]:
    """analysis.json's ``method``: what the intervals are and where they come from."""
    if analysis.sequential_test == SequentialTest.MIXTURE:
        return dict(METHOD)
    return dict(GROUP_SEQUENTIAL_METHOD)


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

# Decision codes (arrays of these in vectorised use), and the decision each one is.
CONTINUE, PROMOTE, ROLLBACK = 0, 1, 2
DECISIONS = (Decision.CONTINUE, Decision.PROMOTE, Decision.ROLLBACK)

# Why the decision was taken: codes, and the cause analysis.json names for each one.
NO_CAUSE, SRM, GUARDRAIL, GOAL_WORSE, PRIMARY_BETTER = 0, 1, 2, 3, 4
POLICY_ROLLBACK, NON_INFERIOR, NOT_NON_INFERIOR, HOLD, HELD, HELD_SRM = 5, 6, 7, 8, 9, 10
HELD_NOVELTY = 11
CAUSES = (
    CauseKind.INCONCLUSIVE,
    CauseKind.SAMPLE_RATIO_MISMATCH,
    CauseKind.GUARDRAIL,
    CauseKind.GOAL_WORSE,
    CauseKind.PRIMARY_BETTER,
    CauseKind.POLICY_ROLLBACK,
    CauseKind.NON_INFERIOR,
    CauseKind.NOT_NON_INFERIOR,
    CauseKind.POLICY_HOLD,
    CauseKind.HELD_BEYOND_BAND,
    CauseKind.HELD_SAMPLE_RATIO,
    CauseKind.HELD_NOVELTY,
)


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
    "rows_per_unit": ("rows_per_unit", True),
    "logged_per_served": ("logged_per_served", True),
}
# Guardrails that are rates of events.
EVENT_RATES = frozenset(
    {"edit_rate", "clarification_rate", "invalid_tool_call_rate", "feedback_missing_rate"}
)


def plan(
    analysis: AnalysisSpec, guardrails: GuardrailsSpec, *, unmeasured: tuple[str, ...] = ()
) -> list[Metric]:
    """The metrics judged under this spec, each with its share of ``analysis.alpha``;
    ``unmeasured`` guardrails (``logged_per_served`` without the capture proxy's events)
    are left out and spend nothing."""
    bands = [
        (name, higher, band)
        for field_name, (name, higher) in GUARDRAILS.items()
        if (band := getattr(guardrails, field_name)) is not None and name not in unmeasured
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


# --- the decision --------------------------------------------------------------------------


@dataclass
class Judgement:
    """The decision code(s), why, and every metric's comparison and verdict."""

    decision: Any
    cause: Any
    comparisons: dict[str, Comparison] = field(default_factory=dict)
    verdicts: dict[str, Any] = field(default_factory=dict)
    non_inferior: Any = False
    settled: Comparison | None = None  # the primary goal among settled rows
    settled_verdict: Any = None
    promote: Comparison | None = None  # the precision-weighted primary
    promote_verdict: Any = None


def judge(
    metrics: Sequence[Metric],
    diffs: Mapping[str, Difference],
    *,
    boundaries: Mapping[str, tuple[Any, Any]] | None = None,
    settled: Difference | None = None,
    settled_boundary: Any = None,
    settled_alpha: float = 0.05,
    promote: Difference | None = None,
    promote_boundary: Any = None,
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
       and, with ``settled`` (the primary goal over the rows of users past their first
       hours in the canary), unless that one is significantly better too, at
       ``settled_alpha`` (``HELD_NOVELTY``: the effect may be a novelty). It only ever
       holds a promotion the primary goal earned at its own alpha, so it spends none of the
       family's; its own alpha bounds the chance that a pure novelty is promoted;
    5. otherwise continue, or at the maximum duration the inconclusive policy: rollback;
       promote-if-non-inferior (promote when every goal's interval excludes a relative harm
       bigger than ``margin`` and no guardrail is ``beyond``, else rollback); hold
       (continue).
    Holding only ever turns a promotion into a continuation, so the chance of a false
    promotion stays within alpha.
    A metric missing from ``diffs`` gets no verdict (inconclusive / ok).

    ``boundaries`` (metric name -> the group-sequential boundary of this look on the log and
    the absolute scale, :mod:`.sequential`) turns each interval into a repeated confidence
    interval; without them (or for a metric they lack: no verdict at this look, ``inf``
    where not given), the always-valid mixture intervals.

    ``promote``: the primary goal's precision-weighted difference (:mod:`.weights`), with its
    ``promote_boundary``: when given, the evidence that promotes is its (``better``), while
    the primary's interaction-weighted difference in ``diffs`` still decides harm
    (``worse``) and non-inferiority. Each is used on one side, so the family's error stays
    within alpha.
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
        z_log, z_abs = (
            (None, None) if boundaries is None else boundaries.get(metric.name, (np.inf, np.inf))
        )
        cmp = compare(
            diffs.get(metric.name, nan), metric.alpha, metric.tau, events=metric.events,
            boundary=z_log, boundary_abs=z_abs,
        )  # fmt: skip
        code = verdict(metric, cmp)
        judgement.comparisons[metric.name] = cmp
        judgement.verdicts[metric.name] = code
        codes = np.asarray(code)
        if metric.kind == "guardrail":
            tripped = tripped | (codes == TRIPPED)
            beyond = beyond | (codes == BEYOND)
            continue
        worse = worse | (codes == WORSE)
        if metric.name != PRIMARY:
            pass
        elif promote is None:
            better = better | (codes == BETTER)
        else:
            cmp_w = compare(
                promote, metric.alpha, metric.tau, events=metric.events,
                boundary=promote_boundary, boundary_abs=promote_boundary,
            )  # fmt: skip
            judgement.promote = cmp_w
            judgement.promote_verdict = verdict(metric, cmp_w)
            better = better | (np.asarray(judgement.promote_verdict) == BETTER)
        noninf = noninf & np.asarray(non_inferior(metric, cmp, margin))
    unsettled = np.zeros(shape, dtype=bool)
    if settled is not None:
        primary = next(m for m in metrics if m.name == PRIMARY)
        cmp = compare(
            settled, settled_alpha, primary.tau, events=primary.events,
            boundary=settled_boundary, boundary_abs=settled_boundary,
        )  # fmt: skip
        judgement.settled = cmp
        judgement.settled_verdict = verdict(primary, cmp)
        unsettled = np.asarray(judgement.settled_verdict) != BETTER
    decision = np.full(
        np.broadcast_shapes(shape, tripped.shape, beyond.shape, better.shape, unsettled.shape),
        CONTINUE,
    )
    cause = np.full(decision.shape, NO_CAUSE)
    suspect = np.asarray(srm_suspect, dtype=bool)
    noninf = noninf & ~beyond & ~suspect
    for mask, code, why in (
        (better, PROMOTE, PRIMARY_BETTER),
        (better & unsettled, CONTINUE, HELD_NOVELTY),
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
