# ruff: noqa: E501
"""The local executor applies plan actions like the API server; the simulated users are
deterministic and judge as documented (``rtrl demo`` end to end: test_demo.py)."""

from __future__ import annotations

import random
from datetime import UTC, datetime
from pathlib import Path

import pytest

from rtrl.core.api.reasons import Reason
from rtrl.planning import Create, Delete, Emit, Patch, PatchStatus, plan
from rtrl.planning.manifests.seal import seal_name
from rtrl_demo import sim
from rtrl_demo.scenario import (
    NAME,
    T0,
    base_checkpoint_manifest,
    deployment_manifest,
    rlcycle_manifest,
)
from rtrl_localkube.cluster import LocalCluster, StaleWriteError
from rtrl_localkube.patch import PatchConflictError, json_patch, merge_patch

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def _dep(name: str, owner_uid: str | None = None) -> dict:
    meta: dict = {"name": name}
    if owner_uid:
        meta["ownerReferences"] = [{"uid": owner_uid}]
    env = [{"name": "MODEL_URI", "value": "a"}]
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta,
            "spec": {"replicas": 1, "template": {"spec": {"containers": [{"name": "c", "env": env}]}}}}  # fmt: skip


def test_json_patch_ops_and_test_failures() -> None:
    doc = {"spec": {"env": [{"name": "A", "value": "1"}]}}
    ops = [{"op": "test", "path": "/spec/env/0/value", "value": "1"},
           {"op": "replace", "path": "/spec/env/0/value", "value": "2"},
           {"op": "add", "path": "/spec/env/-", "value": {"name": "B", "value": "3"}}]  # fmt: skip
    out = json_patch(doc, ops)
    assert out["spec"]["env"] == [{"name": "A", "value": "2"}, {"name": "B", "value": "3"}]
    assert doc["spec"]["env"] == [{"name": "A", "value": "1"}]  # untouched
    with pytest.raises(PatchConflictError):
        json_patch(out, ops)  # the test no longer holds: the API's 422
    with pytest.raises(PatchConflictError):
        json_patch(doc, [{"op": "replace", "path": "/spec/nope/0", "value": 1}])
    assert merge_patch({"a": {"b": 1, "c": 2}}, {"a": {"b": None, "d": 3}}) == {
        "a": {"c": 2, "d": 3}
    }


def test_cluster_applies_actions_like_the_api_server() -> None:
    cluster = LocalCluster(NOW)
    cluster.apply([Create(_dep("d")), Create(_dep("d"))])
    dep = cluster.get("Deployment", "d")
    assert dep is not None and dep["metadata"]["generation"] == 1 and dep["metadata"]["uid"]
    uid = dep["metadata"]["uid"]
    cluster.apply([Create(_dep("child", uid))])
    path = "/spec/template/spec/containers/0/env/0/value"
    ok = [{"op": "test", "path": path, "value": "a"}, {"op": "replace", "path": path, "value": "b"}]
    cluster.apply(
        [Patch("apps/v1", "Deployment", "d", ok), Patch("apps/v1", "Deployment", "d", ok)]
    )
    dep = cluster.get("Deployment", "d")
    assert dep is not None and dep["metadata"]["generation"] == 2  # the second patch: 422, no-op
    cluster.apply(
        [PatchStatus("apps/v1", "Deployment", "d", {"x": 1}), Emit("RLCycle", "r", "R", "m")]
    )
    assert cluster.get("Deployment", "d")["status"] == {"x": 1}  # type: ignore[index]
    assert cluster.get("Deployment", "d")["metadata"]["generation"] == 2  # type: ignore[index]
    assert [e.reason for e in cluster.events] == ["R"]
    cluster.apply([Delete("apps/v1", "Deployment", "d"), Delete("apps/v1", "Deployment", "d")])
    assert cluster.get("Deployment", "child") is None  # garbage-collected with its owner


def test_sim_is_deterministic_and_judges_as_documented() -> None:
    assert sim.make_users(5, 3) == sim.make_users(5, 3)
    user = sim.make_users(1, 0)[0]
    rng = random.Random(0)
    task = sim.Task("edit", 2, [sim.BOS, 100, sim.TASK["edit"], sim.LANG0 + 2])
    kept = [
        sim.judge(task, user, [sim.EDIT0 + 2, 100, sim.EOS], rng)["edit_persisted"]
        for _ in range(400)
    ]
    wrong = [
        sim.judge(task, user, [sim.EDIT0 + 1, 100, sim.EOS], rng)["edit_persisted"]
        for _ in range(400)
    ]
    assert sum(kept) / 400 > 0.8 and sum(wrong) / 400 < 0.2
    bad = sim.judge(task, user, [sim.TOOL0 + 2, sim.EOS], rng)
    assert (
        bad["invalid_tool_calls"] == 1 and bad["tool_calls"] == 1 and bad["edit_persisted"] is None
    )
    ask = sim.judge(task, user, [sim.ASK, sim.Q, sim.EOS], rng)
    assert ask["asked_clarification"] and ask["edits_proposed"] == 0
    assert sim.parse([sim.TOOL0 + 1, sim.END, sim.EOS]) == ("tool", 1)
    assert sim.parse([sim.TOOL0 + 1, 100, sim.END, sim.EOS]) == ("invalid_tool", None)


def test_a_status_write_applies_to_the_version_the_plan_saw() -> None:
    cluster = LocalCluster(NOW)
    seen = cluster.create({"apiVersion": "rtrl.io/v1alpha1", "kind": "Checkpoint",
                           "metadata": {"name": "c"}, "spec": {}})["metadata"]["resourceVersion"]  # fmt: skip
    # two writes of one plan: the second is conditional on the first's answer
    cluster.apply([PatchStatus("rtrl.io/v1alpha1", "Checkpoint", "c", {"phase": "Training"}, seen),
                   PatchStatus("rtrl.io/v1alpha1", "Checkpoint", "c", {"phase": "Evaluating"}, seen)])  # fmt: skip
    assert cluster.objects[("Checkpoint", "c")]["status"]["phase"] == "Evaluating"
    # a plan made before those writes: refused, nothing changed
    with pytest.raises(StaleWriteError, match="the plan saw"):
        cluster.apply([PatchStatus("rtrl.io/v1alpha1", "Checkpoint", "c", {"phase": "Staging"}, seen)])  # fmt: skip
    assert cluster.objects[("Checkpoint", "c")]["status"]["phase"] == "Evaluating"


def test_the_seal_cronjob_is_observed_so_it_is_scheduled_once(tmp_path: Path) -> None:
    """The local cluster shows the plan the seal CronJob it created, as the operator's
    observe does: otherwise every round plans its creation again, with a SealScheduled
    Event each time (the demo's summary held one per round)."""
    cluster = LocalCluster(T0)
    base = (tmp_path / "models" / "demo-0").as_uri() + "/"
    cluster.create(deployment_manifest(base, "demo-0"))
    cluster.create(base_checkpoint_manifest(base))
    cluster.create(rlcycle_manifest(tmp_path.as_uri() + "/", "default", 100))
    cluster.settle()
    for _ in range(3):
        decided = plan(cluster.observe(NAME), cluster.now)
        cluster.apply(decided.actions)
        cluster.patch_status("RLCycle", NAME, decided.status)
        cluster.settle()
    scheduled = [e for e in cluster.events if e.reason == Reason.SEAL_SCHEDULED]
    assert cluster.get("CronJob", seal_name(NAME)) is not None
    assert len(scheduled) == 1, scheduled
