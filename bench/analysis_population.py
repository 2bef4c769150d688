"""Simulated canaries in a realistic user population, for bench/analysis_calibration.py and
its tests: the interactions each arm logs, summed per user and per 5-minute block, vectorised
over many canaries at once.

The population (the issue's, issue 31): ``users`` users with lognormal activity (sd 1.3 on
the log scale: the busiest few send over 100 times the median), ``new_share`` of them new
during the canary (they arrive at a uniform time in the 24 h and have no history), the rest
with ``pre_hours`` of history on the stable arm. Each user has their own base rate of every
metric (logit-normal, intra-user correlation ``icc``), part of it explained by what a shard
carries before any response: the user's ``org`` (``org_share`` of the between-user variance)
and their typical prompt length (``prompt_share``; a request's prompt length is the typical one
with lognormal noise). Every base rate drifts by a daily sine of 10-20% amplitude. Latency is
lognormal per request around a per-user level (the same shares). 5% of interactions never get
their feedback.

Time runs in 5-minute blocks; the canary follows the operator's default steps (5% for 30 min,
25% for 1 h, then 50%); rows mature ``maturity`` after the end of their block. With ``unit
user`` a user's hash bucket puts all their requests in one arm (the canary takes the buckets
below its weight, as the gatewayapi router does); with ``unit request`` each request is drawn.

What a look sees (:class:`Look`) is what the analyze step computes from the shards: per user,
arm and step, the sums of every metric over the matured rows, the rows created so far, and
covariates from the pre-exposure rows; the same sums over "settled" rows (created at least
``settle_blocks`` blocks after the user's first row in the arm and after their step began)
for the novelty rule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rtrl_trainer.analyze.covariates import prompt_bin

BLOCK_H = 5 / 60
STEPS: tuple[tuple[int, float | None], ...] = ((5, 0.5), (25, 1.0), (50, None))
BASE = {"edit": 0.45, "dissatisfied": 0.10, "edit_rate": 0.80, "clarification": 0.05}
# Sign of each rate's dependence on the user's typical prompt length (longer prompts: harder
# tasks, fewer persisted edits, more dissatisfaction and questions, longer answers).
PROMPT_SIGN = {"edit": -1.0, "dissatisfied": 1.0, "edit_rate": -1.0, "clarification": 1.0}
LATENCY_MS, LATENCY_SIGMA = 8000.0, 0.8  # mean and lognormal shape of one request
BERNOULLI = (
    ("edit_persistence", "edit"),
    ("dissatisfied_followup_rate", "dissatisfied"),
    ("edit_rate", "edit_rate"),
    ("clarification_rate", "clarification"),
)
# The metrics summed per user: the four rates, latency, and the share of rows whose feedback
# never came (judged on every row older than the maturity).
METRICS = (*(m for m, _ in BERNOULLI), "latency_ms", "feedback_missing_rate")
PROMPT_MEDIAN, PROMPT_USER_SD, PROMPT_ROW_SD = 2000.0, 0.8, 0.5  # tokens, log-scale sds
# The blog's effects: edit persistence +2.28%, dissatisfied follow-ups -3.13%, latency -10.3%.
BLOG = {"edit": 1.0228, "dissatisfied": 1 - 0.0313, "latency": 1 - 0.103}


def step_of(hours: float) -> int:
    start = 0.0
    for i, (_, length) in enumerate(STEPS):
        if length is None or hours < start + length - 1e-9:
            return i
        start += length
    return len(STEPS) - 1


def look_times(interval_h: float = 0.25, hours: float = 24.0) -> list[float]:
    """The operator's analyses: at the end of each step's minDuration (steps 1 and 2 move on
    then), then every ``interval`` in the last step from its minDuration (1 h) on."""
    times, start = [], 0.0
    for _, length in STEPS[:-1]:
        start += length or 0.0
        times.append(round(start, 6))
    t = start + 1.0
    while t <= hours + 1e-9:
        times.append(round(t, 6))
        t += interval_h
    return times


@dataclass(frozen=True)
class Population:
    users: int = 8000
    new_share: float = 0.2
    activity_sigma: float = 1.3
    # how much a user's activity on the canary's day differs from their usual (log-scale sd)
    activity_day_sigma: float = 0.5
    traffic: float = 10_000.0  # interactions per hour, the whole day's mean
    icc: float = 0.1
    org_share: float = 0.2
    prompt_share: float = 0.1
    orgs: int = 200
    drift: tuple[float, float] = (0.10, 0.20)
    # Share of a user's deviation from the population (on the logit scale) that persists from
    # day to day; the rest is the day's (its tasks, its repository).
    persistence: float = 0.95
    pre_hours: float = 168.0
    feedback_missing: float = 0.05
    engine_errors: float = 0.005  # requests served with an error: never logged as rows
    maturity: float = 1.0  # hours
    hours: float = 24.0


@dataclass(frozen=True)
class Canary:
    """What the candidate does, and what the logging does to its rows."""

    name: str
    unit: str = "user"  # or "request"
    effect: dict[str, float] = field(default_factory=dict)  # multipliers: edit, latency, ...
    novelty: str = ""  # "canary": the first hours of the canary; "user": each user's first
    novelty_lift: float = 0.06  # edit persistence multiplier - 1 while novel
    novelty_hours: float = 2.0
    heavy_harm: float = 0.0  # relative drop of edit persistence for the heaviest users
    heavy_top: float = 0.01  # ... the share of users by activity it hits
    row_loss: float = 0.0  # share of the canary's rows never logged
    biased_loss: bool = False  # the lost rows are failed edits (edit not persisted)
    interval_h: float = 0.25  # analysis.interval

    @property
    def effective(self) -> bool:
        """Whether the canary is better (promotion is right) for the power figures."""
        return bool(self.effect) and self.effect.get("edit", 1.0) > 1.0


def _expit(x: Any) -> Any:
    return 1.0 / (1.0 + np.exp(-x))


def logit_normal(mean: float, icc: float) -> tuple[float, float]:
    """(location, scale) of a logit-normal with this mean whose variance is ``icc`` of the
    Bernoulli variance ``mean (1 - mean)``: the intra-user correlation of one user's rows."""
    nodes, weights = np.polynomial.hermite_e.hermegauss(80)
    weights = weights / weights.sum()
    target = icc * mean * (1 - mean)

    def moments(a: float, b: float) -> tuple[float, float]:
        p = _expit(a + b * nodes)
        m = float(weights @ p)
        return m, float(weights @ (p - m) ** 2)

    a, b = math.log(mean / (1 - mean)), 1.0
    for _ in range(200):
        m, v = moments(a, b)
        a -= (m - mean) / max(m * (1 - m), 1e-6)
        b *= math.sqrt(target / max(v, 1e-12)) ** 0.7
        if abs(m - mean) < 1e-12 and abs(v - target) < 1e-14:
            break
    return a, b


