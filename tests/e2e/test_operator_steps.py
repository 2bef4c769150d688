"""The real operator (kopf, ``rtrl.handlers``, with the chart's ServiceAccount) on the real
control plane, each step's pod scripted by the kubelet (it writes the step's canned result
document, or fails): a whole cycle, insufficient data, each step failing, invalid input and
its recovery, suspend / trigger / cron, the history limit. Deletion: test_operator.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rtrl.core.api.checkpoint import Checkpoint
from rtrl.core.api.rlcycle import RLCycle
from rtrl_localkube.cycle_world import (
    EVAL_FAIL,
    NAME,
    RTRL,
    STAGE_INSUFFICIENT,
    base_checkpoint,
    condition,
    deployment,
    events,
    rlcycle,
    script_all,
    setup_namespace,
    status,
    wait_phase,
)
from rtrl_localkube.job_runner import JobRunner
from rtrl_localkube.outcomes import Fail
from tests.integration.conftest import KubeAPI

pytestmark = pytest.mark.timeout(120)


def test_a_cycle_ends_promoted_with_every_status_field_and_condition(
    kube_api: KubeAPI, job_runner: JobRunner, operator: Any, tmp_path: Path
) -> None:
    script_all(job_runner, tmp_path)
    setup_namespace(kube_api, tmp_path)
    wait_phase(kube_api, "Checkpoint", "composer-1", "Promoted")
    kube_api.wait_for(lambda: status(kube_api, "RLCycle", NAME).get("phase") == "Idle")
    rlc = kube_api.get(RTRL, "RLCycle", NAME)
    assert rlc is not None
    RLCycle.model_validate(rlc)  # the status the operator wrote fits the API's own types
    st = rlc["status"]
    assert st["cycle"] == 1 and st["serving"] == "composer-1" and st["candidate"] == "composer-1"
    assert st["lastPromoted"] == "composer-1" and st["canaryWeight"] == 0
    assert st["observedGeneration"] == rlc["metadata"]["generation"]
    assert st["cycleStartedAt"] and st["nextRun"] and st["message"]
    assert {c["type"]: c["status"] for c in st["conditions"]} == {
        "Ready": "True",
        "Progressing": "False",
        "Degraded": "False",
        "InsufficientData": "False",
        "InvalidSpec": "False",
    }
    ck = kube_api.get(RTRL, "Checkpoint", "composer-1")
    assert ck is not None
    Checkpoint.model_validate(ck)
    assert ck["spec"]["parent"] == "composer-0" and ck["spec"]["rlCycle"] == NAME
    assert ck["metadata"]["ownerReferences"][0]["uid"] == rlc["metadata"]["uid"]
    cst = ck["status"]
    assert cst["data"]["interactions"] == 2000 and cst["training"]["steps"] == 4
    assert cst["eval"]["verdict"] == "Passed" and cst["completedAt"]
    assert job_runner.jobs_seen == [
        "composer-1-stage-0",
        "composer-1-train-0",
        "composer-1-eval-0",
        "composer-1-analyze-0-0",
    ]
    reasons = [reason for _, reason, _ in events(kube_api)]
    for reason in ("CycleStarted", "StageStarted", "Staged", "Trained", "EvalPassed"):
        assert reason in reasons


def test_insufficient_data_leaves_no_checkpoint_and_says_why(
    kube_api: KubeAPI, job_runner: JobRunner, operator: Any, tmp_path: Path
) -> None:
    script_all(job_runner, tmp_path, stage=STAGE_INSUFFICIENT)
    setup_namespace(kube_api, tmp_path)
    kube_api.wait_for(lambda: condition(kube_api, "InsufficientData").get("status") == "True")
    kube_api.wait_for(lambda: kube_api.get(RTRL, "Checkpoint", "composer-1") is None)
    assert "12 interactions" in condition(kube_api, "InsufficientData")["message"]
    kube_api.wait_for(lambda: not kube_api.list("batch/v1", "Job"))
    # the round that deleted the Jobs writes the phase after them: read it once written
    kube_api.wait_for(lambda: status(kube_api, "RLCycle", NAME)["phase"] == "Idle")


@pytest.mark.parametrize("step", ["stage", "train", "eval"])
def test_a_failing_step_is_retried_then_fails_the_cycle_with_the_pods_reason(
    kube_api: KubeAPI, job_runner: JobRunner, operator: Any, tmp_path: Path, step: str
) -> None:
    script_all(job_runner, tmp_path, **{step: Fail(reason="OOMKilled", exit_code=137)})
    setup_namespace(kube_api, tmp_path)
    wait_phase(kube_api, "Checkpoint", "composer-1", "Failed")
    cst = status(kube_api, "Checkpoint", "composer-1")
    assert cst["reason"] == f"{step.title()}Failed"
    assert "OOMKilled (exit 137)" in cst["message"] and "2 attempt(s)" in cst["message"]
    assert [j for j in job_runner.jobs_seen if f"-{step}-" in j] == [
        f"composer-1-{step}-0",
        f"composer-1-{step}-1",
    ]
    kube_api.wait_for(lambda: condition(kube_api, "Degraded").get("status") == "True")
    dep = kube_api.get("apps/v1", "Deployment", "composer-vllm")
    assert dep is not None
    env = dep["spec"]["template"]["spec"]["containers"][0]["env"]
    assert (
        env[0]["value"]
        == deployment(tmp_path)["spec"]["template"]["spec"]["containers"][0]["env"][0]["value"]
    )  # the serving model is untouched


def test_rejected_by_eval(
    kube_api: KubeAPI, job_runner: JobRunner, operator: Any, tmp_path: Path
) -> None:
    script_all(job_runner, tmp_path, eval=EVAL_FAIL)
    setup_namespace(kube_api, tmp_path)
    wait_phase(kube_api, "Checkpoint", "composer-1", "Rejected")
    assert status(kube_api, "Checkpoint", "composer-1")["eval"]["verdict"] == "Failed"


def test_missing_deployment_and_secret_are_conditions_and_recover(
    kube_api: KubeAPI, job_runner: JobRunner, operator: Any, tmp_path: Path
) -> None:
    script_all(job_runner, tmp_path)
    kube_api.create(base_checkpoint(tmp_path))
    spec = rlcycle(tmp_path)["spec"]
    spec["storage"]["credentialsSecret"] = "s3-creds"
    kube_api.create(rlcycle(tmp_path, storage=spec["storage"]))
    kube_api.wait_for(
        lambda: condition(kube_api, "InvalidSpec").get("reason") == "DeploymentNotFound"
    )
    assert condition(kube_api, "InvalidSpec")["message"].startswith("spec.target.deployment:")
    kube_api.create(deployment(tmp_path))
    kube_api.wait_for(lambda: condition(kube_api, "InvalidSpec").get("reason") == "SecretNotFound")
    assert status(kube_api, "RLCycle", NAME)["phase"] == "Invalid"
    assert not kube_api.list("batch/v1", "Job")
    kube_api.create(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "s3-creds"},
            "stringData": {"AWS_ACCESS_KEY_ID": "AKIAEXAMPLE", "AWS_SECRET_ACCESS_KEY": "hush"},
        }
    )
    wait_phase(kube_api, "Checkpoint", "composer-1", "Promoted")
    assert condition(kube_api, "InvalidSpec")["status"] == "False"
    text = repr(kube_api.get(RTRL, "RLCycle", NAME)) + repr(events(kube_api))
    assert "hush" not in text and "AKIAEXAMPLE" not in text


def test_a_semantically_invalid_spec_is_marked_not_crashed_and_recovers(
    kube_api: KubeAPI, job_runner: JobRunner, operator: Any, tmp_path: Path
) -> None:
    script_all(job_runner, tmp_path)
    kube_api.create(deployment(tmp_path))
    kube_api.create(base_checkpoint(tmp_path))
    bad = rlcycle(tmp_path)
    bad["spec"]["rollout"]["analysis"]["maxDuration"] = "1s"  # passes the CRD, not the model
    kube_api.create(bad)
    kube_api.wait_for(lambda: condition(kube_api, "InvalidSpec").get("reason") == "SpecInvalid")
    assert "maxDuration" in condition(kube_api, "InvalidSpec")["message"]
    assert not kube_api.list("batch/v1", "Job")
    kube_api.patch(
        RTRL, "RLCycle", NAME, {"spec": {"rollout": {"analysis": {"maxDuration": "1h"}}}}
    )
    wait_phase(kube_api, "Checkpoint", "composer-1", "Promoted")
    assert status(kube_api, "RLCycle", NAME)["observedGeneration"] == 2


def test_suspend_then_trigger(
    kube_api: KubeAPI, job_runner: JobRunner, operator: Any, tmp_path: Path
) -> None:
    script_all(job_runner, tmp_path)
    setup_namespace(kube_api, tmp_path, suspend=True)
    wait_phase(kube_api, "RLCycle", NAME, "Suspended")
    assert kube_api.get(RTRL, "Checkpoint", "composer-1") is None
    kube_api.patch(RTRL, "RLCycle", NAME, {"spec": {"suspend": False}})
    wait_phase(kube_api, "Checkpoint", "composer-1", "Promoted")
    wait_phase(kube_api, "RLCycle", NAME, "Idle")
    # the next interval is an hour away; a trigger starts the next cycle now, once
    kube_api.patch(
        RTRL, "RLCycle", NAME, {"metadata": {"annotations": {"rtrl.io/trigger": "now-1"}}}
    )
    wait_phase(kube_api, "Checkpoint", "composer-2", "Promoted")
    kube_api.wait_for(lambda: status(kube_api, "RLCycle", NAME).get("lastTrigger") == "now-1")
    wait_phase(kube_api, "RLCycle", NAME, "Idle")
    assert kube_api.get(RTRL, "Checkpoint", "composer-3") is None


def test_cron_schedule_sets_next_run(
    kube_api: KubeAPI, job_runner: JobRunner, operator: Any, tmp_path: Path
) -> None:
    script_all(job_runner, tmp_path)
    setup_namespace(kube_api, tmp_path, schedule={"cron": "0 0 1 1 *"})
    kube_api.wait_for(lambda: status(kube_api, "RLCycle", NAME).get("nextRun"))
    assert status(kube_api, "RLCycle", NAME)["nextRun"].endswith("-01-01T00:00:00Z")
    assert status(kube_api, "RLCycle", NAME)["phase"] == "Idle"
    assert job_runner.jobs_seen == []


def test_history_limit_deletes_old_checkpoints(
    kube_api: KubeAPI, job_runner: JobRunner, operator: Any, tmp_path: Path
) -> None:
    script_all(job_runner, tmp_path)
    setup_namespace(kube_api, tmp_path, historyLimit=1)
    for n in (1, 2, 3):
        wait_phase(kube_api, "Checkpoint", f"composer-{n}", "Promoted")
        wait_phase(kube_api, "RLCycle", NAME, "Idle")
        trigger = {"metadata": {"annotations": {"rtrl.io/trigger": f"t{n}"}}}
        kube_api.patch(RTRL, "RLCycle", NAME, trigger)
    wait_phase(kube_api, "Checkpoint", "composer-4", "Promoted")
    kube_api.wait_for(lambda: kube_api.get(RTRL, "Checkpoint", "composer-2") is None)
    kube_api.wait_for(lambda: kube_api.get(RTRL, "Checkpoint", "composer-1") is None)
    names = {c["metadata"]["name"] for c in kube_api.list(RTRL, "Checkpoint")}
    # the base (registered by hand, never pruned), the serving one and its parent
    assert names == {"composer-0", "composer-3", "composer-4"}
