"""The canary rollout under the real operator against the emulated API: steps and promotion,
rollback on harm, the "asks instead of edits" guardrail and a sample-ratio mismatch judged by
the real ``rtrl-job analyze`` on shards written for each arm, a canary that never becomes
ready, and manual rollback by annotation and by ``spec.pin``."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from rtrl.core.shards import write_shards
from rtrl.planning.timeutil import parse_time
from rtrl_localkube.cycle_world import (
    ANALYSIS_ROLLBACK,
    NAME,
    RTRL,
    base_uri,
    condition,
    events,
    rlcycle,
    script_all,
    setup_namespace,
    status,
    wait_phase,
)
from rtrl_localkube.job_runner import JobRunner
from rtrl_localkube.outcomes import Hang, Run
from tests.integration.conftest import KubeAPI
from tests.rtrl_trainer.helpers import rows

pytestmark = pytest.mark.timeout(120)
CKPT = "composer-1"


def target_env(kube_api: KubeAPI, deployment: str = "composer-vllm") -> dict[str, str]:
    dep = kube_api.get("apps/v1", "Deployment", deployment) or {}
    env = dep["spec"]["template"]["spec"]["containers"][0]["env"]
    return {e["name"]: e["value"] for e in env}


def test_canary_steps_then_promotes(
    kube_api: KubeAPI, job_runner: JobRunner, operator: Any, tmp_path: Path
) -> None:
    from rtrl_localkube.cycle_world import ANALYSIS_CONTINUE, commit_result
    from rtrl_localkube.outcomes import Succeed

    script_all(job_runner, tmp_path)
    wait = ANALYSIS_CONTINUE
    job_runner.script(
        "*-analyze-0-*", Succeed(before=commit_result("analyze", wait, tmp_path / "results"))
    )
    setup_namespace(kube_api, tmp_path)
    kube_api.wait_for(
        lambda: kube_api.get("apps/v1", "Deployment", "composer-vllm-canary"),
        timeout=60,  # stage, train and eval first
        message=lambda: f"no canary; checkpoint: {status(kube_api, 'Checkpoint', CKPT)}",
    )
    canary = kube_api.get("apps/v1", "Deployment", "composer-vllm-canary")
    assert canary is not None
    env = {
        e["name"]: e["value"] for e in canary["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    ck = kube_api.get(RTRL, "Checkpoint", CKPT)
    assert ck is not None
    assert env == {"MODEL_URI": ck["spec"]["uri"], "RTRL_CHECKPOINT_ID": CKPT}
    assert canary["spec"]["template"]["metadata"]["labels"]["rtrl.io/arm"] == "canary"
    wait_phase(kube_api, "Checkpoint", CKPT, "Promoted")
    records = status(kube_api, "Checkpoint", CKPT)["rollout"]
    assert [r["weight"] for r in records] == [25, 50]
    assert [r["decision"] for r in records] == ["continue", "promote"]
    assert target_env(kube_api)["MODEL_URI"] == ck["spec"]["uri"]
    assert target_env(kube_api)["RTRL_CHECKPOINT_ID"] == CKPT
    kube_api.wait_for(lambda: kube_api.get("apps/v1", "Deployment", "composer-vllm-canary") is None)
    assert status(kube_api, "Checkpoint", "composer-0")["phase"] == "Superseded"
    st = status(kube_api, "RLCycle", NAME)
    assert st["serving"] == CKPT and st["lastPromoted"] == CKPT
    reasons = [r for _, r, _ in events(kube_api)]
    assert {"CanaryStarted", "CanaryStep", "AnalysisPromote", "Promoted"} <= set(reasons)


def test_rollback_on_harm_keeps_stable_serving(
    kube_api: KubeAPI, job_runner: JobRunner, operator: Any, tmp_path: Path
) -> None:
    script_all(job_runner, tmp_path, analyze=ANALYSIS_ROLLBACK)
    setup_namespace(kube_api, tmp_path)
    wait_phase(kube_api, "Checkpoint", CKPT, "RolledBack")
    cst = status(kube_api, "Checkpoint", CKPT)
    assert "worse" in cst["message"] and cst["rollout"][0]["metrics"]
    assert target_env(kube_api)["MODEL_URI"] == base_uri(tmp_path)
    kube_api.wait_for(lambda: kube_api.get("apps/v1", "Deployment", "composer-vllm-canary") is None)
    assert status(kube_api, "RLCycle", NAME)["serving"] == "composer-0"


def arm_rows(checkpoint: str, n: int, start: Any, *, seed: int, edit_rate: float,
             clarification: float) -> pa.Table:  # fmt: skip
    """``n`` interactions of ``checkpoint`` created within 2 s after ``start``, matured 0.5 s
    later."""
    rng = np.random.default_rng(seed)
    created = [start + timedelta(seconds=2 * i / n) for i in range(n)]
    return rows(
        n,
        interaction_id=[f"{checkpoint}-{i:06d}" for i in range(n)],
        checkpoint_id=checkpoint,
        created_at=created,
        feedback_at=[c + timedelta(seconds=0.5) for c in created],
        edit_persisted=(rng.random(n) < 0.6).astype(float).tolist(),
        dissatisfied_followup=(rng.random(n) < 0.1).tolist(),
        latency_ms=(1000 * rng.lognormal(0, 0.6, n)).tolist(),
        tool_calls=2,
        invalid_tool_calls=(rng.random(n) < 0.05).astype(int).tolist(),
        asked_clarification=(rng.random(n) < clarification).tolist(),
        edits_proposed=(rng.random(n) < edit_rate).astype(int).tolist(),
    )


@pytest.mark.parametrize(
    ("canary_rows", "canary_behaviour", "expect"),
    [
        # the policy learnt to ask instead of editing: the guardrails trip
        (2000, {"edit_rate": 0.4, "clarification": 0.4}, "clarification_rate"),
        # the canary got 20% of the traffic while the split says 50%
        (500, {"edit_rate": 0.8, "clarification": 0.05}, "sample ratio mismatch"),
    ],
)
def test_the_real_analysis_rolls_back(  # noqa: PLR0917 - pytest passes fixtures by name
    kube_api: KubeAPI, job_runner: JobRunner, operator: Any, tmp_path: Path,
    canary_rows: int, canary_behaviour: dict[str, float], expect: str,
) -> None:  # fmt: skip
    script_all(job_runner, tmp_path, analyze=Run())
    shards = tmp_path / "interactions"
    spec = rlcycle(tmp_path)["spec"]
    spec["data"]["shards"] = shards.as_uri() + "/"
    spec["data"]["maturity"] = "1s"
    spec["rollout"]["steps"] = [{"weight": 25, "minDuration": "6s"}]
    setup_namespace(kube_api, tmp_path, data=spec["data"], rollout=spec["rollout"])
    # The analysis counts a step's interactions from when the canary is ready at its weight.
    start = kube_api.wait_for(
        lambda: parse_time(
            ((status(kube_api, "Checkpoint", CKPT).get("rollout") or [{}])[0]).get("readyAt")
        ),
        timeout=30,
    )
    # one stable pod and one canary pod: the split is 50%
    write_shards(
        pa.concat_tables(
            [
                arm_rows("composer-0", 2000, start, seed=1, edit_rate=0.8, clarification=0.05),
                arm_rows(CKPT, canary_rows, start, seed=2, **canary_behaviour),
            ]
        ),
        shards,
        partition_by=("checkpoint",),
    )
    wait_phase(kube_api, "Checkpoint", CKPT, "RolledBack", timeout=60)
    message = status(kube_api, "Checkpoint", CKPT)["message"]
    assert expect in message, message
    assert target_env(kube_api)["MODEL_URI"] == base_uri(tmp_path)


def test_a_canary_that_never_becomes_ready_is_rolled_back(
    kube_api: KubeAPI, job_runner: JobRunner, deployment_controller: Any, operator: Any,
    tmp_path: Path,
) -> None:  # fmt: skip
    deployment_controller.never_ready = ["*-canary"]
    script_all(job_runner, tmp_path)
    spec = rlcycle(tmp_path)["spec"]
    spec["rollout"]["readyTimeout"] = "2s"
    setup_namespace(kube_api, tmp_path, rollout=spec["rollout"])
    wait_phase(kube_api, "Checkpoint", CKPT, "RolledBack")
    assert status(kube_api, "Checkpoint", CKPT)["message"] == "canary not ready within 2s"
    assert not [j for j in job_runner.jobs_seen if "analyze" in j]


@pytest.mark.parametrize("how", ["annotation", "pin"])
def test_manual_rollback_mid_canary(
    kube_api: KubeAPI, job_runner: JobRunner, operator: Any, tmp_path: Path, how: str
) -> None:
    script_all(job_runner, tmp_path, analyze=Hang())
    setup_namespace(kube_api, tmp_path)
    kube_api.wait_for(lambda: kube_api.get("batch/v1", "Job", f"{CKPT}-analyze-0-0"))
    if how == "annotation":
        patch = {"metadata": {"annotations": {"rtrl.io/rollback": "oops"}}}
    else:
        patch = {"spec": {"pin": "composer-0"}}
    kube_api.patch(RTRL, "RLCycle", NAME, patch)
    wait_phase(kube_api, "Checkpoint", CKPT, "RolledBack")
    assert target_env(kube_api)["MODEL_URI"] == base_uri(tmp_path)
    kube_api.wait_for(lambda: kube_api.get("apps/v1", "Deployment", "composer-vllm-canary") is None)
    kube_api.wait_for(lambda: kube_api.get("batch/v1", "Job", f"{CKPT}-analyze-0-0") is None)
    if how == "pin":
        wait_phase(kube_api, "RLCycle", NAME, "Pinned")
        assert condition(kube_api, "Progressing")["reason"] == "Pinned"
    else:
        kube_api.wait_for(lambda: status(kube_api, "RLCycle", NAME).get("lastRollback") == "oops")


def test_manual_rollback_with_the_kubectl_plugin(
    kube_api: KubeAPI, job_runner: JobRunner, operator: Any, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    from rtrl.kubectl_plugin import main as kubectl_rtrl

    script_all(job_runner, tmp_path, analyze=Hang())
    setup_namespace(kube_api, tmp_path)
    wait_phase(kube_api, "RLCycle", NAME, "Canary")
    kube_api.wait_for(lambda: kube_api.get("batch/v1", "Job", f"{CKPT}-analyze-0-0"))
    assert kubectl_rtrl(["rollback", NAME, "--kubeconfig", str(kube_api.kubeconfig)]) == 0
    wait_phase(kube_api, "Checkpoint", CKPT, "RolledBack")
    assert "rtrl.io/rollback=" in status(kube_api, "Checkpoint", CKPT)["message"]
    assert target_env(kube_api)["MODEL_URI"] == base_uri(tmp_path)
    assert kubectl_rtrl(["status", NAME, "--kubeconfig", str(kube_api.kubeconfig)]) == 0
    assert "RolledBack" in capsys.readouterr().out
