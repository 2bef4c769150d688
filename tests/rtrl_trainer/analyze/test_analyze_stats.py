"""The canary's statistics (rtrl_trainer.analyze: confidence, srm, rule, decide): intervals
computed by hand, and the decision rule on simulated arms whose truth is known."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from rtrl.core.api.rlcycle import AnalysisSpec, Band, GuardrailsSpec
from rtrl_trainer.analyze.confidence import (
    Estimate,
    Moments,
    always_valid_ci,
    cs_radius,
    from_estimates,
)
from rtrl_trainer.analyze.decide import decide as decide_pairs
from rtrl_trainer.analyze.rule import PROMOTE, ROLLBACK, judge, plan
from rtrl_trainer.analyze.srm import srm_test


def test_always_valid_ci_by_hand() -> None:
    # V = 0.25/100 + 0.24/100 = 0.0049; tau^2 = 0.01;
    # radius = sqrt(V (V + tau^2) / tau^2 * (2 ln 20 + ln((V + tau^2) / V)))
    v, t2 = 0.0049, 0.01
    radius = math.sqrt(v * (v + t2) / t2 * (2 * math.log(20) + math.log((v + t2) / v)))
    assert radius == pytest.approx(0.227735, abs=1e-6)
    diff, low, high = always_valid_ci(0.5, 0.25, 100, 0.6, 0.24, 100, 0.05, 0.1)
    assert diff == pytest.approx(0.1)
    assert (low, high) == pytest.approx((0.1 - radius, 0.1 + radius))
    # Wider than the fixed-horizon 95% interval (1.96 sqrt(V) = 0.137): the price of peeking.
    assert radius > 1.96 * math.sqrt(v)
    # Vectorised: one element per experiment.
    radii = cs_radius(np.array([0.0049, 0.0]), 0.05, 0.1)
    assert radii == pytest.approx([radius, 0.0])


def test_ratio_metric_delta_method_by_hand() -> None:
    x = np.array([0.0, 1.0, 0.0, 2.0])  # invalid tool calls
    y = np.array([1.0, 2.0, 0.0, 4.0])  # tool calls
    est = Moments.of(x, y).estimate()
    r = 3 / 7
    resid = x - r * y
    expected = (resid @ resid / 3) / (4 * (7 / 4) ** 2)
    assert est.value == pytest.approx(r)
    assert est.var == pytest.approx(expected)
    mean = Moments.of(np.array([1.0, 0.0, 1.0, 1.0])).estimate()
    assert mean.value == 0.75 and mean.var == pytest.approx(0.25 / 4)
    assert mean.n == 4


def test_alpha_is_split_across_goals_and_guardrails() -> None:
    metrics = plan(AnalysisSpec(alpha=0.05), GuardrailsSpec())
    goals = [m for m in metrics if m.kind == "goal"]
    guards = [m for m in metrics if m.kind == "guardrail"]
    assert [m.name for m in goals] == [
        "edit_persistence",
        "dissatisfied_followup_rate",
        "latency_ms",
    ]
    assert [m.name for m in guards] == [
        "edit_rate", "clarification_rate", "invalid_tool_call_rate", "feedback_missing_rate",
        "logged_per_served",
    ]  # fmt: skip
    assert sum(m.alpha for m in metrics) == pytest.approx(0.05)
    # without the capture proxy's events the reconciliation is not judged: it spends nothing
    measured = plan(AnalysisSpec(alpha=0.05), GuardrailsSpec(), unmeasured=("logged_per_served",))
    assert "logged_per_served" not in {m.name for m in measured}
    assert sum(m.alpha for m in measured) == pytest.approx(0.05)


def arms(
    rng: np.random.Generator,
    n: int,
    *,
    edit: float = 0.60,
    dissatisfied: float = 0.10,
    latency: float = 1.0,
    edit_rate: float = 0.80,
    clarification: float = 0.05,
) -> dict[str, Estimate]:
    def bern(p: float) -> Estimate:
        return Moments.of(rng.random(n) < p).estimate()

    return {
        "edit_persistence": bern(edit),
        "dissatisfied_followup_rate": bern(dissatisfied),
        "latency_ms": Moments.of(1000 * latency * rng.lognormal(0, 0.6, n)).estimate(),
        "edit_rate": bern(edit_rate),
        "clarification_rate": bern(clarification),
    }


GUARDS = GuardrailsSpec(invalid_tool_call_rate=None, feedback_missing_rate=None)


def decide(base: dict[str, Estimate], canary: dict[str, Estimate], *args: Any, **kw: Any) -> Any:
    """The decision from two independent per-arm summaries (rows as the unit)."""
    return decide_pairs(from_estimates(base, canary), *args, **kw)


def test_aa_continues() -> None:
    rng = np.random.default_rng(1)
    result = decide(arms(rng, 20_000), arms(rng, 20_000), AnalysisSpec(), GUARDS)
    assert result.decision == "continue"
    assert result.reasons[0].startswith("inconclusive")
    assert {row["verdict"] for row in result.metrics} <= {"inconclusive", "ok"}


def test_clear_improvement_promotes() -> None:
    rng = np.random.default_rng(2)
    result = decide(arms(rng, 30_000), arms(rng, 30_000, edit=0.64), AnalysisSpec(), GUARDS)
    assert result.decision == "promote"
    row = result.metrics[0]
    assert row["name"] == "edit_persistence" and row["verdict"] == "better"
    assert row["ci_low"] > 0 and row["relative_ci_low"] > 0
    assert "edit_persistence: canary 0.6" in result.reasons[1]


def test_clear_harm_rolls_back() -> None:
    rng = np.random.default_rng(3)
    result = decide(arms(rng, 20_000), arms(rng, 20_000, latency=1.3), AnalysisSpec(), GUARDS)
    assert result.decision == "rollback"
    assert result.reasons[0] == "goal significantly worse: latency_ms"


def test_ask_instead_of_edit_trips_the_guardrails() -> None:
    rng = np.random.default_rng(4)
    canary = arms(rng, 20_000, edit_rate=0.56, clarification=0.10, edit=0.63)
    result = decide(arms(rng, 20_000), canary, AnalysisSpec(), GUARDS)
    assert result.decision == "rollback"
    assert result.reasons[0].startswith("guardrail tripped: edit_rate, clarification_rate")
    verdicts = {row["name"]: row["verdict"] for row in result.metrics}
    assert verdicts["edit_rate"] == verdicts["clarification_rate"] == "tripped"
    # The reward alone would have promoted it: edit persistence rose.
    assert verdicts["edit_persistence"] == "better"


def test_a_guardrail_estimate_beyond_its_band_holds_the_promotion() -> None:
    # Edit persistence clearly better; the clarification rate up ~30%, beyond its 10% band,
    # on too few questions for its interval to lie wholly beyond the band yet.
    rng = np.random.default_rng(7)
    base, canary = arms(rng, 3_000), arms(rng, 3_000, edit=0.70, clarification=0.065)
    result = decide(base, canary, AnalysisSpec(), GUARDS)
    verdicts = {row["name"]: row for row in result.metrics}
    row = verdicts["clarification_rate"]
    assert verdicts["edit_persistence"]["verdict"] == "better"
    assert row["verdict"] == "beyond", row
    assert row["relative_difference"] > 0.10 and row["relative_ci_low"] <= 0.10
    assert result.decision == "continue"
    assert result.reasons[0].startswith(
        "promotion held: edit_persistence significantly better, but the estimate of "
        "clarification_rate is beyond its band"
    )
    late = decide(base, canary, AnalysisSpec(), GUARDS, max_duration_reached=True)
    assert late.decision == "rollback"
    assert late.reasons[0] == (
        "inconclusive at maxDuration (clarification_rate beyond its band): policy rollback"
    )
    spec = AnalysisSpec.model_validate({"inconclusive": "promote-if-non-inferior"})
    assert decide(base, canary, spec, GUARDS, max_duration_reached=True).decision == "rollback"
    # The same improvement with the guardrail within its band promotes at once.
    calm = arms(rng, 3_000, edit=0.70)
    assert decide(base, calm, AnalysisSpec(), GUARDS).decision == "promote"


def test_srm_rolls_back_first() -> None:
    srm = srm_test(8_000, 2_000, 0.05, 0.001)
    assert srm.mismatch and srm.observed_canary_share == pytest.approx(0.2)
    rng = np.random.default_rng(5)
    result = decide(arms(rng, 20_000), arms(rng, 20_000, edit=0.7), AnalysisSpec(), GUARDS, srm=srm)
    assert result.decision == "rollback"
    assert result.reasons[0].startswith("sample ratio mismatch: canary share 20.00%")
    assert result.srm["mismatch"] is True
    fine = srm_test(9_500, 500, 0.05, 0.001)
    assert not fine.mismatch and fine.p_value > 0.5


@pytest.mark.parametrize(
    ("policy", "canary_kw", "decision", "lead"),
    [
        ("rollback", {}, "rollback", "inconclusive at maxDuration: policy rollback"),
        ("hold", {}, "continue", "inconclusive at maxDuration: policy hold"),
        ("promote-if-non-inferior", {}, "promote", "inconclusive at maxDuration: policy "
         "promote-if-non-inferior: every goal"),
        ("promote-if-non-inferior", {"dissatisfied": 0.104}, "rollback",
         "inconclusive at maxDuration: policy promote-if-non-inferior: non-inferiority"),
    ],
)  # fmt: skip
def test_inconclusive_policies_at_max_duration(
    policy: str, canary_kw: dict[str, Any], decision: str, lead: str
) -> None:
    rng = np.random.default_rng(6)
    spec = AnalysisSpec.model_validate({"inconclusive": policy, "nonInferiorityMargin": 0.10})
    base, canary = arms(rng, 60_000), arms(rng, 60_000, **canary_kw)
    before = decide(base, canary, spec, GUARDS)
    assert before.decision == "continue"
    result = decide(base, canary, spec, GUARDS, max_duration_reached=True)
    assert result.decision == decision
    assert result.reasons[0].startswith(lead)


def test_few_samples_give_no_verdict() -> None:
    # 30 of 30 persisted vs 0 of 30: zero sample variances, but no verdict yet.
    base = {"edit_persistence": Moments.of(np.zeros(30)).estimate()}
    canary = {"edit_persistence": Moments.of(np.ones(30)).estimate()}
    result = decide(base, canary, AnalysisSpec(), GuardrailsSpec())
    assert result.decision == "continue"
    assert "no verdict yet" in result.reasons[1]


def test_judge_is_vectorised() -> None:
    metrics = plan(AnalysisSpec(), GuardrailsSpec(edit_rate=Band(max_relative_drop=0.05)))
    n = np.array([20_000.0, 20_000.0, 20_000.0])
    base = {"edit_persistence": Estimate(np.full(3, 0.6), 0.24 / n, n)}
    canary = {"edit_persistence": Estimate(np.array([0.6, 0.65, 0.55]), 0.24 / n, n)}
    j = judge(metrics, from_estimates(base, canary), srm_mismatch=np.array([False, False, False]))
    assert list(j.decision) == [0, PROMOTE, ROLLBACK]
