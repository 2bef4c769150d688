"""kopf handlers: thin adapters between kopf's events and the reconciler.

Each RLCycle has one reconciler, a kopf daemon, so decisions about one RLCycle are never
made twice at once. It sleeps until something relevant changes (the RLCycle, one of its
Jobs or Checkpoints: the event handlers below wake it), the plan asks to look again
(``requeue_after``), or the periodic resync is due; then it observes, plans, applies and
writes the status. The daemon keeps nothing between rounds but a wake-up flag: all state is
read back from the cluster (or the watch cache below) and the store, so the operator can be
killed at any moment.

A round reads the kinds kopf watches from :class:`rtrl.kube.cache.ObjectCache`, which the
index handlers below feed with every watch event before any other handler sees it (kopf runs
no handler and starts no daemon until every index has listed its kind), and which the
round's own writes update with what the API answered; see that module for the consistency
rule. A round reads everything live instead when it is the daemon's first, when the last one
failed or met a conflict, and every ``RTRL_LIVE_READ_SECONDS`` (default 300 s).

Run with ``rtrl operator``, which hands kopf this module's :data:`registry`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import sys
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import kopf

from rtrl.core.api import names

from .core.api.rlcycle import Router
from .kube import KubeClient, KubeError, apply, observe
from .kube.apply import EVENTS, RejectedError, write_status
from .kube.cache import CHILD_KINDS, CHILD_LABEL, CachingClient, ObjectCache, copy_json
from .metrics import forget, observe_plan
from .planning import plan, plan_rejected
from .planning.canary import route_rules
from .planning.plan import validate_spec

GROUP, VERSION = "rtrl.io", "v1alpha1"
# rtrl's handlers live in their own registry, so that other kopf handlers imported into the
# same process (a plugin, a test's operator) never run alongside them.
registry = kopf.OperatorRegistry()
# How long the Job index handler waits for the round a finished Job started (see job_cache).
HAND_OVER_SECONDS = 0.1
log = logging.getLogger("rtrl.operator")


class Wakeup:
    """A reconciler's wake-up flag. Unlike an ``asyncio.Event`` behind ``wait_for``, whose
    waiter resumes a few loop turns after ``set``, a waiting reconciler resumes at the next
    turn. Set and waited on in the event loop only.

    :meth:`set` returns a future that the reconciler resolves when the round this wake-up
    starts has ended: a handler that awaits it keeps kopf from carrying on with its event
    (Python work on the event loop) while the round runs in its thread, so the round does
    not wait for the GIL behind it (see ``job_cache``)."""

    def __init__(self) -> None:
        self.pending = False
        self.woken: float | None = None  # when first set since the last take (for the trace)
        self._future: asyncio.Future[None] | None = None
        self._next_round: asyncio.Future[None] | None = None

    def set(self) -> asyncio.Future[None]:
        if not self.pending:
            self.woken = time.perf_counter()
        self.pending = True
        if self._future is not None:
            _resolve(self._future)
        if self._next_round is None:
            self._next_round = asyncio.get_running_loop().create_future()
        return self._next_round

    def take(self) -> tuple[float | None, asyncio.Future[None] | None]:
        """Clear the flag for a round that starts now: when it was set, and the future to
        resolve when that round ends."""
        taken = self.woken, self._next_round
        self.pending, self.woken, self._next_round = False, None, None
        return taken

    def close(self) -> None:
        """The reconciler stops: nobody waits for a round that will not run."""
        if self._next_round is not None:
            _resolve(self._next_round)

    async def wait(self, timeout: float) -> None:
        """Until set (at once if it is) or ``timeout`` seconds have passed."""
        if self.pending:
            return
        loop = asyncio.get_running_loop()
        future = self._future = loop.create_future()
        timer = loop.call_later(timeout, _resolve, future)
        try:
            await future
        finally:
            timer.cancel()
            self._future = None


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class _Process:
    """Per-process wiring, made at startup: the API client, timings, wake-up flags."""

    client: KubeClient | None = None
    # Seconds between reconciles when nothing happens (schedules are requeued exactly).
    resync_seconds = 30.0
    # A reconcile that fails (API or store unreachable) is retried after this delay.
    error_backoff_seconds = 5.0
    wakeups: dict[tuple[str, str], Wakeup] = {}
    # What an object's last event looked like outside its status, by uid: an event that
    # changed only the status (most of them: the operator's own status writes) wakes nobody.
    # Only a filter for wake-ups; no decision reads it.
    seen: dict[str, tuple[Any, ...]] = {}
    # The watched objects a round reads (see the module docstring).
    cache = ObjectCache()
    # A round reads everything live at least this often (seconds), whatever the cache holds.
    live_read_seconds = 300.0
    # RTRL_ROUND_TRACE: a file that gets one JSON line per round (bench/operator_latency.py).
    trace: Any = None


def client() -> KubeClient:
    if _Process.client is None:
        _Process.client = KubeClient.from_environment()
    return _Process.client


def wake(namespace: str | None, name: str | None) -> asyncio.Future[None] | None:
    """Wake the reconciler of RLCycle ``namespace/name``, if it runs; the future of the
    round that will follow (see :class:`Wakeup`)."""
    if namespace and name:
        flag = _Process.wakeups.get((namespace, name))
        if flag is not None:
            return flag.set()
    return None


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
    _Process.cache = ObjectCache()
    # The reconcile rounds run in threads next to kopf's event loop; when the loop is busy
    # (kopf works through each watch event in Python), a round waiting for the GIL would
    # wait up to the default 5 ms switch interval.
    sys.setswitchinterval(float(os.environ.get("RTRL_SWITCH_INTERVAL", "0.0005")))
    _Process.live_read_seconds = float(os.environ.get("RTRL_LIVE_READ_SECONDS", "300"))
    if _Process.trace is not None:
        _Process.trace.close()
        _Process.trace = None
    if os.environ.get("RTRL_ROUND_TRACE"):
        _Process.trace = open(os.environ["RTRL_ROUND_TRACE"], "a", buffering=1)  # noqa: SIM115
    # No handler requires it any more (see _without_finalizer); named so that kopf removes
    # it from RLCycles an earlier rtrl put it on.
    settings.persistence.finalizer = names.FINALIZER
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


@kopf.on.cleanup(registry=registry)
async def flush_events(**_: Any) -> None:
    """On a graceful stop, post the Events still queued (rtrl.kube.apply.EVENTS)."""
    await asyncio.to_thread(EVENTS.flush, 5.0)


class RLCycleGoneError(Exception):
    """The RLCycle was deleted (or is being deleted): its reconciler ends."""


def reconcile_once(
    namespace: str, name: str, *, live: bool = True, woken: float | None = None
) -> float | None:
    """One round for one RLCycle; returns when to look again (seconds), None for the resync.

    ``live``: read the cluster rather than the cache; ``woken``: when an event woke the
    reconciler for this round (``time.perf_counter``, for the trace). Raises
    :class:`KubeError` after a write that failed or met a conflict (so that the next round
    reads live), :class:`RLCycleGoneError` when there is nothing left to reconcile."""
    kube = CachingClient(client(), _Process.cache, live=live)
    marks = {"t0": time.perf_counter()}
    if woken is not None:
        marks["woken"] = woken
    try:
        rlcycle = kube.get("RLCycle", namespace, name)
        if rlcycle is None or rlcycle["metadata"].get("deletionTimestamp"):
            raise RLCycleGoneError(f"{namespace}/{name}")
        observed = observe(kube, rlcycle)
        marks["observed"] = time.perf_counter()
        now = datetime.now(UTC)
        decided = plan(observed, now)
        marks["planned"] = time.perf_counter()
        try:
            apply(kube, rlcycle, decided.actions)
        except RejectedError as exc:
            # Not transient: say so in the status, and look again at the resync (or when the
            # spec changes), not after the error back-off. The refused write changed nothing.
            log.warning("reconcile %s/%s: %s", namespace, name, exc)
            decided = plan_rejected(observed, now, str(exc))
            apply(kube, rlcycle, decided.actions)
            kube.write_failed = False
        marks["applied"] = time.perf_counter()
        write_status(kube, rlcycle, decided.status)
        observe_plan(name, namespace, rlcycle.get("status"), decided.status, decided.actions)
        if kube.write_failed:
            raise KubeError("a write met a conflict; the next round reads live")
        return decided.requeue_after
    finally:
        if _Process.trace is not None:
            _trace_round(namespace, name, marks, kube)


def _trace_round(namespace: str, name: str, marks: dict[str, float], kube: CachingClient) -> None:
    record = {
        "rlcycle": f"{namespace}/{name}",
        **marks,
        "t1": time.perf_counter(),
        "live": kube.live,
        "requests": kube.requests,
        "cached_reads": kube.cached_reads,
    }
    with contextlib.suppress(OSError, ValueError):
        _Process.trace.write(json.dumps(record) + "\n")


def _without_finalizer(handler_id: str) -> None:
    """kopf puts a finalizer on every object that has a daemon, so that it can stop the
    daemon before the object goes. rtrl's reconciler needs none: it ends by itself once its
    RLCycle is gone, and the API server's garbage collector removes the children (owned
    through ownerReferences). A finalizer would only make every RLCycle undeletable, and
    its CRD too, whenever no operator runs, as after ``helm uninstall``. Objects that
    still carry it from an earlier rtrl lose it: kopf removes a finalizer that no handler
    requires."""
    spawning = registry._spawning  # kopf 1.45 (pinned) keeps the daemons here
    for index, handler in enumerate(spawning._handlers):
        if handler.id == handler_id:
            spawning._handlers[index] = dataclasses.replace(handler, requires_finalizer=False)
            return
    raise RuntimeError(f"kopf registered no daemon {handler_id!r}")


@kopf.daemon(GROUP, VERSION, "rlcycles", cancellation_timeout=10, registry=registry)
async def reconciler(
    name: str, namespace: str | None, stopped: kopf.DaemonStopped, **_: Any
) -> None:
    assert namespace is not None  # RLCycle is namespaced
    flag = _Process.wakeups.setdefault((namespace, name), Wakeup())
    # kopf starts no daemon before every index has listed its kind: the cache is complete.
    _Process.cache.mark_synced()
    last_live: float | None = None  # the first round reads live
    try:
        while not stopped:
            woken, round_ended = flag.take()
            started = time.monotonic()
            live = last_live is None or started - last_live >= _Process.live_read_seconds
            try:
                delay = await asyncio.to_thread(
                    reconcile_once, namespace, name, live=live, woken=woken
                )
                if live:
                    last_live = started
            except RLCycleGoneError:
                log.info("%s/%s is gone; its children go with it (garbage collection), its "
                         "stored artifacts stay", namespace, name)  # fmt: skip
                return
            except KubeError as exc:
                last_live = None
                delay = _Process.error_backoff_seconds
                log.warning("reconcile %s/%s: %s; retrying in %ss", namespace, name, exc, delay)
            except Exception:
                last_live = None
                delay = _Process.error_backoff_seconds
                log.exception("reconcile %s/%s failed; retrying in %ss", namespace, name, delay)
            finally:
                if round_ended is not None:
                    _resolve(round_ended)
            log.debug("reconciled %s/%s in %.3fs", namespace, name, time.monotonic() - started)
            if delay is not None and delay <= 0:
                continue
            resync = _Process.resync_seconds
            timeout = resync if delay is None else min(delay, resync)
            await flag.wait(timeout)
    finally:
        flag.close()
        if _Process.wakeups.get((namespace, name)) is flag:
            del _Process.wakeups[(namespace, name)]


_without_finalizer("reconciler")  # kopf names a handler after its function


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


# --- the watch cache: kopf's indexes feed it (they run first, and block every other handler
# until their kind is listed); the event handlers feed it deletions, which indexes never see.


def _feed(kind: str, body: kopf.Body, type_: str | None = None) -> None:
    labels = body.get("metadata", {}).get("labels") or {}
    kept = type_ != "DELETED" and (kind not in CHILD_KINDS or CHILD_LABEL in labels)
    # copied only when the cache may keep it: not for the cluster's other ConfigMaps and
    # Services, which are only looked at for their name and resourceVersion
    _Process.cache.feed(kind, type_, copy_json(body) if kept else body)


@kopf.index(GROUP, VERSION, "rlcycles", registry=registry)
async def rlcycle_cache(body: kopf.Body, **_: Any) -> None:
    _feed("RLCycle", body)


@kopf.index(GROUP, VERSION, "checkpoints", registry=registry)
async def checkpoint_cache(body: kopf.Body, **_: Any) -> None:
    _feed("Checkpoint", body)


@kopf.index("batch", "v1", "jobs", registry=registry)
async def job_cache(body: kopf.Body, **_: Any) -> None:
    _feed("Job", body)  # kept only with the rtrl.io/rlcycle label (dropped if it loses it)
    # A finished Job wakes its RLCycle from here, the first handler kopf runs for an event
    # (before it works out the event's causes): the reaction starts a little sooner.
    rlcycle = (body.get("metadata", {}).get("labels") or {}).get(names.LABEL_RLCYCLE)
    if rlcycle and _finished(body.get("status") or {}):
        round_ended = wake(body.get("metadata", {}).get("namespace"), rlcycle)
        if round_ended is not None:
            # kopf carries on with this event (on the event loop) once the round that reacts
            # to it has ended, or after HAND_OVER_SECONDS: the round does not share the GIL
            # with that work. Other objects' events are handled meanwhile.
            await asyncio.wait([round_ended], timeout=HAND_OVER_SECONDS)


def _finished(status: Mapping[str, Any]) -> bool:
    return any(
        c.get("type") in ("Complete", "Failed") and c.get("status") == "True"
        for c in status.get("conditions") or []
    )


@kopf.index("apps", "v1", "deployments", registry=registry)
async def deployment_cache(body: kopf.Body, **_: Any) -> None:
    _feed("Deployment", body)  # any: the target Deployment is the user's


@kopf.index("", "v1", "services", registry=registry)
async def service_cache(body: kopf.Body, **_: Any) -> None:
    _feed("Service", body)


@kopf.index("", "v1", "configmaps", registry=registry)
async def config_map_cache(body: kopf.Body, **_: Any) -> None:
    _feed("ConfigMap", body)


@kopf.on.event("apps", "v1", "deployments", registry=registry)
@kopf.on.event("", "v1", "services", labels={names.LABEL_RLCYCLE: kopf.PRESENT}, registry=registry)
@kopf.on.event(
    "", "v1", "configmaps", labels={names.LABEL_RLCYCLE: kopf.PRESENT}, registry=registry
)
async def child_deleted(body: kopf.Body, type: str | None, **_: Any) -> None:
    if type == "DELETED":
        _feed(str(body.get("kind")), body, type)


@kopf.on.event(GROUP, VERSION, "rlcycles", registry=registry)
async def rlcycle_changed(
    name: str,
    namespace: str | None,
    body: kopf.Body,
    type: str | None,
    **_: Any,
) -> None:
    if type == "DELETED":
        _feed("RLCycle", body, type)
        if namespace:
            forget(namespace, name)
            await asyncio.to_thread(release_route, namespace, body)
    if changed_beyond_status(body, type):
        wake(namespace, name)  # a deleted RLCycle's reconciler ends


def release_route(namespace: str, rlcycle: Mapping[str, Any]) -> None:
    """An RLCycle deleted mid-canary with the gatewayapi router: its canary Service goes
    with the garbage collector, so the HTTPRoute's weight on it is given back to the stable
    Service. Best effort, as the operator sees the deletion only while it runs."""
    spec, _problem = validate_spec(rlcycle.get("spec"))
    route_name = spec.rollout.http_route if spec is not None else None
    if spec is None or spec.rollout.router != Router.GATEWAY_API or not route_name:
        return
    try:
        route = client().get("HTTPRoute", namespace, route_name)
        rules = route_rules(spec, route, 0) if route is not None else None
        if rules is not None:
            client().patch("HTTPRoute", namespace, route_name, {"spec": {"rules": rules}})
            log.info("%s/%s deleted: HTTPRoute %s back to the stable Service", namespace,
                     rlcycle.get("metadata", {}).get("name"), route_name)  # fmt: skip
    except KubeError as exc:
        log.warning("could not give HTTPRoute %s/%s back to stable: %s", namespace, route_name,
                    exc)  # fmt: skip


@kopf.on.event("batch", "v1", "jobs", labels={names.LABEL_RLCYCLE: kopf.PRESENT}, registry=registry)
async def job_deleted(
    labels: Mapping[str, str],
    namespace: str | None,
    body: kopf.Body,
    type: str | None,
    **_: Any,
) -> None:
    """Only a finished (see ``job_cache``) or deleted Job changes a decision; its pods
    starting does not."""
    if type == "DELETED":
        _feed("Job", body, type)
        wake(namespace, labels.get(names.LABEL_RLCYCLE))


@kopf.on.event(
    "apps", "v1", "deployments", labels={names.LABEL_RLCYCLE: kopf.PRESENT}, registry=registry
)
async def canary_changed(labels: Mapping[str, str], namespace: str | None, **_: Any) -> None:
    wake(namespace, labels.get(names.LABEL_RLCYCLE))


@kopf.on.event(GROUP, VERSION, "checkpoints", registry=registry)
async def checkpoint_changed(
    spec: kopf.Spec,
    namespace: str | None,
    body: kopf.Body,
    type: str | None,
    **_: Any,
) -> None:
    if type == "DELETED":
        _feed("Checkpoint", body, type)
    if changed_beyond_status(body, type):
        wake(namespace, spec.get("rlCycle"))
