"""Each user's pre-exposure rows (on the stable checkpoints before the canary) and the
covariates built from them (:mod:`.covariates`' model fitted on them, blended with each
unit's own history), for :class:`~rtrl_trainer.analyze.accumulate.Arms`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rtrl_trainer.analyze import covariates as cov_model


@dataclass
class PreExposure:
    """Each user's sums of every metric on the stable checkpoint before the canary, and the
    features of their first such row (its org and prompt-length bin)."""

    sums: dict[str, dict[Any, list[float]]] = field(default_factory=dict)
    first: dict[Any, list[Any]] = field(default_factory=dict)  # user -> [created, org, bin]

    def add(self, name: str, users: np.ndarray, x: Any, n: Any) -> None:
        xs = np.asarray(x, dtype=np.float64)
        ns = np.broadcast_to(np.asarray(n, dtype=np.float64), xs.shape)
        if xs.size == 0:
            return
        unique, inverse = np.unique(users, return_inverse=True)
        sx = np.bincount(inverse, xs, len(unique))
        sxx = np.bincount(inverse, xs * xs, len(unique))
        sn = np.bincount(inverse, ns, len(unique))
        table = self.sums.setdefault(name, {})
        for user, a, aa, b in zip(unique.tolist(), sx.tolist(), sxx.tolist(), sn.tolist(),
                                  strict=True):  # fmt: skip
            entry = table.setdefault(user, [0.0, 0.0, 0.0])
            entry[0] += a
            entry[1] += aa
            entry[2] += b


def first_rows(
    table: dict[Any, list[Any]], users: np.ndarray, created: np.ndarray, org: np.ndarray,
    bins: np.ndarray,
) -> None:  # fmt: skip
    """Keep, per user, the earliest row's (created, org, prompt bin)."""
    if users.size == 0:
        return
    order = np.lexsort((created, users))
    u, t = users[order], created[order]
    starts = np.flatnonzero(np.r_[True, u[1:] != u[:-1]])
    for i in starts.tolist():
        seen = table.get(u[i])
        if seen is None or t[i] < seen[0]:
            row = order[i]
            table[u[i]] = [int(t[i]), str(org[row]), int(bins[row])]


@dataclass
class Covariates:
    """Each key's covariate per metric, and which keys had history of their own."""

    values: dict[str, np.ndarray]
    returning: dict[str, np.ndarray]  # per metric: the key's user had pre-exposure rows
    pre_users: dict[str, int]
    within: dict[str, float] = field(default_factory=dict)  # one row's variance, per metric


def covariates(
    pre: PreExposure, window_first: dict[Any, list[Any]], users: list[Any], *,
    features: bool = True,
) -> Covariates:  # fmt: skip
    """Per metric with pre-exposure data: the model of :mod:`.covariates` fitted on the
    pre-exposure users, each key's covariate from its user's first row in the canary and own
    history."""
    values: dict[str, np.ndarray] = {}
    returning: dict[str, np.ndarray] = {}
    fitted: dict[str, int] = {}
    within: dict[str, float] = {}
    unit_org = np.array([str((window_first.get(u) or [0, ""])[1]) for u in users], dtype=object)
    unit_bin = np.array([int((window_first.get(u) or [0, "", 0])[2]) for u in users])
    for name, table in pre.sums.items():
        pre_users = list(table)
        sums = np.array([table[u] for u in pre_users], dtype=np.float64).reshape(-1, 3)
        org = np.array([str((pre.first.get(u) or [0, ""])[1]) for u in pre_users], dtype=object)
        bins = np.array([int((pre.first.get(u) or [0, "", 0])[2]) for u in pre_users])
        model = cov_model.fit(sums[:, 0], sums[:, 1], sums[:, 2], org, bins, features=features)
        own = np.array([table.get(u, (0.0, 0.0, 0.0)) for u in users], dtype=np.float64)
        own = own.reshape(-1, 3)
        values[name] = cov_model.covariate(model, unit_org, unit_bin, own[:, 0], own[:, 2])
        returning[name] = own[:, 2] > 0
        fitted[name] = 0 if model is None else model.users
        within[name] = 0.0 if model is None else model.within
    return Covariates(values, returning, fitted, within)


# --- the analysis's per-arm statistics ------------------------------------------------

# The metrics measured on matured rows: name -> (rows it is measured on, x, n) from a batch.
