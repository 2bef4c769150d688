"""Prometheus metrics of the operator, derived from each reconcile's plan.

The reconciler calls :func:`observe_plan` after writing an RLCycle's status; everything here
is read off the plan's actions and the status transition, so the planning core stays pure
and the metrics say exactly what the operator decided. ``rtrl operator --metrics-port``
serves them (:func:`serve`).

Series (labels ``namespace`` and ``rlcycle`` unless said otherwise):

- ``rtrl_cycles_total{result}``: finished cycles: promoted, rolled_back, rejected, failed,
  insufficient_data.
- ``rtrl_phase_duration_seconds{phase}``: how long an RLCycle stayed in a phase (observed
  when it leaves it; a phase this process did not see begin is not observed).
- ``rtrl_canary_weight_percent``: the canary's current traffic share.
- ``rtrl_decisions_total{action,kind}``: actions planned: create/delete/patch/patch_status of
  a kind of object, and event (kind: the involved object's kind).
- ``rtrl_events_total{reason,type}``: Kubernetes Events posted, by reason.
- ``rtrl_job_failures_total{step}``: step Jobs that failed (retried or final).
- ``rtrl_last_promotion_age_seconds``: seconds since the last promotion this process made
  (absent until one happens: the promotion time is not in the RLCycle's status).

Per Checkpoint (labels ``namespace``, ``rlcycle``, ``checkpoint``), built at each scrape from
the operator's cache (:class:`CheckpointCollector`), so a deleted Checkpoint's series vanish:

- ``rtrl_eval_gate_value{metric,arm}`` (candidate/parent), ``rtrl_eval_gate_passed{metric}``,
  ``rtrl_eval_gate_difference_interval{metric,bound}`` (low/high);
- of the latest canary step: ``rtrl_ab_estimate{metric,arm}`` (baseline/canary),
  ``rtrl_ab_difference{metric}``, ``rtrl_ab_difference_interval{metric,bound}``,
  ``rtrl_ab_samples{arm}``.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .planning.actions import Action, Create, Delete, Emit, Patch, PatchStatus

CYCLES = Counter("rtrl_cycles", "Finished cycles, by result.", ["namespace", "rlcycle", "result"])
PHASE_DURATION = Histogram(
    "rtrl_phase_duration_seconds",
    "Time an RLCycle spent in a phase.",
    ["namespace", "rlcycle", "phase"],
    buckets=(1, 10, 60, 300, 900, 1800, 3600, 7200, 14400, 28800, 43200, 86400, float("inf")),
)
CANARY_WEIGHT = Gauge(
    "rtrl_canary_weight_percent", "Current canary traffic share.", ["namespace", "rlcycle"]
)
DECISIONS = Counter(
    "rtrl_decisions", "Actions planned, by action and kind.", ["namespace", "action", "kind"]
)
EVENTS = Counter(
    "rtrl_events", "Kubernetes Events posted, by reason.", ["namespace", "reason", "type"]
)
JOB_FAILURES = Counter(
    "rtrl_job_failures", "Step Jobs that failed.", ["namespace", "rlcycle", "step"]
)
LAST_PROMOTION_AGE = Gauge(
    "rtrl_last_promotion_age_seconds",
    "Seconds since the last promotion.",
    ["namespace", "rlcycle"],
)

# Event reason -> cycle result.
RESULTS = {
    "Promoted": "promoted",
    "RolledBack": "rolled_back",
    "EvalGatesFailed": "rejected",
    "CycleFailed": "failed",
    "InsufficientData": "insufficient_data",
}
_JOB_FAILURE = re.compile(r"^(Stage|Train|Eval|Analyze)(Retrying|Failed)$")
_ACTION_NAMES: dict[type, str] = {
    Create: "create",
    Delete: "delete",
    Patch: "patch",
    PatchStatus: "patch_status",
    Emit: "event",
}


class _Seen:
    """What this process saw of each RLCycle: its phase and since when (None: it was already
    in that phase when this process first saw it)."""

    phase_since: dict[tuple[str, str], tuple[str, float | None]] = {}


def _age_since(at: float) -> Callable[[], float]:
    return lambda: time.time() - at


def observe_plan(
    rlcycle_name: str,
    namespace: str,
    old_status: Mapping[str, Any] | None,
    new_status: Mapping[str, Any],
    actions: Iterable[Action],
    *,
    now: float | None = None,
) -> None:
    """Count one reconcile's decisions and the RLCycle's status transition."""
    clock = time.time() if now is None else now
    key = (namespace, rlcycle_name)
    old = old_status or {}
    for action in actions:
        DECISIONS.labels(namespace, _ACTION_NAMES[type(action)], action.kind).inc()
        if isinstance(action, Emit):
            EVENTS.labels(namespace, action.reason, "Warning" if action.warning else "Normal").inc()
            result = RESULTS.get(action.reason)
            if result:
                CYCLES.labels(namespace, rlcycle_name, result).inc()
            failure = _JOB_FAILURE.match(action.reason)
            if failure:
                JOB_FAILURES.labels(namespace, rlcycle_name, failure.group(1).lower()).inc()
        elif (
            isinstance(action, PatchStatus)
            and action.kind == "Checkpoint"
            and action.status.get("phase") == "Promoted"
        ):
            LAST_PROMOTION_AGE.labels(namespace, rlcycle_name).set_function(_age_since(clock))

    weight = new_status.get("canaryWeight", old.get("canaryWeight"))
    CANARY_WEIGHT.labels(namespace, rlcycle_name).set(float(weight or 0))

    phase = new_status.get("phase") or old.get("phase")
    if not phase:
        return
    seen = _Seen.phase_since.get(key)
    if seen is None:
        _Seen.phase_since[key] = (str(phase), clock if old.get("phase") != phase else None)
    elif seen[0] != phase:
        if seen[1] is not None:
            PHASE_DURATION.labels(namespace, rlcycle_name, seen[0]).observe(clock - seen[1])
        _Seen.phase_since[key] = (str(phase), clock)


def forget(namespace: str, rlcycle_name: str) -> None:
    """Drop an RLCycle's per-RLCycle series (it was deleted)."""
    key = (namespace, rlcycle_name)
    _Seen.phase_since.pop(key, None)
    for metric in (CANARY_WEIGHT, LAST_PROMOTION_AGE):
        with contextlib.suppress(KeyError):
            metric.remove(namespace, rlcycle_name)


