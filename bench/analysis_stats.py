"""The analyze step's sums, built from a simulated look (:mod:`bench.analysis_population`)
exactly as :mod:`rtrl_trainer.analyze.accumulate` builds them from shards: per metric the
totals and the Gram matrix of the per-unit sums (users assigned whole: a user's sums are one
unit; requests: each row its own unit, second moments summed per user), each row's covariate
its user's."""

from __future__ import annotations

from typing import Any

import numpy as np

from rtrl_trainer.analyze.estimate import Q

from bench.analysis_population import Look


def unit_sums(
    x: np.ndarray, n: np.ndarray, xx: np.ndarray, cov: np.ndarray | None, unit: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(totals ``[e, 2, S, 3]``, Gram ``[e, 6S, 6S]``, units ``[e]``) of one metric from sums
    ``[arm, step, e, u]``; ``cov`` ``[e, u]`` is each user's covariate (None: 0)."""
    _, strata, e, u = x.shape
    c = np.zeros((e, u)) if cov is None else cov
    z = n * c[None, None]
    totals = np.stack([x.sum(-1), n.sum(-1), z.sum(-1)], axis=-1)  # [2, S, e, 3]
    totals = np.moveaxis(totals, 2, 0)  # [e, 2, S, 3]
    k = 2 * strata * Q
    if unit == "user":
        v = np.stack([x, n, z], axis=2)  # [2, S, 3, e, u]
        v = np.moveaxis(v.reshape(k, e, u), 1, 0)  # [e, k, u]
        gram = np.matmul(v, np.swapaxes(v, 1, 2))
        units = np.sum(np.any((n > 0) | (x != 0), axis=(0, 1)), axis=-1).astype(np.float64)
        return totals, gram, units
    gram = np.zeros((e, k, k))
    for a in range(2):
        for s in range(strata):
            at = (a * strata + s) * Q
            xs, ns, xxs = x[a, s], n[a, s], xx[a, s]
            sx, sn = xs.sum(-1), ns.sum(-1)
            sxz, snz, szz = (c * xs).sum(-1), (c * ns).sum(-1), (c**2 * ns).sum(-1)
            block = np.stack(
                [np.stack(r, -1) for r in ((xxs.sum(-1), sx, sxz), (sx, sn, snz), (sxz, snz, szz))],
                -2,
            )
            gram[:, at : at + Q, at : at + Q] = block
    return totals, gram, n.sum(axis=(0, 1, 3))


def own_history(look: Look, name: str) -> np.ndarray | None:
    """Each user's pre-exposure mean of the metric; the overall pre-exposure mean for users
    with none (:meth:`rtrl_trainer.analyze.accumulate.PreExposure.covariate`)."""
    pre = look.users.pre.get(name)
    if pre is None:
        return None
    sx, _, sn = pre
    overall = sx.sum(-1, keepdims=True) / np.maximum(sn.sum(-1, keepdims=True), 1)
    return np.where(sn > 0, sx / np.maximum(sn, 1), overall)


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