@dataclass
class Users:
    """The static population of ``e`` canaries (arrays ``[e, u]``)."""

    rate: np.ndarray  # interactions per hour while present
    arrive: np.ndarray  # hours (0: there from the start)
    new: np.ndarray  # no history before the canary
    bucket: np.ndarray
    org: np.ndarray
    first_bin: np.ndarray  # prompt-length bin of the first request in the canary
    pre_first_bin: np.ndarray  # ... of the first request before the canary
    heavy: np.ndarray  # among the heaviest heavy_top
    p: dict[str, np.ndarray]  # base rates
    lat_mean: np.ndarray  # mean latency of one request (ms)
    lat_var: np.ndarray
    # pre-exposure sums per user: metric -> (x, xx, n)
    pre: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]
    pre_rate: np.ndarray  # rows per hour on the stable arm before the canary
    pre_rows: np.ndarray  # rows on the stable arm before the canary
    drift: dict[str, tuple[np.ndarray, np.ndarray]]  # amplitude, phase per canary


def draw_users(rng: np.random.Generator, pop: Population, e: int) -> Users:
    u = pop.users
    shape = (e, u)
    activity = rng.lognormal(0.0, pop.activity_sigma, size=shape)
    sd = pop.activity_day_sigma
    today = activity * rng.lognormal(-sd * sd / 2, sd, size=shape)
    new = rng.random(shape) < pop.new_share
    arrive = np.where(new, rng.uniform(0, pop.hours, size=shape), 0.0)
    presence = np.where(new, (pop.hours - arrive) / pop.hours, 1.0)
    scale = pop.traffic / (today * presence).sum(axis=1, keepdims=True)
    rate = today * scale
    usual = activity * scale  # the rate on an average day: the history's
    heavy = activity >= np.quantile(activity, 1 - 0.01, axis=1, keepdims=True)
    ranks = np.arange(1, pop.orgs + 1, dtype=np.float64) ** -1.1
    org = rng.choice(pop.orgs, size=shape, p=ranks / ranks.sum())
    z_prompt = rng.standard_normal(shape)
    log_typical = math.log(PROMPT_MEDIAN) + PROMPT_USER_SD * z_prompt
    first_bin = prompt_bin(np.exp(log_typical + PROMPT_ROW_SD * rng.standard_normal(shape)))
    pre_first_bin = prompt_bin(np.exp(log_typical + PROMPT_ROW_SD * rng.standard_normal(shape)))
    rest = 1 - pop.org_share - pop.prompt_share
    assert rest >= 0

    days = max(1, round(pop.pre_hours / 24))

    def latent(sign: float) -> tuple[np.ndarray, np.ndarray]:
        """A standard normal per user on the canary's day and on each day before it."""
        by_org = rng.standard_normal((e, pop.orgs))
        org_part = np.take_along_axis(by_org, org, axis=1)
        lasting = (
            math.sqrt(pop.org_share) * org_part
            + math.sqrt(pop.prompt_share) * sign * z_prompt
            + math.sqrt(rest) * rng.standard_normal(shape)
        )
        keep, vary = math.sqrt(pop.persistence), math.sqrt(1 - pop.persistence)
        today = keep * lasting + vary * rng.standard_normal(shape)
        before = keep * lasting + vary * rng.standard_normal((days, *shape))
        return today, before

    p: dict[str, np.ndarray] = {}
    p_pre: dict[str, np.ndarray] = {}  # the mean rate over the days before the canary
    for key, mean in BASE.items():
        a, b = logit_normal(mean, pop.icc)
        today, before = latent(PROMPT_SIGN[key])
        p[key] = _expit(a + b * today)
        p_pre[key] = _expit(a + b * before).mean(axis=0)
    sd_user = LATENCY_SIGMA * math.sqrt(pop.icc)
    sd_req = LATENCY_SIGMA * math.sqrt(1 - pop.icc)
    today, before = latent(1.0)
    base_mu = math.log(LATENCY_MS) - LATENCY_SIGMA**2 / 2 + sd_req**2 / 2
    lat_mean = np.exp(base_mu + sd_user * today)
    lat_var = (math.exp(sd_req**2) - 1) * lat_mean**2
    lat_mean_pre = np.exp(base_mu + sd_user * before).mean(axis=0)
    lat_var_pre = (math.exp(sd_req**2) - 1) * lat_mean_pre**2

    # History on the stable arm: each returning user's rows over pre_hours at their usual
    # rate, outcomes at the mean of their days' rates (no drift: a week of daily sines
    # averages out); the analysis sees each user's sums.
    k_pre = np.where(new, 0, rng.poisson(usual * pop.pre_hours))
    n_pre = k_pre.astype(np.float64)
    pre: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
    for name, key in BERNOULLI:
        x = rng.binomial(k_pre, p_pre[key]).astype(np.float64)
        pre[name] = (x, x, n_pre)
    lat = np.maximum(rng.normal(n_pre * lat_mean_pre, np.sqrt(n_pre * lat_var_pre)), 0.0)
    pre["latency_ms"] = (lat, n_pre * (lat_var_pre + lat_mean_pre**2), n_pre)
    drift = {
        key: (rng.uniform(*pop.drift, size=(e, 1)), rng.uniform(0, 2 * math.pi, size=(e, 1)))
        for key in (*BASE, "latency")
    }
    return Users(
        # sorted: users are exchangeable, and each arm's users are then contiguous
        rate=rate, arrive=arrive, new=new, bucket=np.sort(rng.integers(0, 100, size=shape)),
        org=org, first_bin=first_bin, pre_first_bin=pre_first_bin, heavy=heavy, p=p,
        lat_mean=lat_mean, lat_var=lat_var, pre=pre, pre_rate=n_pre / pop.pre_hours,
        pre_rows=n_pre, drift=drift,
    )  # fmt: skip


