"""The group-sequential boundaries (rtrl_trainer.analyze.sequential) against independent
references: the normal distribution from math.erfc, a two-look boundary by direct numerical
integration, and the error rate of Brownian paths observed at uneven information."""

from __future__ import annotations

import math

import numpy as np
import pytest

from rtrl_trainer.analyze.sequential import (
    Boundaries,
    normal_cdf,
    normal_quantile,
    replay,
    spent,
)


def test_normal_cdf_to_double_precision() -> None:
    xs = np.linspace(-38.5, 38.5, 200_001)
    reference = np.array([0.5 * math.erfc(-x / math.sqrt(2)) for x in xs])
    assert np.max(np.abs(normal_cdf(xs) - reference)) < 3e-16
    tails = (xs < -1) & (xs > -37)  # relative accuracy in the tail (before underflow)
    assert np.max(np.abs(normal_cdf(xs[tails]) / reference[tails] - 1)) < 2e-8
    assert normal_quantile(0.975) == pytest.approx(1.959963984540054, abs=1e-12)


def test_spending_functions() -> None:
    assert spent(0.25, 0.05, 1.0) == pytest.approx(0.0125)
    assert spent(0.5, 0.05, 2.0) == pytest.approx(0.0125)
    assert spent(1.7, 0.05, 1.0) == pytest.approx(0.05)  # past maxDuration: all of it
    # O'Brien-Fleming's shape: 2 - 2 Phi(z_{alpha/2} / sqrt(t)), nearly nothing early
    z = normal_quantile(1 - 0.025)
    assert spent(0.25, 0.05, 0.0) == pytest.approx(2 * (1 - float(normal_cdf(z / 0.5))))
    assert spent(1.0, 0.05, 0.0) == pytest.approx(0.05)


def _second_boundary(c1: float, r: float, release: float) -> float:
    """P(|Z1| < c1, |Z2| >= c2) = release, by the trapezoid rule on a fine grid and
    bisection: Z2 = sqrt(r) Z1 + sqrt(1 - r) N(0, 1)."""
    z = np.linspace(-c1, c1, 20_001)
    density = np.exp(-z * z / 2) / math.sqrt(2 * math.pi)
    q, s = math.sqrt(r), math.sqrt(1 - r)

    def crossing(c2: float) -> float:
        tail = normal_cdf((-c2 - q * z) / s) + normal_cdf((-c2 + q * z) / s)
        return float(np.trapezoid(density * tail, z))

    lo, hi = 0.0, 10.0
    for _ in range(45):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if crossing(mid) > release else (lo, mid)
    return (lo + hi) / 2


@pytest.mark.parametrize(("info", "t"), [((1.0, 2.0), (0.5, 1.0)), ((1.0, 9.0), (0.2, 0.6))])
def test_two_looks_against_direct_integration(
    info: tuple[float, float], t: tuple[float, float]
) -> None:
    alpha = 0.05
    b = Boundaries(alpha, (1,))
    c1 = float(b.look(t[0], np.array([info[0]]))[0])
    assert 2 * (1 - float(normal_cdf(c1))) == pytest.approx(spent(t[0], alpha), rel=1e-9)
    c2 = float(b.look(t[1], np.array([info[1]]))[0])
    release = float(spent(t[1], alpha) - spent(t[0], alpha))
    assert c2 == pytest.approx(_second_boundary(c1, info[0] / info[1], release), abs=2e-3)


def _crossing_rate(info: np.ndarray, fractions: np.ndarray, alpha: float, paths: int, *,
                   seed: int, estimated: np.ndarray | None = None) -> float:  # fmt: skip
    """Brownian paths observed at ``info``: the share ever outside the boundaries computed
    from ``estimated`` (the information the data show; default: the true one)."""
    shown = info if estimated is None else estimated
    c = replay(alpha, fractions, shown[:, None], np.ones((info.size, 1), dtype=bool))[:, 0]
    rng = np.random.default_rng(seed)
    steps = np.diff(np.concatenate([[0.0], info]))
    score = np.cumsum(rng.normal(0.0, np.sqrt(steps)[:, None], (info.size, paths)), axis=0)
    crossed = np.any(np.abs(score / np.sqrt(info)[:, None]) >= c[:, None], axis=0)
    return float(crossed.mean())


def test_error_rate_over_many_uneven_looks() -> None:
    """96 looks as a canary gives them: a slow start (5% and 25% steps), then steady, with
    dips in the estimated information (the running maximum adds nothing then). The chance
    of ever leaving the boundaries is alpha, not more."""
    rng = np.random.default_rng(7)
    looks = 96
    increments = np.r_[0.2, 0.6, 1.0, rng.gamma(6, 1 / 6, looks - 3)]
    info = np.cumsum(increments)
    estimated = info.copy()
    estimated[[40, 41, 70]] *= 0.98  # the information the data show dips at three looks
    fractions = np.arange(1, looks + 1) / looks
    alpha, paths = 0.05, 60_000
    rate = _crossing_rate(info, fractions, alpha, paths, seed=1, estimated=estimated)
    se = math.sqrt(alpha * (1 - alpha) / paths)
    assert abs(rate - alpha) < 3.5 * se, (rate, se)


def test_looks_without_a_verdict_spend_nothing() -> None:
    """A look where the metric cannot be judged yet carries its error to the next one:
    after two such looks the first judged look spends alpha t^rho at once."""
    b = Boundaries(0.05, (2,))
    inactive = np.array([False, True])
    first = [b.look(k / 10, np.array([1.0, 1.0 + k]), active=~inactive | (k == 3))
             for k in (1, 2, 3)]  # fmt: skip
    assert np.isinf(first[0][1]) and np.isinf(first[1][1])
    assert 2 * (1 - float(normal_cdf(first[2][1]))) == pytest.approx(spent(0.3, 0.05))
    # past maxDuration nothing is left to spend: no verdict
    late = Boundaries(0.05, ())
    assert math.isfinite(float(late.look(1.0, 4.0)))
    assert math.isinf(float(late.look(1.2, 5.0)))


def test_replay_matches_the_look_by_look_recursion() -> None:
    rng = np.random.default_rng(3)
    info = np.cumsum(rng.gamma(2.0, 1.0, (30, 4)), axis=0)
    fractions = np.arange(1, 31) / 30
    active = rng.random((30, 4)) > 0.1
    at_once = replay(0.02, fractions, info, active, rho=1.5)
    b = Boundaries(0.02, (4,), rho=1.5)
    one_by_one = np.stack([b.look(fractions[k], info[k], active[k]) for k in range(30)])
    np.testing.assert_array_equal(at_once, one_by_one)
    single = replay(0.02, fractions, info[:, 2:3], active[:, 2:3], rho=1.5)
    np.testing.assert_allclose(single[:, 0], at_once[:, 2], rtol=1e-12)
