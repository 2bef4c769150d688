"""What the operator does with a watch event: feed the watch cache, and wake the reconciler
of the RLCycle the event concerns when it may change a decision.

kopf's index handlers (``rtrl.handlers``) feed the cache with every event before any other
handler sees it (they block every other handler until their kind is listed); the event
handlers feed it deletions, which indexes never see, and wake reconcilers. Checkpoints are
not kopf's: each namespace's are listed and watched by an informer of rtrl's own
(:mod:`rtrl.kube.informer`), which a reconciler waits for before its first round. An event that
changed only an object's status (most of them: the operator's own status writes) wakes
nobody.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

from kubernetes.client import ApiClient

from ..core.api import names
from ..core.api.reasons import JobCondition
from ..metrics import forget
from ..planning.traffic import deleting, holds
from .cache import CHILD_KINDS, CHILD_LABEL, copy_json
from .client import KubeClient
from .informer import Event, Informer
from .reconcile import Process, client, run, wake

log = logging.getLogger("rtrl.operator")
# How long the Job index handler waits for the round a finished Job started (see job_event).
HAND_OVER_SECONDS = 0.1
# How often the reconciler of a deleted RLCycle waits for kopf's daemon of it to end.
DAEMON_EXIT_POLL_SECONDS = 0.05


def feed(kind: str, body: Mapping[str, Any], type_: str | None = None) -> None:
    labels = body.get("metadata", {}).get("labels") or {}
    kept = type_ != "DELETED" and (kind not in CHILD_KINDS or CHILD_LABEL in labels)
    # copied only when the cache may keep it: not for the cluster's other ConfigMaps and
    # Services, which are only looked at for their name and resourceVersion
    Process.cache.feed(kind, type_, copy_json(body) if kept else body)


def listing(kind: str, body: Mapping[str, Any], type_: str | None) -> None:
    """Every event an event handler sees (index handlers are not told the type). kopf hands
    a listing's objects over with type None: the initial listing, each object for the first
    time, or a re-list after a watch that could not resume (a 410 Gone, as after an API
    server restart), objects seen before among them, which tells nothing of the ones
    deleted meanwhile: the cache then has the kind listed in full once (ObjectCache.relist)."""
    meta = body.get("metadata") or {}
    uid = str(meta.get("uid"))
    if type_ == "DELETED":
        Process.listed.discard(uid)
        return
    if type_ is None and uid in Process.listed:
        Process.cache.relist(kind, str(meta.get("namespace") or ""))
    Process.listed.add(uid)


def changed_beyond_status(body: Mapping[str, Any], type_: str | None) -> bool:
    """True unless the event only changed the object's status (or nothing)."""
    meta = body.get("metadata") or {}
    uid = str(meta.get("uid"))
    if type_ == "DELETED":
        Process.seen.pop(uid, None)
        return True
    shape = (
        meta.get("generation"),
        tuple(sorted((meta.get("annotations") or {}).items())),
        tuple(sorted((meta.get("labels") or {}).items())),
        bool(meta.get("deletionTimestamp")),
    )
    before = Process.seen.get(uid)
    Process.seen[uid] = shape
    return before != shape


def _rlcycle_label(body: Mapping[str, Any]) -> str | None:
    return (body.get("metadata", {}).get("labels") or {}).get(names.LABEL_RLCYCLE)


async def job_indexed(body: Mapping[str, Any]) -> None:
    """Every Job event, first of all handlers: into the cache (kept only with the
    rtrl.io/rlcycle label, dropped if it loses it); a finished Job wakes its RLCycle from
    here, before kopf works out the event's causes, so the reaction starts a little sooner."""
    feed("Job", body)
    rlcycle = _rlcycle_label(body)
    if rlcycle and _finished(body.get("status") or {}):
        round_ended = wake(body.get("metadata", {}).get("namespace"), rlcycle)
        if round_ended is not None:
            # kopf carries on with this event (on the event loop) once the round that reacts
            # to it has ended, or after HAND_OVER_SECONDS: the round does not share the GIL
            # with that work. Other objects' events are handled meanwhile.
            await asyncio.wait([round_ended], timeout=HAND_OVER_SECONDS)


def _finished(status: Mapping[str, Any]) -> bool:
    return any(
        c.get("type") in (JobCondition.COMPLETE, JobCondition.FAILED) and c.get("status") == "True"
        for c in status.get("conditions") or []
    )


def child_event(body: Mapping[str, Any], type_: str | None) -> None:
    """A Deployment, Service, ConfigMap or CronJob event: only its deletion is news to the
    cache."""
    listing(str(body.get("kind")), body, type_)
    if type_ == "DELETED":
        feed(str(body.get("kind")), body, type_)


