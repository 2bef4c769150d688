"""The canary's estimator and sample-ratio test against by-hand references: explicit
per-unit influence sums, the cluster-robust OLS sandwich, numerical integration of the
beta-binomial mixture, and Monte Carlo variances of clustered, drifting users."""

from __future__ import annotations

import math

import numpy as np
import pytest

from rtrl.core.api.rlcycle import AnalysisSpec, Band, GuardrailsSpec
from rtrl_trainer.analyze.confidence import MIN_EVENTS, compare
from rtrl_trainer.analyze.decide import decide
from rtrl_trainer.analyze.estimate import cell_sums, difference, independent
from rtrl_trainer.analyze.rule import PROMOTE, plan
from rtrl_trainer.analyze.srm import srm_log_bf, srm_steps


def clustered(
    rng: np.random.Generator,
    *,
    users: int = 600,
    icc: float = 0.2,
    weights: tuple[float, ...] = (0.05, 0.25, 0.5),
    drift: tuple[float, ...] = (0.0, 0.0, 0.0),
    effect: float = 0.0,
    sticky: bool = True,
) -> dict[str, np.ndarray]:
    """Rows of users with their own base rates and activity, split per step by a hash
    bucket (sticky) or per request; each user's pre-exposure mean as the covariate."""
    total = 1 / icc - 1
    p = rng.beta(0.45 * total, 0.55 * total, users)
    activity = rng.lognormal(0, 1, users)
    activity *= 4 / activity.mean()
    bucket = rng.random(users)
    k_pre = rng.poisson(activity * 20)
    x_pre = rng.binomial(k_pre, p)
    pooled = x_pre.sum() / k_pre.sum()
    covariate = np.where(k_pre > 0, x_pre / np.maximum(k_pre, 1), pooled)
    cols: dict[str, list[np.ndarray]] = {k: [] for k in ("unit", "arm", "stratum", "x", "c")}
    for s, (w, shift) in enumerate(zip(weights, drift, strict=True)):
        k = rng.poisson(activity)
        unit = np.repeat(np.arange(users), k)
        arm = (bucket[unit] < w) if sticky else (rng.random(unit.size) < w)
        prob = np.clip(p[unit] * (1 + shift) * np.where(arm, 1 + effect, 1.0), 0, 1)
        cols["unit"].append(unit)
        cols["arm"].append(arm.astype(np.int64))
        cols["stratum"].append(np.full(unit.size, s))
        cols["x"].append((rng.random(unit.size) < prob).astype(np.float64))
        cols["c"].append(covariate[unit])
    return {k: np.concatenate(v) for k, v in cols.items()}


def sums(data: dict[str, np.ndarray], strata: int = 3, *, per_row: bool = False) -> tuple:
    return cell_sums(
        None if per_row else data["unit"], data["arm"], data["stratum"], data["x"],
        np.ones(data["x"].size), covariate=data["c"], strata=strata,
    )  # fmt: skip


def test_variance_is_the_cluster_robust_sandwich() -> None:
    """One stratum, no covariate: the difference in means and its variance are OLS of x on
    [1, canary] with the cluster-robust (CR1-style, G/(G-1)) sandwich, by matrices."""
    rng = np.random.default_rng(3)
    data = clustered(rng, users=80, weights=(0.4,), drift=(0.0,))
    data["stratum"][:] = 0
    d = difference(*sums(data, 1), adjust=False)
    design = np.column_stack([np.ones(data["x"].size), data["arm"]])
    bread = np.linalg.inv(design.T @ design)
    coef = bread @ design.T @ data["x"]
    resid = data["x"] - design @ coef
    meat = np.zeros((2, 2))
    units = np.unique(data["unit"])
    for u in units:
        score = design[data["unit"] == u].T @ resid[data["unit"] == u]
        meat += np.outer(score, score)
    sandwich = bread @ meat @ bread * len(units) / (len(units) - 1)
    assert d.difference == pytest.approx(coef[1], rel=1e-12)
    assert d.var == pytest.approx(sandwich[1, 1], rel=1e-10)


