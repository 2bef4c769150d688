"""``rtrl operator`` as the process a Deployment runs, on the real control plane: its
liveness endpoint, and two replicas sharing a KopfPeering, of which exactly one acts while
the other stands by and takes over when the active one dies."""

from __future__ import annotations

import os
import signal
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rtrl_localkube.cycle_world import (
    NAME,
    RTRL,
    base_checkpoint,
    deployment,
    rlcycle,
    script_all,
    status,
)
from rtrl_localkube.job_runner import JobRunner
from rtrl_localkube.processes import free_port
from rtrl_localkube.tools import Cli
from tests.conftest import console_script
from tests.integration.conftest import KubeAPI

pytestmark = pytest.mark.timeout(120)


class Replica:
    """One operator process, its output in a file (printed when a test fails)."""

    def __init__(self, kube_api: KubeAPI, log: Path, *, priority: int):
        self.port = free_port()
        self.log = log
        env = dict(
            os.environ,
            KUBECONFIG=os.fspath(kube_api.kubeconfig),
            RTRL_RESYNC_SECONDS="1",
            RTRL_PEERING_LIFETIME="3",
        )
        args = [
            console_script("rtrl"), "operator", "--namespace", kube_api.namespace,
            "--peering", "rtrl", "--priority", str(priority),
            "--liveness", f"http://127.0.0.1:{self.port}/healthz",
        ]  # fmt: skip
        with log.open("wb") as out:
            self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env)

    def healthy(self) -> bool:
        try:
            url = f"http://127.0.0.1:{self.port}/healthz"
            with urllib.request.urlopen(url, timeout=1) as response:
                return int(response.status) == 200
        except OSError:
            return False

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)


@pytest.fixture
def replicas(kube_api: KubeAPI, admin: Cli, tmp_path: Path) -> Iterator[list[Replica]]:
    # kopf's peering CRDs, as the chart installs them for more than one replica
    admin.kubectl("apply", "-f", "charts/rtrl-operator/files/kopf-peering-crds.yaml")
    admin.kubectl("wait", "--for=condition=Established", "crd/kopfpeerings.kopf.dev")
    kube_api.create(
        {"apiVersion": "kopf.dev/v1", "kind": "KopfPeering", "metadata": {"name": "rtrl"}}
    )
    started = [
        Replica(kube_api, tmp_path / "replica-high.log", priority=200),
        Replica(kube_api, tmp_path / "replica-low.log", priority=100),
    ]
    try:
        yield started
    finally:
        for replica in started:
            replica.kill()


def test_two_replicas_one_active_and_failover(
    kube_api: KubeAPI,
    job_runner: JobRunner,
    deployment_controller: Any,
    replicas: list[Replica],
    tmp_path: Path,
) -> None:
    high, low = replicas

    def logs() -> str:
        return "\n".join(f"--- {r.log.name}\n{r.output()[-4000:]}" for r in replicas)

    kube_api.wait_for(lambda: high.healthy() and low.healthy(), timeout=30, message=logs)
    # kopf starts a peered operator paused until it has seen the peering; the lower-priority
    # replica stays paused while the higher one is alive (asserted below: it never acts).
    script_all(job_runner, tmp_path)
    kube_api.create(deployment(tmp_path))
    kube_api.create(base_checkpoint(tmp_path))
    kube_api.create(rlcycle(tmp_path))
    kube_api.wait_for(
        lambda: status(kube_api, "Checkpoint", "composer-1").get("phase") == "Promoted",
        timeout=30,
        message=logs,
    )
    assert job_runner.jobs_seen == [
        "composer-1-stage-0",
        "composer-1-train-0",
        "composer-1-eval-0",
        "composer-1-analyze-0-0",
    ]
    assert "created Job" in high.output() and "created Job" not in low.output()

    high.kill()  # the active replica dies; the standby takes over after the peering lifetime
    kube_api.wait_for(lambda: status(kube_api, "RLCycle", NAME).get("phase") == "Idle")
    patch: dict[str, Any] = {"metadata": {"annotations": {"rtrl.io/trigger": "after-failover"}}}
    kube_api.patch(RTRL, "RLCycle", NAME, patch)
    kube_api.wait_for(
        lambda: status(kube_api, "Checkpoint", "composer-2").get("phase") == "Promoted",
        timeout=40,
        message=logs,
    )
    assert "created Job composer-2-stage-0" in low.output()
    assert job_runner.jobs_seen[4:] == [
        "composer-2-stage-0", "composer-2-train-0", "composer-2-eval-0", "composer-2-analyze-0-0"
    ]  # fmt: skip
