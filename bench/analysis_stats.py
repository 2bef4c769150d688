"""The analyze step's sums, built from a simulated look (:mod:`bench.analysis_population`)
exactly as :mod:`rtrl_trainer.analyze.accumulate` builds them from shards: per metric the
totals and the Gram matrix of the per-unit sums (users assigned whole: a user's sums are one
unit; requests: each row its own unit, second moments summed per user), each row's covariate
its user's; and the covariates themselves (:mod:`rtrl_trainer.analyze.covariates`)."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
from bench.analysis_population import STEPS, Look, Users

from rtrl_trainer.analyze import covariates as cov_model
from rtrl_trainer.analyze.estimate import Q


class Sums:
    """One metric's totals ``[e, 2, S, 2 + C]`` and Gram ``[e, 2S(2+C), 2S(2+C)]`` over
    (x, n, and one covariate column per variant), and its unit counts."""

    def __init__(self, totals: np.ndarray, gram: np.ndarray, units: np.ndarray) -> None:
        self.totals, self.gram, self.units = totals, gram, units

    def pick(self, k: int | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(totals, Gram, units) with covariate ``k`` as ``z`` (``None``: zeros), in the
        layout :func:`rtrl_trainer.analyze.estimate.difference` takes."""
        _, _, strata, width = self.totals.shape
        cols = [0, 1, 2 + (k if k is not None else 0)]
        totals = self.totals[..., cols].copy()
        if k is None:
            totals[..., 2] = 0.0
        index = np.array(
            [(a * strata + s) * width + c for a in range(2) for s in range(strata) for c in cols]
        )
        gram = self.gram[:, index[:, None], index[None, :]]
        if k is None:
            z = np.arange(len(index)) % Q == 2
            gram = gram * ~(z[:, None] | z[None, :])
        return totals, gram, self.units


def unit_sums(
    x: np.ndarray, n: np.ndarray, xx: np.ndarray, covs: list[np.ndarray], *, unit: str,
    bucket: np.ndarray | None = None,
) -> Sums:  # fmt: skip
    """The sums of one metric from per-user sums ``[arm, step, e, u]`` with covariates
    ``covs`` (each ``[e, u]``)."""
    _, strata, e, _ = x.shape
    width = 2 + len(covs)
    zs = [n * c[None, None] for c in covs]
    cols = [x, n, *zs]
    totals = np.stack([v.sum(-1) for v in cols], axis=-1)  # [2, S, e, W]
    totals = np.moveaxis(totals, 2, 0)  # [e, 2, S, W]
    k = 2 * strata * width
    gram = np.zeros((e, k, k))
    if unit == "user":
        assert bucket is not None
        weights = [w for w, _ in STEPS[:strata]]
        edges = [0, *sorted(set(weights)), 100]
        for lo, hi in itertools.pairwise(edges):
            arms = [int(lo < w) for w in weights]
            first = min(int(np.searchsorted(row, lo)) for row in bucket)
            last = max(int(np.searchsorted(row, hi)) for row in bucket)
            if last <= first:
                continue
            mine = (bucket[:, first:last] >= lo) & (bucket[:, first:last] < hi)  # [e, w]
            # this class's per-user vector: for each step, its arm's (x, n, z...) entries
            v = np.stack(
                [col[arms[s], s, :, first:last] * mine for s in range(strata) for col in cols],
                axis=1,
            )  # [e, S*W, w]
            g = np.matmul(v, np.swapaxes(v, 1, 2))
            index = np.array(
                [(arms[s] * strata + s) * width + c for s in range(strata) for c in range(width)]
            )
            gram[:, index[:, None], index[None, :]] += g
        units = np.sum(np.any((n > 0) | (x != 0), axis=(0, 1)), axis=-1).astype(np.float64)
        return Sums(totals, gram, units)
    for a in range(2):
        for s in range(strata):
            at = (a * strata + s) * width
            xs, ns, xxs = x[a, s], n[a, s], xx[a, s]
            block = np.zeros((e, width, width))
            block[:, 0, 0] = xxs.sum(-1)
            block[:, 0, 1] = block[:, 1, 0] = xs.sum(-1)
            block[:, 1, 1] = ns.sum(-1)
            for i, c in enumerate(covs):
                block[:, 0, 2 + i] = block[:, 2 + i, 0] = (c * xs).sum(-1)
                block[:, 1, 2 + i] = block[:, 2 + i, 1] = (c * ns).sum(-1)
                for j, d in enumerate(covs):
                    block[:, 2 + i, 2 + j] = (c * d * ns).sum(-1)
            gram[:, at : at + width, at : at + width] = block
    return Sums(totals, gram, n.sum(axis=(0, 1, 3)))


def own_history(users: Users, name: str) -> np.ndarray | None:
    """Each user's pre-exposure mean of the metric; the overall pre-exposure mean for users
    with none (:meth:`rtrl_trainer.analyze.accumulate.PreExposure.covariate`): today's."""
    pre = users.pre.get(name)
    if pre is None:
        return None
    sx, _, sn = pre
    overall = sx.sum(-1, keepdims=True) / np.maximum(sn.sum(-1, keepdims=True), 1)
    return np.where(sn > 0, sx / np.maximum(sn, 1), overall)


def predicted(
    users: Users, name: str, *, features: bool = True
) -> tuple[np.ndarray, np.ndarray] | None:
    """Each user's covariate from :mod:`rtrl_trainer.analyze.covariates`: a model of the
    metric fitted on the pre-exposure users' sums and features (org, first prompt's bin),
    blended with the user's own history; and the model's within-user variance per canary."""
    pre = users.pre.get(name)
    if pre is None:
        return None
    sx, sxx, sn = pre
    out = np.zeros(sx.shape)
    within = np.zeros(sx.shape[0])
    for i in range(sx.shape[0]):
        orgs = users.org[i].astype(str)
        model = cov_model.fit(sx[i], sxx[i], sn[i], orgs, users.pre_first_bin[i], features=features)
        out[i] = cov_model.covariate(model, orgs, users.first_bin[i], sx[i], sn[i])
        within[i] = 0.0 if model is None else model.within
    return out, within


def srm_counts(look: Look, unit: str) -> tuple[list[Any], list[Any]]:
    """Per step: units first seen in each arm (users for ``unit user``; rows for
    ``request``), counted at assignment."""
    if unit == "user":
        seen = look.rows > 0
        return (
            [seen[0, s].sum(-1) for s in range(look.steps)],
            [seen[1, s].sum(-1) for s in range(look.steps)],
        )
    return (
        [look.rows[0, s].sum(-1) for s in range(look.steps)],
        [look.rows[1, s].sum(-1) for s in range(look.steps)],
    )
