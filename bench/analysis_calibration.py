"""Calibration of the canary analysis on the operator's real timeline, with real users:
error under A/A despite peeking, power and time to a decision at the blog's effect sizes,
sample-ratio detection, side by side with a fixed-horizon test and with and without
variance reduction.

The timeline is the operator's defaults: ``--traffic`` interactions per hour, feedback
matures after ``--maturity``, steps 5% for 30 min, 25% for 1 h, then 50% (the last step
holds until a decision), one analysis at the end of each step's minDuration and every
15 min in the last step, maxDuration 24 h (inconclusive: rollback). Time runs in 15-minute
blocks.

Users are what makes it real: ``--users`` of them, with lognormal activity (some send ten
times the median), each with their own base rates (a Beta per user with the intra-user
correlation ``--icc``: edit persistence about 0.45, dissatisfied follow-ups about 0.10,
edit rate 0.80, clarifying questions 0.05) and their own latency level (lognormal, about 8 s),
and every base rate drifts by +-10% over the day. With ``unit user`` each user's bucket
(hash mod 100) puts all their requests in one arm, the canary taking buckets below the
weight (as the gatewayapi router does); with ``unit request`` every request is split on its
own. The stable arm's last 24 h before the canary give each user's pre-exposure covariates.

Every look runs the real decision rule (:func:`rtrl_trainer.analyze.rule.judge` on
:func:`rtrl_trainer.analyze.estimate.difference`: per-unit variances, strata by step, CUPED,
log-ratio intervals, the sample-ratio test over every step); ``rows as unit`` is the
previous analysis (each row its own unit, all steps pooled, no covariates). The fixed
horizon is what a team would otherwise run: one z-test at the same per-metric alpha, with
the same estimator, at the first time its power on the same simulated canaries reaches the
sequential test's.

Run: ``python bench/analysis_calibration.py`` (about 10 minutes on two cores;
``--experiments 100`` for a quick look).
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from statistics import NormalDist
from typing import Any

# One BLAS thread per process: the Gram matrices are small, and OpenBLAS's spinning threads
# slow a loaded machine down several-fold; the workers run in parallel instead.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "src")]

from rtrl.core.api.rlcycle import AnalysisSpec, GuardrailsSpec  # noqa: E402
from rtrl_trainer.analyze.estimate import Difference, Q, difference, independent  # noqa: E402
from rtrl_trainer.analyze.rule import (  # noqa: E402
    CONTINUE,
    GOAL_WORSE,
    GUARDRAIL,
    PROMOTE,
    ROLLBACK,
    SRM,
    judge,
    plan,
)
from rtrl_trainer.analyze.srm import SRM_HOLD_P, srm_steps  # noqa: E402

BLOCK_H = 0.25
STEPS = ((5, 0.5), (25, 1.0), (50, None))  # (weight, minDuration in hours; None: holds)
INTERVAL_H = 0.25
MAX_H = 24.0
PRE_H = 168.0  # analysis.preExposure: 7d
BASE = {"edit": 0.45, "dissatisfied": 0.10, "edit_rate": 0.80, "clarification": 0.05}
FEEDBACK_MISSING = 0.05
LATENCY_MS, LATENCY_SIGMA = 8000.0, 0.8  # mean, lognormal shape of one request
# The blog's effects: edit persistence +2.28%, dissatisfied follow-ups -3.13%, latency -10.3%.
EFFECTS = {"edit": 1.0228, "dissatisfied": 1 - 0.0313, "latency": 1 - 0.103}
BERNOULLI = (
    ("edit_persistence", "edit"),
    ("dissatisfied_followup_rate", "dissatisfied"),
    ("edit_rate", "edit_rate"),
    ("clarification_rate", "clarification"),
)
METRICS = (*(m for m, _ in BERNOULLI), "latency_ms", "feedback_missing_rate")


def step_of(hours: float) -> int:
    start = 0.0
    for i, (_, length) in enumerate(STEPS):
        if length is None or hours < start + length:
            return i
        start += length
    return len(STEPS) - 1


def look_times() -> list[float]:
    """The operator's analyses: at the end of each step's minDuration, then every interval."""
    times, start = [], 0.0
    for _, length in STEPS[:-1]:
        start += length or 0.0
        times.append(start)
    t = start + 1.0  # the last step's minDuration (1 h)
    while t <= MAX_H + 1e-9:
        times.append(round(t, 4))
        t += INTERVAL_H
    return times


@dataclass
class Scenario:
    name: str
    unit: str  # "user" or "request"
    icc: float
    effect: dict[str, float] = field(default_factory=dict)
    row_loss: float = 0.0  # share of canary rows never logged
    user_loss: float = 0.0  # share of canary users whose rows are never logged


@dataclass
class Outcome:
    decision: np.ndarray
    cause: np.ndarray
    at_hours: np.ndarray
    interactions: np.ndarray  # matured interactions at the decision
    first_srm: np.ndarray  # hours of the first sample-ratio flag (inf: none)
    first_promote: np.ndarray  # hours of the first promotion verdict (inf: none)
    # per look: (hours, matured interactions per canary, fixed-horizon promote, rollback)
    fixed: list[tuple[float, np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=list)

    def extend(self, other: Outcome) -> Outcome:
        joined = [
            (h, np.concatenate([r, r2]), np.concatenate([p, p2]), np.concatenate([b, b2]))
            for (h, r, p, b), (_, r2, p2, b2) in zip(self.fixed, other.fixed, strict=True)
        ]
        return Outcome(
            *(np.concatenate([getattr(self, f), getattr(other, f)]) for f in (
                "decision", "cause", "at_hours", "interactions", "first_srm", "first_promote"
            )),
            fixed=joined,
        )  # fmt: skip


def beta_rates(rng: np.random.Generator, mean: float, icc: float, shape: tuple[int, int]) -> Any:
    total = 1 / icc - 1
    return rng.beta(mean * total, (1 - mean) * total, size=shape)


def simulate(
    rng: np.random.Generator, sc: Scenario, args: argparse.Namespace
) -> dict[str, Outcome]:
    e, u = args.size, args.users
    shape = (e, u)
    activity = rng.lognormal(0.0, 1.0, size=shape)
    rate = activity / activity.sum(axis=1, keepdims=True) * args.traffic  # per hour
    bucket = rng.integers(0, 100, size=shape)
    p = {key: beta_rates(rng, BASE[key], sc.icc, shape) for _, key in BERNOULLI}
    # latency: a user's level (log scale) carries icc of the log-latency variance
    sd_user = LATENCY_SIGMA * math.sqrt(sc.icc)
    sd_req = LATENCY_SIGMA * math.sqrt(1 - sc.icc)
    mu = math.log(LATENCY_MS) - LATENCY_SIGMA**2 / 2 + rng.normal(0, sd_user, size=shape)
    m_req = np.exp(mu + sd_req**2 / 2)
    v_req = (math.exp(sd_req**2) - 1) * m_req**2
    phase = rng.uniform(0, 2 * math.pi, size=(e, 1))
    lost_user = rng.random(shape) < sc.user_loss

    # Pre-exposure covariates: each user's metrics on the stable arm over the last 24 h.
    k_pre = rng.poisson(rate * args.pre_hours).astype(np.float64)
    cov: dict[str, np.ndarray] = {}
    for name, key in BERNOULLI:
        x = rng.binomial(k_pre.astype(np.int64), p[key]).astype(np.float64)
        pooled = x.sum(axis=1, keepdims=True) / k_pre.sum(axis=1, keepdims=True)
        cov[name] = np.where(k_pre > 0, x / np.maximum(k_pre, 1), pooled)
    lat = np.maximum(rng.normal(k_pre * m_req, np.sqrt(k_pre * v_req)), 0.0)
    pooled = lat.sum(axis=1, keepdims=True) / k_pre.sum(axis=1, keepdims=True)
    cov["latency_ms"] = np.where(k_pre > 0, lat / np.maximum(k_pre, 1), pooled)
    cov["feedback_missing_rate"] = np.full(shape, FEEDBACK_MISSING)

    strata = len(STEPS)
    # Matured sums per (metric, arm, stratum): x, n, xx per user.
    sums = {m: np.zeros((2, strata, 3, e, u)) for m in METRICS}
    seen = np.zeros((strata, e, u), dtype=bool)  # the user had a row in the step (SRM)
    seen_arm = np.zeros((strata, e, u), dtype=np.int8)
    srm_rows = np.zeros((strata, 2, e))  # request unit: rows per step and arm
    pending: list[tuple[float, dict[str, np.ndarray]]] = []  # blocks not yet matured
    looks = look_times()
    results = {
        label: Outcome(
            decision=np.full(e, CONTINUE), cause=np.zeros(e, dtype=np.int64),
            at_hours=np.full(e, MAX_H), interactions=np.zeros(e),
            first_srm=np.full(e, np.inf), first_promote=np.full(e, np.inf),
        )
        for label in args.variants
    }  # fmt: skip
    analysis = AnalysisSpec(alpha=0.05, srm_alpha=args.srm_alpha)
    guardrails = GuardrailsSpec(invalid_tool_call_rate=None)
    metrics = plan(analysis, guardrails)
    goal_alpha = next(m.alpha for m in metrics if m.name == "edit_persistence")
    blocks = round(MAX_H / BLOCK_H)
    matured_rows = np.zeros(e)
    look_index = 0
    for b in range(blocks):
        t0 = b * BLOCK_H
        s = step_of(t0)
        weight = STEPS[s][0] / 100
        drift = 1 + 0.1 * np.sin(2 * math.pi * (t0 + BLOCK_H / 2) / 24 + phase)
        k = rng.poisson(rate * BLOCK_H)
        if sc.unit == "user":
            canary_k = np.where(bucket < STEPS[s][0], k, 0)
        else:
            canary_k = rng.binomial(k, weight)
        arms_k = [k - canary_k, canary_k]
        if sc.row_loss:
            arms_k[1] = rng.binomial(arms_k[1], 1 - sc.row_loss)
        if sc.user_loss:
            arms_k[1] = np.where(lost_user, 0, arms_k[1])
        block: dict[str, np.ndarray] = {}
        for a in (0, 1):
            n = arms_k[a].astype(np.float64)
            f = sc.effect if a == 1 else {}
            for name, key in BERNOULLI:
                prob = np.clip(p[key] * drift * f.get(key, 1.0), 0, 1)
                x = rng.binomial(arms_k[a], prob).astype(np.float64)
                block[f"{name}/{a}"] = np.stack([x, n, x])
            scale = drift * f.get("latency", 1.0)
            m_, v_ = m_req * scale, v_req * scale**2
            x = np.maximum(rng.normal(n * m_, np.sqrt(n * v_)), 0.0)
            block[f"latency_ms/{a}"] = np.stack([x, n, n * (v_ + m_**2)])
            miss = rng.binomial(arms_k[a], FEEDBACK_MISSING).astype(np.float64)
            block[f"feedback_missing_rate/{a}"] = np.stack([miss, n, miss])
            srm_rows[s, a] += n.sum(axis=1)
        rows = k > 0
        canary_rows = arms_k[1] > 0
        seen_arm[s] = np.where(~seen[s] & rows, np.where(canary_rows, 1, 0), seen_arm[s])
        if sc.unit == "user":  # a lost user never reaches the logs
            arrived = rows & ~(lost_user & (bucket < STEPS[s][0]))
            seen[s] |= arrived
        pending.append((t0 + BLOCK_H, block | {"stratum": np.array(s)}))
        now = t0 + BLOCK_H
        # Blocks whose every row is older than the maturity are added to the sums.
        while pending and pending[0][0] <= now - args.maturity + 1e-9:
            _, done = pending.pop(0)
            st = int(done["stratum"])
            for name in METRICS:
                for a in (0, 1):
                    sums[name][a, st] += done[f"{name}/{a}"]
            matured_rows += sum(done[f"edit_persistence/{a}"][1].sum(axis=1) for a in (0, 1))
        if look_index >= len(looks) or abs(looks[look_index] - now) > 1e-6:
            continue
        look_index += 1
        last = now >= MAX_H - 1e-9
        steps_so_far = step_of(now - 1e-9) + 1
        # SRM: units (users) or rows per step and arm, counted at assignment.
        if sc.unit == "user":
            counts = [
                [np.sum(seen[i] & (seen_arm[i] == a), axis=1) for i in range(steps_so_far)]
                for a in (0, 1)
            ]
        else:
            counts = [[srm_rows[i, a] for i in range(steps_so_far)] for a in (0, 1)]
        srm = srm_steps(
            counts[0], counts[1], [STEPS[i][0] / 100 for i in range(steps_so_far)],
            analysis.srm_alpha,
        )  # fmt: skip
        variants = estimates(sums, cov, sc.unit)
        for label in args.variants:
            diffs = variants[label]
            old = label == "rows"  # the previous analysis had no sample-ratio look this early
            j = judge(
                metrics, diffs, srm_mismatch=False if old else srm.mismatch,
                srm_suspect=False if old else np.asarray(srm.p_value) <= SRM_HOLD_P,
                max_duration_reached=last,
            )  # fmt: skip
            out = results[label]
            decision = np.asarray(j.decision)
            open_ = out.decision == CONTINUE
            new = open_ & ((decision != CONTINUE) | last)
            out.decision[new] = decision[new]
            out.cause[new] = np.asarray(j.cause)[new]
            out.at_hours[new] = now
            out.interactions[new] = matured_rows[new]
            mism = np.asarray(srm.mismatch) & np.isinf(out.first_srm)
            out.first_srm[mism] = now
            better = np.asarray(j.verdicts["edit_persistence"]) == 1
            out.first_promote[better & np.isinf(out.first_promote)] = now
            out.fixed.append((now, matured_rows.copy(), *fixed_test(diffs, goal_alpha)))
    return results


def fixed_test(diffs: dict[str, Difference], alpha: float) -> tuple[np.ndarray, np.ndarray]:
    """(promote, rollback) of a fixed-horizon z-test at this look on the goals, with the
    sequential rule (promote when edit persistence is better and no goal worse)."""
    z = NormalDist().inv_cdf(1 - alpha / 2)
    worse: Any = False
    better: Any = False
    for name in ("edit_persistence", "dissatisfied_followup_rate", "latency_ms"):
        d = diffs[name]
        radius = z * np.sqrt(np.asarray(d.var))
        up = np.asarray(d.difference) - radius > 0
        down = np.asarray(d.difference) + radius < 0
        worse = worse | (down if name == "edit_persistence" else up)
        if name == "edit_persistence":
            better = up
    return np.asarray(better & ~worse), np.asarray(worse)


def estimates(
    sums: dict[str, np.ndarray], cov: dict[str, np.ndarray], unit: str
) -> dict[str, dict[str, Difference]]:
    """Every metric's difference at this look, as the analysis step computes it (with and
    without CUPED), and as the previous analysis did (rows as the unit, steps pooled)."""
    found: dict[str, dict[str, Difference]] = {"cuped": {}, "plain": {}, "rows": {}}
    for name, per in sums.items():
        x, n, xx = per[:, :, 0], per[:, :, 1], per[:, :, 2]  # [arm, stratum, e, u]
        arm_x, arm_n, arm_xx = (v.sum(axis=(1, 3)) for v in (x, n, xx))
        with np.errstate(all="ignore"):
            mean = arm_x / arm_n
            var = (arm_xx / arm_n - mean**2) / (arm_n - 1)
        found["rows"][name] = independent(
            mean[0], var[0], arm_n[0], mean[1], var[1], arm_n[1], arm_x[0], arm_x[1]
        )
        c = cov[name][None, None]
        z = n * c
        totals = np.stack([x.sum(-1), n.sum(-1), z.sum(-1)], axis=-1)  # [arm, stratum, e, 3]
        totals = np.moveaxis(totals, 2, 0)  # [e, arm, stratum, 3]
        e_, strata = totals.shape[0], totals.shape[2]
        k = 2 * strata * Q
        if unit == "user":
            v = np.stack([x, n, z], axis=2).reshape(k, e_, -1).transpose(1, 0, 2)  # [e, k, u]
            gram = np.matmul(v, v.transpose(0, 2, 1))
            units = np.sum(np.any(n > 0, axis=(0, 1)), axis=-1)
        else:  # every row its own unit: the Gram matrix is block-diagonal by cell
            gram = np.zeros((e_, k, k))
            cc = cov[name]
            for a in range(2):
                for s in range(strata):
                    at = (a * strata + s) * Q
                    xs, ns, xxs = x[a, s], n[a, s], xx[a, s]
                    sx, sn = xs.sum(-1), ns.sum(-1)
                    sxz, snz, szz = (cc * xs).sum(-1), (cc * ns).sum(-1), (cc**2 * ns).sum(-1)
                    block = np.stack(
                        [np.stack(r, -1) for r in (
                            (xxs.sum(-1), sx, sxz), (sx, sn, snz), (sxz, snz, szz)
                        )], -2,
                    )  # fmt: skip
                    gram[:, at : at + Q, at : at + Q] = block
            units = n.sum(axis=(0, 1, 3))
        found["cuped"][name] = difference(totals, gram, units, adjust=True)
        found["plain"][name] = difference(totals, gram, units, adjust=False)
    return found


def summarise(out: Outcome, effect: bool) -> dict[str, float]:
    evidence = out.cause != 5  # POLICY_ROLLBACK: maxDuration, not a verdict
    promote = out.decision == PROMOTE
    rollback = (out.decision == ROLLBACK) & evidence
    rolled = out.decision == ROLLBACK
    return {
        "false_promotion": float(np.mean(promote)) if not effect else math.nan,
        "false_rollback": float(np.mean(rollback)) if not effect else math.nan,
        "power": float(np.mean(promote)) if effect else math.nan,
        "wrong_rollback": float(np.mean(rollback)) if effect else math.nan,
        "hours": float(np.mean(out.at_hours)),
        "interactions": float(np.mean(out.interactions)),
        "srm_rollbacks": float(np.mean(rolled & (out.cause == SRM))),
        "guardrail_rollbacks": float(np.mean(rolled & (out.cause == GUARDRAIL))),
        "goal_rollbacks": float(np.mean(rolled & (out.cause == GOAL_WORSE))),
        "promoted_before_srm": float(np.mean(promote & (out.first_srm >= out.at_hours))),
    }  # fmt: skip


def fixed_horizon(
    ab: Outcome, aa: Outcome, power: float
) -> tuple[float, float, float, float, float]:
    """The first look at which the fixed-horizon test's power reaches ``power``: (hours,
    mean matured interactions, its power, its A/A false promotion, false rollback)."""
    for (hours, rows, promote, _), (_, _, aa_promote, aa_rollback) in zip(
        ab.fixed, aa.fixed, strict=True
    ):
        if np.mean(promote) >= power:
            return (
                hours, float(np.mean(rows)), float(np.mean(promote)),
                float(np.mean(aa_promote)), float(np.mean(aa_rollback)),
            )  # fmt: skip
    return math.inf, math.inf, math.nan, math.nan, math.nan


def _chunk(job: tuple[Scenario, int, int, argparse.Namespace]) -> dict[str, Outcome]:
    sc, size, seed, args = job
    args = argparse.Namespace(**{**vars(args), "size": size})
    return simulate(np.random.default_rng(seed), sc, args)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experiments", type=int, default=400)
    parser.add_argument("--users", type=int, default=4000)
    parser.add_argument("--traffic", type=float, default=10_000, help="interactions per hour")
    parser.add_argument("--maturity", type=float, default=1.0, help="hours")
    parser.add_argument("--seed", type=int, default=17)
    parser.add_argument(
        "--pre-hours", type=float, default=PRE_H, help="pre-exposure window (covariates)"
    )
    parser.add_argument(
        "--srm-alpha", type=float, default=AnalysisSpec().srm_alpha, help="analysis.srmAlpha"
    )
    parser.add_argument("--chunk", type=int, default=50, help="experiments simulated at once")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--only", help="run only the scenarios whose name contains this")
    args = parser.parse_args()
    args.variants = ("cuped", "plain", "rows")
    rng = np.random.default_rng(args.seed)
    clock = time.perf_counter()
    scenarios = [
        Scenario("user A/A icc 0.1", "user", 0.1),
        Scenario("user A/B icc 0.1", "user", 0.1, EFFECTS),
        Scenario("user A/A icc 0.2", "user", 0.2),
        Scenario("user A/B icc 0.2", "user", 0.2, EFFECTS),
        Scenario("request A/A icc 0.1", "request", 0.1),
        Scenario("request A/B icc 0.1", "request", 0.1, EFFECTS),
        Scenario("request A/B, 3% canary rows lost", "request", 0.1, EFFECTS, row_loss=0.03),
        Scenario("user A/B, 3% canary users lost", "user", 0.1, EFFECTS, user_loss=0.03),
    ]
    if args.only:
        scenarios = [sc for sc in scenarios if args.only in sc.name]
    runs = {}
    jobs = []
    for sc in scenarios:
        for begin in range(0, args.experiments, args.chunk):
            size = min(args.chunk, args.experiments - begin)
            jobs.append((sc, size, int(rng.integers(2**63))))
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        parts = list(pool.map(_chunk, [(sc, size, seed, args) for sc, size, seed in jobs]))
    for sc in scenarios:
        mine = [part for (job_sc, _, _), part in zip(jobs, parts, strict=True) if job_sc is sc]
        runs[sc.name] = {
            v: functools.reduce(Outcome.extend, (part[v] for part in mine)) for v in mine[0]
        }
    seconds = time.perf_counter() - clock
    print(
        f"# analysis calibration: {args.experiments} canaries per scenario, {args.users:,} users "
        f"(lognormal activity), {args.traffic:,.0f} interactions/h, maturity "
        f"{args.maturity:g} h, steps 5%/30m, 25%/1h, 50% (analyses at 0.5 h, 1.5 h, then "
        f"every 15 min from 2.5 h), maxDuration {MAX_H:g} h, base rates drifting +-10% a day; "
        f"alpha 0.05; simulated in {seconds:.0f} s"
    )
    print(
        f"# A/B effects: edit persistence {100 * (EFFECTS['edit'] - 1):+.2f}% at "
        f"{BASE['edit']}, dissatisfied follow-ups {100 * (EFFECTS['dissatisfied'] - 1):+.2f}% "
        f"at {BASE['dissatisfied']}, latency {100 * (EFFECTS['latency'] - 1):+.1f}% "
        f"(about {LATENCY_MS / 1000:g} s)"
    )
    print()
    labels = {"cuped": "CUPED", "plain": "no CUPED", "rows": "rows as unit (old)"}
    header = f"{'':40}" + "".join(f"{labels[v]:>20}" for v in args.variants)
    print(header)
    print("-" * len(header))
    figures: dict[str, dict[str, dict[str, float]]] = {}
    for sc in scenarios:
        effect = bool(sc.effect)
        figures[sc.name] = {v: summarise(runs[sc.name][v], effect) for v in args.variants}
        keys = (
            ("power", "wrong_rollback", "hours", "interactions")
            if effect
            else ("false_promotion", "false_rollback", "srm_rollbacks")
        )
        if sc.row_loss or sc.user_loss:
            keys = ("srm_rollbacks", "promoted_before_srm", "hours")
        for key in keys:
            cells = []
            for v in args.variants:
                value = figures[sc.name][v][key]
                cells.append(f"{value:>20,.0f}" if key == "interactions" else f"{value:>20.3f}")
            print(f"{sc.name + ': ' + key:40}" + "".join(cells))
    print()
    goals = []
    for icc in ("0.1", "0.2"):
        if f"user A/A icc {icc}" not in figures or f"user A/B icc {icc}" not in figures:
            continue
        aa = figures[f"user A/A icc {icc}"]["cuped"]
        error = aa["false_promotion"] + aa["false_rollback"]
        goals.append((f"A/A family-wise error <= 0.05, unit user, icc {icc}, drift", error <= 0.05,
                      f"{error:.3f} (false promotion {aa['false_promotion']:.3f}, false rollback "
                      f"{aa['false_rollback']:.3f})"))  # fmt: skip
        ab = figures[f"user A/B icc {icc}"]["cuped"]
        goals.append((f"power >= 0.9 within maxDuration, unit user, icc {icc}", ab["power"] >= 0.9,
                      f"{ab['power']:.3f}, mean {ab['hours']:.1f} h"))  # fmt: skip
    for icc in ("0.1", "0.2"):
        if f"user A/A icc {icc}" not in figures or f"user A/B icc {icc}" not in figures:
            continue
        ab_runs, aa_runs = runs[f"user A/B icc {icc}"], runs[f"user A/A icc {icc}"]
        seq = figures[f"user A/B icc {icc}"]["cuped"]
        for variant in ("plain", "cuped"):
            hours, rows, power, fp, fr = fixed_horizon(
                ab_runs[variant], aa_runs[variant], seq["power"]
            )
            ratio = seq["interactions"] / rows if math.isfinite(rows) else 0.0
            goals.append(
                (
                    f"interactions to a decision <= 0.6x fixed horizon ({labels[variant]}), "
                    f"icc {icc}",
                    ratio <= 0.6,
                    (
                        f"sequential+CUPED {seq['interactions']:,.0f} ({seq['hours']:.1f} h) vs "
                        f"fixed {rows:,.0f} ({hours:.1f} h) at power {power:.3f} = {ratio:.2f}x; "
                        f"fixed A/A false promotion {fp:.3f}, false rollback {fr:.3f}"
                    )
                    if math.isfinite(rows)
                    else f"the fixed test never reaches power {seq['power']:.3f} within "
                    f"{MAX_H:g} h",
                )
            )
    for name in ("request A/B, 3% canary rows lost", "user A/B, 3% canary users lost"):
        if name not in figures:
            continue
        row = figures[name]["cuped"]
        goals.append((f"SRM flagged before any promotion >= 0.95 ({name})",
                      row["srm_rollbacks"] >= 0.95,
                      f"{row['srm_rollbacks']:.3f} rolled back for the sample ratio; promoted "
                      f"first {row['promoted_before_srm']:.3f}"))  # fmt: skip
    for name, met, text in goals:
        print(f"goal: {name}: {'met' if met else 'NOT met'} ({text})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
