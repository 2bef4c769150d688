"""What a watch event tells the operator beyond its object: a re-list by kopf."""

from __future__ import annotations

from typing import Any

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
