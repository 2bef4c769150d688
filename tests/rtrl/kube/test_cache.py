"""The operator's watch cache (rtrl.kube.cache): the newest version wins, whichever way it
came (a watch event, the answer to the operator's own write, a live read), so a late event
never undoes a write and a deleted object never comes back. resourceVersions are opaque: the
helpers below make them strings that do not sort in the order they were issued."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest

from rtrl.core.api import names
from rtrl.kube.cache import ObjectCache
from rtrl.kube.cached_client import CachingClient
from rtrl.kube.client import KubeClient, KubeError

NS = "default"


def opaque(rv: int) -> str:
    """Version ``rv`` as an API server not backed by etcd might spell it."""
    return hashlib.sha1(str(rv).encode()).hexdigest()[:12]


def obj(kind: str, name: str, rv: int, phase: str | None = None, **meta: Any) -> dict[str, Any]:
    meta.setdefault("uid", f"uid-{kind}-{name}")
    out: dict[str, Any] = {
        "kind": kind,
        "metadata": {"name": name, "namespace": NS, "resourceVersion": opaque(rv), **meta},
    }
    if phase:
        out["status"] = {"phase": phase}
    return out


def job(name: str, rv: int, **meta: Any) -> dict[str, Any]:
    return obj("Job", name, rv, labels={names.LABEL_RLCYCLE: "composer"}, **meta)


def phase(cache: ObjectCache, name: str) -> Any:
    return ((cache.get("Checkpoint", NS, name) or {}).get("status") or {}).get("phase")


def synced() -> ObjectCache:
    cache = ObjectCache()
    cache.mark_synced()
    return cache


def test_a_late_event_never_undoes_the_operators_write() -> None:
    cache = synced()
    cache.feed("Checkpoint", "ADDED", obj("Checkpoint", "c1", 5))
    cache.wrote("Checkpoint", obj("Checkpoint", "c1", 9, "Training"))  # the PATCH's answer
    cache.feed("Checkpoint", "MODIFIED", obj("Checkpoint", "c1", 7, "Staging"))  # in flight
    assert phase(cache, "c1") == "Training"
    cache.feed("Checkpoint", "MODIFIED", obj("Checkpoint", "c1", 9, "Training"))  # its own
    slow = cache.begin()  # a request whose answer comes back late
    cache.feed("Checkpoint", "MODIFIED", obj("Checkpoint", "c1", 11, "Training"))  # its event
    cache.feed("Checkpoint", "MODIFIED", obj("Checkpoint", "c1", 12, "Evaluating"))  # newer
    assert phase(cache, "c1") == "Evaluating"
    cache.wrote("Checkpoint", obj("Checkpoint", "c1", 11, "Training"), slow)  # the answer
    cache.end(slow)
    assert phase(cache, "c1") == "Evaluating"


def test_a_created_object_is_seen_before_its_event() -> None:
    cache = synced()
    cache.wrote("Job", job("c1-stage-0", 4))
    assert [j["metadata"]["name"] for j in cache.list("Job", NS)] == ["c1-stage-0"]


def test_a_deleted_object_never_comes_back() -> None:
    cache = synced()
    cache.feed("Job", "ADDED", job("j", 3))
    cache.feed("Job", "DELETED", job("j", 8))
    cache.wrote("Job", job("j", 6))  # a patch answered after the deletion
    cache.feed("Job", "MODIFIED", job("j", 7))  # a late event
    assert cache.get("Job", NS, "j") is None
    cache.feed("Job", "ADDED", job("j", 10, uid="j-again"))  # created again: a new object
    assert cache.get("Job", NS, "j") is not None


def test_the_operators_delete_hides_the_object_at_once() -> None:
    cache = synced()
    cache.feed("Job", "ADDED", job("j", 3))
    cache.deleted("Job", NS, "j", job("j", 5))  # gone (no finalizers)
    cache.feed("Job", "MODIFIED", job("j", 4))  # an update before the deletion, late
    assert cache.get("Job", NS, "j") is None
    # with finalizers the answer is the object, now deleting: kept as such
    cache.feed("Checkpoint", "ADDED", obj("Checkpoint", "c", 3))
    answer = obj("Checkpoint", "c", 6, deletionTimestamp="2026-11-29T00:00:00Z")
    cache.deleted("Checkpoint", NS, "c", answer)
    cache.feed("Checkpoint", "MODIFIED", obj("Checkpoint", "c", 4))
    held = cache.get("Checkpoint", NS, "c")
    assert held is not None and held["metadata"]["deletionTimestamp"]
    # an answer that is not the object (a Status): the kind is read live until a list
    cache.deleted("Job", NS, "k", {"kind": "Status", "status": "Success"})
    assert not cache.usable("Job", NS)
    cache.absorb_list("Job", NS, {names.LABEL_RLCYCLE: "composer"}, [])
    assert cache.usable("Job", NS)


def test_a_live_list_drops_what_it_no_longer_holds_but_not_newer_objects() -> None:
    cache = synced()
    cache.feed("Job", "ADDED", job("ghost", 3))  # deleted while the watch was down
    listing = cache.begin()  # the list request is sent
    cache.wrote("Job", job("new", 12))  # created after the list was taken
    cache.absorb_list("Job", NS, {names.LABEL_RLCYCLE: "composer"}, [job("kept", 9)], listing)
    cache.end(listing)
    kept = sorted(j["metadata"]["name"] for j in cache.list("Job", NS))
    assert kept == ["kept", "new"]


def test_only_the_operators_children_are_kept() -> None:
    cache = synced()
    cache.feed("Job", "ADDED", obj("Job", "someone-elses", 3))
    assert cache.get("Job", NS, "someone-elses") is None
    cache.feed("Job", "ADDED", job("mine", 4))
    cache.feed("Job", "MODIFIED", obj("Job", "mine", 5))  # lost its label
    assert cache.get("Job", NS, "mine") is None
    assert cache.list("Job", NS, {names.LABEL_RLCYCLE: "composer"}) == []


def test_not_usable_before_the_initial_listing() -> None:
    cache = ObjectCache()
    assert not cache.usable("Job", NS)
    cache.mark_synced()
    assert cache.usable("Job", NS) and not cache.usable("Pod", NS)


def test_managed_fields_are_not_kept_and_the_fed_object_is_not_changed() -> None:
    cache = synced()
    fed = job("j", 3, managedFields=[{"manager": "kubectl"}])
    cache.feed("Job", "ADDED", fed)
    assert "managedFields" not in cache.get("Job", NS, "j")["metadata"]  # type: ignore[index]
    assert fed["metadata"]["managedFields"]


def test_caching_client_reads_its_own_writes_without_a_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cache = synced()
    kube = CachingClient(KubeClient(api_client=object()), cache)  # type: ignore[arg-type]
    sent: list[str] = []

    def request(*args: Any, **_: Any) -> Any:
        sent.append(" ".join(map(str, args[1:3])))
        raise AssertionError("no request expected")

    monkeypatch.setattr(KubeClient, "request", request)
    monkeypatch.setattr(KubeClient, "create", lambda self, manifest: {**manifest, **job("j", 7)})
    monkeypatch.setattr(
        KubeClient, "patch", lambda self, *a, **k: obj("Checkpoint", "c1", 8, "Training")
    )
    kube.create(job("j", 0))
    kube.patch("Checkpoint", NS, "c1", {"status": {"phase": "Training"}}, sub="status")
    assert [j["metadata"]["name"] for j in kube.list("Job", NS, {names.LABEL_RLCYCLE: "composer"})]
    assert phase(cache, "c1") == "Training"
    assert kube.get("Checkpoint", NS, "c1") is not None
    assert kube.cached_reads == 2 and sent == [] and not kube.write_failed
    # live: every read is a request (and refreshes the cache)
    live = CachingClient(KubeClient(api_client=object()), cache, live=True)  # type: ignore[arg-type]
    with pytest.raises(AssertionError):
        live.get("Checkpoint", NS, "c1")
    assert sent


def test_a_write_that_meets_a_conflict_makes_the_kind_read_live(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cache = synced()
    base = KubeClient(api_client=object())  # type: ignore[arg-type]
    kube = CachingClient(base, cache)

    def conflict(*_: Any, **__: Any) -> Any:
        raise KubeError("HTTP 422", 422)

    monkeypatch.setattr(KubeClient, "patch", conflict)
    with pytest.raises(KubeError):
        kube.patch("Deployment", NS, "target", [{"op": "test"}], json_patch=True)
    assert kube.write_failed and not cache.usable("Deployment", NS)
    assert kube.reads_remotely("Deployment", NS) and not kube.reads_remotely("Job", NS)
    cache.absorb_get("Deployment", NS, "target", obj("Deployment", "target", 30))  # re-read
    assert cache.usable("Deployment", NS)

    def exists(*_: Any, **__: Any) -> Any:
        return None  # 409: it existed already

    monkeypatch.setattr(KubeClient, "create", exists)
    kube2 = CachingClient(base, cache)
    assert kube2.create({**job("x", 0), "kind": "Job"}) is None
    assert kube2.write_failed and not cache.usable("Job", NS)


def test_a_relist_drops_what_its_watch_missed_with_one_full_list(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """kopf re-lists a kind when its watch cannot resume (a 410 after an API server restart):
    the listing brings what exists, never the deletions missed meanwhile. No round re-reads
    the cluster on a timer (bench/scale.py), so the next read of that kind lists it in full,
    once, and what is gone leaves the cache; other kinds stay cached."""
    cache = ObjectCache()
    cache.feed("Job", None, job("kept", 3))  # kopf's first listing, before any round
    cache.feed("Job", None, job("deleted-while-down", 4))
    cache.feed("Checkpoint", None, obj("Checkpoint", "c1", 5))
    cache.mark_synced()
    assert cache.usable("Job", NS)
    # the watch broke; kopf re-lists: only "kept" (and another RLCycle's Job) exists now
    cache.relist("Job", NS)  # rtrl.kube.watch.listing saw a listed object it knew
    cache.feed("Job", None, job("kept", 3))
    lists: list[tuple[str, Any]] = []

    def list_with_version(self: Any, kind: str, namespace: str, labels: Any = None) -> Any:
        lists.append((kind, labels))
        other = obj("Job", "other", 6, labels={names.LABEL_RLCYCLE: "second"})
        unlabelled = obj("Job", "not-ours", 7)
        return [job("kept", 3), other, unlabelled], 20

    monkeypatch.setattr(KubeClient, "list_with_version", list_with_version)
    kube = CachingClient(KubeClient(api_client=object()), cache)  # type: ignore[arg-type]
    mine = {names.LABEL_RLCYCLE: "composer"}
    assert kube.reads_remotely("Job", NS) and not kube.reads_remotely("Checkpoint", NS)
    assert [j["metadata"]["name"] for j in kube.list("Job", NS, mine)] == ["kept"]
    assert lists == [("Job", None)]  # one full list, not the labelled one
    assert cache.get("Job", NS, "not-ours") is None  # only the operator's children are kept
    assert kube.list("Job", NS, mine) and kube.get("Checkpoint", NS, "c1") is not None
    assert lists == [("Job", None)] and kube.cached_reads == 3  # all from the cache


def test_no_namespace_lists_every_namespace() -> None:
    """What the metrics' scrape reads: every namespace's Checkpoints, and no other kind."""
    cache = synced()
    cache.feed("Checkpoint", "ADDED", obj("Checkpoint", "c1", 5))
    cache.feed("Checkpoint", "ADDED", obj("Checkpoint", "c2", 6, namespace="other"))
    cache.feed("RLCycle", "ADDED", obj("RLCycle", "composer", 7))
    names = sorted(c["metadata"]["name"] for c in cache.list("Checkpoint", None))
    assert names == ["c1", "c2"]
    assert [c["metadata"]["name"] for c in cache.list("Checkpoint", "other")] == ["c2"]


def test_opaque_resource_versions_keep_the_cache_on_and_in_order() -> None:
    """Kubernetes defines resourceVersions as opaque strings, to compare for equality only
    (an API server not backed by etcd issues such): the cache stays on and still orders a
    late event after the operator's write, by the order of the watch and by equality."""
    cache = synced()

    def ck(rv: str, phase: str) -> dict[str, Any]:
        out = obj("Checkpoint", "c1", 0, phase, uid="u-c1")
        out["metadata"]["resourceVersion"] = rv
        return out

    cache.feed("Checkpoint", "ADDED", ck("a7f3c1", "Staging"))
    cache.wrote("Checkpoint", ck("0b9e44", "Training"))  # the PATCH's answer
    cache.feed("Checkpoint", "MODIFIED", ck("f00d2a", "Staging"))  # in flight before it
    assert cache.usable("Checkpoint", NS)
    assert phase(cache, "c1") == "Training"
    cache.feed("Checkpoint", "MODIFIED", ck("0b9e44", "Training"))  # the write's own event
    cache.feed("Checkpoint", "MODIFIED", ck("3c3c3c", "Evaluating"))  # newer
    assert phase(cache, "c1") == "Evaluating"


