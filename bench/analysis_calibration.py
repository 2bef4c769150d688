"""Calibration of the canary analysis in a realistic user population (work in progress)."""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from statistics import NormalDist
from typing import Any

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "src")]

from rtrl.core.api.rlcycle import AnalysisSpec, GuardrailsSpec  # noqa: E402
from rtrl_trainer.analyze.estimate import Difference, difference  # noqa: E402
from rtrl_trainer.analyze.rule import (  # noqa: E402
    CONTINUE,
    GOAL_WORSE,
    GUARDRAIL,
    POLICY_ROLLBACK,
    PROMOTE,
    ROLLBACK,
    SRM,
    judge,
    plan,
)
from rtrl_trainer.analyze.srm import SRM_HOLD_P, srm_steps  # noqa: E402

from bench.analysis_population import (  # noqa: E402
    BLOG,
    METRICS,
    Canary,
    Look,
    Population,
    simulate,
)
from bench.analysis_stats import own_history, srm_counts, unit_sums  # noqa: E402


@dataclass
class Outcome:
    decision: np.ndarray
    cause: np.ndarray
    hours: np.ndarray
    interactions: np.ndarray
    first_better: np.ndarray
    # per look: hours, matured interactions, fixed-horizon promote, fixed-horizon rollback
    fixed: list[tuple[float, np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=list)

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
        )  # fmt: skip


SPEC = AnalysisSpec()
GUARDS = GuardrailsSpec()


class Mixture:
    """Today's analysis: mSPRT mixture intervals, CUPED on each user's own history,
    sample-ratio test on units with its promotion hold."""

    label = "mixture (today)"

    def __init__(self, unit: str, e: int) -> None:
        self.unit = unit
        self.metrics = plan(SPEC, GUARDS)
        self.goal_alpha = next(m.alpha for m in self.metrics if m.name == "edit_persistence")
        self.out = Outcome.empty(e)

    def diffs(self, look: Look) -> dict[str, Difference]:
        found = {}
        for name in METRICS:
            cov = own_history(look, name)
            totals, gram, units = unit_sums(look.x[name], look.n[name], look.xx[name], cov, self.unit)
            found[name] = difference(totals, gram, units, adjust=cov is not None)
        return found

    def look(self, look: Look) -> None:
        diffs = self.diffs(look)
        base, cand = srm_counts(look, self.unit)
        srm = srm_steps(base, cand, look.shares, SPEC.srm_alpha)
        j = judge(
            self.metrics, diffs, srm_mismatch=srm.mismatch,
            srm_suspect=np.asarray(srm.p_value) <= SRM_HOLD_P, max_duration_reached=look.last,
        )  # fmt: skip
        self.out.record(look, j.decision, j.cause, np.asarray(j.verdicts["edit_persistence"]) == 1)
        self.out.fixed.append((look.hours, look.matured.copy(), *fixed_test(diffs, self.goal_alpha)))


def fixed_test(diffs: dict[str, Difference], alpha: float) -> tuple[np.ndarray, np.ndarray]:
    """(promote, rollback) of a fixed-horizon z-test on the goals at this look, the same
    estimator, the sequential rule's logic (promote: edit persistence better, no goal worse)."""
    z = NormalDist().inv_cdf(1 - alpha / 2)
    worse: Any = False
    better: Any = False
    for name in ("edit_persistence", "dissatisfied_followup_rate", "latency_ms"):
        d = diffs[name]
        radius = z * np.sqrt(np.asarray(d.log_var))
        up = np.asarray(d.log_ratio) - radius > 0
        down = np.asarray(d.log_ratio) + radius < 0
        worse = worse | (down if name == "edit_persistence" else up)
        if name == "edit_persistence":
            better = up
    return np.asarray(better & ~worse), np.asarray(worse)


def run_chunk(job: tuple[Population, Canary, int, int, tuple[str, ...]]) -> dict[str, Outcome]:
    pop, canary, e, seed, labels = job
    methods = {label: METHODS[label](canary.unit, e) for label in labels}

    def on_look(look: Look) -> None:
        for m in methods.values():
            m.look(look)

    simulate(np.random.default_rng(seed), pop, canary, e, on_look)
    return {label: m.out for label, m in methods.items()}


METHODS: dict[str, Any] = {"mixture": Mixture}


def proportion(mask: np.ndarray) -> tuple[float, float]:
    p = float(np.mean(mask))
    return p, math.sqrt(p * (1 - p) / mask.size)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--experiments", type=int, default=40)
    parser.add_argument("--chunk", type=int, default=20)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--seed", type=int, default=31)
    parser.add_argument("--only", default="")
    parser.add_argument("--persistence", type=float, default=0.95)
    parser.add_argument("--sigma", type=float, default=1.3)
    args = parser.parse_args()
    pop = Population(persistence=args.persistence, activity_sigma=args.sigma)
    scenarios = [
        Canary("user A/A"),
        Canary("user A/B", effect=BLOG),
        Canary("novelty (canary's first 2 h)", novelty="canary"),
        Canary("novelty (each user's first 2 h)", novelty="user"),
        Canary("biased 3% row loss, user", row_loss=0.03, biased_loss=True),
        Canary("biased 3% row loss, request", unit="request", row_loss=0.03, biased_loss=True),
    ]
    scenarios = [s for s in scenarios if args.only in s.name]
    rng = np.random.default_rng(args.seed)
    jobs = []
    for sc in scenarios:
        for begin in range(0, args.experiments, args.chunk):
            size = min(args.chunk, args.experiments - begin)
            jobs.append((pop, sc, size, int(rng.integers(2**63)), tuple(METHODS)))
    clock = time.perf_counter()
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        parts = list(pool.map(run_chunk, jobs))
    print(f"simulated in {time.perf_counter() - clock:.0f} s")
    for sc in scenarios:
        mine = [part for job, part in zip(jobs, parts, strict=True) if job[1] is sc]
        for label in METHODS:
            out = mine[0][label]
            for other in mine[1:]:
                out = out.join(other[label])
            promote = out.decision == PROMOTE
            evidence = (out.decision == ROLLBACK) & (out.cause != POLICY_ROLLBACK)
            p, se = proportion(promote)
            r, rse = proportion(evidence)
            hours = np.median(out.hours[promote]) if promote.any() else math.nan
            print(f"{sc.name:40} {label:16} promote {p:.3f} ± {se:.3f}  rollback {r:.3f} ± {rse:.3f}"
                  f"  median h {hours:.1f}  mean interactions {np.mean(out.interactions):,.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
