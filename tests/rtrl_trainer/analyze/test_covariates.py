"""Covariates for every unit (rtrl_trainer.analyze.covariates): the model fitted on
pre-exposure users recovers what org and prompt length say about a user, a new user's
covariate is that prediction, a user with history keeps their own mean in proportion to how
much of it there is, and the adjusted difference stays unbiased when the features predict
nothing."""

from __future__ import annotations

import numpy as np
import pytest

from rtrl_trainer.analyze import covariates as cov
from rtrl_trainer.analyze.estimate import cell_sums, difference


def test_prompt_bins() -> None:
    assert cov.prompt_bin([0, 255, 256, 511, 16_383, 16_384, 10**6]).tolist() == [
        0, 0, 1, 1, 6, 7, 7
    ]  # fmt: skip
    assert cov.PROMPT_BINS == 8


def population(rng: np.random.Generator, users: int, *, explained: float) -> dict[str, np.ndarray]:
    """Users whose rate is 0.45 plus an org effect and a prompt-length effect (together
    ``explained`` of the between-user variance) plus their own; each with a week of rows."""
    orgs = rng.integers(0, 40, users)
    org_effect = rng.normal(0, 1, 40)
    bins = rng.integers(0, cov.PROMPT_BINS, users)
    bin_effect = np.linspace(-1, 1, cov.PROMPT_BINS)
    signal = org_effect[orgs] + bin_effect[bins]
    signal = (signal - signal.mean()) / signal.std()
    latent = np.sqrt(explained) * signal + np.sqrt(1 - explained) * rng.normal(0, 1, users)
    p = np.clip(0.45 + 0.15 * latent, 0.01, 0.99)
    n = rng.poisson(rng.lognormal(2.5, 1.0, users)).astype(np.float64)
    x = rng.binomial(n.astype(np.int64), p).astype(np.float64)
    return {"org": orgs.astype(str), "bin": bins, "p": p, "n": n, "x": x}


def test_the_model_predicts_new_users_from_their_features() -> None:
    rng = np.random.default_rng(1)
    old = population(rng, 4000, explained=0.6)
    model = cov.fit(old["x"], old["x"], old["n"], old["org"], old["bin"])
    assert model is not None and model.users == int((old["n"] > 0).sum())
    assert model.mean == pytest.approx(old["x"].sum() / old["n"].sum())
    assert model.within == pytest.approx(np.average(old["p"] * (1 - old["p"]), weights=old["n"]),
                                         rel=0.05)  # fmt: skip
    # new users (no history), the same orgs and prompt lengths: the prediction explains
    # about the share of their between-user variance the features explain
    new = population(np.random.default_rng(1), 4000, explained=0.6)
    c = cov.covariate(model, new["org"], new["bin"], np.zeros(4000), np.zeros(4000))
    explained = 1 - np.var(new["p"] - c) / np.var(new["p"])
    assert 0.45 < explained < 0.65
    # an org never seen: no org effect, the prompt length's alone
    unseen = cov.covariate(model, np.array(["elsewhere"]), np.array([3]), [0.0], [0.0])
    assert unseen[0] == pytest.approx(model.mean + model.bin_effect[3])


def test_own_history_weighs_by_how_much_there_is() -> None:
    rng = np.random.default_rng(2)
    old = population(rng, 3000, explained=0.3)
    model = cov.fit(old["x"], old["x"], old["n"], old["org"], old["bin"])
    assert model is not None
    pred = model.predict(np.array(["3"]), np.array([2]))[0]
    # a user at 0.9 over 2, 20 and 2000 rows: pulled toward the prediction, less and less
    c = [cov.covariate(model, ["3"], [2], [0.9 * n], [n])[0] for n in (2.0, 20.0, 2000.0)]
    assert pred < c[0] < c[1] < c[2] < 0.9
    assert c[2] == pytest.approx(0.9, abs=0.01)
    w = model.between / (model.between + model.within / 20)
    assert c[1] == pytest.approx(pred + w * (0.9 - pred))
    # no pre-exposure data: no model, no adjustment
    assert cov.fit([1.0], [1.0], [3.0], ["a"], [0]) is None
    assert cov.covariate(None, ["a"], [0], [1.0], [3.0]).tolist() == [0.0]


def test_features_that_predict_nothing_leave_the_difference_unbiased() -> None:
    """A/A with users assigned whole, covariates from a model of pure noise for new users:
    over 300 canaries the adjusted difference averages zero within its standard error and its
    variance matches the spread of the estimates."""
    rng = np.random.default_rng(3)
    history = population(rng, 2000, explained=0.0)
    model = cov.fit(history["x"], history["x"], history["n"], history["org"], history["bin"])
    estimates, variances = [], []
    for _ in range(300):
        users = population(rng, 600, explained=0.0)
        covariate = cov.covariate(model, users["org"], users["bin"], np.zeros(600), np.zeros(600))
        arm = (rng.random(600) < 0.5).astype(np.int64)
        k = rng.poisson(users["n"] / 7 + 0.5).astype(np.int64)
        unit = np.repeat(np.arange(600), k)
        x = (rng.random(unit.size) < users["p"][unit]).astype(np.float64)
        stratum = np.zeros(unit.size, dtype=np.int64)
        sums = cell_sums(unit, arm[unit], stratum, x, np.ones(unit.size),
                         covariate=covariate[unit], strata=1)  # fmt: skip
        d = difference(*sums)
        estimates.append(d.difference)
        variances.append(d.var)
    estimates_ = np.asarray(estimates)
    se = estimates_.std() / np.sqrt(estimates_.size)
    assert abs(estimates_.mean()) < 3 * se
    assert np.mean(variances) == pytest.approx(estimates_.var(), rel=0.25)
