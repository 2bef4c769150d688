"""``spec.capture`` on the real control plane: the operator injects the ``rtrl-capture``
sidecar into the target Deployment and its canary as the real API server stores them (with
its defaults), points it at each checkpoint the engine serves, never rolls the Deployment
for nothing, takes it out with the spec, refuses to overwrite someone else's container, and
runs the seal as a CronJob the real CronJob controller accepts and fires.

Here the serving pods are scripted to stay up (the steps too): what is under test is what
the operator writes and the API server accepts. The sidecar running in front of a real engine
is tests/e2e/test_capture_serving.py."""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

import pytest

from rtrl.planning.manifests.capture import SIDECAR
from rtrl_localkube.api import KubeAPI
from rtrl_localkube.cycle_world import (
    ANALYSIS_PROMOTE,
    NAME,
    RTRL,
    base_checkpoint,
    base_uri,
    commit_result,
    condition,
    deployment,
    events,
    rlcycle,
    script_all,
    setup_namespace,
    status,
)
from rtrl_localkube.kubelet import Kubelet
from rtrl_localkube.outcomes import Hang, Succeed
from rtrl_localkube.tools import OperatorProcess

pytestmark = pytest.mark.timeout(180)
CKPT = "composer-1"
TARGET = "composer-vllm"
CANARY = "composer-vllm-canary"


def capture(root: Path, **changes: Any) -> dict[str, Any]:
    return {
        "events": (root / "events").as_uri() + "/",
        "image": "rtrl-serving:test",
        "maturity": {"editPersisted": "2h"},
        "seal": {"schedule": "* * * * *"},
        **changes,
    }


def template(kube: KubeAPI, name: str = TARGET) -> dict[str, Any]:
    return ((kube.get("apps/v1", "Deployment", name) or {}).get("spec") or {}).get("template") or {}


def sidecar(kube: KubeAPI, name: str = TARGET) -> dict[str, Any] | None:
    containers = (template(kube, name).get("spec") or {}).get("containers") or []
    return next((c for c in containers if c["name"] == SIDECAR), None)


def sidecar_env(kube: KubeAPI, name: str = TARGET) -> dict[str, str]:
    found = sidecar(kube, name) or {}
    return {e["name"]: e.get("value", "") for e in found.get("env") or []}


def generation(kube: KubeAPI, name: str = TARGET) -> int:
    return int((kube.get("apps/v1", "Deployment", name) or {})["metadata"]["generation"])


def test_the_sidecar_follows_the_checkpoint_through_a_canary_and_goes_with_the_spec(
    kube_api: KubeAPI, job_runner: Kubelet, fast_operator: OperatorProcess, tmp_path: Path
) -> None:
    hold = {**ANALYSIS_PROMOTE, "decision": "continue", "reasons": ["inconclusive"]}
    script_all(job_runner, tmp_path)
    job_runner.script(
        "*-analyze-0-*", Succeed(before=commit_result("analyze", hold, tmp_path / "results"))
    )
    job_runner.script(f"{TARGET}-*", Hang())  # serving pods: up, whatever their containers
    (tmp_path / "events").mkdir()  # the sidecars' root (no sidecar runs here: empty)
    original = copy.deepcopy(deployment(tmp_path)["spec"]["template"])
    kube_api.create(deployment(tmp_path))
    kube_api.create(base_checkpoint(tmp_path))
    cycle = rlcycle(tmp_path, capture=capture(tmp_path))
    cycle["spec"]["data"]["shards"] = (tmp_path / "shards").as_uri() + "/"  # the seal's output
    cycle["spec"]["rollout"]["readyTimeout"] = "150s"  # pods start slowly on a loaded machine
    kube_api.create(cycle)

    # the stable sidecar, as the API server stores it
    kube_api.wait_for(
        lambda: sidecar(kube_api),
        timeout=60,
        message=lambda: str(status(kube_api, "RLCycle", NAME)),
    )
    env = sidecar_env(kube_api)
    assert (env["RTRL_ARM"], env["RTRL_CHECKPOINT_ID"]) == ("stable", "composer-0")
    assert env["RTRL_MODEL_URI"] == base_uri(tmp_path)
    stored = sidecar(kube_api) or {}
    assert stored["ports"][0]["name"] == SIDECAR
    assert stored.get("terminationMessagePath")  # the server's defaults are in what it holds
    notes = template(kube_api)["metadata"]["annotations"]
    assert notes["rtrl.io/capture"] == NAME

    # the seal: a CronJob the server accepted, which its controller fires every minute
    cron = kube_api.wait_for(lambda: kube_api.get("batch/v1", "CronJob", f"{NAME}-seal"))
    assert cron["spec"]["timeZone"] == "Etc/UTC" and cron["spec"]["concurrencyPolicy"] == "Forbid"
    args = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[0] == "seal" and "--maturity=edit_persisted=2h" in args

    # the canary's sidecar: the candidate, on the canary arm
    kube_api.wait_for(
        lambda: sidecar(kube_api, CANARY),
        timeout=90,
        message=lambda: str(status(kube_api, "Checkpoint", CKPT)),
    )
    ck = kube_api.get(RTRL, "Checkpoint", CKPT) or {}
    env = sidecar_env(kube_api, CANARY)
    assert (env["RTRL_ARM"], env["RTRL_CHECKPOINT_ID"]) == ("canary", CKPT)
    assert env["RTRL_MODEL_URI"] == ck["spec"]["uri"]
    stage = kube_api.get("batch/v1", "Job", f"{CKPT}-stage-0") or {}
    assert "--sealed" in stage["spec"]["template"]["spec"]["containers"][0]["args"]

    # promoted: the stable sidecar serves the candidate, rolled out with the engine
    kube_api.wait_for(
        lambda: status(kube_api, "Checkpoint", CKPT).get("phase") == "Promoted",
        timeout=60,
        message=lambda: (
            f"{status(kube_api, 'Checkpoint', CKPT)}\n{events(kube_api)}\n"
            f"{[(p['metadata']['name'], p.get('status')) for p in kube_api.list('v1', 'Pod')]}"
        ),
    )
    env = sidecar_env(kube_api)
    assert (env["RTRL_ARM"], env["RTRL_CHECKPOINT_ID"]) == ("stable", CKPT)
    assert env["RTRL_MODEL_URI"] == ck["spec"]["uri"]

    # rounds go on (1 s resync): nothing more is written to the Deployment
    settled = generation(kube_api)
    time.sleep(4)
    assert generation(kube_api) == settled
    reasons = [r for _, r, _ in events(kube_api)]
    assert reasons.count("CaptureInjected") == 1 and reasons.count("SealScheduled") == 1

    # the seal's controller fires it every minute; the real rtrl-job seal runs, with the
    # arguments, env and credentials the operator gave it, and finds nothing to seal yet
    def seal_ended() -> dict[str, Any] | None:
        for job in kube_api.list("batch/v1", "Job", {"rtrl.io/seal": NAME}):
            for cond in (job.get("status") or {}).get("conditions") or []:
                if cond["type"] in ("Complete", "Failed") and cond["status"] == "True":
                    return dict(cond, job=job["metadata"]["name"])
        return None

    ended = kube_api.wait_for(seal_ended, timeout=120, message="no seal Job ended")
    assert ended["type"] == "Complete", job_runner.logs(ended["job"])

    # capture off: the sidecar, its volumes and annotations, and the CronJob go
    kube_api.patch(RTRL, "RLCycle", NAME, {"spec": {"capture": None}})
    kube_api.wait_for(lambda: sidecar(kube_api) is None, timeout=30)
    after = template(kube_api)
    assert [c["name"] for c in after["spec"]["containers"]] == ["vllm"]
    assert not after["spec"].get("volumes")
    assert not (after["metadata"].get("annotations") or {})
    assert after["metadata"]["labels"] == original["metadata"]["labels"]
    kube_api.wait_for(lambda: kube_api.get("batch/v1", "CronJob", f"{NAME}-seal") is None)
    assert condition(kube_api, "InvalidSpec")["status"] == "False"


