"""kopf handlers: thin adapters between kopf's events and the reconciler.

Only kopf's registrations live here; what they do is in :mod:`rtrl.kube.reconcile` (one
reconciler per RLCycle, a kopf daemon, running observe -> plan -> apply rounds) and
:mod:`rtrl.kube.watch` (what a watch event feeds into the cache and whom it wakes).

The index handlers below feed the watch cache with every event before any other handler
sees it: kopf runs no handler and starts no daemon until every index has listed its kind.

Run with ``rtrl operator``, which hands kopf this module's :data:`registry`.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import kopf
from kopf._cogs.aiokits import aiotoggles  # kopf 1.45 (pinned): see _make_toggle

from .core.api.names import FINALIZER, GROUP, LABEL_RLCYCLE, VERSION
from .kube import reconcile, watch
from .kube.apply import EVENTS
from .settings import Settings

# rtrl's handlers live in their own registry, so that other kopf handlers imported into the
# same process (a plugin, a test's operator) never run alongside them.
registry = kopf.OperatorRegistry()
CHILD = {LABEL_RLCYCLE: kopf.PRESENT}  # the operator's children carry their RLCycle's name


@kopf.on.login(registry=registry)
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """kopf's own credentials: in-cluster service account or kubeconfig, as the client."""
    return kopf.login_via_client(**kwargs)


@kopf.on.startup(registry=registry)
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    wanted = Settings.from_environment()
    reconcile.start(wanted)
    # No handler requires it any more (see _without_finalizer); named so that kopf removes
    # it from RLCycles an earlier rtrl put it on.
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    settings.peering.lifetime = wanted.peering_lifetime
    settings.posting.enabled = False  # the reconciler posts its own Events, with reasons
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330


@kopf.on.cleanup(registry=registry)
async def flush_events(**_: Any) -> None:
    """On a graceful stop, post the Events still queued (rtrl.kube.apply.EVENTS)."""
    await asyncio.to_thread(EVENTS.flush, 5.0)


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
    await reconcile.run(namespace, name, stopped)


_without_finalizer("reconciler")  # kopf names a handler after its function


# kopf holds every object's first event until the index handlers have seen the whole initial
# listing: each listed object gets a toggle in one ToggleSet, dropped once indexed, and each
# object's worker then waits on the set's condition. kopf notifies every waiter at each toggle
# made or dropped, and each re-evaluates the set: quadratic in the objects listed (1,000
# RLCycles and 10,000 Checkpoints: over 10 minutes before the first round, bench/scale.py).
# Adding or dropping a toggle changes no toggle's own state, at most the set's: so notify
# only when the set's state changed (kopf 1.45, pinned; tests/rtrl/test_handlers.py).
async def _make_toggle(
    self: aiotoggles.ToggleSet, __val: bool = False, *, name: str | None = None
) -> aiotoggles.Toggle:
    toggle = aiotoggles.Toggle(__val, name=name, condition=self._condition)
    async with self._condition:
        before = self.is_on()
        self._toggles.add(toggle)
        if self.is_on() != before:
            self._condition.notify_all()
    return toggle


async def _drop_toggles(self: aiotoggles.ToggleSet, toggles: Any) -> None:
    async with self._condition:
        before = self.is_on()
        self._toggles.difference_update(toggles)
        if self.is_on() != before:
            self._condition.notify_all()


async def _drop_toggle(self: aiotoggles.ToggleSet, toggle: aiotoggles.Toggle) -> None:
    await _drop_toggles(self, (toggle,))


aiotoggles.ToggleSet.make_toggle = _make_toggle  # type: ignore[method-assign]
aiotoggles.ToggleSet.drop_toggle = _drop_toggle  # type: ignore[method-assign]
aiotoggles.ToggleSet.drop_toggles = _drop_toggles  # type: ignore[method-assign]


# --- the watch cache's feed: one index per cached kind -------------------------------------
@kopf.index(GROUP, VERSION, "rlcycles", registry=registry)
async def rlcycle_cache(body: kopf.Body, **_: Any) -> None:
    watch.feed("RLCycle", body)


@kopf.index(GROUP, VERSION, "checkpoints", registry=registry)
async def checkpoint_cache(body: kopf.Body, **_: Any) -> None:
    watch.feed("Checkpoint", body)


@kopf.index("batch", "v1", "jobs", registry=registry)
async def job_cache(body: kopf.Body, **_: Any) -> None:
    await watch.job_indexed(body)  # and a finished Job wakes its RLCycle at once


@kopf.index("apps", "v1", "deployments", registry=registry)
async def deployment_cache(body: kopf.Body, **_: Any) -> None:
    watch.feed("Deployment", body)  # any: the target Deployment is the user's


@kopf.index("", "v1", "services", registry=registry)
async def service_cache(body: kopf.Body, **_: Any) -> None:
    watch.feed("Service", body)


@kopf.index("", "v1", "configmaps", registry=registry)
async def config_map_cache(body: kopf.Body, **_: Any) -> None:
    watch.feed("ConfigMap", body)


@kopf.index("batch", "v1", "cronjobs", registry=registry)
async def cron_job_cache(body: kopf.Body, **_: Any) -> None:
    watch.feed("CronJob", body)  # the seal CronJobs (spec.capture)


# --- events: deletions (which indexes never see) and wake-ups ------------------------------
@kopf.on.event("apps", "v1", "deployments", registry=registry)
@kopf.on.event("", "v1", "services", labels=CHILD, registry=registry)
@kopf.on.event("", "v1", "configmaps", labels=CHILD, registry=registry)
@kopf.on.event("batch", "v1", "cronjobs", labels=CHILD, registry=registry)
async def child_deleted(body: kopf.Body, type: str | None, **_: Any) -> None:
    watch.child_event(body, type)


@kopf.on.event(GROUP, VERSION, "rlcycles", registry=registry)
async def rlcycle_changed(body: kopf.Body, type: str | None, **_: Any) -> None:
    await watch.rlcycle_event(body, type)


@kopf.on.event("batch", "v1", "jobs", labels=CHILD, registry=registry)
async def job_deleted(body: kopf.Body, type: str | None, **_: Any) -> None:
    watch.child_job_event(body, type)


@kopf.on.event("apps", "v1", "deployments", labels=CHILD, registry=registry)
async def canary_changed(body: kopf.Body, **_: Any) -> None:
    watch.canary_event(body)


@kopf.on.event(GROUP, VERSION, "checkpoints", registry=registry)
async def checkpoint_changed(body: kopf.Body, type: str | None, **_: Any) -> None:
    watch.checkpoint_event(body, type)
