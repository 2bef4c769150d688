"""kopf handlers: thin adapters between kopf's events and the reconciler.

Only kopf's registrations live here; what they do is in :mod:`rtrl.kube.reconcile` (one
reconciler per RLCycle, a kopf daemon, running observe -> plan -> apply rounds) and
:mod:`rtrl.kube.watch` (what a watch event feeds into the cache and whom it wakes).

The index handlers below feed the watch cache with every event before any other handler
sees it: kopf runs no handler and starts no daemon until every index has listed its kind.
Checkpoints are not watched by kopf but by rtrl's own informer (:mod:`rtrl.kube.informer`):
kopf's memory of each of the 10,000 Checkpoints of 1,000 RLCycles cost more than the rest.

Run with ``rtrl operator``, which hands kopf this module's :data:`registry`.
"""

from __future__ import annotations

import asyncio
from typing import Any

import kopf

from . import kopf_fixes
from .core.api.names import FINALIZER, GROUP, LABEL_RLCYCLE, VERSION
from .kube import reconcile, watch
from .kube.apply import EVENTS
from .kube.informer import stop_all
from .settings import Settings

# rtrl's handlers live in their own registry, so that other kopf handlers imported into the
# same process (a plugin, a test's operator) never run alongside them.
registry = kopf.OperatorRegistry()
kopf_fixes.install()  # what rtrl changes inside kopf 1.45 (pinned): see kopf_fixes.py
CHILD = {LABEL_RLCYCLE: kopf.PRESENT}  # the operator's children carry their RLCycle's name


@kopf.on.login(registry=registry)
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """kopf's own credentials: in-cluster service account or kubeconfig, as the client."""
    return kopf.login_via_client(**kwargs)


@kopf.on.startup(registry=registry)
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    wanted = Settings.from_environment()
    reconcile.start(wanted)
    # No handler requires it any more (kopf_fixes.without_finalizer); named so kopf removes
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
    """On a graceful stop: no informer feeds the cache any more, and the Events still queued
    (rtrl.kube.apply.EVENTS) are posted."""
    stop_all(reconcile.Process.informers)
    await asyncio.to_thread(EVENTS.flush, 5.0)


@kopf.daemon(GROUP, VERSION, "rlcycles", cancellation_timeout=10, registry=registry)
async def reconciler(
    name: str, namespace: str | None, stopped: kopf.DaemonStopped, **_: Any
) -> None:
    assert namespace is not None  # RLCycle is namespaced
    await watch.reconciler(namespace, name, stopped)


kopf_fixes.without_finalizer(registry, "reconciler")  # kopf names it after its function


# --- the watch cache's feed: one index per cached kind -------------------------------------
@kopf.index(GROUP, VERSION, "rlcycles", registry=registry)
async def rlcycle_cache(body: kopf.Body, **_: Any) -> None:
    watch.feed("RLCycle", body)


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
