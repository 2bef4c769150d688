"""``rtrl operator`` as the process a Deployment runs, on the real control plane: its
liveness endpoint, and two replicas sharing a KopfPeering, of which exactly one acts while
the other stands by and takes over when the active one dies, and a replica that acts on a
stale view (a split brain) cannot undo the active one's writes."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from rtrl.core.api.policy import UNRESTRICTED
from rtrl.kube.apply import apply, write_status
from rtrl.kube.cache import CACHED_KINDS, ObjectCache
from rtrl.kube.cached_client import CachingClient
from rtrl.kube.client import KubeClient, KubeError
from rtrl.kube.observe import observe
from rtrl.planning import PatchStatus, plan
from rtrl_localkube.cycle_world import (
    NAME,
    RESULTS,
    RTRL,
    base_checkpoint,
    commit_result,
    deployment,
    rlcycle,
    script_all,
    setup_namespace,
    status,
    wait_phase,
)
from rtrl_localkube.job_runner import JobRunner
from rtrl_localkube.outcomes import Succeed
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
def replicas(
    kube_api: KubeAPI, admin: Cli, release: str, tmp_path: Path
) -> Iterator[list[Replica]]:
    # ``release``: the chart's CRDs (a test run alone installs them here)
    # kopf's peering CRDs, as the chart installs them for more than one replica
    admin.kubectl("apply", "-f", "charts/rtrl-operator/files/kopf-peering-crds.yaml")
    admin.wait_established("crd/kopfpeerings.kopf.dev")
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
    # kopf starts a peered operator paused until it has seen the peering, and resumes it if no
    # peer of a higher priority is in it: a low replica that started first (the high one
    # slower to import, on a loaded machine) acts until it sees the high one's keep-alive.
    # From then on the lower-priority replica stays paused while the higher one is alive
    # (asserted below: it never acts).
    kube_api.wait_for(lambda: standing_by(kube_api, low), timeout=30, message=logs)
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


def standing_by(kube_api: KubeAPI, low: Replica) -> bool:
    """The high replica is in the peering, and the low one is paused: it never resumed, or
    paused again since (kopf logs both)."""
    peers = (kube_api.get("kopf.dev/v1", "KopfPeering", "rtrl") or {}).get("status") or {}
    high = any(isinstance(p, dict) and p.get("priority") == 200 for p in peers.values())
    out = low.output()
    return high and out.rfind("Resuming operations") <= out.rfind("Pausing operations")


def stale_view(kube: KubeAPI, client: KubeClient, old: dict[str, Any]) -> CachingClient:
    """What a replica whose Checkpoint watch lags sees: every kind as it is now, but the
    Checkpoint ``old`` as it was (kopf's watch streams, one per kind, lag independently)."""
    cache = ObjectCache()
    view = CachingClient(client, cache)
    name = old["metadata"]["name"]
    for kind in CACHED_KINDS:
        with cache.request() as mark:
            items, _ = view.list_with_version(kind, kube.namespace)
            if kind == "Checkpoint":
                items = [old if i["metadata"]["name"] == name else i for i in items]
            cache.absorb_list(kind, kube.namespace, None, items, mark)
    cache.mark_synced()
    return view


def test_a_replica_with_a_stale_view_cannot_undo_what_the_active_one_did(
    kube_api: KubeAPI, job_runner: JobRunner, operator: Any, tmp_path: Path
) -> None:
    """kopf's peering is no fencing lease: a replica stalled past the peering lifetime (a
    long GC pause, a starved node) resumes and acts on what it saw before, while the other
    already took over. Its round here sees the train Job succeeded but the Checkpoint still
    Training, after the active operator promoted it: it decides to record the training and
    move the Checkpoint to Evaluating. That write must be refused (409), not regress a
    Promoted Checkpoint into a running phase the operator can never leave (seen in CI)."""
    release = threading.Event()
    write_train = commit_result("train", RESULTS["train"], tmp_path / "results")

    def train(job: dict[str, Any]) -> None:
        release.wait(60)
        write_train(job)

    script_all(job_runner, tmp_path, train=Succeed(before=train))
    setup_namespace(kube_api, tmp_path)
    training = kube_api.wait_for(
        lambda: (
            "composer-1-train-0" in job_runner.jobs_seen
            and (ck := kube_api.get(RTRL, "Checkpoint", "composer-1"))
            and ck["status"].get("phase") == "Training"
            and ck
        ),
        message=operator.output,
    )
    release.set()
    wait_phase(kube_api, "Checkpoint", "composer-1", "Promoted")
    kube_api.wait_for(lambda: status(kube_api, "RLCycle", NAME).get("phase") == "Idle")

    view = stale_view(kube_api, KubeClient(kube_api.api_client), training)
    rlc = view.get("RLCycle", kube_api.namespace, NAME)
    assert rlc is not None
    decided = plan(observe(view, rlc, UNRESTRICTED), datetime.now(UTC))
    writes = [a for a in decided.actions if isinstance(a, PatchStatus) and a.kind == "Checkpoint"]
    assert [(a.name, a.status.get("phase")) for a in writes] == [("composer-1", "Evaluating")]
    with pytest.raises(KubeError) as refused:
        apply(view, rlc, decided.actions)
    assert refused.value.status == 409
    assert status(kube_api, "Checkpoint", "composer-1")["phase"] == "Promoted"

    # the RLCycle's status write is conditional too: changed since the view read it (a
    # user's trigger), it is refused
    patch: dict[str, Any] = {"metadata": {"annotations": {"rtrl.io/trigger": "after-stale"}}}
    kube_api.patch(RTRL, "RLCycle", NAME, patch)
    with pytest.raises(KubeError) as refused:
        write_status(view, rlc, decided.status)
    assert refused.value.status == 409

    # and the active operator carries on: the trigger's cycle runs
    wait_phase(kube_api, "Checkpoint", "composer-2", "Promoted")
