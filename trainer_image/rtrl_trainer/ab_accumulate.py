"""Streaming per-unit sums for :func:`rtrl_trainer.ab_estimate.difference`.

The analysis reads shards batch by batch; a unit's rows are spread over files and hours,
so its sums are kept by key (a user or session id) until the pass ends, and only then
turned into the Gram matrix the cluster-robust variance needs. With the request as the
unit every row is its own unit and the Gram matrix is block-diagonal: per-row second
moments are summed per key (the user, whose pre-exposure mean is each row's covariate)
instead, so memory grows with the number of users, never with rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rtrl_trainer.ab_estimate import N, Q, X, Z

# Per-key columns: x, n (per unit); and xx, nn, xn (per row, request unit only).
_COLUMNS_UNIT = 2
_COLUMNS_ROW = 5


@dataclass
class Keys:
    """Dense integer ids for string keys, shared by every metric of one analysis."""

    ids: dict[Any, int] = field(default_factory=dict)
    covariate_key: list[Any] = field(default_factory=list)  # the user behind each key

    def lookup(self, keys: np.ndarray, users: np.ndarray) -> np.ndarray:
        unique, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
        mapped = np.empty(len(unique), dtype=np.int64)
        for i, (key, row) in enumerate(zip(unique.tolist(), first.tolist(), strict=True)):
            found = self.ids.get(key)
            if found is None:
                found = self.ids[key] = len(self.ids)
                self.covariate_key.append(users[row])
            mapped[i] = found
        return mapped[inverse]


@dataclass
class MetricSums:
    """One metric's sums per (key, cell), the cell being ``arm * strata + stratum``."""

    strata: int
    per_row: bool
    data: np.ndarray = field(default_factory=lambda: np.zeros((0, 0, 0)))
    rows: int = 0  # rows added: the request unit's unit count

    def __post_init__(self) -> None:
        width = _COLUMNS_ROW if self.per_row else _COLUMNS_UNIT
        self.data = np.zeros((0, 2 * self.strata, width))

    def _grow(self, size: int) -> None:
        if self.data.shape[0] >= size:
            return
        width = _COLUMNS_ROW if self.per_row else _COLUMNS_UNIT
        grown = np.zeros((max(size, 2 * self.data.shape[0], 1024), 2 * self.strata, width))
        grown[: self.data.shape[0]] = self.data
        self.data = grown

    def add(self, ids: np.ndarray, cell: np.ndarray, x: Any, n: Any) -> None:
        if ids.size == 0:
            return
        self.rows += int(ids.size)
        xs = np.asarray(x, dtype=np.float64)
        ns = np.broadcast_to(np.asarray(n, dtype=np.float64), xs.shape)
        self._grow(int(ids.max()) + 1)
        columns = [xs, ns, xs * xs, ns * ns, xs * ns] if self.per_row else [xs, ns]
        for column, values in enumerate(columns):
            np.add.at(self.data[:, :, column], (ids, cell), values)

    def finish(self, keys: int, covariate: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
        """(totals [2, S, 3], Gram [6S, 6S], units); ``covariate[k]`` is key k's row
        covariate (its user's pre-exposure mean)."""
        self._grow(keys)
        data = self.data[:keys]
        c = covariate[:keys, None]
        cells = 2 * self.strata
        totals = np.zeros((cells, Q))
        totals[:, X] = data[:, :, 0].sum(axis=0)
        totals[:, N] = data[:, :, 1].sum(axis=0)
        totals[:, Z] = (data[:, :, 1] * c).sum(axis=0)
        gram = np.zeros((cells * Q, cells * Q))
        if self.per_row:
            xx, nn, xn = (data[:, :, i] for i in (2, 3, 4))
            for cell in range(cells):
                block = np.array(
                    [
                        [xx[:, cell].sum(), xn[:, cell].sum(), (c[:, 0] * xn[:, cell]).sum()],
                        [0.0, nn[:, cell].sum(), (c[:, 0] * nn[:, cell]).sum()],
                        [0.0, 0.0, (c[:, 0] ** 2 * nn[:, cell]).sum()],
                    ]
                )
                block = np.triu(block) + np.triu(block, 1).T
                gram[cell * Q : (cell + 1) * Q, cell * Q : (cell + 1) * Q] = block
            units = self.rows
        else:
            vectors = np.zeros((keys, cells * Q))
            vectors[:, X::Q] = data[:, :, 0]
            vectors[:, N::Q] = data[:, :, 1]
            vectors[:, Z::Q] = data[:, :, 1] * c
            active = np.any(data[:, :, 1] != 0, axis=1) | np.any(data[:, :, 0] != 0, axis=1)
            vectors = vectors[active]
            gram = vectors.T @ vectors
            units = int(active.sum())
        return totals.reshape(2, self.strata, Q), gram, units


@dataclass
class PreExposure:
    """Each user's sums of every metric on the stable checkpoint before the canary."""

    sums: dict[str, dict[Any, list[float]]] = field(default_factory=dict)

    def add(self, name: str, users: np.ndarray, x: Any, n: Any) -> None:
        xs = np.asarray(x, dtype=np.float64)
        ns = np.broadcast_to(np.asarray(n, dtype=np.float64), xs.shape)
        if xs.size == 0:
            return
        unique, inverse = np.unique(users, return_inverse=True)
        sx = np.bincount(inverse, xs, len(unique))
        sn = np.bincount(inverse, ns, len(unique))
        table = self.sums.setdefault(name, {})
        for user, a, b in zip(unique.tolist(), sx.tolist(), sn.tolist(), strict=True):
            entry = table.setdefault(user, [0.0, 0.0])
            entry[0] += a
            entry[1] += b

    def covariate(self, name: str, users: list[Any]) -> tuple[np.ndarray, int]:
        """Per key: its user's pre-exposure mean, the overall pre-exposure mean for users
        not seen before (so their covariate carries no information); and how many keys had
        one of their own."""
        table = self.sums.get(name, {})
        total_x = sum(v[0] for v in table.values())
        total_n = sum(v[1] for v in table.values())
        overall = total_x / total_n if total_n > 0 else 0.0
        values = np.full(len(users), overall)
        own = 0
        for i, user in enumerate(users):
            entry = table.get(user)
            if entry is not None and entry[1] > 0:
                values[i] = entry[0] / entry[1]
                own += 1
        return values, own
