"""Crash coverage of every path, on the real control plane: the operator (``rtrl operator``
with the chart's ServiceAccount token, each run a fresh process) is SIGKILLed right after
each of its writes in turn, through a proxy in front of the real kube-apiserver
(src/rtrl_localkube/crashrun.py), and restarted; the path must still end as it does without
kills, with the invariants of src/rtrl_localkube/invariants.py holding after every restart
and at the end. Steps' pods are scripted by the kubelet stand-in (their canned results).
This module: the happy path, every write of it. The other paths: test_crash_*.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rtrl_localkube.api import KubeAPI
from rtrl_localkube.crashrun import CrashSweep
from rtrl_localkube.cycle_world import (
    ANALYSIS_PROMOTE,
    NAME,
    commit_result,
    script_all,
    setup_namespace,
)
from rtrl_localkube.outcomes import Succeed
from tests.e2e import crash
from tests.e2e.crash import CANARY, CKPT, exists, killed, phase

pytestmark = pytest.mark.timeout(240)


forkserver, sweep = crash.forkserver, crash.sweep  # the fixtures


def test_happy_path_with_a_continue_and_a_second_canary_step(
    sweep: CrashSweep, kube_api: KubeAPI, job_runner: Any, tmp_path: Path
) -> None:
    """Every write of a cycle: the Checkpoint, its ConfigMap, the step Jobs, the train
    Service, each status change, the canary, its analysis saying continue, step 2 (50%),
    promote: the target patched, the canary deleted, the parent Superseded, Idle."""
    script_all(job_runner, tmp_path)
    wait = {**ANALYSIS_PROMOTE, "decision": "continue", "reasons": ["inconclusive"]}
    job_runner.script(
        "*-analyze-0-*", Succeed(before=commit_result("analyze", wait, tmp_path / "results"))
    )
    setup_namespace(kube_api, tmp_path)
    sweep.sweeping = True

    def done() -> bool:
        return (
            phase(sweep, "Checkpoint", CKPT) == "Promoted"
            and phase(sweep, "RLCycle", NAME) == "Idle"
            and not exists(kube_api, "Deployment", CANARY)
        )

    sweep.run(done, timeout=200)
    sweep.settle()
    ledger = sweep.ledger
    assert ledger.created("Job") == [
        f"{CKPT}-stage-0", f"{CKPT}-train-0", f"{CKPT}-eval-0", f"{CKPT}-analyze-0-0",
        f"{CKPT}-analyze-1-0",
    ], sweep.explain()  # fmt: skip
    assert ledger.created("Checkpoint") == ["composer-0", CKPT]
    records = sweep.status("Checkpoint", CKPT)["rollout"]
    assert [(r["weight"], r["decision"]) for r in records] == [(25, "continue"), (50, "promote")]
    assert phase(sweep, "Checkpoint", "composer-0") == "Superseded"
    st = sweep.status()
    assert st["serving"] == CKPT and st["lastPromoted"] == CKPT and st["canaryWeight"] == 0
    expected = {
        ("POST", "checkpoints"), ("POST", "configmaps"), ("POST", "services"), ("POST", "jobs"),
        ("POST", "deployments"), ("PATCH", "deployments"), ("DELETE", "deployments"),
        ("PATCH", "rlcycles"), ("PATCH", "checkpoints"),
    }  # fmt: skip
    assert expected <= killed(sweep), sorted(expected - killed(sweep))
    print(f"happy path: {sweep.runs} runs, {len(sweep.kills)} kills after writes")
