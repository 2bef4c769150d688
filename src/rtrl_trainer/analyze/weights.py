"""Precision weights for units: how much each unit's rows say about the arm it is in.

With users as the unit, a user's rows share that user's deviation from what the covariate
predicts (their own rate today, the part of it no history or feature explains). Counting
every row equally (the interaction-weighted mean) lets the heaviest users' deviations
dominate the variance, and that part does not shrink as the canary runs on: a user with
twice the rows has twice the weight and the same deviation. Weighting each unit by
``1 / (1 + rho n)`` (its ``n`` rows then count as ``n / (1 + rho n)``, at most ``1 / rho``)
is the minimum-variance combination of the units' means under a random-effects model with
the between-unit share ``rho = tau^2 / sigma^2`` (DerSimonian & Laird, "Meta-analysis in
clinical trials", Controlled Clinical Trials 7(3), 1986; the same weights make a
random-effects meta-analysis): light units count by their rows, heavy ones by the user they
are. Under a relative effect common to all units its expectation is the interaction-weighted
mean's; the analysis uses it for the evidence that promotes, and the interaction-weighted
mean, which weighs every interaction alike, for harm (a harm to heavy users must roll back).

``tau^2`` is estimated at each look, separately for units with history of their own and
units without (the covariate explains much more of the former), by DerSimonian and Laird's
method of moments on the units' residuals from their covariate, with both arms pooled
(weights that never look at the arm keep the comparison fair); ``sigma^2`` is the within-unit
variance of one row (:class:`.covariates.Model`).
"""

from __future__ import annotations

from typing import Any

import numpy as np


def random_effect(
    x: Any, n: Any, covariate: Any, groups: Any, within: Any
) -> tuple[np.ndarray, np.ndarray]:
    """Per group: the between-unit variance ``tau^2`` of the units' means around their
    covariates, and ``rho = tau^2 / sigma^2``. ``x``, ``n``: each unit's totals (``[..., U]``);
    ``groups``: each unit's group index; ``within``: ``sigma^2`` (``[...]``)."""
    xs, ns = np.asarray(x, np.float64), np.asarray(n, np.float64)
    c = np.asarray(covariate, np.float64)
    g = np.asarray(groups, np.int64)
    sigma2 = np.asarray(within, np.float64)[..., None]
    count = int(g.max()) + 1 if g.size else 0
    taus, rhos = [], []
    with np.errstate(all="ignore"):
        resid = np.where(ns > 0, xs / np.where(ns > 0, ns, 1.0) - c, 0.0)
        for k in range(count):
            mine = (g == k) & (ns > 0)
            w = np.where(mine, ns / sigma2, 0.0)  # fixed-effect weights
            sw = w.sum(-1, keepdims=True)
            centre = np.where(sw > 0, (w * resid).sum(-1, keepdims=True) / sw, 0.0)
            q = (w * (resid - centre) ** 2).sum(-1)
            units = mine.sum(-1)
            denominator = sw[..., 0] - np.where(sw[..., 0] > 0, (w * w).sum(-1) / sw[..., 0], 0.0)
            tau2 = np.where(
                (units > 1) & (denominator > 0), np.maximum(q - (units - 1), 0.0) / denominator, 0.0
            )
            taus.append(tau2)
            rhos.append(np.where(sigma2[..., 0] > 0, tau2 / sigma2[..., 0], 0.0))
    return np.stack(taus, -1), np.stack(rhos, -1)


def unit_weights(n: Any, groups: Any, rho: Any) -> np.ndarray:
    """Each unit's weight ``1 / (1 + rho_group n)``."""
    ns = np.asarray(n, np.float64)
    r = np.take_along_axis(np.asarray(rho, np.float64), np.asarray(groups, np.int64), -1)
    result: np.ndarray = 1.0 / (1.0 + r * ns)
    return result