def test_someone_elses_rtrl_capture_container_is_never_overwritten(
    kube_api: KubeAPI, job_runner: Kubelet, operator: OperatorProcess, tmp_path: Path
) -> None:
    script_all(job_runner, tmp_path)
    job_runner.script(f"{TARGET}-*", Hang())
    theirs = {"name": SIDECAR, "image": "example.com/their-proxy:1", "command": ["sleep", "1h"]}
    target = deployment(tmp_path)
    target["spec"]["template"]["spec"]["containers"].append(theirs)
    kube_api.create(target)
    kube_api.create(base_checkpoint(tmp_path))
    kube_api.create(rlcycle(tmp_path, capture=capture(tmp_path)))
    invalid = kube_api.wait_for(
        lambda: (
            condition(kube_api, "InvalidSpec").get("status") == "True"
            and condition(kube_api, "InvalidSpec")
        ),
        timeout=30,
    )
    assert invalid["reason"] == "CaptureContainerConflict"
    assert "someone other than rtrl" in invalid["message"]
    assert generation(kube_api) == 1 and (sidecar(kube_api) or {})["image"] == theirs["image"]
    assert kube_api.get("batch/v1", "CronJob", f"{NAME}-seal") is None
    assert kube_api.list("batch/v1", "Job") == []


def test_a_sidecar_the_server_rejects_is_invalid_spec_until_fixed(
    kube_api: KubeAPI, job_runner: Kubelet, fast_operator: OperatorProcess, tmp_path: Path
) -> None:
    """A spec both validators accept from which the operator derives a sidecar the API server
    refuses (requests above limits): InvalidSpec with the server's words, never taken for a
    patch that merely no longer applies (the same 422) and tried again every round."""
    script_all(job_runner, tmp_path)
    job_runner.script(f"{TARGET}-*", Hang())
    resources = {"requests": {"cpu": "2"}, "limits": {"cpu": "1"}}
    setup_namespace(kube_api, tmp_path, capture=capture(tmp_path, resources=resources))
    invalid = kube_api.wait_for(
        lambda: (
            condition(kube_api, "InvalidSpec").get("status") == "True"
            and condition(kube_api, "InvalidSpec")
        ),
        timeout=60,
        message=fast_operator.output,
    )
    assert invalid["reason"] == "RejectedByAPIServer", invalid
    assert "rejected Deployment composer-vllm:" in invalid["message"], invalid
    assert "must be less than or equal to cpu limit" in invalid["message"], invalid
    assert sidecar(kube_api) is None and generation(kube_api) == 1
    kube_api.patch(RTRL, "RLCycle", NAME, {"spec": {"capture": {"resources": {
        "requests": {"cpu": "500m"}, "limits": {"cpu": "1"}}}}})  # fmt: skip
    kube_api.wait_for(lambda: sidecar(kube_api), timeout=60, message=fast_operator.output)
    kube_api.wait_for(lambda: condition(kube_api, "InvalidSpec").get("status") == "False")
