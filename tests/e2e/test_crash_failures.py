"""Crash coverage of the paths where a cycle does not reach its canary, on the real control
plane (see tests/e2e/crash.py and src/rtrl_localkube/crashrun.py): a step retried after a
failure and then the candidate rejected by eval, a step failing for good, a step that
succeeded without committing its result; and kills while each step's Job runs, the Job
finishing while no operator is there or after a new one has seen it running."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rtrl_localkube.api import KubeAPI
from rtrl_localkube.crashrun import CrashSweep
from rtrl_localkube.cycle_world import (
    EVAL_FAIL,
    RESULTS,
    STAGE_OK,
    commit_result,
    script_all,
    setup_namespace,
)
from rtrl_localkube.outcomes import Fail, Succeed
from tests.e2e import crash
from tests.e2e.crash import CKPT, ended, killed, phase

pytestmark = pytest.mark.timeout(240)
forkserver, sweep = crash.forkserver, crash.sweep  # the fixtures


def job_done(kube: KubeAPI, name: str) -> bool:
    return bool(((kube.get("batch/v1", "Job", name) or {}).get("status") or {}).get("succeeded"))


def test_a_retried_train_then_eval_rejected(
    sweep: CrashSweep, kube_api: KubeAPI, job_runner: Any, tmp_path: Path
) -> None:
    script_all(job_runner, tmp_path, eval=EVAL_FAIL)
    job_runner.script(f"{CKPT}-train-0", Fail(reason="OOMKilled", exit_code=137))
    setup_namespace(kube_api, tmp_path)
    sweep.sweeping = True
    sweep.run(lambda: ended(sweep, CKPT, "Rejected"), timeout=150)
    sweep.settle()
    assert sweep.ledger.created("Job") == [
        f"{CKPT}-stage-0", f"{CKPT}-train-0", f"{CKPT}-train-1", f"{CKPT}-eval-0"
    ], sweep.explain()  # fmt: skip
    assert sweep.status("Checkpoint", CKPT)["eval"]["verdict"] == "Failed"
    assert sweep.status()["serving"] == "composer-0"
    assert {("POST", "jobs"), ("PATCH", "checkpoints"), ("PATCH", "rlcycles")} <= killed(sweep)


@pytest.mark.parametrize("how", ["fails-twice", "no-result"])
def test_a_step_that_fails_the_cycle(
    sweep: CrashSweep, kube_api: KubeAPI, job_runner: Any, tmp_path: Path, how: str
) -> None:
    """Stage fails both attempts (backoffLimit 1), or succeeds without a result."""
    outcome = Fail(reason="Error", exit_code=1) if how == "fails-twice" else Succeed()
    script_all(job_runner, tmp_path, stage=outcome)
    setup_namespace(kube_api, tmp_path)
    sweep.sweeping = True
    sweep.run(lambda: ended(sweep, CKPT, "Failed"), timeout=120)
    sweep.settle()
    reason = sweep.status("Checkpoint", CKPT)["reason"]
    assert reason == ("StageFailed" if how == "fails-twice" else "ResultMissing")
    jobs = [f"{CKPT}-stage-0"] + ([f"{CKPT}-stage-1"] if how == "fails-twice" else [])
    assert sweep.ledger.created("Job") == jobs, sweep.explain()
    assert sweep.ledger.created("Checkpoint") == ["composer-0", CKPT]


def test_killed_while_each_step_runs(
    sweep: CrashSweep, kube_api: KubeAPI, job_runner: Any, tmp_path: Path
) -> None:
    """Each step's pod kills the operator as it starts, then commits its result: stage and
    eval finish while no operator runs (their events go unheard), train and the analysis
    after a new operator has read their Job running."""
    results = tmp_path / "results"

    def killing(step: str, after_restart: bool) -> Succeed:
        commit = commit_result(step.split("-", 1)[0], RESULTS[step.split("-", 1)[0]], results)

        def run(job: dict[str, Any]) -> None:
            name = job["metadata"]["name"]
            sweep.kill_while_running(None if after_restart else lambda: job_done(kube_api, name))
            if after_restart:  # the sweep's loop restarts it; wait until it has looked
                kube_api.wait_for(lambda: sweep.rounds() >= 2, timeout=30,
                                  message=sweep.explain)  # fmt: skip
            commit(job)

        return Succeed(before=run)

    script_all(job_runner, tmp_path)
    for step, after in (("stage", False), ("train", True), ("eval", False), ("analyze", True)):
        job_runner.script(f"{CKPT}-{step}-0" if step != "analyze" else f"{CKPT}-analyze-0-0",
                          killing(step, after))  # fmt: skip
    setup_namespace(kube_api, tmp_path)
    sweep.run(lambda: ended(sweep, CKPT, "Promoted"), timeout=150)
    sweep.settle()
    assert sweep.kills_while_running == 4
    assert sweep.ledger.created("Job") == [
        f"{CKPT}-stage-0", f"{CKPT}-train-0", f"{CKPT}-eval-0", f"{CKPT}-analyze-0-0"
    ], sweep.explain()  # fmt: skip
    cst = sweep.status("Checkpoint", CKPT)
    assert cst["data"]["interactions"] == STAGE_OK["interactions_used"]
    assert phase(sweep, "Checkpoint", "composer-0") == "Superseded"
