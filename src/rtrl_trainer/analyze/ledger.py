"""The per-unit sums of the analysis, look by look: a :class:`Ledger` keeps each (unit, look
the rows first count at) entry, and :func:`unit_looks` / :func:`row_looks` grow each key's
running sums and the Gram matrix of the per-unit vectors one look at a time (only the keys
with new rows change it), for :class:`~rtrl_trainer.analyze.accumulate.Arms`. Memory grows
with the (unit, look) pairs that have rows: at most the rows, at most the units times the
looks. With the request as the unit every row is its own unit and the Gram matrix is
block-diagonal: per-row second moments are summed per key (the user, whose covariate is
each row's) instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rtrl_trainer.analyze.estimate import Difference, Q, difference
from rtrl_trainer.analyze.weights import random_effect, unit_weights

# Per-entry columns: x, n (per unit); x, n, xx, nn, xn, rows (per row, request unit only).
_UNIT, _ROW = 2, 6


@dataclass
class Keys:
    """Dense integer ids for string keys, shared by every metric of one analysis; each key's
    user (whose history and features are its covariate's)."""

    ids: dict[Any, int] = field(default_factory=dict)
    covariate_key: list[Any] = field(default_factory=list)

    def lookup(self, keys: np.ndarray, users: np.ndarray) -> np.ndarray:
        unique, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
        mapped = np.empty(len(unique), dtype=np.int64)
        for i, (key, row) in enumerate(zip(unique.tolist(), first.tolist(), strict=True)):
            found = self.ids.get(key)
            if found is None:
                found = self.ids[key] = len(self.ids)
                self.covariate_key.append(users[row])
            mapped[i] = found
        result: np.ndarray = mapped[inverse]
        return result


class Ledger:
    """Sums per (key, look, tag) and cell (``arm * strata + stratum``): the rows of a key
    that first count at a look (the tag: their 5-minute bin, where exposure matters)."""

    def __init__(self, cells: int, width: int, looks: int, tags: int = 1) -> None:
        self.cells, self.width = cells, width
        self.look_span, self.tag_span = looks + 1, max(tags, 1)
        self.index: dict[int, int] = {}
        self.key = np.zeros(0, dtype=np.int64)
        self.look = np.zeros(0, dtype=np.int64)
        self.tag = np.zeros(0, dtype=np.int64)
        self.data = np.zeros((0, cells, width))
        self.size = 0

    def add(
        self, keys: np.ndarray, looks: np.ndarray, cells: np.ndarray, columns: list[Any],
        tags: np.ndarray | None = None,
    ) -> None:  # fmt: skip
        if keys.size == 0:
            return
        tag = np.zeros(keys.size, dtype=np.int64) if tags is None else np.clip(tags, 0, None)
        code = (keys * self.look_span + looks) * self.tag_span + np.minimum(tag, self.tag_span - 1)
        unique, inverse = np.unique(code, return_inverse=True)
        ids = np.empty(unique.size, dtype=np.int64)
        fresh: list[int] = []
        for i, c in enumerate(unique.tolist()):
            found = self.index.get(c)
            if found is None:
                found = self.index[c] = self.size + len(fresh)
                fresh.append(c)
            ids[i] = found
        if fresh:
            self._grow(self.size + len(fresh))
            codes = np.asarray(fresh, dtype=np.int64)
            at = slice(self.size, self.size + len(fresh))
            self.tag[at] = codes % self.tag_span
            self.look[at] = (codes // self.tag_span) % self.look_span
            self.key[at] = codes // self.tag_span // self.look_span
            self.size += len(fresh)
        rows = ids[inverse]
        for column, values in enumerate(columns):
            v = np.broadcast_to(np.asarray(values, dtype=np.float64), keys.shape)
            np.add.at(self.data[:, :, column], (rows, cells), v)

    def _grow(self, size: int) -> None:
        if self.data.shape[0] >= size:
            return
        new = max(size, 2 * self.data.shape[0], 1024)
        data = np.zeros((new, self.cells, self.width))
        data[: self.size] = self.data[: self.size]
        self.data = data
        for name in ("key", "look", "tag"):
            grown = np.zeros(new, dtype=np.int64)
            grown[: self.size] = getattr(self, name)[: self.size]
            setattr(self, name, grown)

    def entries(self, select: np.ndarray | None = None) -> tuple[np.ndarray, ...]:
        """(key, look, data) of the entries, those of ``select`` (a mask) only."""
        key, look, data = self.key[: self.size], self.look[: self.size], self.data[: self.size]
        if select is not None:
            key, look, data = key[select], look[select], data[select]
        return key, look, data


@dataclass
class PerLook:
    """One metric's sums at every look: totals ``[L, 2, S, 3]``, Gram ``[L, 6S, 6S]``,
    units ``[L]``, and at the last look the Gram of each group of keys (``parts``)."""

    totals: np.ndarray
    gram: np.ndarray
    units: np.ndarray
    parts: tuple[np.ndarray, ...] = ()

    def difference(self, adjust: bool) -> Difference:
        """The difference at every look (the last one's with its parts' reductions)."""
        every = difference(self.totals, self.gram, self.units, adjust=adjust)
        last = difference(self.totals[-1], self.gram[-1], self.units[-1], adjust=adjust,
                          parts=self.parts)  # fmt: skip
        return every._replace(part_reduction=last.part_reduction)


@dataclass(frozen=True)
class Weighting:
    """Precision weights (:mod:`.weights`): each key's group (0: no history of its own, 1:
    some) and the within-unit variance of one row."""

    groups: np.ndarray
    within: float


def unit_looks(
    ledger: Ledger, keys: int, looks: int, covariate: np.ndarray, strata: int, *,
    counts: bool = False, groups: tuple[np.ndarray, ...] = (), select: np.ndarray | None = None,
    weighting: Weighting | None = None,
) -> PerLook:  # fmt: skip
    """Per look: the totals and Gram matrix of the per-unit vectors ``(x, n, n c)`` per cell,
    ``c`` each key's covariate; ``counts``: the ledger holds rows per cell and a unit's
    ``n`` is 1 where it has any (rows per unit). ``groups``: masks over keys whose Gram
    at the last look is wanted. ``weighting``: each unit's vector scaled by its precision
    weight at the look (the between-unit variance estimated from that look's units)."""
    key, look, data = ledger.entries(select)
    cells = 2 * strata
    order = np.argsort(look, kind="stable")
    key, look, data = key[order], look[order], data[order]
    bounds = np.searchsorted(look, np.arange(looks + 1))
    raw = np.zeros((keys, cells, ledger.width))
    c = covariate[:keys, None]

    def vectors(ids: np.ndarray) -> np.ndarray:
        v = raw[ids]
        x = v[:, :, 0]
        n = (x > 0).astype(np.float64) if counts else v[:, :, 1]
        out = np.stack([x, n, n * c[ids]], axis=-1)  # [k, cells, 3]
        result: np.ndarray = out.reshape(len(ids), cells * Q)
        return result

    gram = np.zeros((cells * Q, cells * Q))
    total = np.zeros(cells * Q)
    active = np.zeros(keys, dtype=bool)
    grams = np.zeros((looks, cells * Q, cells * Q))
    totals = np.zeros((looks, cells * Q))
    units = np.zeros(looks)
    every = np.arange(keys)

    def weighted(ids: np.ndarray) -> np.ndarray:
        v = vectors(ids)
        if weighting is None:
            return v
        xs, ns = raw[:, :, 0].sum(axis=1), raw[:, :, 1].sum(axis=1)
        _, rho = random_effect(xs, ns, covariate[:keys], weighting.groups[:keys],
                               weighting.within)  # fmt: skip
        w = unit_weights(ns, weighting.groups[:keys], rho)
        result: np.ndarray = v * w[ids, None]
        return result

    for j in range(looks):
        lo, hi = bounds[j], bounds[j + 1]
        if hi > lo:
            ids = np.unique(key[lo:hi])
            old = vectors(ids)
            np.add.at(raw, key[lo:hi], data[lo:hi])
            new = vectors(ids)
            gram += new.T @ new - old.T @ old
            total += new.sum(axis=0) - old.sum(axis=0)
            active[ids] = np.any(new != 0, axis=1)
        if weighting is not None:  # every unit's weight moves with the look's estimate
            v = weighted(every[active])
            grams[j], totals[j] = v.T @ v, v.sum(axis=0)
        else:
            grams[j], totals[j] = gram, total
        units[j] = np.count_nonzero(active)
    parts = []
    for group in groups:
        v = weighted(np.flatnonzero(group[:keys] & active))
        parts.append(v.T @ v)
    return PerLook(totals.reshape(looks, 2, strata, Q), grams, units, tuple(parts))


def row_looks(
    ledger: Ledger, keys: int, looks: int, covariate: np.ndarray, strata: int, *,
    groups: tuple[np.ndarray, ...] = (), select: np.ndarray | None = None,
) -> PerLook:  # fmt: skip
    """Per look, with every row its own unit: the block-diagonal Gram matrix from the per-row
    moments summed per key (``c`` the key's covariate), cumulated over the looks."""
    key, look, data = ledger.entries(select)
    cells = 2 * strata
    c = covariate[key][:, None]
    x, n, xx, nn, xn, rows = (data[:, :, i] for i in range(_ROW))
    moments = np.stack(
        [xx, xn, c * xn, nn, c * nn, c * c * nn, x, n, c * n, rows], axis=-1
    )  # [entries, cells, 10]
    per_look = np.zeros((looks, cells, 10))
    np.add.at(per_look, look, moments)
    cum = np.cumsum(per_look, axis=0)

    def blocks(m: np.ndarray) -> np.ndarray:
        g = np.zeros((*m.shape[:-2], cells * Q, cells * Q))
        for cell in range(cells):
            a, b_, cz, d, e, f = (m[..., cell, i] for i in range(6))
            block = np.stack([np.stack(r, -1) for r in ((a, b_, cz), (b_, d, e), (cz, e, f))], -2)
            g[..., cell * Q : (cell + 1) * Q, cell * Q : (cell + 1) * Q] = block
        return g

    totals = np.stack([cum[..., 6], cum[..., 7], cum[..., 8]], axis=-1)  # [L, cells, 3]
    units = cum[..., 9].sum(axis=-1)
    parts = []
    for group in groups:
        parts.append(blocks(moments[group[key]].sum(axis=0)))
    return PerLook(totals.reshape(looks, 2, strata, Q), blocks(cum), units, tuple(parts))
