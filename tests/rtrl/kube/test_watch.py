"""What a watch event tells the operator beyond its object: a re-list by kopf."""

from __future__ import annotations

import asyncio
from typing import Any

from rtrl.core.api.names import FINALIZER_RESTORE_TRAFFIC
from rtrl.kube import reconcile, watch
from rtrl.kube.reconcile import Process
from rtrl.settings import Settings


def checkpoint(name: str, uid: str, rv: int) -> dict[str, Any]:
    meta = {"name": name, "namespace": "ns", "uid": uid, "resourceVersion": str(rv)}
    return {"kind": "Checkpoint", "metadata": meta, "spec": {"rlCycle": "composer"}}


def test_only_a_relist_of_objects_seen_before_flags_the_kind(monkeypatch: Any) -> None:
    """kopf hands the event handlers a listing's objects with type None, the initial one as
    a re-list after a watch that could not resume; only the re-list, which brings objects
    seen before, must make the cache list the kind in full (what it missed: deletions)."""
    monkeypatch.setattr("rtrl.kube.reconcile.KubeClient.from_environment", lambda: None)
    reconcile.start(Settings())
    cache = Process.cache
    cache.mark_synced()  # the first daemon runs before the listing's event handlers do
    for k in range(3):  # the initial listing
        watch.checkpoint_event(checkpoint(f"c{k}", f"u{k}", 10 + k), None)
    watch.checkpoint_event(checkpoint("c3", "u3", 20), "ADDED")
    watch.checkpoint_event(checkpoint("c0", "u0", 21), "MODIFIED")
    assert not cache.relisted("Checkpoint", "ns")
    watch.checkpoint_event(checkpoint("c0", "u0", 21), None)  # kopf lists again
    assert cache.relisted("Checkpoint", "ns") and not cache.relisted("Job", "ns")


def test_a_deleted_rlcycle_held_by_the_finalizer_gets_a_reconciler_after_kopfs(
    monkeypatch: Any,
) -> None:
    """kopf starts no daemon for an RLCycle being deleted and stops the one it ran: one that
    carries rtrl.io/restore-traffic gets a reconciler of its own, started once kopf's has
    ended (never two rounds of one RLCycle at once), once however many events come."""
    monkeypatch.setattr("rtrl.kube.reconcile.KubeClient.from_environment", lambda: None)
    reconcile.start(Settings())
    rounds: list[str] = []

    def one_round(namespace: str, name: str, **_: Any) -> float:
        rounds.append(name)
        raise reconcile.RLCycleGoneError(name)  # what the round finds once it gave back

    monkeypatch.setattr(reconcile, "reconcile_once", one_round)

    async def listed(namespace: str) -> None:  # no API server here to list Checkpoints from
        return None

    monkeypatch.setattr(watch, "checkpoints_listed", listed)
    meta = {"name": "composer", "namespace": "ns", "uid": "u", "resourceVersion": "5",
            "deletionTimestamp": "2026-11-29T12:00:00Z"}  # fmt: skip
    held = {"kind": "RLCycle", "metadata": {**meta, "finalizers": [FINALIZER_RESTORE_TRAFFIC]}}
    other = {"kind": "RLCycle", "metadata": {**meta, "name": "plain", "uid": "v"}}
    key = ("ns", "composer")

    async def scenario() -> None:
        Process.wakeups[key] = reconcile.Wakeup()  # kopf's daemon of it still runs
        await watch.rlcycle_event(held, "MODIFIED")
        await watch.rlcycle_event(held, "MODIFIED")
        await watch.rlcycle_event(other, "MODIFIED")  # nothing held: nothing to do
        assert list(Process.giving_back) == [key]
        await asyncio.sleep(0.3)
        assert rounds == []  # not while kopf's runs
        del Process.wakeups[key]  # kopf's daemon ends
        await asyncio.wait_for(Process.giving_back[key], 5)
        assert rounds == ["composer"] and not Process.giving_back

    asyncio.run(scenario())


class RecordedInformer:
    """Stands in for rtrl.kube.informer.Informer (tested on the real API server in
    tests/e2e/test_informer.py): its listing is in at once; records its life."""

    made: list[RecordedInformer] = []

    def __init__(self, client: Any, kind: str, namespace: str, handle: Any, loop: Any) -> None:
        self.namespace, self.handle, self.running = namespace, handle, False
        self.listed = asyncio.Event()
        RecordedInformer.made.append(self)

    def start(self) -> RecordedInformer:
        self.running = True
        listed = checkpoint("c0", f"u-{self.namespace}", 10)
        listed["metadata"]["namespace"] = self.namespace
        self.handle([(None, listed)])
        self.listed.set()
        return self

    def stop(self) -> None:
        self.running = False


def test_a_namespaces_informer_runs_while_a_reconciler_of_it_does(monkeypatch: Any) -> None:
    """The first reconciler of a namespace starts its Checkpoints' informer and waits for its
    listing; the informer stops with the namespace's last reconciler, and what is deleted
    after that goes unseen, so the namespace's Checkpoints are then read live."""
    monkeypatch.setattr("rtrl.kube.reconcile.KubeClient.from_environment", reconcile.KubeClient)
    monkeypatch.setattr(watch, "Informer", RecordedInformer)
    RecordedInformer.made = []
    reconcile.start(Settings())
    ends: dict[tuple[str, str], asyncio.Event] = {}
    began: list[tuple[str, str, bool]] = []

    async def run(namespace: str, name: str, stopped: object) -> None:
        # what the round would see: the listing is in the cache
        began.append((namespace, name, Process.cache.usable("Checkpoint", namespace)))
        await ends.setdefault((namespace, name), asyncio.Event()).wait()

    monkeypatch.setattr(watch, "run", run)

    async def scenario() -> None:
        Process.cache.mark_synced()
        tasks = [asyncio.create_task(watch.reconciler(ns, n, False))
                 for ns, n in (("a", "x"), ("a", "y"), ("b", "z"))]  # fmt: skip
        while len(began) < 3:
            await asyncio.sleep(0.01)
        assert sorted(began) == [("a", "x", True), ("a", "y", True), ("b", "z", True)]
        assert sorted(i.namespace for i in RecordedInformer.made) == ["a", "b"]
        assert Process.cache.get("Checkpoint", "a", "c0") is not None
        informer_a = Process.informers["a"]
        ends[("a", "x")].set()
        await tasks[0]
        assert informer_a.running and Process.cache.usable("Checkpoint", "a")
        ends[("a", "y")].set()
        await tasks[1]
        assert not informer_a.running and "a" not in Process.informers
        assert not Process.cache.usable("Checkpoint", "a")  # read live from now on
        assert Process.informers["b"].running and Process.cache.usable("Checkpoint", "b")
        ends[("b", "z")].set()
        await tasks[2]
        assert not Process.informers and not Process.informer_users

    asyncio.run(scenario())