# --- per-Checkpoint series, built at scrape time from the operator's cache -----------------
# A deleted Checkpoint leaves the cache and so its series vanish; cardinality is bounded by
# the RLCycle's history limit (pruned Checkpoints are deleted) and the API's list bounds
# (at most 64 gates and 64 A/B metrics per Checkpoint).
_checkpoints: Callable[[], Iterable[Mapping[str, Any]]] = list


def set_checkpoint_source(source: Callable[[], Iterable[Mapping[str, Any]]]) -> None:
    """Where the collector reads the Checkpoints from at each scrape (the kube room's cache)."""
    global _checkpoints  # noqa: PLW0603 (set once when the operator starts)
    _checkpoints = source


def _add_interval(family: GaugeMetricFamily, labels: list[str], row: Mapping[str, Any]) -> None:
    """An interval's two bounds as ``bound="low"|"high"`` series."""
    family.add_metric([*labels, "low"], float(row["ciLow"]))
    family.add_metric([*labels, "high"], float(row["ciHigh"]))


class CheckpointCollector(Collector):
    """Eval gates and the latest canary step's A/B numbers of every cached Checkpoint."""

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        base = ["namespace", "rlcycle", "checkpoint"]
        gate = GaugeMetricFamily(
            "rtrl_eval_gate_value", "Eval gate value, by arm.", labels=[*base, "metric", "arm"]
        )
        gate_ci = GaugeMetricFamily(
            "rtrl_eval_gate_difference_interval",
            "Bootstrap interval of an eval gate's difference (bound: low/high).",
            labels=[*base, "metric", "bound"],
        )
        passed = GaugeMetricFamily(
            "rtrl_eval_gate_passed", "1 when the eval gate passed.", labels=[*base, "metric"]
        )
        ab = GaugeMetricFamily(
            "rtrl_ab_estimate", "A/B estimate of a metric, by arm.", labels=[*base, "metric", "arm"]
        )
        diff = GaugeMetricFamily(
            "rtrl_ab_difference", "Canary minus baseline.", labels=[*base, "metric"]
        )
        ab_ci = GaugeMetricFamily(
            "rtrl_ab_difference_interval",
            "Always-valid interval of the difference (bound: low/high).",
            labels=[*base, "metric", "bound"],
        )
        samples = GaugeMetricFamily(
            "rtrl_ab_samples", "Matured interactions of the step, by arm.", labels=[*base, "arm"]
        )
        # The CRD requires every number read here (GateResult, MetricComparison): indexing
        # them reports what the status says, never a made-up 0.
        for ck in _checkpoints():
            meta = ck.get("metadata") or {}
            ident = [
                str(meta.get("namespace") or ""),
                str((ck.get("spec") or {}).get("rlCycle") or ""),
                str(meta.get("name") or ""),
            ]
            status = ck.get("status") or {}
            for g in ((status.get("eval") or {}).get("gates")) or []:
                m = str(g["metric"])
                gate.add_metric([*ident, m, "candidate"], float(g["candidate"]))
                gate.add_metric([*ident, m, "parent"], float(g["parent"]))
                _add_interval(gate_ci, [*ident, m], g)
                passed.add_metric([*ident, m], 1.0 if g["passed"] else 0.0)
            step = (status.get("rollout") or [{}])[-1]
            for arm in ("baseline", "canary"):
                if step.get(f"{arm}Samples") is not None:
                    samples.add_metric([*ident, arm], float(step[f"{arm}Samples"]))
            for row in step.get("metrics") or []:
                m = str(row["name"])
                for arm in ("baseline", "canary"):
                    ab.add_metric([*ident, m, arm], float(row[arm]))
                diff.add_metric([*ident, m], float(row["difference"]))
                _add_interval(ab_ci, [*ident, m], row)
        return [gate, gate_ci, passed, ab, diff, ab_ci, samples]


REGISTRY.register(CheckpointCollector())


def serve(port: int, addr: str = "0.0.0.0") -> None:
    """Serve /metrics on ``port`` from a background thread."""
    start_http_server(port, addr=addr)


__all__ = ["CheckpointCollector", "forget", "observe_plan", "serve", "set_checkpoint_source"]
