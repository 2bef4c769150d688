"""Crash safety: the real operator, as its own OS process, is SIGKILLed at each phase boundary
of a cycle, a fresh one is started, and the cycle must still complete with no duplicate Job
and no lost or duplicated Checkpoint (docs/operator.md, "How it decides").

The kill happens at an exact point: the emulator's ``after_write`` hook runs after a write is
applied and before it is answered, so the operator dies with that write done and nothing of
what it meant to do next. Then there is a kill while the stage Job runs, with the Job
finishing while the operator is down, or after the new one has looked at it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from tests.integration.conftest import KubeAPI

from rtrl_localkube.cycle_world import (
    NAME,
    RTRL,
    STAGE_OK,
    TRAIN_OK,
    commit_result,
    script_all,
    setup_namespace,
    status,
)
from rtrl_localkube.job_runner import JobRunner
from rtrl_localkube.outcomes import Succeed

pytestmark = pytest.mark.timeout(60)

CKPT = "composer-1"
JOBS = [f"{CKPT}-stage-0", f"{CKPT}-train-0", f"{CKPT}-eval-0", f"{CKPT}-analyze-0-0"]
NS_PATH = "/namespaces/default/"
DEPLOYMENT = "/apis/apps/v1/namespaces/default/deployments/composer-vllm"


class OperatorProcess:
    """``rtrl operator`` as a child process, all its runs logging into one file."""

    def __init__(self, kube_api: KubeAPI, workdir: Path) -> None:
        self.kube_api = kube_api
        self.workdir = workdir
        self.log_path = workdir / "operator.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.runs = 0

    def start(self) -> None:
        assert self.proc is None or self.proc.poll() is not None, "still running"
        self.runs += 1
        env = {
            **os.environ,
            "KUBECONFIG": os.fspath(self.kube_api.kubeconfig),
            "RTRL_RESYNC_SECONDS": "1",
            # rounds() counts the rounds that read the cluster: one a second at least (the
            # rounds woken in between read the watch cache)
            "RTRL_LIVE_READ_SECONDS": "1",
            "RTRL_ERROR_BACKOFF_SECONDS": "0.5",
            "PYTHONUNBUFFERED": "1",
        }
        argv = [sys.executable, "-m", "rtrl.cli", "operator", "--namespace"]
        argv += [self.kube_api.namespace, "--standalone", "--liveness", "none"]
        with self.log_path.open("ab") as log:
            log.write(f"===== operator run {self.runs} =====\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                argv,
                env=env,
                cwd=self.workdir,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def kill(self) -> None:
        """SIGKILL: no graceful shutdown, no last writes; returns once it is gone."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


Write = tuple[str, str, Any, dict[str, Any] | None]  # method, path, body, result


@dataclass
class CrashAt:
    """The emulator's ``after_write`` hook: records every applied write, and kills the
    operator right after the first write that ``boundary`` matches (once)."""

    operator: OperatorProcess
    boundary: Callable[[str, str, Any, dict[str, Any] | None], bool] | None
    writes: list[Write] = field(default_factory=list)
    fired: threading.Event = field(default_factory=threading.Event)
    errors: list[str] = field(default_factory=list)

    def __call__(self, method: str, path: str, body: Any, result: dict[str, Any] | None) -> None:
        try:
            self.writes.append((method, path, body, result))
            hit = self.boundary is not None and self.boundary(method, path, body, result)
            if hit and not self.fired.is_set():
                self.operator.kill()  # before the response: the writer never hears back
                self.fired.set()
        except Exception as exc:  # never fail the emulator's request: report it to the test
            self.errors.append(repr(exc))

    def created(self, plural: str) -> list[str]:
        """Names of the objects of ``plural`` created (successfully) in the namespace."""
        return [
            (result or {}).get("metadata", {}).get("name", "?")
            for method, path, _, result in self.writes
            if method == "POST" and path.endswith(f"{NS_PATH}{plural}")
        ]

    def deleted(self, plural: str) -> list[str]:
        return [
            path.rsplit("/", 1)[-1]
            for method, path, _, _ in self.writes
            if method == "DELETE" and f"{NS_PATH}{plural}/" in path
        ]


# --- the boundaries ----------------------------------------------------------------------------


