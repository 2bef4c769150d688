"""An adapter RLCycle (``spec.adapter``) on the real control plane: one organisation's LoRA
adapter trained from the base, canaried, and promoted as writes of the RLCycle's own key of
the routing ConfigMap, which the real API server stores and the operator reads back; the
target Deployment's pods never restarted, no canary Deployment made, the key of another
organisation never written, the base never Superseded; and a ConfigMap not labelled as a
routing table is never written into.

The target's ``rtrl-capture`` sidecar is not the adapter RLCycle's: the RLCycle serving the
base (here ``composer-base``, suspended: it runs no cycle of its own) injects it, following
the routing table, and one operator runs both RLCycles.

The same story against an in-memory world is tests/rtrl/planning/test_adapter_cycle.py;
here the steps and the serving pods are scripted (tests/e2e/test_capture.py): what is under
test is what the operator writes, with the chart's RBAC, and what the API server keeps.
"""

from __future__ import annotations

import copy
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from rtrl.core.api.names import LABEL_ADAPTER_ROUTES
from rtrl.planning.manifests.adapters import ADAPTERS_MOUNT, ADAPTERS_VOLUME
from rtrl.planning.manifests.capture import SIDECAR
from rtrl_localkube.api import KubeAPI
from rtrl_localkube.cycle_world import (
    ANALYSIS_PROMOTE,
    NAME,
    RTRL,
    base_checkpoint,
    commit_result,
    condition,
    deployment,
    events,
    rlcycle,
    script_all,
    status,
)
from rtrl_localkube.kubelet import Kubelet
from rtrl_localkube.outcomes import Hang, Succeed
from rtrl_localkube.tools import OperatorProcess

pytestmark = pytest.mark.timeout(120)
BASE = "composer-0"
CKPT = "composer-1"
TARGET = "composer-vllm"
BASE_RLCYCLE = "composer-base"  # the full-model RLCycle of the base: it injects the sidecar
TABLE = "composer-adapters"  # the routing table (spec.capture.adapters.configMap)
KEY = f"{NAME}.yaml"  # the RLCycle's own key
ORG = "acme"
OTHER_KEY = "globex.yaml"  # what the RLCycle of another organisation wrote
OTHER = json.dumps(
    {"orgs": {"globex": {"stable": {"name": "globex-3", "checkpoint": "globex-3",
                                    "uri": "s3://rtrl-artifacts/globex/globex-3/"}}}}
)  # fmt: skip


def lora_deployment(root: Path) -> dict[str, Any]:
    """The target whose engine can serve adapters: LoRA on, the pod's adapters volume
    mounted where the sidecar downloads them (manifests/adapters.py)."""
    doc = deployment(root)
    pod = doc["spec"]["template"]["spec"]
    pod["volumes"] = [{"name": ADAPTERS_VOLUME, "emptyDir": {}}]
    engine = pod["containers"][0]
    engine["args"] = [*engine.get("args", []), "--enable-lora", "--max-lora-rank=8"]
    engine["volumeMounts"] = [{"name": ADAPTERS_VOLUME, "mountPath": ADAPTERS_MOUNT}]
    return doc


def capture(root: Path) -> dict[str, Any]:
    return {
        "events": (root / "events").as_uri() + "/",
        "image": "rtrl-serving:test",
        "maturity": {"editPersisted": "2h"},
        "adapters": {"configMap": TABLE},
    }


def base_rlcycle(root: Path) -> dict[str, Any]:
    """The RLCycle of the base, suspended: it injects the sidecar following the routing
    table (an adapter RLCycle injects none) and runs no cycle."""
    cycle = rlcycle(root, capture=capture(root), suspend=True)
    cycle["metadata"]["name"] = BASE_RLCYCLE
    return cycle


def adapter_rlcycle(root: Path) -> dict[str, Any]:
    cycle = rlcycle(root, capture=capture(root), adapter={"rank": 8, "alpha": 16})
    cycle["spec"]["data"]["population"] = {"orgs": [ORG]}
    return cycle