def test_stratified_cuped_by_hand() -> None:
    """Three strata and a covariate: the adjusted difference, theta and the variance from
    explicit per-unit influence sums in plain Python."""
    rng = np.random.default_rng(4)
    data = clustered(rng, users=120, drift=(0.0, 0.1, -0.1))
    d = difference(*sums(data), adjust=True)
    x, arm, st, c, unit = data["x"], data["arm"], data["stratum"], data["c"], data["unit"]
    n_as = {(a, s): np.sum((arm == a) & (st == s)) for a in (0, 1) for s in range(3)}
    h = {s: n_as[0, s] * n_as[1, s] / (n_as[0, s] + n_as[1, s]) for s in range(3)}
    w = {s: h[s] / sum(h.values()) for s in range(3)}  # Cochran-Mantel-Haenszel
    mean = {k: x[(arm == k[0]) & (st == k[1])].mean() for k in n_as}
    cmean = {k: c[(arm == k[0]) & (st == k[1])].mean() for k in n_as}
    d_a = sum(w[s] * (mean[1, s] - mean[0, s]) for s in range(3))
    d_c = sum(w[s] * (cmean[1, s] - cmean[0, s]) for s in range(3))
    inf_a, inf_c = [], []
    for u in np.unique(unit):
        ia = ic = 0.0
        for i in np.nonzero(unit == u)[0]:
            key, sign = (arm[i], st[i]), (1 if arm[i] == 1 else -1)
            ia += sign * w[st[i]] * (x[i] - mean[key]) / n_as[key]
            ic += sign * w[st[i]] * (c[i] - cmean[key]) / n_as[key]
        inf_a.append(ia)
        inf_c.append(ic)
    ia_, ic_ = np.array(inf_a), np.array(inf_c)
    theta = (ia_ @ ic_) / (ic_ @ ic_)
    g = len(ia_)
    var = np.sum((ia_ - theta * ic_) ** 2) * g / (g - 1)
    assert d.theta == pytest.approx(theta, rel=1e-9)
    assert d.difference == pytest.approx(d_a - theta * d_c, rel=1e-9)
    assert d.var == pytest.approx(var, rel=1e-9)
    raw = np.sum(ia_**2) * g / (g - 1)
    assert d.variance_reduction == pytest.approx(1 - var / raw, rel=1e-9)
    assert d.variance_reduction > 0.2  # the pre-exposure mean predicts each user


@pytest.mark.parametrize("sticky", [True, False])
def test_variances_match_monte_carlo_with_clustered_drifting_users(sticky: bool) -> None:
    """The estimated variances (plain, CUPED, log ratio) are the real ones over 300
    replications of clustered users (icc 0.2) whose base rate drifts across steps; the
    rows-as-unit variance of the previous analysis is far too small when users are
    assigned whole."""
    rng = np.random.default_rng(5 if sticky else 6)
    found: dict[str, list[float]] = {k: [] for k in ("d", "v", "dr", "vr", "lr", "lv", "nv")}
    for _ in range(300):
        data = clustered(rng, users=400, drift=(0.0, 0.1, 0.2), sticky=sticky)
        adj = difference(*sums(data), adjust=True)
        raw = difference(*sums(data), adjust=False)
        found["d"].append(adj.difference)
        found["v"].append(adj.var)
        found["dr"].append(raw.difference)
        found["vr"].append(raw.var)
        found["lr"].append(adj.log_ratio)
        found["lv"].append(adj.log_var)
        per_row = difference(*sums(data, per_row=True), adjust=False)
        found["nv"].append(per_row.var)
    f = {k: np.array(v) for k, v in found.items()}
    for est, var in (("d", "v"), ("dr", "vr"), ("lr", "lv")):
        assert np.mean(f[var]) == pytest.approx(np.var(f[est]), rel=0.2), est
        assert abs(np.mean(f[est])) < 4 * math.sqrt(np.var(f[est]) / 300)  # unbiased under drift
    if sticky:
        assert np.mean(f["nv"]) < 0.5 * np.var(f["dr"])  # treating rows as units: wrong
        assert np.mean(f["v"]) < 0.8 * np.mean(f["vr"])  # CUPED helps
    else:
        assert np.mean(f["nv"]) == pytest.approx(np.var(f["dr"]), rel=0.25)