def created(plural: str, name: str) -> Callable[..., bool]:
    def match(method: str, path: str, body: Any, result: dict[str, Any] | None) -> bool:
        return (
            method == "POST"
            and path.endswith(f"{NS_PATH}{plural}")
            and ((result or {}).get("metadata") or {}).get("name") == name
        )

    return match


def status_to(plural: str, name: str, phase: str) -> Callable[..., bool]:
    def match(method: str, path: str, body: Any, result: dict[str, Any] | None) -> bool:
        return (
            method == "PATCH"
            and path.endswith(f"{NS_PATH}{plural}/{name}/status")
            and isinstance(body, dict)
            and (body.get("status") or {}).get("phase") == phase
        )

    return match


BOUNDARIES = {
    # the Checkpoint exists; the RLCycle's status and the stage's children do not
    "checkpoint-created": created("checkpoints", CKPT),
    "stage-job-created": created("jobs", f"{CKPT}-stage-0"),
    # data summary written, train Job not yet created
    "checkpoint-training": status_to("checkpoints", CKPT, "Training"),
    "train-job-created": created("jobs", f"{CKPT}-train-0"),
    "checkpoint-evaluating": status_to("checkpoints", CKPT, "Evaluating"),
    "eval-job-created": created("jobs", f"{CKPT}-eval-0"),
    # eval summary written; Events and the RLCycle's status not yet
    "checkpoint-evaluated": status_to("checkpoints", CKPT, "Evaluated"),
    "checkpoint-canary": status_to("checkpoints", CKPT, "Canary"),
    "canary-created": created("deployments", "composer-vllm-canary"),
    "analysis-job-created": created("jobs", f"{CKPT}-analyze-0-0"),
    # the target serves the candidate; the canary is still there, the Checkpoint not Promoted
    "target-patched": lambda method, path, body, result: method == "PATCH" and path == DEPLOYMENT,
    "checkpoint-promoted": status_to("checkpoints", CKPT, "Promoted"),
    "rlcycle-idle": status_to("rlcycles", NAME, "Idle"),
}


# --- the test ------------------------------------------------------------------------------


@pytest.fixture
def operator(
    kube_api: KubeAPI, job_runner: JobRunner, deployment_controller: Any, tmp_path: Path
) -> Iterator[Any]:
    """The operator process (not started); killed before the job runner and the API stop."""
    workdir = tmp_path / "operator"
    workdir.mkdir()
    process = OperatorProcess(kube_api, workdir)
    try:
        yield process
    finally:
        process.kill()
        kube_api.emulator.after_write = None


def rounds(kube_api: KubeAPI) -> int:
    """Reconcile rounds that have read the cluster (live, not the watch cache) so far: a
    round's reads end with a GET
    of the target Deployment, which nothing else in these tests reads (the emulator logs every
    request; an idle round writes nothing, so the writes cannot tell)."""
    log = list(kube_api.emulator.request_log)
    return sum(1 for method, path in log if method == "GET" and path == DEPLOYMENT)


def explain(kube_api: KubeAPI, op: OperatorProcess, crash: CrashAt) -> str:
    jobs = [j["metadata"]["name"] for j in kube_api.list("batch/v1", "Job")]
    return (
        f"\nRLCycle status: {status(kube_api, 'RLCycle', NAME)}"
        f"\nCheckpoint {CKPT} status: {status(kube_api, 'Checkpoint', CKPT)}"
        f"\nJobs: {jobs}\nwrites: {[(m, p) for m, p, _, _ in crash.writes]}"
        f"\n--- operator log ---\n{op.log()[-6000:]}"
    )


