"""Eval metrics, their bootstrap confidence intervals, and the regression gates.

Every metric is a statistic of per-item values (a held-out interaction, a task, a prompt)
measured on the same items for the candidate and the parent, so the bootstrap resamples
items *paired*: one resample of indices feeds both models, and the interval of the
difference reflects item-to-item variation once, not twice.

A metric's statistic is the mean of its values, or, with ``groups``, the mean over group 1
minus the mean over group 0 (e.g. log-likelihood of kept edits minus that of discarded
ones). ``direction`` says which way is better (+1 higher, -1 lower). With ``weights`` it is a ratio
of sums (e.g. valid tool calls / tool calls), weights being per model.

A gate on metric m with threshold t (``absolute``; ``relative``: t * |parent value|)
computes the regression r = direction * (parent - candidate) per bootstrap resample and
fails iff the ``alpha`` quantile of r - t is above 0: the candidate is worse than allowed
with confidence 1 - alpha (a one-sided test). Equal models therefore always pass, and a
noisy small sample cannot fail a candidate on noise alone. Resampling is seeded, so a
rerun gives the same verdicts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from rtrl.core.api.rlcycle import EvalGate, RegressionMode

DEFAULT_RESAMPLES = 2000
DEFAULT_SEED = 0


class GateError(ValueError):
    """A gate names a metric the suites did not produce."""


@dataclass(frozen=True)
class Metric:
    """Per-item values of one metric for one model."""

    name: str
    values: tuple[float, ...]
    direction: int = 1
    groups: tuple[int, ...] | None = None
    description: str = ""
    # A ratio metric: sum(values) / sum(weights) (e.g. valid calls / calls); per model.
    weights: tuple[float, ...] | None = None

    def to_dict(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "name": self.name,
            "direction": self.direction,
            "values": list(self.values),
        }
        if self.groups is not None:
            doc["groups"] = list(self.groups)
        if self.weights is not None:
            doc["weights"] = list(self.weights)
        if self.description:
            doc["description"] = self.description
        return doc

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> Metric:
        groups = doc.get("groups")
        weights = doc.get("weights")
        return cls(
            name=str(doc["name"]),
            values=tuple(float(v) for v in doc["values"]),
            direction=int(doc["direction"]),
            groups=None if groups is None else tuple(int(g) for g in groups),
            description=str(doc.get("description", "")),
            weights=None if weights is None else tuple(float(w) for w in weights),
        )


def _statistic(
    values: npt.NDArray[np.float64],
    groups: npt.NDArray[np.int64] | None,
    index: npt.NDArray[np.int64],
    weights: npt.NDArray[np.float64] | None = None,
) -> npt.NDArray[np.float64]:
    """The statistic for each row of ``index`` (resamples x items); NaN where undefined."""
    taken = values[index]
    with np.errstate(invalid="ignore", divide="ignore"):
        if weights is not None:
            ratio: npt.NDArray[np.float64] = taken.sum(axis=-1) / weights[index].sum(axis=-1)
            return ratio
        if groups is None:
            result: npt.NDArray[np.float64] = taken.mean(axis=-1)
            return result
        g = groups[index]
        one, zero = g == 1, g == 0
        mean1 = np.where(one, taken, 0.0).sum(axis=-1) / one.sum(axis=-1)
        mean0 = np.where(zero, taken, 0.0).sum(axis=-1) / zero.sum(axis=-1)
        diff: npt.NDArray[np.float64] = mean1 - mean0
        return diff


def value(metric: Metric) -> float | None:
    """The metric's statistic on all items (None when undefined, e.g. no items)."""
    if not metric.values:
        return None
    values = np.asarray(metric.values, dtype=np.float64)
    groups = None if metric.groups is None else np.asarray(metric.groups, dtype=np.int64)
    result = float(_statistic(values, groups, np.arange(len(values))[None, :], _weights(metric))[0])
    return None if np.isnan(result) else result


