"""Calibration of the canary analysis: error under A/A despite peeking, power and time to a
decision at the blog's effect sizes, side by side with a fixed-horizon test.

Each simulated canary follows the default rollout: the canary gets 5% of traffic for the
first analysis interval, 25% for the next two, then 50%; an analysis runs after every
``--per-look`` interactions, with the real decision rule (:func:`rtrl_trainer.sequential.judge`:
always-valid intervals, Bonferroni split, guardrails, sample-ratio check), until it decides
or reaches ``--max-looks`` (maxDuration). Arms are simulated as per-interaction Bernoulli
signals (edit persistence, dissatisfied follow-up, edit proposed, clarifying question) and
lognormal latency, drawn interaction by interaction and reduced to each arm's sufficient
statistics, vectorised over experiments.

The fixed-horizon baseline is what a team would otherwise run: a two-sided z-test of edit
persistence at the same per-metric alpha, with the sample size that gives the same power as
the sequential test (computed, then checked on the same simulated data), looked at once;
its rule is the same (promote if edit persistence is better and no goal worse).

Run: ``python bench/analysis_calibration.py`` (about two minutes on two cores).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from statistics import NormalDist
from typing import Any

import numpy as np

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / p) for p in ("operator", "trainer_image")]

from rtrl.api.rlcycle import AnalysisSpec, Band, GuardrailsSpec  # noqa: E402
from rtrl_trainer.sequential import (  # noqa: E402
    CONTINUE,
    GOAL_WORSE,
    GUARDRAIL,
    PROMOTE,
    ROLLBACK,
    SRM,
    Estimate,
    Moments,
    judge,
    plan,
    srm_test,
)

BASE = {"edit": 0.60, "dissatisfied": 0.10, "edit_rate": 0.80, "clarification": 0.05}
LATENCY_SIGMA = 0.6  # lognormal shape of latency (CV 0.66)
# The blog's effects: edit persistence +2.28% relative, dissatisfied follow-ups -3.13%,
# latency -10.3%.
EFFECTS = {"edit": 1.0228, "dissatisfied": 1 - 0.0313, "latency": 1 - 0.103}
WEIGHTS = [5, 25, 25]  # then 50 for the rest


def weight_at(look: int) -> int:
    return WEIGHTS[look] if look < len(WEIGHTS) else 50


def simulate(
    rng: np.random.Generator,
    *,
    experiments: int,
    per_look: int,
    looks: int,
    max_looks: int,
    effect: dict[str, float],
    analysis: AnalysisSpec,
    guardrails: GuardrailsSpec,
) -> dict[str, Any]:
    """Run the sequential analysis at every look; keep the goals' estimates at every look
    for the fixed-horizon test."""
    metrics = plan(analysis, guardrails)
    goals = [m.name for m in metrics if m.kind == "goal"]
    arms = [{}, {}]  # type: list[dict[str, Moments]]
    decided = np.full(experiments, -1)
    decision = np.full(experiments, CONTINUE)
    cause = np.zeros(experiments, dtype=np.int64)
    history: list[tuple[dict[str, Estimate], dict[str, Estimate]]] = []
    totals = np.zeros(looks, dtype=np.int64)
    srm_counts = np.zeros((2, experiments))
    lat = np.empty((experiments, per_look))
    columns = np.arange(per_look)
    for look in range(looks):
        w = weight_at(look)
        if look == 0 or weight_at(look - 1) != w:
            srm_counts[:] = 0  # --weight-since: the SRM check counts the current step only
        canary_n = rng.binomial(per_look, w / 100, size=experiments).astype(np.float64)
        counts = (per_look - canary_n, canary_n)
        for arm, n in enumerate(counts):
            scale = effect if arm == 1 else {}
            for name, key in (
                ("edit_persistence", "edit"),
                ("dissatisfied_followup_rate", "dissatisfied"),
                ("edit_rate", "edit_rate"),
                ("clarification_rate", "clarification"),
            ):
                p = BASE[key] * scale.get(key, 1.0)
                k = rng.binomial(n.astype(np.int64), p).astype(np.float64)
                arms[arm].setdefault(name, Moments()).add(Moments(n, k, n, k, n, k))
        # Latency, interaction by interaction: the first canary_n columns are the canary's.
        rng.standard_normal(out=lat)
        np.exp(lat * LATENCY_SIGMA + math.log(1000.0), out=lat)
        is_canary = columns[None, :] < canary_n[:, None]
        f = effect.get("latency", 1.0)
        s_all, q_all = lat.sum(axis=1), np.einsum("ij,ij->i", lat, lat)
        lat *= is_canary
        s_c, q_c = lat.sum(axis=1), np.einsum("ij,ij->i", lat, lat)
        for arm, (n, s, q) in enumerate(
            ((counts[0], s_all - s_c, q_all - q_c), (canary_n, s_c, q_c))
        ):
            g = f if arm == 1 else 1.0
            arms[arm].setdefault("latency_ms", Moments()).add(
                Moments(n, g * s, n, g * g * q, n, g * s)
            )
        srm_counts[0] += counts[0]
        srm_counts[1] += canary_n
        totals[look] = per_look * (look + 1)
        est = [{k: m.estimate() for k, m in a.items()} for a in arms]
        history.append(({g: est[0][g] for g in goals}, {g: est[1][g] for g in goals}))
        if look >= max_looks:
            continue
        srm = srm_test(srm_counts[0], srm_counts[1], w / 100, analysis.srm_alpha)
        j = judge(metrics, est[0], est[1], srm_mismatch=srm.mismatch)
        new = (decided < 0) & (np.asarray(j.decision) != CONTINUE)
        decided[new] = look
        decision[new] = np.asarray(j.decision)[new]
        cause[new] = np.asarray(j.cause)[new]
    return {
        "decided": decided,
        "decision": decision,
        "cause": cause,
        "history": history,
        "totals": totals,
        "metrics": metrics,
    }


def fixed_horizon(
    sim: dict[str, Any], look: int, alpha_goal: float
) -> tuple[np.ndarray, np.ndarray]:
    """(promote, rollback) masks of a fixed-horizon z-test at ``look``, same rule."""
    base, canary = sim["history"][look]
    z = NormalDist().inv_cdf(1 - alpha_goal / 2)
    worse = np.zeros(len(sim["decided"]), dtype=bool)
    better = worse.copy()
    for metric in (m for m in sim["metrics"] if m.kind == "goal"):
        b, c = base[metric.name], canary[metric.name]
        diff = c.value - b.value
        half = z * np.sqrt(b.var + c.var)
        up, down = diff - half > 0, diff + half < 0
        good, bad = (up, down) if metric.higher_is_better else (down, up)
        worse |= bad
        if metric.name == "edit_persistence":
            better = good
    return better & ~worse, worse


def expected_canary(look: int, per_look: int) -> float:
    return sum(per_look * weight_at(i) / 100 for i in range(look + 1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experiments", type=int, default=2000)
    parser.add_argument("--per-look", type=int, default=10_000, help="interactions per analysis")
    parser.add_argument("--max-looks", type=int, default=14, help="maxDuration, in analyses")
    parser.add_argument(
        "--looks", type=int, default=40, help="simulated (fixed test may need more)"
    )
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    analysis = AnalysisSpec(alpha=0.05)
    # The bench simulates two guardrails (edit rate, clarification rate) with default bands.
    guardrails = GuardrailsSpec(
        edit_rate=Band(max_relative_drop=0.05),
        clarification_rate=Band(max_relative_rise=0.10),
        invalid_tool_call_rate=None,
    )
    metrics = plan(analysis, guardrails)
    alpha_goal = next(m.alpha for m in metrics if m.name == "edit_persistence")
    rng = np.random.default_rng(args.seed)
    clock = time.perf_counter()
    runs = {}
    for label, effect in (("A/A", {}), ("A/B", EFFECTS)):
        runs[label] = simulate(
            rng,
            experiments=args.experiments,
            per_look=args.per_look,
            looks=args.looks,
            max_looks=args.max_looks,
            effect=effect,
            analysis=analysis,
            guardrails=guardrails,
        )
    seconds = time.perf_counter() - clock
    n_exp = args.experiments

    aa, ab = runs["A/A"], runs["A/B"]
    aa_rollback = np.mean(aa["decision"] == ROLLBACK)
    aa_promote = np.mean(aa["decision"] == PROMOTE)
    power = float(np.mean(ab["decision"] == PROMOTE))
    ab_rollback = float(np.mean(ab["decision"] == ROLLBACK))

    def interactions(sim: dict[str, Any]) -> tuple[float, float]:
        looks = np.where(sim["decided"] >= 0, sim["decided"], args.max_looks - 1)
        totals = sim["totals"][looks]
        done = sim["decided"] >= 0
        return float(totals.mean()), float(totals[done].mean()) if done.any() else math.nan

    seq_all, seq_decided = interactions(ab)
    # Fixed horizon with the same alpha and power: the per-arm sample size, then the first
    # look at which the canary has it (the stable arm has more).
    target = min(power, 1 - 1 / (2 * n_exp))
    delta = BASE["edit"] * (EFFECTS["edit"] - 1)
    var = BASE["edit"] * (1 - BASE["edit"]) + BASE["edit"] * EFFECTS["edit"] * (
        1 - BASE["edit"] * EFFECTS["edit"]
    )
    z = NormalDist().inv_cdf(1 - alpha_goal / 2) + NormalDist().inv_cdf(target)
    n_fixed = z * z * var / delta**2
    fixed_look = next(
        (i for i in range(args.looks) if expected_canary(i, args.per_look) >= n_fixed), None
    )
    if fixed_look is None:
        print(f"fixed horizon needs {n_fixed:.0f} per arm: raise --looks", file=sys.stderr)
        return 1
    # Interactions at which the canary reaches n_fixed (within the look: the test is judged
    # at the look's end, which only helps its power).
    short = n_fixed - expected_canary(fixed_look - 1, args.per_look) if fixed_look else n_fixed
    fixed_interactions = round(fixed_look * args.per_look + short / (weight_at(fixed_look) / 100))
    f_aa_promote, f_aa_rollback = fixed_horizon(aa, fixed_look, alpha_goal)
    f_ab_promote, f_ab_rollback = fixed_horizon(ab, fixed_look, alpha_goal)

    causes = {SRM: "sample ratio", GUARDRAIL: "guardrail", GOAL_WORSE: "goal worse"}
    aa_causes = ", ".join(
        f"{name} {np.mean((aa['decision'] == ROLLBACK) & (aa['cause'] == code)):.4f}"
        for code, name in causes.items()
    )
    print(
        f"# analysis calibration: {n_exp} A/A + {n_exp} A/B experiments, an analysis every "
        f"{args.per_look:,} interactions, canary weights 5%/25%/25%/then 50%, maxDuration "
        f"{args.max_looks} analyses ({args.max_looks * args.per_look:,} interactions); "
        f"alpha {analysis.alpha}, per goal {alpha_goal:.4f} (weighted Bonferroni), "
        f"srmAlpha {analysis.srm_alpha}; simulated in {seconds:.0f} s"
    )
    print(
        f"# A/B effects: edit persistence {100 * (EFFECTS['edit'] - 1):+.2f}% at "
        f"{BASE['edit']}, dissatisfied follow-ups {100 * (EFFECTS['dissatisfied'] - 1):+.2f}% "
        f"at {BASE['dissatisfied']}, latency {100 * (EFFECTS['latency'] - 1):+.1f}% "
        f"(lognormal sigma {LATENCY_SIGMA})"
    )
    print()
    header = f"{'':44} {'sequential (mSPRT)':>20} {'fixed horizon (z)':>20}"
    print(header)
    print("-" * len(header))
    rows = [
        ("A/A false rollback (any look)", f"{aa_rollback:.4f}", f"{np.mean(f_aa_rollback):.4f}"),
        ("A/A false promotion (any look)", f"{aa_promote:.4f}", f"{np.mean(f_aa_promote):.4f}"),
        ("A/A total error", f"{aa_rollback + aa_promote:.4f}",
         f"{np.mean(f_aa_rollback | f_aa_promote):.4f}"),
        ("A/B power (promote)", f"{power:.4f}", f"{np.mean(f_ab_promote):.4f}"),
        ("A/B wrong rollback", f"{ab_rollback:.4f}", f"{np.mean(f_ab_rollback):.4f}"),
        ("A/B mean interactions to a decision", f"{seq_all:,.0f}", f"{fixed_interactions:,}"),
        ("  (sequential: decided runs only)", f"{seq_decided:,.0f}", ""),
        ("A/B median interactions (decided runs)",
         f"{np.median(ab['totals'][ab['decided'][ab['decided'] >= 0]]):,.0f}", ""),
        ("A/A runs reaching maxDuration undecided", f"{np.mean(aa['decided'] < 0):.4f}", "-"),
        ("per-arm sample size of the fixed test", "", f"{n_fixed:,.0f} (canary)"),
    ]  # fmt: skip
    for name, seq, fixed in rows:
        print(f"{name:44} {seq:>20} {fixed:>20}")
    print(f"A/A rollbacks by cause: {aa_causes}")
    print()
    # Per-goal detection under the A/B effects, at the sequential test's stop / max and at
    # the fixed horizon.
    for metric in (m for m in metrics if m.kind == "goal"):
        base_est, canary_est = ab["history"][args.max_looks - 1]
        b, c = base_est[metric.name], canary_est[metric.name]
        rel = np.mean(c.value / b.value - 1)
        print(f"{metric.name}: mean relative difference at maxDuration {100 * rel:+.2f}%")
    print()
    total_error = aa_rollback + aa_promote
    goals = [
        (
            "A/A error <= alpha despite peeking",
            total_error <= analysis.alpha,
            f"false rollback {aa_rollback:.4f} + false promotion {aa_promote:.4f} = "
            f"{total_error:.4f} vs alpha {analysis.alpha}",
        ),
        (
            "fewer interactions to a decision than fixed horizon",
            seq_all < fixed_interactions,
            f"{seq_all:,.0f} vs {fixed_interactions:,} "
            f"({100 * (seq_all / fixed_interactions - 1):+.0f}%)"
            f" at power {power:.3f} vs {np.mean(f_ab_promote):.3f}",
        ),
    ]
    for name, met, figures in goals:
        print(f"goal: {name}: {'met' if met else 'NOT met'} ({figures})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