def test_pooling_steps_is_biased_under_drift_and_strata_are_not() -> None:
    """A/A with the base rate rising 30% while the canary's weight rises: one pooled
    stratum finds an effect that is not there; the stratified estimate does not."""
    rng = np.random.default_rng(8)
    pooled, strat = [], []
    for _ in range(100):
        data = clustered(rng, users=500, drift=(0.0, 0.15, 0.3), sticky=False)
        strat.append(difference(*sums(data), adjust=False).difference)
        one = dict(data, stratum=np.zeros_like(data["stratum"]))
        pooled.append(difference(*sums(one, 1), adjust=False).difference)
    se = np.std(strat) / 10
    assert abs(np.mean(strat)) < 4 * se
    assert np.mean(pooled) > 6 * np.std(pooled) / 10


def test_relative_interval_on_the_log_scale_never_passes_minus_100_percent() -> None:
    # 12 invalid tool calls in 2,000 vs 2 in 2,000: rare events, a wide but possible interval.
    b = independent(0.006, 0.006 * 0.994 / 2000, 2000, 0.001, 0.001 * 0.999 / 2000, 2000, 12, 2)
    cmp = compare(b, alpha=0.01, tau=0.1, events=True)
    assert -1 < cmp.rel_low < cmp.relative < cmp.rel_high
    assert cmp.relative == pytest.approx(0.001 / 0.006 - 1)
    # the log-scale variance by hand: v_c / c^2 + v_b / b^2
    assert b.log_var == pytest.approx(0.999 / 2000 / 0.001 + 0.994 / 2000 / 0.006)
    assert cmp.few_events and not cmp.enough  # 2 events in the canary: no verdict
    assert MIN_EVENTS > 2


def test_too_few_events_neither_trips_nor_holds_a_promotion() -> None:
    spec = GuardrailsSpec(
        edit_rate=None, clarification_rate=None, feedback_missing_rate=None,
        invalid_tool_call_rate=Band(max_relative_rise=0.1),
    )  # fmt: skip
    n = 20_000.0
    diffs = {
        "edit_persistence": independent(0.45, 0.2475 / n, n, 0.47, 0.2491 / n, n, 9000, 9400),
        # 3 invalid calls vs 6: the estimate is +100%, far beyond the 10% band
        "invalid_tool_call_rate": independent(3 / n, 3 / n**2, n, 6 / n, 6 / n**2, n, 3, 6),
    }
    result = decide(diffs, AnalysisSpec(), spec)
    rows = {r["name"]: r for r in result.metrics}
    assert rows["invalid_tool_call_rate"]["verdict"] == "too-few-events"
    assert rows["invalid_tool_call_rate"]["relative_ci_low"] is None  # no interval, a reason
    assert rows["invalid_tool_call_rate"]["relative_difference"] == pytest.approx(1.0)
    assert result.decision == "promote"
    line = next(r for r in result.reasons if r.startswith("invalid_tool_call_rate"))
    assert f"fewer than {MIN_EVENTS} events in an arm" in line


