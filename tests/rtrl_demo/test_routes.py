"""Scenario two-orgs' wiring, without running a step: the RLCycles the planning core plans in
the one local cluster, and the routing ConfigMap projected into the directory the sidecars
read, as the kubelet's ConfigMap volume is (rtrl_localkube.configmapvolume)."""

from __future__ import annotations

import json
from pathlib import Path

from rtrl.planning import plan
from rtrl_demo.pipeline import routes_into_pods
from rtrl_demo.scenario import (
    DEPLOYMENT,
    HISTORY,
    NAME,
    ROUTING,
    T0,
    base_checkpoint_manifest,
    deployment_manifest,
    rlcycle_manifests,
)
from rtrl_localkube.cluster import LocalCluster
from rtrl_localkube.configmapvolume import project
from rtrl_serving.capture.table import parse, snapshot

ROUTE_A = json.dumps({"orgs": {"org-a": {"stable": {"name": "a-1", "checkpoint": "a-1",
                                                    "uri": "file:///s/a-1/"}}}})  # fmt: skip
ROUTE_B = json.dumps({"orgs": {"org-b": {"weight": 0}}})


def test_a_configmap_is_projected_as_the_kubelet_does_and_the_sidecar_reads_its_keys(
    tmp_path: Path,
) -> None:
    volume = tmp_path / "volume"
    assert project(None, volume) is True  # no ConfigMap yet: no keys
    assert parse(snapshot(volume) or ()).orgs == {}
    assert project({"demo-org-a.yaml": ROUTE_A, "demo-org-b.yaml": ROUTE_B}, volume) is True
    assert (volume / "..data").is_symlink() and (volume / "demo-org-a.yaml").is_symlink()
    assert set(parse(snapshot(volume) or ()).orgs) == {"org-a", "org-b"}
    first = (volume / "..data").readlink()
    assert project({"demo-org-a.yaml": ROUTE_A, "demo-org-b.yaml": ROUTE_B}, volume) is False
    assert (volume / "..data").readlink() == first  # unchanged data: nothing written
    assert project({"demo-org-a.yaml": ROUTE_A}, volume) is True
    assert sorted(p.name for p in volume.iterdir() if not p.name.startswith(".")) == [
        "demo-org-a.yaml"
    ]
    assert not (volume / first).exists()  # the previous timestamped directory is gone
    assert set(parse(snapshot(volume) or ()).orgs) == {"org-a"}


def test_two_orgs_plans_a_suspended_base_that_follows_the_table_and_one_cycle_per_org(
    tmp_path: Path,
) -> None:
    store = tmp_path.as_uri() + "/"
    cluster = LocalCluster(T0 - HISTORY)
    cluster.create(deployment_manifest(f"{store}models/demo-0/", "demo-0", lora=True))
    cluster.create(base_checkpoint_manifest(f"{store}models/demo-0/"))
    names = []
    for rlcycle in rlcycle_manifests(store, "two-orgs", 1000):
        cluster.create(rlcycle)
        names.append(rlcycle["metadata"]["name"])
    assert names == [NAME, "demo-org-a", "demo-org-b"]
    cluster.now = T0
    for _ in range(3):
        for name in names:
            decided = plan(cluster.observe(name), cluster.now)
            cluster.apply(decided.actions)
            cluster.patch_status("RLCycle", name, decided.status)
            cluster.settle()
    base = cluster.get("RLCycle", NAME) or {}
    assert base["status"]["phase"] == "Suspended", base["status"]
    containers = (cluster.get("Deployment", DEPLOYMENT) or {})["spec"]["template"]["spec"][
        "containers"
    ]
    sidecar = next(c for c in containers if c["name"] == "rtrl-capture")
    env = {e["name"]: e.get("value") for e in sidecar["env"]}
    assert env["RTRL_CAPTURE_ADAPTERS"] == "/etc/rtrl-capture/adapters"
    assert cluster.get("CronJob", f"{NAME}-seal") is not None  # the base's RLCycle seals
    for org in ("org-a", "org-b"):
        rlcycle = cluster.get("RLCycle", f"demo-{org}") or {}
        conditions = {c["type"]: c for c in rlcycle["status"].get("conditions") or []}
        assert conditions.get("InvalidSpec", {}).get("status") != "True", conditions
        ck = cluster.get("Checkpoint", f"demo-{org}-1") or {}
        assert ck["spec"]["base"] == "demo-0" and ck["spec"]["parent"] == "demo-0"
        stage = [
            j
            for j in cluster.pending_jobs()
            if j["metadata"]["name"].startswith(f"demo-{org}-1-stage")
        ]
        assert stage, [j["metadata"]["name"] for j in cluster.pending_jobs()]
    # the adapter RLCycles see the routing ConfigMap (none yet: nothing routed)
    assert cluster.observe("demo-org-a").routing is None
    assert cluster.observe(NAME).routing is None
    table = {"metadata": {"name": ROUTING}, "data": {"demo-org-b.yaml": ROUTE_B}}
    cluster.create({"apiVersion": "v1", "kind": "ConfigMap", **table})
    for name in names:  # the organisations' RLCycles write it, the base's reads it
        assert (cluster.observe(name).routing or {})["data"] == {"demo-org-b.yaml": ROUTE_B}
    assert routes_into_pods(cluster, tmp_path / "deployment") == {"org-b": {"weight": 0}}


def test_two_orgs_shared_is_the_bases_rlcycle_alone_cycling_with_no_adapter() -> None:
    (base,) = rlcycle_manifests("file:///tmp/store/", "two-orgs-shared", 1000)
    spec = base["spec"]
    assert not spec.get("suspend") and "adapter" not in spec
    assert "adapters" not in (spec.get("capture") or {})
    assert "population" not in spec["data"]  # everyone's rows: one model for both orgs
