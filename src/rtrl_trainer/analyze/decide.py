"""The scalar front end of the decision rule: ``analysis.json``'s decision, its reasons
in words, and one row per metric (:func:`decide`, what the analyze step calls)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rtrl.core.api.checkpoint import Decision
from rtrl.core.api.rlcycle import AnalysisSpec, Band, GuardrailsSpec
from rtrl.core.results import AnalysisCause
from rtrl_trainer.analyze.confidence import MIN_EVENTS, MIN_SAMPLES, Comparison, compare
from rtrl_trainer.analyze.estimate import Difference
from rtrl_trainer.analyze.rule import (
    BEYOND,
    CAUSES,
    DECISIONS,
    GOAL_WORSE,
    GUARDRAIL,
    HELD,
    HELD_NOVELTY,
    HELD_SRM,
    HOLD,
    NON_INFERIOR,
    NOT_NON_INFERIOR,
    POLICY_ROLLBACK,
    PRIMARY,
    PRIMARY_BETTER,
    SRM,
    TRIPPED,
    VERDICTS,
    WORSE,
    Metric,
    judge,
    plan,
)
from rtrl_trainer.analyze.srm import SRM_HOLD_P, SrmResult


@dataclass
class Analysis:
    """One analysis, as ``analysis.json`` reports it."""

    decision: Decision
    reasons: list[str]
    metrics: list[dict[str, Any]]
    srm: dict[str, Any]
    missing: list[str]
    settled: dict[str, Any] | None = None
    # why, as fields: the rule's cause and the metrics it names (tripped guardrails, goals
    # significantly worse, guardrails beyond their band)
    cause: AnalysisCause | None = None


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


def describe(
    metric: Metric, cmp: Comparison, code: int, *, kind: str = "always-valid",
    judged: bool = True,
) -> str:  # fmt: skip
    """``edit_persistence: canary 0.614 vs 0.600 (+2.3%), always-valid 98.7% CI [+0.4%,
    +4.2%]: better``; ``kind`` names the interval (``repeated`` for the group-sequential
    test's); ``judged`` False: this look of the plan spends no error on the metric."""
    text = f"{metric.name}: canary {_num(cmp.canary, metric.unit)} vs " + _num(
        cmp.baseline, metric.unit
    )
    if math.isfinite(cmp.relative) and cmp.few_events:
        text += f" ({_pct(cmp.relative)})"  # a handful of events: no interval worth printing
    elif math.isfinite(cmp.relative):
        level = f"{100 * (1 - metric.alpha):.3g}%"
        text += (
            f" ({_pct(cmp.relative)}), {kind} {level} CI "
            f"[{_pct(cmp.rel_low)}, {_pct(cmp.rel_high)}]"
        )
        if not judged:
            text += " (no verdict at this look: the plan spends no error here)"
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
    metrics: list[Metric] | None = None,
    boundaries: Mapping[str, Sequence[float]] | None = None,
    settled: Difference | None = None,
    settled_boundary: Sequence[float] | None = None,
    promote: Difference | None = None,
    promote_boundary: Sequence[float] | None = None,
) -> Analysis:
    """The decision for one canary from each arm's estimates, with reasons and metric rows
    (see :func:`judge` for the rule). ``boundaries``: per metric the group-sequential
    boundary of this look on the log and absolute scales, and the finite ones to print when
    these are infinite (no verdict at this look); without: the mixture's intervals.
    ``settled``: the primary goal among settled rows, with its boundaries likewise."""
    if metrics is None:
        unmeasured = () if "logged_per_served" in diffs else ("logged_per_served",)
        metrics = plan(analysis, guardrails, unmeasured=unmeasured)
    mismatch = bool(srm.mismatch) if srm is not None else False
    suspect = bool(srm.p_value <= SRM_HOLD_P) if srm is not None else False
    verdict_z = None if boundaries is None else {k: (v[0], v[1]) for k, v in boundaries.items()}
    j = judge(
        metrics,
        diffs,
        boundaries=verdict_z,
        settled=settled,
        settled_boundary=None if settled_boundary is None else settled_boundary[0],
        settled_alpha=analysis.alpha,
        promote=promote,
        promote_boundary=None if promote_boundary is None else promote_boundary[0],
        srm_mismatch=mismatch,
        srm_suspect=suspect,
        max_duration_reached=max_duration_reached,
        policy=analysis.inconclusive,
        margin=analysis.non_inferiority_margin,
    )
    kind = "always-valid" if boundaries is None else "repeated"
    rows: list[dict[str, Any]] = []
    lines: list[str] = []
    missing: list[str] = []
    for metric in metrics:
        cmp = j.comparisons[metric.name]
        code = int(j.verdicts[metric.name])
        found = diffs.get(metric.name)
        judged = True
        if found is not None and boundaries is not None and metric.name in boundaries:
            z = boundaries[metric.name]
            judged = math.isfinite(z[0])
            if not judged:  # print the interval with the last finite boundary of the plan
                cmp = compare(found, metric.alpha, metric.tau, events=metric.events,
                              boundary=z[2], boundary_abs=z[3])  # fmt: skip
        if found is None or not all(
            math.isfinite(float(v)) for v in (cmp.baseline, cmp.canary, cmp.ci_low, cmp.ci_high)
        ):
            missing.append(metric.name)
            lines.append(f"{metric.name}: not measured in both arms: {VERDICTS[code]}")
            continue
        lines.append(describe(metric, cmp, code, kind=kind, judged=judged))
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
        if len(found.part_reduction) == 2:
            row["variance_reduction_new"] = _finite(found.part_reduction[0])
            row["variance_reduction_returning"] = _finite(found.part_reduction[1])
        if boundaries is not None and metric.name in boundaries:
            row["boundary"] = _finite(boundaries[metric.name][0])
        if metric.band is not None:
            row["band"] = metric.band.to_k8s()
        rows.append(row)
    if promote is not None and j.promote is not None:
        primary = next(m for m in metrics if m.name == PRIMARY)
        cmp, code = j.promote, int(j.promote_verdict)
        pz = promote_boundary
        judged = pz is None or math.isfinite(pz[0])
        if pz is not None and not judged:
            cmp = compare(promote, primary.alpha, primary.tau, events=primary.events,
                          boundary=pz[2], boundary_abs=pz[3])  # fmt: skip
        if all(math.isfinite(float(v)) for v in (cmp.baseline, cmp.canary)):
            lines.insert(
                1, "precision-weighted " + describe(primary, cmp, code, kind=kind, judged=judged)
            )
            found_row: dict[str, Any] | None = next((r for r in rows if r["name"] == PRIMARY), None)
            if found_row is not None:
                found_row["precision_weighted"] = {
                    "relative_difference": _finite(cmp.relative),
                    "relative_ci_low": _finite(cmp.rel_low),
                    "relative_ci_high": _finite(cmp.rel_high),
                    "verdict": VERDICTS[code],
                    "boundary": None if pz is None else _finite(pz[0]),
                }
    settled_doc: dict[str, Any] | None = None
    if settled is not None and j.settled is not None:
        primary = next(m for m in metrics if m.name == PRIMARY)
        primary = dataclasses.replace(primary, alpha=analysis.alpha)
        code = int(j.settled_verdict)
        cmp = j.settled
        sz = settled_boundary
        judged = sz is None or math.isfinite(sz[0])
        if sz is not None and not judged:
            cmp = compare(settled, primary.alpha, primary.tau, events=primary.events,
                          boundary=sz[2], boundary_abs=sz[3])  # fmt: skip
        if all(math.isfinite(float(v)) for v in (cmp.baseline, cmp.canary)):
            lines.append("settled " + describe(primary, cmp, code, kind=kind, judged=judged))
            settled_doc = {
                "novelty_window": analysis.novelty_window,
                "baseline": float(cmp.baseline),
                "canary": float(cmp.canary),
                "relative_difference": _finite(cmp.relative),
                "relative_ci_low": _finite(cmp.rel_low),
                "relative_ci_high": _finite(cmp.rel_high),
                "verdict": VERDICTS[code],
                "baseline_samples": int(settled.n_baseline),
                "canary_samples": int(settled.n_canary),
                "boundary": None if sz is None else _finite(sz[0]),
            }
    cause = int(j.cause)
    beyond = [m.name for m in metrics if j.verdicts[m.name] == BEYOND]
    named = {
        GUARDRAIL: [m.name for m in metrics if j.verdicts[m.name] == TRIPPED],
        GOAL_WORSE: [m.name for m in metrics if m.kind == "goal" and j.verdicts[m.name] == WORSE],
        HELD: beyond,
        POLICY_ROLLBACK: beyond,
        NOT_NON_INFERIOR: beyond,
        HOLD: beyond,
    }.get(cause, [])
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
        lead.append(f"guardrail tripped: {', '.join(named)} moved beyond its band")
    elif cause == GOAL_WORSE:
        lead.append(f"goal significantly worse: {', '.join(named)}")
    elif cause == PRIMARY_BETTER:
        lead.append(f"{PRIMARY} significantly better and no goal worse, no guardrail tripped")
    elif cause == HELD_NOVELTY:
        lead.append(
            f"promotion held: {PRIMARY} significantly better, but not yet among the "
            f"interactions of users past their first {analysis.novelty_window} in the canary "
            "(a novelty effect fades); the analysis goes on until it is, or maxDuration"
        )
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
    why = AnalysisCause(kind=CAUSES[cause], metrics=named)
    decision = DECISIONS[int(j.decision)]
    return Analysis(decision, lead + lines, rows, srm_doc, missing, settled_doc, why)
