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