def child_job_event(body: Mapping[str, Any], type_: str | None) -> None:
    """Only a finished (see :func:`job_indexed`) or deleted Job changes a decision; its pods
    starting does not."""
    listing("Job", body, type_)
    if type_ == "DELETED":
        feed("Job", body, type_)
        wake(body.get("metadata", {}).get("namespace"), _rlcycle_label(body))


def canary_event(body: Mapping[str, Any]) -> None:
    """Any event of a canary Deployment (labelled with its RLCycle) wakes the RLCycle."""
    wake(body.get("metadata", {}).get("namespace"), _rlcycle_label(body))


def checkpoint_event(body: Mapping[str, Any], type_: str | None) -> None:
    listing("Checkpoint", body, type_)
    if type_ == "DELETED":
        feed("Checkpoint", body, type_)
    if changed_beyond_status(body, type_):
        namespace = body.get("metadata", {}).get("namespace")
        wake(namespace, (body.get("spec") or {}).get("rlCycle"))


def checkpoints_handed(batch: list[Event]) -> None:
    """A page or event of a namespace's Checkpoints, from its informer."""
    for type_, body in batch:
        if type_ != "DELETED":
            # as an index handler would, first; not copied (feed's copy_json): the informer
            # parsed this dict for the cache alone and keeps nothing of it
            Process.cache.feed("Checkpoint", type_, body)
        checkpoint_event(body, type_)


async def reconciler(namespace: str, name: str, stopped: object) -> None:
    """The reconciler of RLCycle ``namespace/name`` (``rtrl.kube.reconcile.run``), once
    the namespace's Checkpoints have been listed into the cache. The namespace's informer
    runs while a reconciler of the namespace does."""
    Process.informer_users[namespace] = Process.informer_users.get(namespace, 0) + 1
    try:
        await checkpoints_listed(namespace)
        await run(namespace, name, stopped)
    finally:
        left = Process.informer_users.get(namespace, 0) - 1
        if left > 0:
            Process.informer_users[namespace] = left
        else:
            Process.informer_users.pop(namespace, None)
            informer = Process.informers.pop(namespace, None)
            if informer is not None:
                informer.stop()
                # what is deleted from now on goes unseen: read live until a list says
                Process.cache.invalidate("Checkpoint", namespace)


async def checkpoints_listed(namespace: str) -> None:
    """Until the Checkpoints of ``namespace`` are in the cache, from an informer of the
    namespace (started here when none runs)."""
    informer = Process.informers.get(namespace)
    if informer is None:
        loop = asyncio.get_running_loop()
        own = KubeClient(ApiClient(client().api.configuration))  # a watch holds a connection
        informer = Informer(own, "Checkpoint", namespace, checkpoints_handed, loop)
        Process.informers[namespace] = informer.start()
    await informer.listed.wait()
    Process.cache.informed("Checkpoint", namespace)


async def rlcycle_event(body: Mapping[str, Any], type_: str | None) -> None:
    namespace, name = body["metadata"].get("namespace"), body["metadata"]["name"]
    listing("RLCycle", body, type_)
    if type_ == "DELETED":
        feed("RLCycle", body, type_)
        if namespace:
            forget(namespace, name)
    elif namespace and deleting(body) and holds(body):
        give_back_soon(namespace, name)  # its traffic, before it goes (planning.traffic)
    if changed_beyond_status(body, type_):
        wake(namespace, name)  # a deleted RLCycle's reconciler ends


def give_back_soon(namespace: str, name: str) -> None:
    """RLCycle ``namespace/name`` is being deleted and carries rtrl's finalizer: a
    reconciler of its own gives its traffic back (:mod:`rtrl.kube.deletion`) until it is
    gone. kopf starts no daemon for an object being deleted, and stops the one that ran:
    that one's round ends first, so that no two rounds of one RLCycle ever run at once.
    Called on the event loop for every event of such an RLCycle (the listing's too, when
    the operator starts); a second call while one runs does nothing."""
    key = (namespace, name)
    if key in Process.giving_back:
        return
    Process.giving_back[key] = asyncio.get_running_loop().create_task(_give_back(namespace, name))


async def _give_back(namespace: str, name: str) -> None:
    key = (namespace, name)
    try:
        while key in Process.wakeups:  # kopf's daemon of it, told to stop, ends its round
            await asyncio.sleep(DAEMON_EXIT_POLL_SECONDS)
        await reconciler(namespace, name, stopped=False)
    finally:
        if Process.giving_back.get(key) is asyncio.current_task():
            del Process.giving_back[key]
