"""What a round reads of its namespace's Checkpoints: all it can look at, found through an
index, and not the other RLCycles' (1,000 RLCycles of 10 Checkpoints in a namespace made
every round plan over, then filter, 10,000: bench/scale.py)."""

from __future__ import annotations

from typing import Any

from rtrl.kube.cache import ObjectCache
from rtrl.kube.cached_client import CacheFinder
from rtrl.kube.index import ListFinder
from rtrl.kube.observe import relevant_checkpoints

NS = "ns"


def ck(name: str, rlcycle: str | None, parent: str | None = None, phase: str = "Superseded",
       uri: str | None = None) -> dict[str, Any]:  # fmt: skip
    spec = {"uri": uri or f"s3://b/{name}/", "rlCycle": rlcycle, "parent": parent}
    meta = {"name": name, "namespace": NS, "uid": f"u-{name}", "resourceVersion": f"v-{name}"}
    return {"kind": "Checkpoint", "metadata": meta, "spec": spec, "status": {"phase": phase}}


CHECKPOINTS = [
    ck("base", None),
    ck("a-1", "a", "base"),
    ck("a-2", "a", "a-1", "Training"),
    ck("b-0", None),
    ck("b-1", "b", "b-0"),
    ck("b-2", "b", "b-1", "RolledBack"),  # a rolled-back one, whoever made it
    ck("b-3", "b", "b-2"),  # served by a's Deployment: seen, with its lineage
    ck("b-4", "b", "b-3"),
    ck("c-1", "c"),  # pinned by a
    ck("c-2", "c", "c-1"),
    ck("d-1", "d", None, "Promoted", uri="s3://b/shared/"),  # a's canary serves it
    ck("e-0", None),  # another RLCycle's base model, which a neither serves nor names
]
RLCYCLE = {"metadata": {"name": "a", "annotations": {}}, "spec": {"pin": "c-1"},
           "status": {"serving": "b-3"}}  # fmt: skip
URIS: list[str | None] = ["s3://b/b-3", "s3://b/shared/", None]
SEEN = ["a-1", "a-2", "b-0", "b-1", "b-2", "b-3", "base", "c-1", "d-1"]  # by name, as listed


def names(found: list[dict[str, Any]]) -> list[str]:
    return [c["metadata"]["name"] for c in found]


def test_a_round_sees_its_own_and_what_it_names_or_serves_with_their_lineage() -> None:
    seen = relevant_checkpoints(ListFinder("Checkpoint", CHECKPOINTS), RLCYCLE, URIS)
    assert names(seen) == SEEN


def test_the_watch_cache_answers_the_same_from_its_index() -> None:
    cache = ObjectCache()
    for c in CHECKPOINTS:
        cache.feed("Checkpoint", "ADDED", c)
    seen = relevant_checkpoints(CacheFinder(cache, "Checkpoint", NS), RLCYCLE, URIS)
    assert names(seen) == SEEN
    # the index follows the objects: a phase, a URI and an RLCycle that change
    cache.feed("Checkpoint", "MODIFIED", {**ck("b-2", "b", "b-1"), "metadata": {
        **ck("b-2", "b")["metadata"], "resourceVersion": "v-b-2-again"}})  # fmt: skip
    cache.feed("Checkpoint", "MODIFIED", {**ck("e-0", "a"), "metadata": {
        **ck("e-0", None)["metadata"], "resourceVersion": "v-e-0-again"}})  # fmt: skip
    seen = relevant_checkpoints(CacheFinder(cache, "Checkpoint", NS), RLCYCLE, URIS)
    assert names(seen) == [*SEEN, "e-0"]  # b-2 still in b-3's lineage; e-0 now a's own
    cache.feed("Checkpoint", "DELETED", ck("d-1", "d"))
    seen = relevant_checkpoints(CacheFinder(cache, "Checkpoint", NS), RLCYCLE, URIS)
    assert "d-1" not in names(seen)


class CountingSpec(dict):  # type: ignore[type-arg]
    """A Checkpoint's spec that counts how often a round looks into it."""

    reads = 0

    def get(self, *args: Any) -> Any:
        CountingSpec.reads += 1
        return super().get(*args)


def test_a_round_from_the_cache_does_not_look_at_other_rlcycles_checkpoints() -> None:
    cache = ObjectCache()
    for c in CHECKPOINTS:
        cache.feed("Checkpoint", "ADDED", c)
    for k in range(2_000):  # another 200 RLCycles' history
        other = ck(f"z{k // 10}-{k % 10}", f"z{k // 10}", f"z{k // 10}-{k % 10 - 1}")
        other["spec"] = CountingSpec(other["spec"])
        cache.feed("Checkpoint", "ADDED", other)
    CountingSpec.reads = 0
    seen = relevant_checkpoints(CacheFinder(cache, "Checkpoint", NS), RLCYCLE, URIS)
    assert names(seen) == SEEN and CountingSpec.reads == 0
