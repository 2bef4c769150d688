"""kopf handlers: thin adapters between kopf's events and the reconciler.

Each RLCycle has one reconciler, a kopf daemon, so decisions about one RLCycle are never
made twice at once. It sleeps until something relevant changes (the RLCycle, one of its
Jobs or Checkpoints: the event handlers below wake it), the plan asks to look again
(``requeue_after``), or the periodic resync is due; then it observes, plans, applies and
writes the status. The daemon keeps nothing between rounds but a wake-up flag: all state is
read back from the cluster and the store, so the operator can be killed at any moment.

Run with ``rtrl operator``, which hands kopf this module's :data:`registry`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import kopf

from .kube import KubeClient, KubeError, apply, observe
from .kube.apply import write_status
from .metrics import forget, observe_plan
from .planning import children as ch
from .planning import plan, plan_deletion

GROUP, VERSION = "rtrl.io", "v1alpha1"
# rtrl's handlers live in their own registry, so that other kopf handlers imported into the
# same process (a plugin, a test's operator) never run alongside them.
registry = kopf.OperatorRegistry()
log = logging.getLogger("rtrl.operator")


class _Process:
    """Per-process wiring, made at startup: the API client, timings, wake-up flags."""

    client: KubeClient | None = None
    # Seconds between reconciles when nothing happens (schedules are requeued exactly).
    resync_seconds = 30.0
    # A reconcile that fails (API or store unreachable) is retried after this delay.
    error_backoff_seconds = 5.0
    wakeups: dict[tuple[str, str], asyncio.Event] = {}
    # What an object's last event looked like outside its status, by uid: an event that
    # changed only the status (most of them: the operator's own status writes) wakes nobody.
    # Only a filter for wake-ups; no decision reads it.
    seen: dict[str, tuple[Any, ...]] = {}


def client() -> KubeClient:
    if _Process.client is None:
        _Process.client = KubeClient.from_environment()
    return _Process.client


def wake(namespace: str | None, name: str | None) -> None:
    if namespace and name:
        flag = _Process.wakeups.get((namespace, name))
        if flag is not None:
            flag.set()


@kopf.on.login(registry=registry)
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """kopf's own credentials: in-cluster service account or kubeconfig, as the client."""
    return kopf.login_via_client(**kwargs)


@kopf.on.startup(registry=registry)
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    _Process.client = KubeClient.from_environment()
    _Process.resync_seconds = float(os.environ.get("RTRL_RESYNC_SECONDS", "30"))
    _Process.error_backoff_seconds = float(os.environ.get("RTRL_ERROR_BACKOFF_SECONDS", "5"))
    _Process.wakeups.clear()
    _Process.seen.clear()
    settings.persistence.finalizer = ch.FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="rtrl.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="rtrl.io", key="last-handled-configuration"
    )
    # A standby replica takes over this long after the active one stopped renewing its
    # peering record (kopf's default is 60 s).
    settings.peering.lifetime = int(os.environ.get("RTRL_PEERING_LIFETIME", "60"))
    settings.posting.enabled = False  # the reconciler posts its own Events, with reasons
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330


def reconcile_once(namespace: str, name: str) -> float | None:
    """One round for one RLCycle; returns when to look again (seconds), None for the resync."""
    kube = client()
    rlcycle = kube.get("RLCycle", namespace, name)
    if rlcycle is None or rlcycle["metadata"].get("deletionTimestamp"):
        return None
    observed = observe(kube, rlcycle)
    decided = plan(observed, datetime.now(UTC))
    apply(kube, rlcycle, decided.actions)
    write_status(kube, rlcycle, decided.status)
    observe_plan(name, namespace, rlcycle.get("status"), decided.status, decided.actions)
    return decided.requeue_after