@dataclass
class Look:
    """What one analysis sees. Sums are ``[arm, step, e, u]`` over the steps so far."""

    hours: float
    decides: bool  # the operator analyses at this grid point (else: only a look of the plan)
    last: bool  # at maxDuration
    steps: int
    shares: list[float]  # each step's canary share
    x: dict[str, np.ndarray]  # metric -> numerator sums over matured rows (judged rows
    n: dict[str, np.ndarray]  # for feedback_missing_rate); metric -> denominators
    xx: dict[str, np.ndarray]  # per-row second moments (the request unit's variance)
    settled_x: np.ndarray  # edit persistence over settled rows
    settled_n: np.ndarray
    rows: np.ndarray  # rows created so far (assignment, no maturity)
    matured: np.ndarray  # [e] matured rows at this look, both arms
    served: np.ndarray  # [arm, hour, e] requests each arm served (the capture proxy's count)
    logged: np.ndarray  # [arm, hour, e] rows each arm logged
    users: Users


def simulate(
    rng: np.random.Generator,
    pop: Population,
    canary: Canary,
    e: int,
    on_look: Any,
    *,
    settle_hours: float = 2.0,
    users: Users | None = None,
    record: Any = None,
) -> None:
    """Run ``e`` canaries; call ``on_look(look)`` at every look of the plan (and at the
    operator's analyses); ``record(block, entries)``, if given, gets every block's rows as
    sums per user and arm (the agreement check writes them out as shards)."""
    users = users if users is not None else draw_users(rng, pop, e)
    u = pop.users
    size = e * u
    blocks = round(pop.hours / BLOCK_H)
    strata = len(STEPS)
    settle_blocks = round(settle_hours / BLOCK_H)
    step_start = np.round(np.cumsum([0.0, *(h or 0.0 for _, h in STEPS[:-1])]) / BLOCK_H)
    novelty_blocks = round(canary.novelty_hours / BLOCK_H)
    x = {m: np.zeros((2, strata, size)) for m in METRICS}
    n = {m: np.zeros((2, strata, size)) for m in METRICS}
    xx_lat = np.zeros((2, strata, size))
    settled_x = np.zeros((2, strata, size))
    settled_n = np.zeros((2, strata, size))
    rows = np.zeros((2, strata, size))
    first_in_arm = np.full((2, size), -1)  # each user's first logged row in each arm
    hours = math.ceil(pop.hours)
    served = np.zeros((2, hours, e))
    logged_rows = np.zeros((2, hours, e))
    first_canary = np.full(size, -1)
    pending: list[tuple[float, list[tuple[str, int, int, np.ndarray, np.ndarray]]]] = []
    looks = look_times(canary.interval_h, pop.hours)
    look_index = 0
    matured = np.zeros(e)
    rate = users.rate.ravel()
    arrive_block = np.floor(users.arrive.ravel() / BLOCK_H + 1e-9).astype(np.int64)
    bucket = users.bucket.ravel()
    heavy = users.heavy.ravel()
    p = {k: v.ravel() for k, v in users.p.items()}
    lat_mean, lat_var = users.lat_mean.ravel(), users.lat_var.ravel()
    exp_of = np.repeat(np.arange(e), u)
    effect = canary.effect
    q_biased = canary.row_loss / (1 - BASE["edit"]) if canary.biased_loss else 0.0
    for b in range(blocks):
        t0 = b * BLOCK_H
        s = step_of(t0)
        weight = STEPS[s][0]
        present = arrive_block <= b
        k = rng.poisson(rate * BLOCK_H * present)
        idx = np.flatnonzero(k)
        kk = k[idx]
        ex = exp_of[idx]
        drift = {
            key: 1 + amp[ex, 0] * np.sin(2 * math.pi * (t0 + BLOCK_H / 2) / 24 + phase[ex, 0])
            for key, (amp, phase) in users.drift.items()
        }
        if canary.unit == "user":
            kc = np.where(bucket[idx] < weight, kk, 0)
        else:
            kc = rng.binomial(kk, weight / 100)
        newly_logged: list[tuple[int, np.ndarray]] = []
        entries: list[tuple[str, int, int, np.ndarray, np.ndarray]] = []
        hour = int(t0 + 1e-9)
        for arm, served_k in ((0, kk - kc), (1, kc)):
            np.add.at(served[arm, hour], ex, served_k.astype(np.float64))
            ka = served_k - rng.binomial(served_k, pop.engine_errors)
            if arm == 1 and canary.row_loss and not canary.biased_loss:
                ka = rng.binomial(ka, 1 - canary.row_loss)
            on = ka > 0
            if not on.any():
                continue
            ids, ka, exs = idx[on], ka[on], ex[on]
            dr = {key: v[on] for key, v in drift.items()}
            miss = rng.binomial(ka, pop.feedback_missing)
            m = ka - miss
            lift = np.ones(ids.size)
            if arm == 1:
                newly = first_canary[ids] < 0
                first_canary[ids[newly]] = b
                if canary.novelty == "canary" and b < novelty_blocks:
                    lift *= 1 + canary.novelty_lift
                elif canary.novelty == "user":
                    lift *= np.where(b < first_canary[ids] + novelty_blocks,
                                     1 + canary.novelty_lift, 1.0)  # fmt: skip
                if canary.heavy_harm:
                    lift *= np.where(heavy[ids], 1 - canary.heavy_harm, 1.0)
            f = effect if arm == 1 else {}
            prob = np.clip(p["edit"][ids] * dr["edit"] * f.get("edit", 1.0) * lift, 0, 1)
            x_edit = rng.binomial(m, prob)
            if arm == 1 and q_biased:
                lost = rng.binomial(m - x_edit, q_biased)
                m = m - lost
                ka = m + miss
            values = {"edit_persistence": x_edit.astype(np.float64)}
            for name, key in BERNOULLI[1:]:
                pr = np.clip(p[key][ids] * dr[key] * f.get(key, 1.0), 0, 1)
                values[name] = rng.binomial(m, pr).astype(np.float64)
            scale = dr["latency"] * f.get("latency", 1.0)
            mu_, var_ = lat_mean[ids] * scale, lat_var[ids] * scale**2
            mf = m.astype(np.float64)
            values["latency_ms"] = np.maximum(rng.normal(mf * mu_, np.sqrt(mf * var_)), 0.0)
            lat_xx = mf * (var_ + mu_**2)
            logged = ka > 0
            arrived_here = ids[logged]
            fresh_here = first_in_arm[arm, arrived_here] < 0
            newly_logged.append((arm, arrived_here[fresh_here]))
            np.add.at(logged_rows[arm, hour], exs, ka.astype(np.float64))
            np.add.at(rows[arm, s], ids, ka.astype(np.float64))
            entries.append(("m", arm, s, ids, mf))
            for name, v in values.items():
                entries.append((name, arm, s, ids, v))
            entries.append(("lat_xx", arm, s, ids, lat_xx))
            entries.append(("fm_x", arm, s, ids, miss.astype(np.float64)))
            entries.append(("fm_n", arm, s, ids, ka.astype(np.float64)))
            entries.append(("exp", arm, s, exs, mf))
            # settled: the user's first logged row in this arm is at least settle_blocks ago
            first = first_in_arm[arm, ids]
            settled = (first >= 0) & (b >= first + settle_blocks)
            settled &= b >= step_start[s] + settle_blocks  # and the step's clock, both arms
            if settled.any():
                entries.append(
                    ("settled_x", arm, s, ids[settled], values["edit_persistence"][settled])
                )
                entries.append(("settled_n", arm, s, ids[settled], mf[settled]))
        for arm_, fresh_ids in newly_logged:
            first_in_arm[arm_, fresh_ids] = b
        if record is not None:
            record(b, entries)
        pending.append((t0 + BLOCK_H + pop.maturity, entries))
        now = t0 + BLOCK_H
        while pending and pending[0][0] <= now + 1e-9:
            _, done = pending.pop(0)
            for name, arm, st, ids, v in done:
                if name == "m":
                    for metric in METRICS[:-1]:
                        np.add.at(n[metric][arm, st], ids, v)
                elif name == "lat_xx":
                    np.add.at(xx_lat[arm, st], ids, v)
                elif name == "fm_x":
                    np.add.at(x["feedback_missing_rate"][arm, st], ids, v)
                elif name == "fm_n":
                    np.add.at(n["feedback_missing_rate"][arm, st], ids, v)
                elif name == "exp":
                    np.add.at(matured, ids, v)
                elif name == "settled_x":
                    np.add.at(settled_x[arm, st], ids, v)
                elif name == "settled_n":
                    np.add.at(settled_n[arm, st], ids, v)
                else:
                    np.add.at(x[name][arm, st], ids, v)
        on_grid = abs(now / canary.interval_h - round(now / canary.interval_h)) < 1e-6
        decides = look_index < len(looks) and abs(looks[look_index] - now) < 1e-6
        if not (on_grid or decides):
            continue
        look_index += int(decides)
        steps = step_of(now - 1e-9) + 1

        def view(a: np.ndarray, steps: int = steps) -> np.ndarray:
            return a[:, :steps].reshape(2, steps, e, u)

        xx = {name: view(x[name]) for name in METRICS}  # Bernoulli rows: x^2 = x
        xx["latency_ms"] = view(xx_lat)
        on_look(
            Look(
                hours=now, decides=decides, last=now >= pop.hours - 1e-9, steps=steps,
                shares=[STEPS[i][0] / 100 for i in range(steps)],
                x={name: view(x[name]) for name in METRICS},
                n={name: view(n[name]) for name in METRICS},
                xx=xx, settled_x=view(settled_x), settled_n=view(settled_n),
                rows=view(rows), matured=matured.copy(), users=users,
                served=served, logged=logged_rows,
            )
        )  # fmt: skip
