"""What a round reads of its namespace's Checkpoints: all it can look at, and not the other
RLCycles' (1,000 RLCycles of 10 Checkpoints in a namespace made every round plan over
10,000: bench/scale.py)."""

from __future__ import annotations

from typing import Any

from rtrl.kube.observe import relevant_checkpoints


def ck(name: str, rlcycle: str | None, parent: str | None = None, phase: str = "Superseded",
       uri: str | None = None) -> dict[str, Any]:  # fmt: skip
    spec = {"uri": uri or f"s3://b/{name}/", "rlCycle": rlcycle, "parent": parent}
    return {"metadata": {"name": name}, "spec": spec, "status": {"phase": phase}}


def test_a_round_sees_its_own_the_base_models_and_what_it_names_or_serves() -> None:
    checkpoints = [
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
    ]
    rlcycle = {"metadata": {"name": "a", "annotations": {}}, "spec": {"pin": "c-1"},
               "status": {"serving": "b-3"}}  # fmt: skip
    seen = relevant_checkpoints(checkpoints, rlcycle, ["s3://b/b-3", "s3://b/shared/"])
    names = [c["metadata"]["name"] for c in seen]
    assert names == ["base", "a-1", "a-2", "b-0", "b-1", "b-2", "b-3", "c-1", "d-1"]
