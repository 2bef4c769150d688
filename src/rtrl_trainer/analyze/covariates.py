"""Each unit's covariate for variance reduction, new units included: a prediction of its
metric from what was known before it saw either arm.

CUPED on a unit's own history (Deng, Xu, Kohavi & Walker, WSDM 2013) helps only units with
history; a canary running a day meets many units that have none, and with heavy-tailed
activity the few heavy units' residuals dominate whatever is left. Here every unit gets the
best prediction of its metric from data that the canary cannot have influenced
(CUPAC-style: Tang, Li, Wang & Wang, "Control Using Predictions as Covariates", DoorDash
engineering, 2020; regression adjustment with any pre-treatment covariate keeps the
difference unbiased, Lin, Ann. Appl. Stat. 2013):

- **features** of the unit known before its first response in the canary: its ``org`` and
  the prompt-length bin (:data:`PROMPT_EDGES`) of its first request in the canary;
- a **model** fitted on the stable arm's rows before the canary (never on the canary's, and
  never on the arm): the mean of each user's pre-exposure rows regressed on the same features
  of that user (org and the prompt-length bin of their first pre-exposure row), additive,
  org effects shrunk toward 0 by empirical Bayes (many orgs are small);
- the unit's **own history**, where it has one, blended with the prediction by empirical
  Bayes: ``c = pred + w (own mean - pred)``, ``w = tau^2 / (tau^2 + sigma^2 / n)`` with
  ``sigma^2`` the within-user variance and ``tau^2`` the between-user variance the
  features leave, both estimated from the same rows. A user with a week of history keeps
  their own mean; one with three rows is pulled toward users like them.

The covariate enters the estimator exactly as CUPED's did (one ``theta`` per metric,
:func:`rtrl_trainer.analyze.estimate.difference`). Pure numpy: the analyze step and the
calibration benchmark call the same functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

# Prompt-length bins (tokens): < 256, < 512, ..., >= 16384.
PROMPT_EDGES = (256, 512, 1024, 2048, 4096, 8192, 16384)
PROMPT_BINS = len(PROMPT_EDGES) + 1
_ITERATIONS = 8


def prompt_bin(lengths: Any) -> np.ndarray:
    """The prompt-length bin of each length in tokens."""
    edges = np.asarray(PROMPT_EDGES, dtype=np.float64)
    return np.searchsorted(edges, np.asarray(lengths, dtype=np.float64), side="right")


@dataclass(frozen=True)
class Model:
    """Predictions of one metric from a unit's features, fitted on pre-exposure users."""

    mean: float
    org_effect: dict[str, float]
    bin_effect: np.ndarray  # [PROMPT_BINS]
    within: float  # sigma^2: variance of one row around its user's mean
    between: float  # tau^2: variance of users' means around the prediction
    users: int  # pre-exposure users the model was fitted on

    def predict(self, org: Any, bins: Any) -> np.ndarray:
        """The prediction for units with these orgs (an unknown org: no effect) and bins."""
        orgs = np.asarray(org).astype(str).ravel()
        effect = np.array([self.org_effect.get(o, 0.0) for o in orgs.tolist()], dtype=np.float64)
        b = np.asarray(bins, dtype=np.int64).ravel()
        result: np.ndarray = (self.mean + effect + self.bin_effect[b]).reshape(np.shape(bins))
        return result


def fit(sx: Any, sxx: Any, n: Any, org: Any, bins: Any, *, features: bool = True) -> Model | None:
    """The model of one metric from each pre-exposure user's sums (``sx``, ``sxx``, ``n``
    rows) and features (``org`` as strings, null orgs as ""); None without two users with
    rows. ``features`` False fits the overall mean only (no org or prompt effects)."""
    sx, sxx, n = (np.asarray(v, dtype=np.float64).ravel() for v in (sx, sxx, n))
    keep = n > 0
    if np.count_nonzero(keep) < 2:
        return None
    sx, sxx, n = sx[keep], sxx[keep], n[keep]
    orgs = np.asarray(org).astype(str).ravel()[keep]
    b = np.asarray(bins, dtype=np.int64).ravel()[keep]
    m = sx / n
    # sigma^2: pooled within-user variance (users with two rows or more)
    many = n > 1
    spread = np.maximum(sxx - sx * sx / n, 0.0)
    within = float(spread[many].sum() / (n[many] - 1).sum()) if many.any() else float(np.var(m))
    mean = float(sx.sum() / n.sum())
    org_keys, org_index = np.unique(orgs, return_inverse=True)
    org_eff = np.zeros(len(org_keys))
    bin_eff = np.zeros(PROMPT_BINS)
    between = _between(m, n, within, mean)
    for _ in range(_ITERATIONS if features else 0):
        w = 1.0 / (between + within / n)
        # prompt-length bins: few, each with many users, estimated by weighted means
        resid = m - mean - org_eff[org_index]
        num = np.bincount(b, w * resid, PROMPT_BINS)
        den = np.bincount(b, w, PROMPT_BINS)
        bin_eff = np.where(den > 0, num / np.where(den > 0, den, 1.0), 0.0)
        bin_eff -= np.sum(den * bin_eff) / np.sum(den)
        # orgs: many, some small, each mean shrunk toward 0 by its own precision
        resid = m - mean - bin_eff[b]
        num = np.bincount(org_index, w * resid, len(org_keys))
        den = np.bincount(org_index, w, len(org_keys))
        raw = num / den
        # between-org variance by the method of moments: E[raw^2] = tau_org^2 + 1/den
        tau_org = max(float(np.sum(den * raw**2 - 1.0) / np.sum(den)), 0.0)
        org_eff = raw * tau_org / (tau_org + 1.0 / den)
        between = _between(m, n, within, mean + org_eff[org_index] + bin_eff[b])
    return Model(
        mean=mean,
        org_effect=dict(zip(org_keys.tolist(), org_eff.tolist(), strict=True)),
        bin_effect=bin_eff,
        within=within,
        between=between,
        users=int(keep.sum()),
    )


def _between(m: np.ndarray, n: np.ndarray, within: float, pred: Any) -> float:
    """tau^2 by the method of moments: the users' mean squared residual less its sampling
    part ``sigma^2 / n``; at least 1e-6 of the within-user variance."""
    value = float(np.mean((m - pred) ** 2 - within / n))
    return max(value, 1e-6 * within, 1e-300)


def covariate(model: Model | None, org: Any, bins: Any, own_sx: Any, own_n: Any) -> np.ndarray:
    """Each unit's covariate: the model's prediction from its features, blended with its
    own pre-exposure mean by ``tau^2 / (tau^2 + sigma^2 / n)`` where it has rows. Without a
    model (no pre-exposure data): zeros, no adjustment."""
    own_sx = np.asarray(own_sx, dtype=np.float64)
    own_n = np.asarray(own_n, dtype=np.float64)
    if model is None:
        return np.zeros(own_n.shape)
    pred = model.predict(org, bins)
    with np.errstate(divide="ignore", invalid="ignore"):
        own = np.where(own_n > 0, own_sx / np.where(own_n > 0, own_n, 1.0), pred)
        weight = np.where(
            own_n > 0, model.between / (model.between + model.within / np.maximum(own_n, 1e-300)),
            0.0,
        )  # fmt: skip
    return np.asarray(pred + weight * (own - pred))
