"""Crash coverage of ``spec.capture`` on the real control plane (see test_crash_paths.py):
the operator is SIGKILLed right after each of its writes in turn and restarted, through a
whole cycle with capture on. Every write of it must be done once: the sidecar injected with
one rollout of the target, the seal CronJob created once, promotion moving the engine and
the sidecar together with one more, and the canary tagged with the candidate."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rtrl.planning.manifests.capture import SIDECAR
from rtrl_localkube.api import KubeAPI
from rtrl_localkube.crashrun import CrashSweep
from rtrl_localkube.cycle_world import NAME, script_all, setup_namespace
from rtrl_localkube.outcomes import Hang, Succeed
from tests.e2e import crash
from tests.e2e.crash import CANARY, CKPT, exists, killed, phase

pytestmark = pytest.mark.timeout(300)
TARGET = "composer-vllm"

forkserver, sweep = crash.forkserver, crash.sweep  # the fixtures


def sidecar_env(kube: KubeAPI, name: str) -> dict[str, str]:
    dep = kube.get("apps/v1", "Deployment", name) or {}
    containers = dep["spec"]["template"]["spec"]["containers"]
    found = next(c for c in containers if c["name"] == SIDECAR)
    return {e["name"]: e.get("value", "") for e in found.get("env") or []}


def test_capture_through_a_cycle_with_a_kill_after_every_write(
    sweep: CrashSweep, kube_api: KubeAPI, job_runner: Any, tmp_path: Path
) -> None:
    script_all(job_runner, tmp_path)
    job_runner.script(f"{TARGET}-*", Hang())  # the serving pods stay up as they are
    job_runner.script(f"{NAME}-seal-*", Succeed())
    capture = {"events": (tmp_path / "events").as_uri() + "/", "image": "rtrl-serving:test"}
    setup_namespace(kube_api, tmp_path, capture=capture)
    sweep.sweeping = True
    canary_env: dict[str, str] = {}

    def done() -> bool:
        if exists(kube_api, "Deployment", CANARY) and not canary_env:
            canary_env.update(sidecar_env(kube_api, CANARY))
        return (
            phase(sweep, "Checkpoint", CKPT) == "Promoted"
            and phase(sweep, "RLCycle", NAME) == "Idle"
            and not exists(kube_api, "Deployment", CANARY)
        )

    sweep.run(done, timeout=260)
    sweep.settle()
    target = kube_api.get("apps/v1", "Deployment", TARGET) or {}
    # created, the sidecar injected, the candidate promoted: three templates, however many
    # times the operator died after a write (each patch applies to the template it was
    # planned from, and none is planned when the template already says it)
    assert target["metadata"]["generation"] == 3, sweep.explain()
    env = sidecar_env(kube_api, TARGET)
    assert (env["RTRL_ARM"], env["RTRL_CHECKPOINT_ID"]) == ("stable", CKPT)
    if canary_env:  # seen while it ran (a kill may hide a short-lived canary from the poll)
        assert (canary_env["RTRL_ARM"], canary_env["RTRL_CHECKPOINT_ID"]) == ("canary", CKPT)
    assert [c["metadata"]["name"] for c in kube_api.list("batch/v1", "CronJob")] == [f"{NAME}-seal"]
    expected = {("PATCH", "deployments"), ("POST", "cronjobs")}
    assert expected <= killed(sweep), sorted(expected - killed(sweep))
    print(f"capture: {sweep.runs} runs, {len(sweep.kills)} kills after writes")