def setup(kube: KubeAPI, runner: Kubelet, root: Path, labels: dict[str, str],
          data: dict[str, str]) -> dict[str, Any]:  # fmt: skip
    """The routing table as given, the LoRA-capable target, the base, both RLCycles; the
    steps succeed, the serving pods stay up; the table as the server stored it."""
    script_all(runner, root)
    runner.script(f"{TARGET}-*", Hang())  # serving pods: up, whatever their containers
    runner.script(f"{BASE_RLCYCLE}-seal-*", Succeed())  # (its CronJob may fire meanwhile)
    (root / "events").mkdir()
    stored = kube.create(routing_table(labels, data))
    kube.create(lora_deployment(root))
    kube.create(base_checkpoint(root))
    kube.create(base_rlcycle(root))
    kube.create(adapter_rlcycle(root))
    return stored


def routing_table(labels: dict[str, str], data: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": TABLE, "labels": labels},
        "data": data,
    }


def table(kube: KubeAPI) -> dict[str, Any]:
    return kube.get("v1", "ConfigMap", TABLE) or {}


def route(found: dict[str, Any]) -> dict[str, Any] | None:
    """The RLCycle's own key of the table, parsed as written (None: no key yet)."""
    text = (found.get("data") or {}).get(KEY)
    return json.loads(text) if text else None


def target(kube: KubeAPI) -> dict[str, Any]:
    return kube.get("apps/v1", "Deployment", TARGET) or {}


def checkpoint(kube: KubeAPI, name: str) -> dict[str, Any]:
    return kube.get(RTRL, "Checkpoint", name) or {}


def ref(kube: KubeAPI, name: str) -> dict[str, Any]:
    """A Checkpoint as the routing table names it."""
    ck = checkpoint(kube, name)
    return {"name": name, "checkpoint": name, "uri": ck["spec"]["uri"], "rlcycle": NAME}