@kopf.daemon(GROUP, VERSION, "rlcycles", cancellation_timeout=10, registry=registry)
async def reconciler(
    name: str, namespace: str | None, stopped: kopf.DaemonStopped, **_: Any
) -> None:
    assert namespace is not None  # RLCycle is namespaced
    flag = _Process.wakeups.setdefault((namespace, name), asyncio.Event())
    try:
        while not stopped:
            flag.clear()
            started = time.monotonic()
            try:
                delay = await asyncio.to_thread(reconcile_once, namespace, name)
            except KubeError as exc:
                delay = _Process.error_backoff_seconds
                log.warning("reconcile %s/%s: %s; retrying in %ss", namespace, name, exc, delay)
            except Exception:
                delay = _Process.error_backoff_seconds
                log.exception("reconcile %s/%s failed; retrying in %ss", namespace, name, delay)
            log.debug("reconciled %s/%s in %.3fs", namespace, name, time.monotonic() - started)
            if delay is not None and delay <= 0:
                continue
            resync = _Process.resync_seconds
            timeout = resync if delay is None else min(delay, resync)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(flag.wait(), timeout=timeout)
    finally:
        if _Process.wakeups.get((namespace, name)) is flag:
            del _Process.wakeups[(namespace, name)]


def changed_beyond_status(body: kopf.Body, type_: str | None) -> bool:
    """True unless the event only changed the object's status (or nothing)."""
    meta = body.get("metadata") or {}
    uid = str(meta.get("uid"))
    if type_ == "DELETED":
        _Process.seen.pop(uid, None)
        return True
    shape = (
        meta.get("generation"),
        tuple(sorted((meta.get("annotations") or {}).items())),
        tuple(sorted((meta.get("labels") or {}).items())),
        bool(meta.get("deletionTimestamp")),
    )
    before = _Process.seen.get(uid)
    _Process.seen[uid] = shape
    return before != shape


@kopf.on.event(GROUP, VERSION, "rlcycles", registry=registry)
def rlcycle_changed(
    name: str,
    namespace: str | None,
    body: kopf.Body,
    type: str | None,
    **_: Any,
) -> None:
    if changed_beyond_status(body, type):
        wake(namespace, name)


@kopf.on.event("batch", "v1", "jobs", labels={ch.LABEL_RLCYCLE: kopf.PRESENT}, registry=registry)
def job_changed(
    labels: Mapping[str, str],
    namespace: str | None,
    status: kopf.Status,
    type: str | None,
    **_: Any,
) -> None:
    """Only a finished or deleted Job changes a decision; its pods starting does not."""
    finished = any(
        c.get("type") in ("Complete", "Failed") and c.get("status") == "True"
        for c in status.get("conditions") or []
    )
    if finished or type == "DELETED":
        wake(namespace, labels.get(ch.LABEL_RLCYCLE))


@kopf.on.event(
    "apps", "v1", "deployments", labels={ch.LABEL_RLCYCLE: kopf.PRESENT}, registry=registry
)
def canary_changed(labels: Mapping[str, str], namespace: str | None, **_: Any) -> None:
    wake(namespace, labels.get(ch.LABEL_RLCYCLE))


@kopf.on.event(GROUP, VERSION, "checkpoints", registry=registry)
def checkpoint_changed(
    spec: kopf.Spec,
    namespace: str | None,
    body: kopf.Body,
    type: str | None,
    **_: Any,
) -> None:
    if changed_beyond_status(body, type):
        wake(namespace, spec.get("rlCycle"))


@kopf.on.delete(GROUP, VERSION, "rlcycles", registry=registry)
def rlcycle_deleted(body: kopf.Body, name: str, namespace: str | None, **_: Any) -> None:
    """Stop the RLCycle's Jobs and remove the children it created; stored artifacts stay."""
    kube = client()
    rlcycle = dict(body)
    actions, _done = plan_deletion(observe(kube, rlcycle))
    apply(kube, rlcycle, actions)
    _actions, done = plan_deletion(observe(kube, rlcycle))
    if not done:
        raise kopf.TemporaryError("waiting for children to be deleted", delay=1)
    if namespace:
        forget(namespace, name)
    log.info("%s/%s deleted with its children; stored artifacts are kept", namespace, name)
