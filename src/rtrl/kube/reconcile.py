"""The reconciler: one per RLCycle, woken by watch events, running observe -> plan -> apply
-> write status in rounds.

Each RLCycle has one reconciler (kopf runs it as a daemon, see ``rtrl.handlers``), so
decisions about one RLCycle are never made twice at once. It sleeps until something relevant
changes (the RLCycle, one of its Jobs or Checkpoints: the watch handlers wake it, see
:mod:`rtrl.kube.watch`), the plan asks to look again (``requeue_after``), or the periodic
resync is due; then it observes, plans, applies and writes the status. The reconciler keeps
nothing between rounds but a wake-up flag: all state is read back from the cluster (or the
watch cache) and the store, so the operator can be killed at any moment.

A round reads the kinds kopf watches from :class:`rtrl.kube.cache.ObjectCache`, which the
index handlers feed with every watch event before any other handler sees it (kopf runs no
handler and starts no daemon until every index has listed its kind), and which the round's
own writes update with what the API answered; see that module for the consistency rule. A
round reads everything live instead only after a round that failed or met a conflict, and,
if ``RTRL_LIVE_READ_SECONDS`` is set, at least that often. The first round of a reconciler
reads the cache: kopf starts no daemon before its listing has filled it, and 1,000 RLCycles
each listing every Checkpoint of their namespace when the operator starts (or when they are
applied at once) is 1,000 times the listing kopf just did; only a new RLCycle (no status
yet) reads its target Deployment by name, which may have been created just before it, and
reads everything live a second later if that first round found something it names missing. No
round re-reads the cluster on a timer by default, so an idle operator sends no request but
its watches (``bench/scale.py``); what a re-list of kopf's may have missed is read once,
then (:func:`rtrl.kube.watch.listing`).

This module holds no kopf code: ``rtrl.handlers`` registers the handlers that call it.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import functools
import json
import logging
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any

from ..core.api.rlcycle import RLCyclePhase
from ..metrics import observe_plan, reconcile_failed, set_object_source
from ..planning import plan, plan_rejected
from ..planning.traffic import deleting, holds
from ..settings import Settings
from .apply import RejectedError, apply, write_status
from .cache import ObjectCache
from .cached_client import CachingClient
from .client import KubeClient, KubeError
from .deletion import give_back
from .heap import keep_trimmed
from .informer import Informer, stop_all
from .kept import INFORMED_KINDS
from .observe import observe
from .webhooks import NOTIFIER, confirm

log = logging.getLogger("rtrl.operator")


class Wakeup:
    """A reconciler's wake-up flag. Unlike an ``asyncio.Event`` behind ``wait_for``, whose
    waiter resumes a few loop turns after ``set``, a waiting reconciler resumes at the next
    turn. Set and waited on in the event loop only.

    :meth:`set` returns a future that the reconciler resolves when the round this wake-up
    starts has ended: a handler that awaits it keeps kopf from carrying on with its event
    (Python work on the event loop) while the round runs in its thread, so the round does
    not wait for the GIL behind it (see :func:`rtrl.kube.watch.job_indexed`)."""

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
            resolve(self._future)
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
            resolve(self._next_round)

    async def wait(self, timeout: float) -> None:
        """Until set (at once if it is) or ``timeout`` seconds have passed."""
        if self.pending:
            return
        loop = asyncio.get_running_loop()
        future = self._future = loop.create_future()
        timer = loop.call_later(timeout, resolve, future)
        try:
            await future
        finally:
            timer.cancel()
            self._future = None


def resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class Process:
    """Per-process wiring, made at startup (:func:`start`): the API client, the settings,
    the wake-up flags, the watch cache."""

    client: KubeClient | None = None
    settings = Settings()
    wakeups: dict[tuple[str, str], Wakeup] = {}
    # What an object's last event looked like outside its status, by uid: an event that
    # changed only the status (most of them: the operator's own status writes) wakes nobody.
    # Only a filter for wake-ups; no decision reads it.
    seen: dict[str, tuple[Any, ...]] = {}
    # The uids the event handlers have had an event of: a listing's object among them means
    # kopf re-lists its kind (rtrl.kube.watch.listing).
    listed: set[str] = set()
    # The watched objects a round reads (see the module docstring).
    cache = ObjectCache()
    # RTRL_ROUND_TRACE: a file that gets one JSON line per round (bench/operator_latency.py).
    trace: Any = None
    # The Checkpoints' list-and-watch of each namespace with an RLCycle (rtrl.kube.watch
    # .checkpoints_listed).
    informers: dict[str, Informer] = {}
    informer_users: dict[str, int] = {}  # namespace -> its reconcilers running or starting
    # The reconcilers of deleted RLCycles held by rtrl's finalizer (kopf runs no daemon for
    # an object being deleted): rtrl.kube.watch.give_back_soon.
    giving_back: dict[tuple[str, str], asyncio.Task[None]] = {}


def start(settings: Settings) -> None:
    """The operator starts (again, in tests): fresh client, flags and cache."""
    Process.client = KubeClient.from_environment()
    Process.settings = settings
    Process.wakeups.clear()
    Process.seen.clear()
    Process.listed.clear()
    stop_all(Process.informers)  # none feeds the new cache
    Process.informer_users.clear()
    Process.cache = ObjectCache(informed=INFORMED_KINDS)
    Process.giving_back = {}
    NOTIFIER.reset()
    NOTIFIER.policy = settings.policy
    set_object_source(lambda kind: Process.cache.list(kind, None))
    keep_trimmed()  # what kopf's listings allocated and freed goes back to the OS
    # The reconcile rounds run in threads next to kopf's event loop; when the loop is busy
    # (kopf works through each watch event in Python), a round waiting for the GIL would
    # wait up to the default 5 ms switch interval.
    sys.setswitchinterval(settings.switch_interval)
    if Process.trace is not None:
        Process.trace.close()
        Process.trace = None
    if settings.round_trace:
        Process.trace = open(settings.round_trace, "a", buffering=1)  # noqa: SIM115


def client() -> KubeClient:
    if Process.client is None:
        Process.client = KubeClient.from_environment()
    return Process.client


def wake(namespace: str | None, name: str | None) -> asyncio.Future[None] | None:
    """Wake the reconciler of RLCycle ``namespace/name``, if it runs; the future of the
    round that will follow (see :class:`Wakeup`)."""
    if namespace and name:
        flag = Process.wakeups.get((namespace, name))
        if flag is not None:
            return flag.set()
    return None


# Rounds an event woke run here, resyncs on the loop's default executor: at 1,000 RLCycles
# the resyncs alone can keep every thread of that one busy (bench/scale.py).
WOKEN_ROUNDS = ThreadPoolExecutor(max_workers=2, thread_name_prefix="rtrl-woken")

# What the first round of a new RLCycle reads live: the kinds it gets by name; and when a
# live round follows if that first round found the spec invalid (not found what it names).
NEW_RLCYCLE_LIVE = frozenset({"Deployment"})
NEW_RLCYCLE_RETRY_SECONDS = 1.0
# When a round whose conditional write met a change (409) is replanned, live.
CONFLICT_RETRY_SECONDS = 0.2


def _phase(namespace: str, name: str) -> str | None:
    """The phase the RLCycle's status has now (the cache holds the round's own write)."""
    return ((Process.cache.get("RLCycle", namespace, name) or {}).get("status") or {}).get("phase")


class RLCycleGoneError(Exception):
    """The RLCycle was deleted (or is being deleted): its reconciler ends."""


def reconcile_once(
    namespace: str,
    name: str,
    *,
    live: bool = True,
    woken: float | None = None,
    live_kinds: frozenset[str] = frozenset(),
) -> float | None:
    """One round for one RLCycle; returns when to look again (seconds), None for the resync.

    ``live``: read the cluster rather than the cache (``live_kinds``: these kinds only);
    ``woken``: when an event woke the
    reconciler for this round (``time.perf_counter``, for the trace). Raises
    :class:`KubeError` after a write that failed or met a conflict (so that the next round
    reads live), :class:`RLCycleGoneError` when there is nothing left to reconcile."""
    kube = CachingClient(client(), Process.cache, live=live, live_kinds=live_kinds)
    marks = {"t0": time.perf_counter()}
    if woken is not None:
        marks["woken"] = woken
    try:
        rlcycle = kube.get("RLCycle", namespace, name)
        if rlcycle is None or (deleting(rlcycle) and not holds(rlcycle)):
            raise RLCycleGoneError(f"{namespace}/{name}")
        policy = Process.settings.policy
        if deleting(rlcycle):
            return give_back(kube, rlcycle, policy)
        observed = with_webhooks(kube, rlcycle, observe(kube, rlcycle, policy))
        marks["observed"] = time.perf_counter()
        now = datetime.now(UTC)
        decided = plan(observed, now)
        marks["planned"] = time.perf_counter()
        post_outbox(kube, rlcycle, decided.status)
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
        return notify(kube, rlcycle, decided.status, decided.requeue_after)
    finally:
        if Process.trace is not None:
            _trace_round(namespace, name, marks, kube)


def with_webhooks(kube: CachingClient, rlcycle: dict[str, Any], observed: Any) -> Any:
    """What the webhooks answered: the confirm webhook of a gate that waits for it, and the
    notifications this process is done with."""
    meta = rlcycle["metadata"]
    confirmed, why = confirm(kube, rlcycle, Process.settings.policy)
    delivered, failed = NOTIFIER.done(meta["namespace"], meta["name"])
    if confirmed is None and not delivered:
        return observed
    return dataclasses.replace(
        observed,
        confirmed=confirmed,
        confirm_error=why,
        delivered=delivered,
        undeliverable=tuple((k, t, w) for k, t, w in failed),
    )


def post_outbox(kube: CachingClient, rlcycle: dict[str, Any], status: dict[str, Any]) -> None:
    """New notifications are written to the outbox before the round's changes: a crash
    after a change must not lose the notification of it (a decision carried out is not
    decided again). Planned again after a crash, the same decision has the same id."""
    old = {e.get("id") for e in (rlcycle.get("status") or {}).get("outbox") or []}
    new = [e for e in status.get("outbox") or [] if e.get("id") not in old]
    if new:
        write_status(kube, rlcycle, {"outbox": status["outbox"]})


def notify(
    kube: CachingClient, rlcycle: dict[str, Any], status: dict[str, Any], requeue: float | None
) -> float | None:
    """Start the outbox's deliveries (in the background); when to look again for the ones
    retried later."""
    if not status.get("outbox"):
        if (rlcycle.get("status") or {}).get("outbox"):
            NOTIFIER.submit(kube, {**rlcycle, "status": status})  # forgets the delivered
        return requeue
    events = KubeClient(kube.api)  # used from the notifier's threads
    wait = NOTIFIER.submit(
        events, {**rlcycle, "status": {**(rlcycle.get("status") or {}), **status}}
    )
    if wait is None:
        return requeue
    return wait if requeue is None else min(wait, requeue)


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
        Process.trace.write(json.dumps(record) + "\n")


async def run(namespace: str, name: str, stopped: object) -> None:
    """The reconciler of RLCycle ``namespace/name``: rounds until ``stopped`` is true or
    the RLCycle is gone."""
    flag = Process.wakeups.setdefault((namespace, name), Wakeup())
    loop = asyncio.get_running_loop()

    # a delivery that ended wakes the reconciler, whose next plan drops it from the outbox
    def delivery_ended(ns: str, n: str) -> None:
        loop.call_soon_threadsafe(wake, ns, n)

    NOTIFIER.woken = delivery_ended
    # kopf starts no daemon before every index has listed its kind: the cache is complete.
    Process.cache.mark_synced()
    read_live = False  # after a failure; the first round reads the cache kopf filled
    # but a new RLCycle (no status yet) reads its Deployment by name: created just before
    # it, the Deployment's event may not be in yet (another watch stream)
    new = not (Process.cache.get("RLCycle", namespace, name) or {}).get("status")
    last_live = time.monotonic()
    try:
        while not stopped:
            woken, round_ended = flag.take()
            started = time.monotonic()
            period = Process.settings.live_read_seconds  # 0: never on a timer
            live = read_live or (period > 0 and started - last_live >= period)
            try:
                # a woken round does not queue behind the resyncs of 1,000 idle RLCycles
                lane = WOKEN_ROUNDS if woken is not None else None
                # in this task's context, as asyncio.to_thread would run it: the logs take
                # the RLCycle a record is about from kopf's context variables (rtrl.logs)
                context = contextvars.copy_context()
                delay = await asyncio.get_running_loop().run_in_executor(lane, functools.partial(
                    context.run, reconcile_once, namespace, name, live=live, woken=woken,
                    live_kinds=NEW_RLCYCLE_LIVE if new else frozenset(),
                ))  # fmt: skip
                if new and _phase(namespace, name) == RLCyclePhase.INVALID:
                    # perhaps only a race with the events of what was created with it (the
                    # base Checkpoint): once more in a second, live
                    read_live, delay = True, NEW_RLCYCLE_RETRY_SECONDS
                else:
                    read_live = False
                new = False
                if live:
                    last_live = started
            except RLCycleGoneError:
                log.info("%s/%s is gone or going; its children go with it (garbage "
                         "collection), its stored artifacts stay", namespace, name)  # fmt: skip
                return
            except KubeError as exc:
                reconcile_failed(namespace, name, internal=False)
                read_live = True
                # 409: the round decided on a version someone changed since (its status
                # writes are conditional): nothing is wrong, the next round reads it live
                conflict = exc.status == 409
                delay = (
                    CONFLICT_RETRY_SECONDS if conflict else Process.settings.error_backoff_seconds
                )
                level = logging.INFO if conflict else logging.WARNING
                log.log(level, "reconcile %s/%s: %s; retrying in %ss", namespace, name, exc, delay)
            except Exception:
                reconcile_failed(namespace, name, internal=True)
                read_live = True
                delay = Process.settings.error_backoff_seconds
                log.exception("reconcile %s/%s failed; retrying in %ss", namespace, name, delay)
            finally:
                if round_ended is not None:
                    resolve(round_ended)
            log.debug("reconciled %s/%s in %.3fs", namespace, name, time.monotonic() - started)
            if delay is not None and delay <= 0:
                continue
            resync = Process.settings.resync_seconds
            timeout = resync if delay is None else min(delay, resync)
            await flag.wait(timeout)
    finally:
        flag.close()
        if Process.wakeups.get((namespace, name)) is flag:
            del Process.wakeups[(namespace, name)]