def test_an_adapter_is_canaried_and_promoted_as_routes_never_as_a_restart(
    kube_api: KubeAPI, job_runner: Kubelet, fast_operator: OperatorProcess, tmp_path: Path
) -> None:
    # What the world looks like while the canary's analysis runs: seen from its pod.
    seen: list[dict[str, Any]] = []
    lock = threading.Lock()
    promote = commit_result("analyze", ANALYSIS_PROMOTE, tmp_path / "results")

    def during_canary(job: dict[str, Any]) -> None:
        with lock:
            seen.append(
                {
                    "job": job["metadata"]["name"],
                    "args": job["spec"]["template"]["spec"]["containers"][0]["args"],
                    "table": table(kube_api),
                    "target": target(kube_api),
                    "canary": kube_api.get("apps/v1", "Deployment", f"{TARGET}-canary"),
                }
            )
        promote(job)

    labels = {LABEL_ADAPTER_ROUTES: "true", "app.kubernetes.io/managed-by": "rtrl"}
    setup(kube_api, job_runner, tmp_path, labels, {OTHER_KEY: OTHER})
    job_runner.script("*-analyze-*", Succeed(before=during_canary))

    def explain() -> str:
        return (
            f"rlcycle: {status(kube_api, 'RLCycle', NAME)}\n"
            f"{BASE_RLCYCLE}: {status(kube_api, 'RLCycle', BASE_RLCYCLE)}\n"
            f"{CKPT}: {status(kube_api, 'Checkpoint', CKPT)}\n"
            f"table: {table(kube_api).get('data')}\nevents: {events(kube_api)}\n"
            f"operator: {fast_operator.output()[-3000:]}"
        )

    # the base's RLCycle injects the sidecar: the one write of the target's template
    def injected() -> bool:
        containers = target(kube_api)["spec"]["template"]["spec"]["containers"]
        return any(c["name"] == SIDECAR for c in containers)

    kube_api.wait_for(injected, timeout=30, message=explain)
    # the adapter RLCycle finds it (InvalidSpec until then) and starts its cycle
    ck = kube_api.wait_for(lambda: checkpoint(kube_api, CKPT), timeout=60, message=explain)
    kube_api.wait_for(
        lambda: condition(kube_api, "InvalidSpec").get("status") == "False", message=explain
    )
    settled = target(kube_api)
    assert ck["spec"]["base"] == BASE and ck["spec"]["parent"] == BASE
    stage = kube_api.wait_for(lambda: kube_api.get("batch/v1", "Job", f"{CKPT}-stage-0"))
    assert stage  # the cycle runs: the environment (the sidecar among it) is settled

    # promoted, through a canary that was a route
    kube_api.wait_for(
        lambda: status(kube_api, "Checkpoint", CKPT).get("phase") == "Promoted",
        timeout=60,
        message=explain,
    )
    with lock:
        assert seen, "no analysis Job ran during the canary"
        first = copy.deepcopy(seen[0])
    assert first["job"].startswith(f"{CKPT}-analyze-0"), [s["job"] for s in seen]
    assert f"--org={ORG}" in first["args"], first["args"]
    assert first["canary"] is None  # no canary Deployment: the engine serves both arms
    assert route(first["table"]) == {"orgs": {ORG: {"canary": ref(kube_api, CKPT), "weight": 25}}}
    assert first["table"]["data"][OTHER_KEY] == OTHER
    assert first["target"]["spec"]["template"] == settled["spec"]["template"]
    assert first["target"]["metadata"]["generation"] == settled["metadata"]["generation"]

    # the route's stable is the candidate; the target and the other org's key untouched
    found = table(kube_api)
    assert route(found) == {"orgs": {ORG: {"stable": ref(kube_api, CKPT), "weight": 0}}}
    assert found["data"][OTHER_KEY] == OTHER
    assert found["metadata"]["labels"] == labels
    after = target(kube_api)
    assert after["spec"]["template"] == settled["spec"]["template"]
    assert after["metadata"]["generation"] == settled["metadata"]["generation"]
    assert kube_api.get("apps/v1", "Deployment", f"{TARGET}-canary") is None
    # the base goes on serving every other organisation: never Superseded by an adapter
    assert status(kube_api, "Checkpoint", BASE).get("phase") != "Superseded"
    assert status(kube_api, "RLCycle", NAME).get("serving") == CKPT
    promoted = [m for _, reason, m in events(kube_api) if reason == "Promoted"]
    assert any(f"now serves organisation {ORG}" in m for m in promoted), promoted

    # rounds go on (1 s resync): the route read back each round is not written again
    time.sleep(3)
    assert table(kube_api)["metadata"]["resourceVersion"] == found["metadata"]["resourceVersion"]
    assert target(kube_api)["metadata"]["generation"] == settled["metadata"]["generation"]
    writes = fast_operator.output().count(f"patched ConfigMap {TABLE}")
    assert writes == 2, writes  # the canary's route, the promotion's


def test_a_configmap_not_labelled_as_a_routing_table_is_never_written(
    kube_api: KubeAPI, job_runner: Kubelet, fast_operator: OperatorProcess, tmp_path: Path
) -> None:
    theirs = setup(kube_api, job_runner, tmp_path, {"app": "billing"}, {"settings.yaml": "a: 1\n"})
    # (CaptureAdaptersUnservable until the base's RLCycle has injected the sidecar)

    def unlabelled() -> dict[str, Any]:
        found = condition(kube_api, "InvalidSpec")
        return found if found.get("reason") == "AdapterRoutesUnlabelled" else {}

    invalid = kube_api.wait_for(
        unlabelled,
        timeout=30,
        message=lambda: f"{status(kube_api, 'RLCycle', NAME)}\n{fast_operator.output()[-3000:]}",
    )
    assert invalid["status"] == "True", invalid
    time.sleep(3)  # rounds go on (1 s resync): still nothing written
    assert f"ConfigMap {TABLE} is not labelled {LABEL_ADAPTER_ROUTES}=true" in invalid["message"]
    found = table(kube_api)
    assert found["metadata"]["resourceVersion"] == theirs["metadata"]["resourceVersion"]
    assert found["data"] == {"settings.yaml": "a: 1\n"}
    assert checkpoint(kube_api, CKPT) == {}
    assert kube_api.list("batch/v1", "Job") == []
