"""Calibration of the canary analysis in a realistic user population: false decisions of A/A
canaries however often they are looked at, power and time to promote at the blog's effects,
and the canaries that must not be promoted (a novelty bump, rows lost by a logging fault) or
must be rolled back (a harm to heavy users, a latency regression behind a gain); today's
analysis and the alternatives side by side on the same simulated canaries.

The population and the timeline are :mod:`bench.analysis_population`'s (issue 31): 8,000
users, lognormal activity (a few above 100x the median), 20% of them new during the canary,
a user's activity on the day varying around their usual, per-user rates at an intra-user
correlation of 0.1 (0.2) partly explained by org and prompt length and mostly lasting from
day to day, daily drift of 10-20%, 10,000 interactions an hour, the operator's default steps
(5% for 30 min, 25% for 1 h, then 50%), analyses at 0.5 h, 1.5 h and then every 15 minutes
(5 in the "every 5 min" scenarios), maxDuration 24 h with the inconclusive policy rollback.

Every look runs the analyze step's own functions (:mod:`bench.analysis_methods`); a
fixed-horizon z-test of the same estimator, judged once at the first look where its power
reaches the sequential test's, is the baseline for the interactions a decision costs.

Run: ``python bench/analysis_calibration.py`` (see docs/benchmarks.md for the time it
takes); ``--experiments 40`` for a quick look, ``--only NAME`` for some scenarios.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src")]

from bench.analysis_methods import (  # noqa: E402
    PRIMARY,
    TODAY,
    Analysis,
    LookStats,
    Method,
    Outcome,
    SharedBoundaries,
    covariates_of,
)
from bench.analysis_population import BLOG, Canary, Look, Population, draw_users, simulate  # noqa: E402

from rtrl_trainer.analyze.rule import (  # noqa: E402
    GOAL_WORSE,
    GUARDRAIL,
    HELD,
    POLICY_ROLLBACK,
    PROMOTE,
    ROLLBACK,
    SRM,
)

AFTER = Method(
    "group-sequential, predicted covariates, weighted, novelty rule, reconciliation", weighted=True
)
# without the capture proxy's counts: nothing sees lost rows per user; per request the
# rows-per-unit guardrail (each arm's rows against its share)
NO_CAPTURE = Method("... without the capture proxy's counts", reconcile=False, weighted=True)
NO_CAPTURE_REQUEST = Method(
    "... without the capture proxy's counts, rows per share 2%", reconcile=False, rows_band=0.02
)
ABLATIONS = (
    Method("mixture tau x2, own history", boundary="mixture", tau_scale=2.0, covariate="own",
           novelty=False, reconcile=False),
    Method("group-sequential rho 1, own history", rho=1.0, covariate="own", novelty=False,
           reconcile=False),
    Method("group-sequential rho 2, own history", rho=2.0, covariate="own", novelty=False,
           reconcile=False),
    Method("group-sequential O'Brien-Fleming, own history", rho=0.0, covariate="own",
           novelty=False, reconcile=False),
    Method("group-sequential rho 1, predicted", rho=1.0, novelty=False, reconcile=False),
    Method("group-sequential rho 1, predicted, novelty", rho=1.0, reconcile=False),
    Method("group-sequential rho 1, predicted, weighted", rho=1.0, novelty=False,
           reconcile=False, weighted=True),
    Method("group-sequential rho 2, predicted, weighted", rho=2.0, novelty=False,
           reconcile=False, weighted=True),
    Method("group-sequential rho 3, predicted, weighted", rho=3.0, novelty=False,
           reconcile=False, weighted=True),
    Method("group-sequential rho 1, predicted, weighted, novelty rule", rho=1.0,
           reconcile=False, weighted=True),
)  # fmt: skip


REQUEST_METHODS = (TODAY, AFTER, NO_CAPTURE_REQUEST)
# the hours at which the effective scenarios report what has been promoted by then
CEILING_HOURS = (4.0, 8.0, 12.0, 16.0, 20.0, 24.0)


@dataclass(frozen=True)
class Scenario:
    canary: Canary
    population: Population = field(default_factory=Population)
    methods: tuple[Method, ...] = (TODAY, AFTER, NO_CAPTURE)
    experiments: float = 1.0  # share of --experiments


EXPLORE = (
    TODAY,
    Method("weighted, rho 1", rho=1.0, reconcile=False, weighted=True),
    Method("weighted, rho 1.5", rho=1.5, reconcile=False, weighted=True),
    Method("weighted, rho 2", rho=2.0, reconcile=False, weighted=True),
    Method("weighted, rho 3", rho=3.0, reconcile=False, weighted=True),
    Method("weighted, O'Brien-Fleming", rho=0.0, reconcile=False, weighted=True),
    # the settled rows tested one-sided at alpha (two-sided at 2 alpha)
    Method(
        "weighted, rho 3, settled rows one-sided",
        rho=3.0,
        reconcile=False,
        weighted=True,
        settled_alpha=0.10,
    ),
)


def scenarios() -> list[Scenario]:
    icc2 = Population(icc=0.2)
    every5 = 5 / 60
    harm = {"edit": 1.0228, "dissatisfied": 1 - 0.0313, "latency": 1.103}
    return [
        Scenario(Canary("user A/A icc 0.1"), methods=(TODAY, *ABLATIONS, AFTER, NO_CAPTURE)),
        Scenario(Canary("user A/B icc 0.1", effect=BLOG),
                 methods=(TODAY, *ABLATIONS, AFTER, NO_CAPTURE)),
        Scenario(Canary("user A/A icc 0.2"), icc2),
        Scenario(Canary("user A/B icc 0.2", effect=BLOG), icc2),
        Scenario(Canary("user A/A icc 0.1, looks every 5 min", interval_h=every5), experiments=0.5),
        Scenario(Canary("user A/A icc 0.2, looks every 5 min", interval_h=every5), icc2,
                 experiments=0.5),
        Scenario(Canary("novelty: canary's first 2 h +6%", novelty="canary")),
        Scenario(Canary("novelty: each user's first 2 h +6%", novelty="user")),
        Scenario(Canary("A/A, 3% of canary rows lost (failed edits), user", row_loss=0.03,
                        biased_loss=True)),
        Scenario(Canary("A/A, 3% of canary rows lost (failed edits), request", unit="request",
                        row_loss=0.03, biased_loss=True), methods=REQUEST_METHODS),
        Scenario(Canary("A/A, 3% of canary rows lost at random, request", unit="request",
                        row_loss=0.03), methods=REQUEST_METHODS),
        Scenario(Canary("harm to the heaviest 1% of users (-15%)", heavy_harm=0.15)),
        Scenario(Canary("latency +10.3% behind the blog's gains", effect=harm)),
        Scenario(Canary("request A/A icc 0.1", unit="request"), methods=REQUEST_METHODS,
                 experiments=0.5),
        Scenario(Canary("request A/B icc 0.1", unit="request", effect=BLOG),
                 methods=REQUEST_METHODS, experiments=0.5),
        Scenario(Canary("user A/B icc 0.1, features explain nothing", effect=BLOG),
                 Population(org_share=0.0, prompt_share=0.0), experiments=0.5),
    ]  # fmt: skip


def run_chunk(job: tuple[Scenario, int, int]) -> dict[str, Outcome]:
    sc, e, seed = job
    rng = np.random.default_rng(seed)
    users = draw_users(rng, sc.population, e)
    covs = covariates_of(users)
    analyses = [Analysis(m, sc.canary.unit, e, sc.population.hours) for m in sc.methods]
    reduction: dict[str, list[float]] = {}
    shared = SharedBoundaries(e)

    def on_look(look: Look) -> None:
        stats = LookStats(look, sc.canary.unit, covs, shared)
        for a in analyses:
            a.look(stats)
        if look.decides and abs(look.hours - round(look.hours)) < 1e-9 and look.hours in (4, 8, 24):
            for cov in ("own", "predicted"):
                new, old = stats.split(PRIMARY, cov)
                reduction.setdefault(f"{cov} new {look.hours:g}h", []).append(new)
                reduction.setdefault(f"{cov} returning {look.hours:g}h", []).append(old)

    simulate(rng, sc.population, sc.canary, e, on_look, users=users)
    outs = {a.method.label: a.out for a in analyses}
    for out in outs.values():
        out.reduction = {k: list(v) for k, v in reduction.items()}
    return outs


# --- summaries with standard errors ----------------------------------------------------------


def proportion(mask: np.ndarray) -> tuple[float, float]:
    p = float(np.mean(mask))
    return p, math.sqrt(max(p * (1 - p), 0.25 / mask.size) / mask.size)


def bootstrap_se(values: np.ndarray, stat: Any, rng: np.random.Generator, reps: int = 400) -> float:
    if values.size < 2:
        return math.nan
    draws = [stat(values[rng.integers(0, values.size, values.size)]) for _ in range(reps)]
    finite = np.asarray([d for d in draws if np.isfinite(d)])
    return float(np.std(finite)) if finite.size > 1 else math.nan


def summarise(out: Outcome, rng: np.random.Generator) -> dict[str, Any]:
    promote = out.decision == PROMOTE
    evidence = (out.decision == ROLLBACK) & (out.cause != POLICY_ROLLBACK)
    promoted_hours = out.hours[promote]
    fig: dict[str, Any] = {"n": int(out.decision.size)}
    fig["promoted"] = proportion(promote)
    fig["rolled_back_on_evidence"] = proportion(evidence)
    fig["false_decision"] = proportion(promote | evidence)
    for name, cause in (("srm", SRM), ("guardrail", GUARDRAIL), ("goal_worse", GOAL_WORSE)):
        fig[f"rollback_{name}"] = proportion((out.decision == ROLLBACK) & (out.cause == cause))
    med = float(np.median(promoted_hours)) if promoted_hours.size else math.nan
    fig["median_hours_to_promote"] = (med, bootstrap_se(promoted_hours, np.median, rng))
    fig["mean_interactions"] = (
        float(np.mean(out.interactions)),
        float(np.std(out.interactions) / math.sqrt(out.interactions.size)),
    )
    fig["held_for_a_guardrail"] = proportion(out.cause == HELD)
    fig["reduction"] = {k: float(np.mean(v)) for k, v in out.reduction.items()}
    return fig


def fixed_horizon(out: Outcome, power: float, rng: np.random.Generator) -> dict[str, Any]:
    """The first decision look at which the fixed-horizon test of the same estimator reaches
    ``power``, its interactions, and the sequential test's interactions over them (with a
    bootstrap standard error over canaries)."""

    def ratio(idx: np.ndarray) -> float:
        target = float(np.mean(out.decision[idx] == PROMOTE))
        for _, rows, promote, _ in out.fixed:
            if np.mean(promote[idx]) >= target:
                return float(np.mean(out.interactions[idx]) / np.mean(rows[idx]))
        return math.nan

    all_ = np.arange(out.decision.size)
    for hours, rows, promote, _ in out.fixed:
        if np.mean(promote) >= power:
            draws = [ratio(rng.integers(0, all_.size, all_.size)) for _ in range(200)]
            finite = [d for d in draws if np.isfinite(d)]
            return {
                "hours": hours, "interactions": float(np.mean(rows)),
                "power": float(np.mean(promote)), "ratio": ratio(all_),
                "ratio_se": float(np.std(finite)) if len(finite) > 1 else math.nan,
            }  # fmt: skip
    return {"hours": math.inf, "interactions": math.inf, "power": math.nan, "ratio": math.nan,
            "ratio_se": math.nan}  # fmt: skip


def promoted_by(out: Outcome, hours: tuple[float, ...]) -> dict[float, dict[str, float]]:
    """At each of ``hours``: the share of canaries the sequential test has promoted by then,
    and the share the fixed-horizon test of the same estimator promotes when judged once at
    that look with all of alpha (binomial standard errors). Under the estimator's Gaussian
    approximation its value at a look is sufficient for the effect, so no test of it that
    keeps alpha over the canary promotes more often by then than the fixed test there: a
    ceiling on how soon this estimator can promote, whatever the boundaries."""
    done = np.where(out.decision == PROMOTE, out.hours, math.inf)
    ceiling: dict[float, dict[str, float]] = {}
    for h in hours:
        look = next((f for f in out.fixed if f[0] >= h - 1e-9), None)
        if look is None:
            continue
        ceiling[h] = {
            "look_h": look[0],
            "sequential": float(np.mean(done <= look[0])),
            "fixed": float(np.mean(look[2])),
            "se": math.sqrt(max(float(np.mean(look[2])) * (1 - float(np.mean(look[2]))), 0.0)
                            / max(look[2].size, 1)),
        }  # fmt: skip
    return ceiling


def cell(value: tuple[float, float], digits: int = 3) -> str:
    v, se = value
    if not math.isfinite(v):
        return "-"
    return f"{v:.{digits}f} ± {se:.{digits}f}" if math.isfinite(se) else f"{v:.{digits}f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experiments", type=int, default=400)
    parser.add_argument("--chunk", type=int, default=25)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--seed", type=int, default=31)
    parser.add_argument("--only", action="append", help="scenarios whose name contains this")
    parser.add_argument("--methods", choices=("all", "today-after", "explore"), default="all")
    parser.add_argument("--json", type=Path, help="write every figure here too")
    args = parser.parse_args()
    chosen = [s for s in scenarios() if not args.only or any(o in s.canary.name for o in args.only)]
    if args.methods == "explore":
        chosen = [replace(s, methods=EXPLORE) for s in chosen]
    if args.methods == "today-after":
        chosen = [
            replace(s, methods=REQUEST_METHODS if s.canary.unit == "request"
                    else (TODAY, AFTER, NO_CAPTURE))
            for s in chosen
        ]  # fmt: skip
    rng = np.random.default_rng(args.seed)
    jobs = []
    for sc in chosen:
        total = max(1, round(args.experiments * sc.experiments))
        for begin in range(0, total, args.chunk):
            jobs.append((sc, min(args.chunk, total - begin), int(rng.integers(2**63))))
    clock = time.perf_counter()
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        parts = list(pool.map(run_chunk, jobs))
    seconds = time.perf_counter() - clock
    pop = Population()
    print(
        f"# analysis calibration: {pop.users:,} users (lognormal activity sd {pop.activity_sigma}, "
        f"day-to-day sd {pop.activity_day_sigma}), {pop.new_share:.0%} new during the canary, "
        f"{pop.traffic:,.0f} interactions/h, maturity {pop.maturity:g} h, per-user rates "
        f"{pop.persistence:.0%} lasting, org and prompt length explaining "
        f"{pop.org_share:.0%} and {pop.prompt_share:.0%} of their lasting part, daily drift "
        f"{pop.drift[0]:.0%}-{pop.drift[1]:.0%}; steps 5%/30m, 25%/1h, 50%; maxDuration "
        f"{pop.hours:g} h; alpha 0.05; {len(jobs)} chunks in {seconds:.0f} s"
    )
    report: dict[str, Any] = {}
    for sc in chosen:
        mine = [part for job, part in zip(jobs, parts, strict=True) if job[0] is sc]
        print(f"\n## {sc.canary.name} ({sum(j[1] for j in jobs if j[0] is sc)} canaries)")
        report[sc.canary.name] = {}
        for method in sc.methods:
            out = mine[0][method.label]
            for other in mine[1:]:
                out = out.join(other[method.label])
            fig = summarise(out, rng)
            if sc.canary.effective:
                fig["fixed_horizon"] = fixed_horizon(out, fig["promoted"][0], rng)
                fig["promoted_by"] = promoted_by(out, CEILING_HOURS)
            report[sc.canary.name][method.label] = fig
            line = (
                f"{method.label:70} promoted {cell(fig['promoted'])}  rolled back "
                f"{cell(fig['rolled_back_on_evidence'])} (srm {fig['rollback_srm'][0]:.3f}, "
                f"guardrail {fig['rollback_guardrail'][0]:.3f}, "
                f"goal {fig['rollback_goal_worse'][0]:.3f})"
                f"  median h {cell(fig['median_hours_to_promote'], 1)}  interactions "
                f"{fig['mean_interactions'][0]:,.0f}"
            )
            if "fixed_horizon" in fig:
                fh = fig["fixed_horizon"]
                line += (f"  fixed horizon: {fh['hours']:g} h {fh['interactions']:,.0f} "
                         f"(ratio {fh['ratio']:.2f} ± {fh['ratio_se']:.2f})")  # fmt: skip
            print(line)
            if "promoted_by" in fig:
                print("    promoted by the hour, sequential / fixed horizon there (the "
                      "ceiling): " + ", ".join(
                          f"{h:g} h {c['sequential']:.3f} / {c['fixed']:.3f} ± {c['se']:.3f}"
                          for h, c in fig["promoted_by"].items()))  # fmt: skip
        reduction = report[sc.canary.name][sc.methods[-1].label]["reduction"]
        print("  variance reduction of edit persistence (new / returning users): " + ", ".join(
            f"{k} {v:.2f}" for k, v in reduction.items()
        ))  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