def _weights(metric: Metric) -> npt.NDArray[np.float64] | None:
    return None if metric.weights is None else np.asarray(metric.weights, dtype=np.float64)


def _finite(x: float) -> float | None:
    return None if not np.isfinite(x) else float(x)


def compare(
    candidate: Metric,
    parent: Metric,
    *,
    alpha: float,
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = DEFAULT_SEED,
    gate: EvalGate | None = None,
) -> dict[str, Any]:
    """Candidate vs parent on one metric: both values, the interval of candidate - parent
    (the ``alpha`` and ``1 - alpha`` quantiles), and the gate's verdict when gated."""
    if len(candidate.values) != len(parent.values) or candidate.groups != parent.groups:
        raise GateError(f"{candidate.name}: candidate and parent were measured on different items")
    doc: dict[str, Any] = {
        "metric": candidate.name,
        "direction": "higher" if candidate.direction > 0 else "lower",
        "items": len(candidate.values),
        "candidate": value(candidate),
        "parent": value(parent),
    }
    n = len(candidate.values)
    if n == 0 or doc["candidate"] is None or doc["parent"] is None:
        doc.update({"difference": None, "ci_low": None, "ci_high": None})
        if gate is not None:
            doc["gate"] = _gate_doc(gate, None, passed=True, note="no data: not judged")
        return doc
    rng = np.random.default_rng(seed)
    index = rng.integers(0, n, size=(resamples, n))
    groups = None if candidate.groups is None else np.asarray(candidate.groups, dtype=np.int64)
    cand = _statistic(
        np.asarray(candidate.values, dtype=np.float64), groups, index, _weights(candidate)
    )
    par = _statistic(np.asarray(parent.values, dtype=np.float64), groups, index, _weights(parent))
    diff = cand - par
    diff = diff[~np.isnan(diff)]
    doc["difference"] = doc["candidate"] - doc["parent"]
    if diff.size == 0:
        doc["ci_low"] = doc["ci_high"] = doc["difference"]
    else:
        doc["ci_low"] = _finite(float(np.quantile(diff, alpha)))
        doc["ci_high"] = _finite(float(np.quantile(diff, 1 - alpha)))
    cand_ok = cand[~np.isnan(cand)]
    if cand_ok.size:
        doc["candidate_ci"] = [
            float(np.quantile(cand_ok, alpha)),
            float(np.quantile(cand_ok, 1 - alpha)),
        ]
    if gate is not None:
        threshold = gate.max_regression
        if gate.mode == RegressionMode.RELATIVE:
            threshold *= abs(doc["parent"])
        regression = -candidate.direction * diff if diff.size else np.zeros(1)
        bound = float(np.quantile(regression - threshold, alpha))
        doc["gate"] = _gate_doc(gate, bound, passed=not bound > 0, threshold=threshold)
    return doc


def _gate_doc(
    gate: EvalGate,
    bound: float | None,
    *,
    passed: bool,
    threshold: float | None = None,
    note: str | None = None,
) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "max_regression": gate.max_regression,
        "mode": str(gate.mode),
        "threshold": threshold,
        "regression_excess_lower_bound": bound,
        "passed": passed,
    }
    if note:
        doc["note"] = note
    return doc


def judge(
    candidate: Sequence[Metric],
    parent: Sequence[Metric],
    gates: Sequence[EvalGate],
    *,
    alpha: float,
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = DEFAULT_SEED,
) -> list[dict[str, Any]]:
    """Every metric compared, gated ones with a verdict; unknown gate metrics are errors."""
    by_name = {m.name: m for m in parent}
    known = {m.name for m in candidate}
    for gate in gates:
        if gate.metric not in known:
            raise GateError(
                f"gate metric {gate.metric!r} is not produced by the suites "
                f"(available: {', '.join(sorted(known))})"
            )
    gate_of = {g.metric: g for g in gates}
    return [
        compare(
            m,
            by_name[m.name],
            alpha=alpha,
            resamples=resamples,
            seed=seed,
            gate=gate_of.get(m.name),
        )
        for m in candidate
    ]