def test_an_object_created_again_under_its_name_is_told_apart_by_its_uid() -> None:
    """The operator replaces an object (delete, then create under the same name); kopf hands
    each incarnation's events to a worker of its own, so the old one's late events and its
    DELETED may come after the new one's: they never hide the new one."""
    cache = synced()

    def seal(rv: int, uid: str) -> dict[str, Any]:
        return obj("CronJob", "seal", rv, uid=uid, labels={names.LABEL_RLCYCLE: "composer"})

    cache.feed("CronJob", "ADDED", seal(3, uid="first"))
    cache.deleted("CronJob", NS, "seal", seal(5, uid="first"))  # gone
    cache.wrote("CronJob", seal(6, uid="second"))  # created again
    cache.feed("CronJob", "MODIFIED", seal(4, uid="first"))  # the first one, late
    cache.feed("CronJob", "DELETED", seal(5, uid="first"))
    held = cache.get("CronJob", NS, "seal")
    assert held is not None and held["metadata"]["uid"] == "second"
    assert cache.usable("CronJob", NS)
    # someone else replaces it: two incarnations from the watch, neither known gone yet:
    # read live until a live read says which one exists
    cache.feed("CronJob", "ADDED", seal(9, uid="third"))
    assert not cache.usable("CronJob", NS)
    cache.absorb_get("CronJob", NS, "seal", seal(9, uid="third"))
    assert cache.usable("CronJob", NS)
    cache.feed("CronJob", "MODIFIED", seal(7, uid="second"))  # gone by the live read
    assert cache.get("CronJob", NS, "seal")["metadata"]["uid"] == "third"  # type: ignore[index]


