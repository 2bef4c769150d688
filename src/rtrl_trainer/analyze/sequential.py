"""Group-sequential boundaries: the error is spent where the looks are.

A canary is analysed on a schedule the spec fixes in advance: every ``analysis.interval`` from
its start until ``analysis.maxDuration``. An always-valid (mixture) interval pays for looks at
every instant forever; a group-sequential test pays only for the looks that can happen. Its
two-sided boundary ``c_k`` at look ``k`` is chosen so that the chance, under the true value, of
the standardised estimate ``Z_k = (estimate - truth) / sd`` leaving ``(-c_k, c_k)`` at look
``k`` for the first time is the error the *spending function* releases between the previous
look and this one (Lan & DeMets, "Discrete sequential boundaries for clinical trials",
Biometrika 70(3), 1983). The spending function is of calendar time, ``t = elapsed /
maxDuration``; the error it has released by ``t`` is ``alpha t^rho`` (Kim & DeMets, 1987), all
of it by maxDuration. Looks at which a metric cannot be judged yet spend nothing; their error
is carried to the next.

The joint law of the ``Z_k`` is the one of a Brownian motion observed at the looks'
*information* ``I_k = 1 / V_k`` (``V_k`` the variance of the estimate): consecutive
``Z``'s correlate by ``sqrt(I_{k-1} / I_k)`` (Jennison & Turnbull, *Group Sequential Methods
with Applications to Clinical Trials*, 2000, ch. 19: the recursive numerical integration of
Armitage, McPherson & Rowe, 1969). Here the density of ``Z`` on the continuation region is
carried from look to look as the mass of ``BINS`` equal bins, uniform within each; moving it
to the next look and finding the boundary are exact integrals of the normal kernel over each
bin (``G(y) = y Phi(y) + phi(y)`` is the integral of ``Phi``), so a look that adds little
information (a kernel far narrower than a bin) is as accurate as one that adds much.

``estimate -+ c_k sqrt(V_k)`` is then a *repeated confidence interval*: with probability
``1 - alpha`` it covers the truth at every look of the plan simultaneously (Jennison &
Turnbull, ch. 9), however the canary is stopped. Everything is numpy on a batch (one element
per metric or per simulated canary).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

# The nodes carrying the continuation density; beyond +-Z_MAX the normal density is below
# 6e-15 and is dropped.
NODES = 41
Z_MAX = 8.5
# Released error: alpha * t^rho; rho 1 releases it in proportion to calendar time, 3 keeps
# most of it for the later hours, where a lasting effect shows (the calibration in
# docs/analysis.md measures 1, 1.5, 2, 3 and O'Brien-Fleming's shape side by side).
DEFAULT_RHO = 3.0
_BISECTIONS = 56
_ITERATIONS = 60
_SQRT_2PI = math.sqrt(2 * math.pi)


def _tail_and_density(x: Any) -> tuple[np.ndarray, np.ndarray]:
    """``(Phi(-|x|), phi(x))`` to double precision (Hart's algorithm 5666, as given by G.
    West, "Better approximations to cumulative normal functions", Wilmott Magazine, 2005:
    absolute error below 2e-16; numpy has no ``erf``), sharing one exponential."""
    a = np.atleast_1d(np.minimum(np.abs(np.asarray(x, dtype=np.float64)), 40.0))
    e = np.exp(-a * a / 2)
    num = 3.52624965998911e-02 * a + 0.700383064443688
    for c in (6.37396220353165, 33.912866078383, 112.079291497871, 221.213596169931,
              220.206867912376):  # fmt: skip
        num = num * a + c
    den = 8.83883476483184e-02 * a + 1.75566716318264
    for c in (16.064177579207, 86.7807322029461, 296.564248779674, 637.333633378831,
              793.826512519948, 440.413735824752):  # fmt: skip
        den = den * a + c
    tail = e * num / den
    far = a >= 7.07106781186547
    if far.any():
        af = a[far]
        b = af + 0.65
        for k in (4.0, 3.0, 2.0, 1.0):
            b = af + k / b
        tail[far] = e[far] / b / 2.506628274631
    shape = np.shape(x)
    return tail.reshape(shape), (e / _SQRT_2PI).reshape(shape)


def normal_lower_tail(x: Any) -> np.ndarray:
    """``Phi(-|x|)`` to double precision."""
    return _tail_and_density(x)[0]


def normal_cdf(x: Any) -> np.ndarray:
    """The standard normal distribution function, to double precision."""
    x = np.asarray(x, dtype=np.float64)
    tail = normal_lower_tail(x)
    return np.where(x > 0, 1.0 - tail, tail)


def _cdf_pdf(y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    tail, pdf = _tail_and_density(y)
    return np.where(y > 0, 1.0 - tail, tail), pdf


@functools.lru_cache(maxsize=64)
def normal_quantile(p: float) -> float:
    """``Phi^-1(p)`` by bisection on :func:`normal_cdf` (scalars: the spending function)."""
    lo, hi = -40.0, 40.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if float(normal_cdf(mid)) < p:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def spent(t: Any, alpha: float, rho: float = DEFAULT_RHO) -> np.ndarray:
    """The error released by calendar fraction ``t`` (``alpha`` from ``t = 1`` on):
    ``alpha t^rho``; ``rho`` 0 means O'Brien-Fleming's shape (Lan & DeMets' ``2 - 2
    Phi(z_{alpha/2} / sqrt(t))``, which saves nearly all of it for the end)."""
    frac = np.clip(np.asarray(t, dtype=np.float64), 0.0, 1.0)
    if rho == 0:
        z = normal_quantile(1 - alpha / 2)
        with np.errstate(divide="ignore"):
            released = 2 * normal_lower_tail(z / np.sqrt(frac))
        return np.where(frac > 0, np.minimum(released, alpha), 0.0)
    return alpha * frac**rho


class _Recursion:
    """The continuation density of ``Z`` for a batch of tests at ``nodes`` equally spaced
    points spanning the last look's continuation region ``[-c, c]``, linear between them and
    0 outside (the truncation at the boundary is exact). The density at the next look and
    the chance of crossing its boundary are exact Gaussian integrals of each linear piece, so
    a look adding little information (a kernel narrower than a piece) is as accurate as one
    adding much; the error is that of linear interpolation, of order (2c / nodes)^2."""

    def __init__(self, shape: tuple[int, ...], nodes: int) -> None:
        self.nodes = nodes
        self.half = np.zeros(shape)
        self.density = np.zeros((*shape, nodes))

    def _grid(self, half: np.ndarray) -> np.ndarray:
        return half[..., None] * np.linspace(-1.0, 1.0, self.nodes)

    def first(self, sel: np.ndarray, c: np.ndarray) -> None:
        half = np.minimum(c, Z_MAX)
        z = self._grid(half)
        self.density[sel] = np.exp(-z * z / 2) / _SQRT_2PI
        self.half[sel] = half

    def next(self, sel: np.ndarray, release: np.ndarray, r: np.ndarray) -> np.ndarray:
        """The boundary of a later look, ``Z' = q Z + s N(0, 1)`` (``q^2 = r = I_prev / I``,
        ``s^2 = 1 - r``), spending ``release``; the density moves on to that look."""
        q, s = np.sqrt(r)[:, None], np.sqrt(1 - r)[:, None]
        half_old = self.half[sel]
        a = self._grid(half_old)  # [n, M] old nodes
        f = self.density[sel]
        h = (2 * half_old / (self.nodes - 1))[:, None]
        v = np.diff(f, axis=-1) / h  # each piece: f = u + v z on [a_i, a_i+1]
        u = f[:, :-1] - v * a[:, :-1]

        def crossing(c: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            """P(|Z'| >= c) and its derivative in c (twice the upper tail: f is even)."""
            cc = c[:, None]
            y = (q * a - cc) / s
            cdf, pdf = _cdf_pdf(y)
            g = y * cdf + pdf  # the integral of Phi
            k = ((y * y - 1) * cdf + y * pdf) / 2  # the integral of y Phi
            lead = u + v * cc / q
            tail = lead * np.diff(g, axis=-1) + v * s / q * np.diff(k, axis=-1)
            slope = lead * np.diff(cdf, axis=-1) - v * s / q * np.diff(pdf, axis=-1)
            return 2 * (s / q)[:, 0] * tail.sum(-1), -2 / q[:, 0] * slope.sum(-1)

        # Newton from the previous boundary, kept inside a bisection bracket; an element
        # stops once its crossing chance is the release to 1e-12 of it.
        lo, hi = np.zeros(release.shape), np.full(release.shape, 40.0)
        c = np.minimum(half_old, 10.0)
        going = np.ones(release.shape, dtype=bool)
        for _ in range(_ITERATIONS):
            value, slope = crossing(c)
            error = value - release
            going &= np.abs(error) > 1e-12 * release
            if not going.any():
                break
            lo = np.where(going & (error > 0), c, lo)
            hi = np.where(going & (error < 0), c, hi)
            with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
                step = c - error / slope
            inside = np.isfinite(step) & (step >= lo) & (step <= hi)
            c = np.where(going, np.where(inside, step, (lo + hi) / 2), c)
        half = np.minimum(c, Z_MAX)
        z = self._grid(half)  # [n, M] new nodes
        # The new density at z_j integrates the kernel over the old pieces near z_j / q
        # (beyond 8 kernel sds a piece adds nothing): a band of B + 1 old nodes per z_j.
        reach = 8 * s / q
        band = int(min(self.nodes - 1, np.ceil(np.max(2 * reach / h)) + 2))
        first = np.floor((z / q - reach - a[:, :1]) / h).astype(np.int64)
        first = np.clip(first, 0, self.nodes - 1 - band)
        idx = first[:, :, None] + np.arange(band + 1)  # [n, M, B + 1]
        rows = np.arange(len(z))[:, None, None]
        a_b = a[rows, idx]
        y = (z[:, :, None] - q[:, :, None] * a_b) / s[:, :, None]
        cdf, pdf = _cdf_pdf(y)
        pieces = idx[..., :-1]
        u_b, v_b = u[rows, pieces], v[rows, pieces]
        lead = u_b + v_b * z[:, :, None] / q[:, :, None]
        term = lead * (cdf[..., :-1] - cdf[..., 1:]) - v_b * (s / q)[:, :, None] * (
            pdf[..., 1:] - pdf[..., :-1]
        )
        self.density[sel] = np.maximum(term.sum(-1) / q, 0.0)
        self.half[sel] = half
        result: np.ndarray = c
        return result


class Boundaries:
    """The two-sided boundaries of a batch of group-sequential tests, look by look.

    :meth:`look` takes each test's calendar fraction and information at the next look and
    returns the boundary ``c`` (``inf`` where the test has no verdict at this look). Two
    recursions run side by side, on ``nodes`` and ``2 nodes - 1`` points; their boundaries
    differ by a multiple of the grid's squared spacing, which Richardson's extrapolation
    removes (``(4 c_fine - c_coarse) / 3``), for a boundary good to about 0.002 at a third
    of the cost of one recursion as accurate. A batch of simulated canaries advances one
    look at a time; the analyze step replays a canary's looks from its start
    (:func:`replay`).
    """

    def __init__(
        self, alpha: float, shape: tuple[int, ...] = (), *, rho: float = DEFAULT_RHO,
        nodes: int = NODES,
    ) -> None:  # fmt: skip
        self.alpha = alpha
        self.rho = rho
        self.spent = np.zeros(shape)  # error spent so far
        self.info = np.zeros(shape)  # information at the last look (0: none yet)
        self.coarse = _Recursion(shape, nodes)
        self.fine = _Recursion(shape, 2 * nodes - 1)

    def look(self, t: Any, info: Any, active: Any = True) -> np.ndarray:
        """The boundary of the next look at calendar fraction ``t`` with information
        ``info`` (``1 / variance``); ``active`` False, or an information that is not a
        positive number, means no verdict at this look: nothing spent, ``inf``."""
        shape = self.spent.shape
        t = np.broadcast_to(np.asarray(t, dtype=np.float64), shape)
        raw = np.broadcast_to(np.asarray(info, dtype=np.float64), shape)
        ok = np.broadcast_to(np.asarray(active, dtype=bool), shape) & np.isfinite(raw) & (raw > 0)
        release = spent(t, self.alpha, self.rho) - self.spent
        ok = ok & (release > 0)
        boundary = np.full(shape, np.inf)
        # Information estimated from the data may dip; the correlation of two looks needs
        # it non-decreasing (the running maximum: such a look then adds almost nothing).
        info_now = np.maximum(raw, self.info * (1 + 1e-9))
        first = ok & (self.info <= 0)
        later = ok & (self.info > 0)
        if first.any():
            c = _first_boundary(release[first])
            self.coarse.first(first, c)
            self.fine.first(first, c)
            boundary[first] = c
        if later.any():
            r = np.clip(self.info[later] / info_now[later], 1e-12, 1 - 1e-12)
            coarse = self.coarse.next(later, release[later], r)
            fine = self.fine.next(later, release[later], r)
            boundary[later] = (4 * fine - coarse) / 3
        self.info = np.where(ok, info_now, self.info)
        self.spent = np.where(ok, self.spent + release, self.spent)
        return boundary


def _first_boundary(release: np.ndarray) -> np.ndarray:
    """The first look: ``Z`` is standard normal, ``P(|Z| >= c) = release``."""
    tail = np.clip(release / 2, 1e-300, 0.5)
    lo, hi = np.zeros(tail.shape), np.full(tail.shape, 40.0)
    for _ in range(_BISECTIONS):
        mid = (lo + hi) / 2
        above = normal_lower_tail(mid) > tail
        lo, hi = np.where(above, mid, lo), np.where(above, hi, mid)
    result: np.ndarray = (lo + hi) / 2
    return result


def replay(
    alpha: float, fractions: Any, info: Any, active: Any, *, rho: float = DEFAULT_RHO
) -> np.ndarray:
    """The boundaries of every look of one plan at once: ``fractions``, ``info`` and
    ``active`` are ``[looks, ...]``; returns ``[looks, ...]`` (``inf`` where no verdict)."""
    info = np.asarray(info, dtype=np.float64)
    frac = np.asarray(fractions, dtype=np.float64)
    frac = frac.reshape(frac.shape + (1,) * (info.ndim - frac.ndim))
    fractions = np.broadcast_to(frac, info.shape)
    active = np.broadcast_to(np.asarray(active, dtype=bool), info.shape)
    tests = Boundaries(alpha, info.shape[1:], rho=rho)
    return np.stack([tests.look(fractions[k], info[k], active[k]) for k in range(info.shape[0])])