def settle_and_check(
    kube_api: KubeAPI, job_runner: JobRunner, op: OperatorProcess, crash: CrashAt
) -> None:
    """The cycle ends Promoted and Idle, one full round later nothing else has happened,
    and every Job, Checkpoint and the canary Deployment was created once."""

    def why() -> str:
        return explain(kube_api, op, crash)

    kube_api.wait_for(
        lambda: status(kube_api, "Checkpoint", CKPT).get("phase") == "Promoted",
        timeout=25,
        message=why,
    )
    kube_api.wait_for(
        lambda: status(kube_api, "RLCycle", NAME).get("phase") == "Idle", timeout=10, message=why
    )
    # A round that read everything after the cycle ended (the resync is 1 s) must find
    # nothing to do: wait for two more rounds' reads (the first may have begun before).
    done = rounds(kube_api)
    kube_api.wait_for(lambda: rounds(kube_api) >= done + 2, timeout=8, message=why)
    time.sleep(0.2)  # the second round's writes, if any, follow its reads at once
    assert op.proc is not None and op.proc.poll() is None, f"the operator died{why()}"
    assert not crash.errors, crash.errors
    assert job_runner.jobs_seen == JOBS, why()
    assert crash.created("jobs") == JOBS, why()
    # composer-0 is the base the test registers; composer-1 is never recreated (not lost)
    assert crash.created("checkpoints") == ["composer-0", CKPT], why()
    assert crash.deleted("checkpoints") == [] and crash.deleted("jobs") == [], why()
    names = sorted(c["metadata"]["name"] for c in kube_api.list(RTRL, "Checkpoint"))
    assert names == ["composer-0", CKPT], why()
    cst = status(kube_api, "Checkpoint", CKPT)
    assert cst["data"]["interactions"] == STAGE_OK["interactions_used"], why()
    assert cst["training"]["steps"] == TRAIN_OK["summary"]["steps"], why()
    assert cst["eval"]["verdict"] == "Passed", why()
    st = status(kube_api, "RLCycle", NAME)
    assert st["cycle"] == 1 and st["candidate"] == CKPT and st["serving"] == CKPT, why()
    assert st["lastPromoted"] == CKPT, why()
    assert crash.created("deployments") == ["composer-vllm", "composer-vllm-canary"], why()
    assert kube_api.get("apps/v1", "Deployment", "composer-vllm-canary") is None, why()


@pytest.mark.parametrize("boundary", list(BOUNDARIES))
def test_killed_at_a_phase_boundary_the_restarted_operator_finishes_the_cycle(
    kube_api: KubeAPI, job_runner: JobRunner, operator: OperatorProcess, tmp_path: Path,
    boundary: str,
) -> None:  # fmt: skip
    crash = CrashAt(operator, BOUNDARIES[boundary])
    kube_api.emulator.after_write = crash
    script_all(job_runner, tmp_path)
    setup_namespace(kube_api, tmp_path)
    operator.start()
    kube_api.wait_for(
        crash.fired.is_set, timeout=20, message=lambda: explain(kube_api, operator, crash)
    )
    assert operator.proc is not None and operator.proc.returncode == -signal.SIGKILL
    operator.start()
    settle_and_check(kube_api, job_runner, operator, crash)


@pytest.mark.parametrize("finishes", ["while-down", "after-restart"])
def test_killed_while_the_stage_job_runs(
    kube_api: KubeAPI, job_runner: JobRunner, operator: OperatorProcess, tmp_path: Path,
    finishes: str,
) -> None:  # fmt: skip
    """The operator dies while the stage Job runs; the Job completes while no operator is
    there (its events go unheard), or after a new one has seen it running."""
    crash = CrashAt(operator, None)
    kube_api.emulator.after_write = crash
    restarted: list[int] = []  # rounds() when the new operator started
    commit = commit_result("stage", STAGE_OK, tmp_path / "results")

    def stage(job: dict[str, Any]) -> None:
        operator.kill()
        crash.fired.set()
        if finishes == "after-restart":  # the new operator reads the Job while it runs
            kube_api.wait_for(
                lambda: restarted and rounds(kube_api) > restarted[0],
                timeout=20,
                message="the restarted operator never reconciled",
            )
        commit(job)

    script_all(job_runner, tmp_path)
    job_runner.script("*-stage-*", Succeed(before=stage))
    setup_namespace(kube_api, tmp_path)
    operator.start()
    kube_api.wait_for(
        crash.fired.is_set, timeout=20, message=lambda: explain(kube_api, operator, crash)
    )
    if finishes == "while-down":
        kube_api.wait_for(
            lambda: (
                (kube_api.get("batch/v1", "Job", JOBS[0]) or {}).get("status", {}).get("succeeded")
            ),
            timeout=10,
        )
        time.sleep(0.2)
    restarted.append(rounds(kube_api))
    operator.start()
    settle_and_check(kube_api, job_runner, operator, crash)
    assert status(kube_api, "Checkpoint", CKPT)["data"]["tokens"] == 90000
