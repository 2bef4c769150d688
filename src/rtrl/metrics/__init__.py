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
- ``rtrl_decisions_total{action,kind}``: actions planned: create/delete/patch/patch_status of
  a kind of object, and event (kind: the involved object's kind).
- ``rtrl_events_total{reason,type}``: Kubernetes Events posted, by reason.
- ``rtrl_job_failures_total{step}``: step Jobs that failed (retried or final).
- ``rtrl_last_promotion_age_seconds``: seconds since the last promotion this process made
  (absent until one happens: the promotion time is not in the RLCycle's status).
- ``rtrl_reconcile_errors_total{error}``: reconcile rounds that raised (kube, internal).

Built at each scrape from the operator's cache (:mod:`.status`), so a deleted
object's series vanish and every number is what the object's status says now: per RLCycle
its phase (a state set), cycle number, canary weight and cycle start / next run times; per
Checkpoint (labels ``namespace``, ``rlcycle``, ``checkpoint``) its phase, times, what it was
trained on (``rtrl_data_*``: reward, behaviour monitors), how training went
(``rtrl_training_*``), the eval gates (``rtrl_eval_*``) and its latest canary step's A/B
numbers (``rtrl_ab_*``). :data:`SERIES` lists them; docs/monitoring.md is the user's list.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, start_http_server

from ..core.api.checkpoint import CheckpointPhase
from ..core.api.reasons import Reason
from ..core.api.rlcycle import NotificationEvent
from ..planning.actions import Action, Create, Delete, Emit, Patch, PatchStatus
from .status import SERIES, StatusCollector, set_object_source

CYCLES = Counter("rtrl_cycles", "Finished cycles, by result.", ["namespace", "rlcycle", "result"])
PHASE_DURATION = Histogram(
    "rtrl_phase_duration_seconds",
    "Time an RLCycle spent in a phase.",
    ["namespace", "rlcycle", "phase"],
    buckets=(1, 10, 60, 300, 900, 1800, 3600, 7200, 14400, 28800, 43200, 86400, float("inf")),
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
RECONCILE_ERRORS = Counter(
    "rtrl_reconcile_errors",
    "Reconcile rounds that failed (error: kube, an API error or write conflict; internal).",
    ["namespace", "rlcycle", "error"],
)
LAST_PROMOTION_AGE = Gauge(
    "rtrl_last_promotion_age_seconds",
    "Seconds since the last promotion.",
    ["namespace", "rlcycle"],
)

# Event reason -> cycle result. A rejection is told by its EvalRejected notification, not
# its reason: the Checkpoint's reason is the eval's (EvalGatesFailed, SandboxUnsafe, ...).
RESULTS: dict[str, str] = {
    Reason.PROMOTED: "promoted",
    Reason.ROLLED_BACK: "rolled_back",
    Reason.CYCLE_FAILED: "failed",
    Reason.INSUFFICIENT_DATA: "insufficient_data",
}
# A Checkpoint that becomes Promoted without being promoted: the base model's first status
# (it serves), the parent that serves again after a manual rollback.
SERVING_WITHOUT_PROMOTION = frozenset({Reason.SERVING, Reason.SERVING_AGAIN})
# A step Job's failure (retried or final) -> the step label of rtrl_job_failures_total.
JOB_FAILURE_STEP: dict[str, str] = {
    Reason.STAGE_RETRYING: "stage",
    Reason.STAGE_FAILED: "stage",
    Reason.TRAIN_RETRYING: "train",
    Reason.TRAIN_FAILED: "train",
    Reason.EVAL_RETRYING: "eval",
    Reason.EVAL_FAILED: "eval",
}
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
            if NotificationEvent.EVAL_REJECTED in action.notify:
                result = "rejected"
            # a serving checkpoint rolled back by hand is no cycle ending: its cycle was
            # counted when it was promoted (only a canary's rollback completes a cycle)
            if action.reason == Reason.ROLLED_BACK and (
                NotificationEvent.CYCLE_COMPLETED not in action.notify
            ):
                result = None
            if result:
                CYCLES.labels(namespace, rlcycle_name, result).inc()
            step = JOB_FAILURE_STEP.get(action.reason)
            if step:
                JOB_FAILURES.labels(namespace, rlcycle_name, step).inc()
        elif (
            isinstance(action, PatchStatus)
            and action.kind == "Checkpoint"
            and action.status.get("phase") == CheckpointPhase.PROMOTED
            and action.status.get("reason") not in SERVING_WITHOUT_PROMOTION
        ):
            LAST_PROMOTION_AGE.labels(namespace, rlcycle_name).set_function(_age_since(clock))

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


def reconcile_failed(namespace: str, rlcycle_name: str, *, internal: bool) -> None:
    """Count a reconcile round that raised (the round loop retries it after a back-off)."""
    RECONCILE_ERRORS.labels(namespace, rlcycle_name, "internal" if internal else "kube").inc()


def forget(namespace: str, rlcycle_name: str) -> None:
    """Drop an RLCycle's per-RLCycle series (it was deleted)."""
    key = (namespace, rlcycle_name)
    _Seen.phase_since.pop(key, None)
    with contextlib.suppress(KeyError):
        LAST_PROMOTION_AGE.remove(namespace, rlcycle_name)


REGISTRY.register(StatusCollector())


def serve(port: int, addr: str = "0.0.0.0") -> None:
    """Serve /metrics on ``port`` from a background thread."""
    start_http_server(port, addr=addr)


__all__ = [
    "SERIES",
    "StatusCollector",
    "forget",
    "observe_plan",
    "reconcile_failed",
    "serve",
    "set_object_source",
]