def test_a_live_read_ends_an_answer_the_watch_skipped() -> None:
    """After a re-list (a watch that could not resume) the watch may never deliver the
    version an answer holds ahead; the live list that follows every re-list settles it."""
    cache = synced()
    cache.feed("Checkpoint", "ADDED", obj("Checkpoint", "c1", 3, "Staging"))
    cache.wrote("Checkpoint", obj("Checkpoint", "c1", 5, "Training"))  # ahead of the watch
    cache.feed("Checkpoint", None, obj("Checkpoint", "c1", 8, "Evaluating"))  # re-listed
    assert phase(cache, "c1") == "Training"  # the watch never said 5: still ahead
    with cache.request() as mark:  # the full live list after the re-list
        cache.absorb_list("Checkpoint", NS, None, [obj("Checkpoint", "c1", 8, "Evaluating")], mark)
    assert phase(cache, "c1") == "Evaluating"
    cache.feed("Checkpoint", "MODIFIED", obj("Checkpoint", "c1", 9, "Promoted"))
    assert phase(cache, "c1") == "Promoted"


def test_two_answers_crossing_are_settled_by_the_watch_without_a_live_read() -> None:
    """A round's status write and a notifier's cross (two threads, one object): whichever
    answer is held, the watch delivers both versions in their order and the later stays;
    the kind stays cached (a live read of every RLCycle's kind would send 1,000 rounds
    live: seen in bench/scale.py)."""
    for first_held in (True, False):
        cache = synced()
        cache.feed("RLCycle", "ADDED", obj("RLCycle", "r", 3, "Idle"))
        round_write, notifier_write = cache.begin(), cache.begin()
        older, newer = obj("RLCycle", "r", 4, "Running"), obj("RLCycle", "r", 5, "Canary")
        answers = [(round_write, older), (notifier_write, newer)]
        for mark, answer in answers if first_held else answers[::-1]:
            cache.wrote("RLCycle", answer, mark)
        assert cache.usable("RLCycle", NS)
        cache.feed("RLCycle", "MODIFIED", older)
        cache.feed("RLCycle", "MODIFIED", newer)
        assert ((cache.get("RLCycle", NS, "r") or {}).get("status") or {})["phase"] == "Canary"
        cache.end(round_write)
        cache.end(notifier_write)


def test_tombstones_are_forgotten_once_no_late_event_can_come(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A tombstone per deleted uid: an operator that runs for months deletes Jobs every
    cycle, and no live list (which used to prune them) may come for as long."""
    cache = synced()
    clock = [1000.0]
    monkeypatch.setattr("rtrl.kube.cache.time.monotonic", lambda: clock[0])
    for k in range(300):
        cache.feed("Job", "DELETED", job(f"j{k}", k, uid=f"j{k}"))
        clock[0] += 10.0  # 300 deletions over 50 minutes
    assert len(cache._gone) < 100  # those of the last TOMBSTONE_SECONDS, and a batch