def test_srm_bayes_factor_is_the_beta_binomial_mixture_by_integration() -> None:
    """BF = integral of Binomial(k; n, p) Beta(p; a, b) dp over Binomial(k; n, p0),
    integrated numerically on a fine grid."""
    from rtrl_trainer.analyze.srm import SRM_RELATIVE_SPREAD

    for nb, nc, p0 in ((950, 50, 0.05), (760, 240, 0.25), (5_000, 4_800, 0.5), (30, 0, 0.05)):
        spread = SRM_RELATIVE_SPREAD * min(p0, 1 - p0)
        kappa = max(p0 * (1 - p0) / spread**2 - 1, 1.0)
        a, b = kappa * p0, kappa * (1 - p0)
        grid = np.linspace(1e-6, 1 - 1e-6, 400_001)
        log_prior = (a - 1) * np.log(grid) + (b - 1) * np.log1p(-grid)
        log_prior -= math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b)
        log_like = nc * np.log(grid / p0) + nb * np.log((1 - grid) / (1 - p0))
        integrand = np.exp(log_prior + log_like)
        bf = float(np.sum((integrand[1:] + integrand[:-1]) / 2 * np.diff(grid)))
        assert float(srm_log_bf(nb, nc, p0)) == pytest.approx(math.log(bf), abs=1e-4)


def test_srm_over_steps_multiplies_their_evidence_and_holds_alpha() -> None:
    one = srm_steps([950], [50], [0.05], 0.001)
    two = srm_steps([950, 7_600], [50, 2_400], [0.05, 0.25], 0.001)
    expected = float(srm_log_bf(950, 50, 0.05) + srm_log_bf(7_600, 2_400, 0.25))
    assert two.p_value == pytest.approx(min(1.0, math.exp(-expected)))
    assert one.observed_canary_share == 0.05 and two.observed_canary_share == 0.24
    # A/A: 2,000 canaries looked at every 500 units over three steps: false alarms <= alpha.
    rng = np.random.default_rng(9)
    alpha, flagged = 0.01, np.zeros(2000, dtype=bool)
    counts: list[list[np.ndarray]] = [[], []]
    for share in (0.05, 0.25, 0.5):
        nb, nc = np.zeros(2000), np.zeros(2000)
        counts[0].append(nb)
        counts[1].append(nc)
        for _ in range(20):
            c = rng.binomial(500, share, 2000)
            nc += c
            nb += 500 - c
            flagged |= np.asarray(
                srm_steps(counts[0], counts[1], [0.05, 0.25, 0.5][: len(counts[0])], alpha).mismatch
            )
    assert flagged.mean() <= alpha


def test_vectorised_decision_matches_the_scalar_one() -> None:
    rng = np.random.default_rng(10)
    metrics = plan(AnalysisSpec(), GuardrailsSpec())
    assert metrics
    datas = [clustered(rng, users=300, effect=e) for e in (0.0, 0.3)]
    parts = [sums(d) for d in datas]
    batch = difference(
        np.stack([p[0] for p in parts]), np.stack([p[1] for p in parts]),
        np.array([p[2] for p in parts]),
    )  # fmt: skip
    for i, p in enumerate(parts):
        single = difference(*p)
        assert np.asarray(batch.difference)[i] == pytest.approx(single.difference)
        assert np.asarray(batch.var)[i] == pytest.approx(single.var)
    big = {"edit_persistence": difference(*parts[1])}
    assert decide(big, AnalysisSpec(), GuardrailsSpec()).decision in {"promote", "continue"}
    assert PROMOTE == 1


def test_a_suspect_sample_ratio_holds_a_promotion_and_a_clear_one_does_not() -> None:
    n = 40_000.0
    diffs = {"edit_persistence": independent(0.45, 0.2475 / n, n, 0.47, 0.2491 / n, n, 18e3, 19e3)}
    guards = GuardrailsSpec(
        edit_rate=None, clarification_rate=None, invalid_tool_call_rate=None,
        feedback_missing_rate=None,
    )  # fmt: skip
    suspect = srm_steps([20_300], [19_700], [0.5], 0.001)  # 1.5% short: p between the two
    assert 0.001 < suspect.p_value <= 0.1
    held = decide(diffs, AnalysisSpec(), guards, srm=suspect)
    assert held.decision == "continue"
    assert held.reasons[0].startswith(
        "promotion held: edit_persistence significantly better, but the sample ratio is suspect"
    )
    fine = srm_steps([20_050], [19_950], [0.5], 0.001)
    assert fine.p_value > 0.1
    assert decide(diffs, AnalysisSpec(), guards, srm=fine).decision == "promote"
