"""Training on two nodes, on the real control plane: the operator's own Indexed train Job for
``spec.training.nodes: 2`` (CPU: ``gpusPerNode: 0``), its two pods run by the kubelet stand-in
as real ``rtrl-job train`` processes (DeepSpeed ZeRO-2 over gloo) that meet through the
headless Service's names (resolved from its EndpointSlices: ``src/rtrl_localkube/podnet.py``),
and one pod killed mid-run: the Job fails as a whole, the operator's retry (a new Job, the
same ``--out``) resumes from the last committed DeepSpeed state, and the published weights
are exactly those of the uninterrupted two-pod run.

The stage step is scripted: it commits a staged set the test builds, the same in every
namespace, so that both runs train on the same rows. The eval step hangs: what follows
training is tested elsewhere (test_cycle.py).
"""

from __future__ import annotations

import json
import os
import secrets
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kubernetes
import pytest
from kubernetes.dynamic import DynamicClient

from rtrl.core.store import open_store
from rtrl_localkube.api import KubeAPI
from rtrl_localkube.controlplane import ControlPlane
from rtrl_localkube.cycle_world import arg, base_checkpoint, deployment, rlcycle
from rtrl_localkube.kubelet import Kubelet
from rtrl_localkube.outcomes import Hang, Succeed
from rtrl_localkube.tools import Cli, OperatorProcess
from rtrl_trainer import checkpoint_io as cio
from tests.e2e.conftest import RELEASE_NAMESPACE
from tests.rtrl_trainer.trainset import Row, pattern_rows, save_parent, tiny_gpt2, write_trainset

pytestmark = pytest.mark.timeout(300)

CHECKPOINT = "composer-1"
SERVICE = f"{CHECKPOINT}-train"
# 64 rows of ~6.5 loss tokens, split over two rank files; batchTokens 8 makes 32 steps an
# epoch (one row per rank each), 3 epochs: 96 steps, the DeepSpeed state saved at step 50
# (saveEverySteps' default) and no later, so a kill after it leaves that state committed.
ROWS = 64
TRAINING = {
    "nodes": 2, "gpusPerNode": 0, "precision": "fp32", "zeroStage": 2, "learningRate": 1e-3,
    "batchTokens": 8, "microBatchSize": 1, "epochs": 3, "maxSequenceLength": 64,
    "activationCheckpointing": False,
}  # fmt: skip
SAVED_STEP = 50


@dataclass
class Run:
    kube: KubeAPI
    node: Kubelet
    root: Path
    operator: OperatorProcess

    def job(self, attempt: int) -> dict[str, Any]:
        return self.kube.get("batch/v1", "Job", f"{CHECKPOINT}-train-{attempt}") or {}

    def pods(self, attempt: int) -> dict[int, dict[str, Any]]:
        """The attempt's pods by completion index."""
        labels = {"batch.kubernetes.io/job-name": f"{CHECKPOINT}-train-{attempt}"}
        return {
            int(p["metadata"]["labels"]["batch.kubernetes.io/job-completion-index"]): p
            for p in self.kube.list("v1", "Pod", labels=labels)
        }

    def log(self, pod: dict[str, Any]) -> str:
        return self.node.logs(pod["metadata"]["name"], self.kube.namespace)

    def out(self) -> str:
        ck = self.kube.get("rtrl.io/v1alpha1", "Checkpoint", CHECKPOINT) or {}
        return str(ck["spec"]["uri"])

    def why(self) -> str:
        logs = "\n".join(
            f"=== {job}\n{self.node.logs(job, self.kube.namespace)[-4000:]}"
            for job in self.node.jobs_seen
        )
        return f"--- operator\n{self.operator.output()[-4000:]}\n{logs}"

    def wait_job(self, attempt: int, timeout: float = 200) -> dict[str, Any]:
        return self.kube.wait_for_job(f"{CHECKPOINT}-train-{attempt}", timeout, message=self.why)


@dataclass
class Cluster:
    """The session's control plane, its kubelet, the chart's operator ServiceAccount, and
    the rows to train on."""

    controlplane: ControlPlane
    kubelet: Kubelet
    release: str
    model: Any
    rows: list[Row]


@pytest.fixture(scope="module")
def cluster(controlplane: ControlPlane, kubelet: Kubelet, release: str) -> Cluster:
    model = tiny_gpt2(seed=1)
    return Cluster(controlplane, kubelet, release, model, pattern_rows(model, ROWS))


@contextmanager
def cycle(cluster: Cluster, tmp: Path) -> Iterator[Run]:
    """A namespace of its own with the parent, the Deployment, the base Checkpoint and an
    RLCycle training on two CPU nodes; the operator running for it; stage scripted."""
    controlplane, kubelet, release = cluster.controlplane, cluster.kubelet, cluster.release
    admin = Cli(controlplane.admin_kubeconfig)
    namespace = f"multinode-{secrets.token_hex(3)}"
    admin.kubectl("create", "namespace", namespace)
    kubeconfig = controlplane.kubeconfig(tmp / "admin.kubeconfig", namespace=namespace)
    client = kubernetes.config.new_client_from_config(config_file=os.fspath(kubeconfig))
    env = dict(kubelet.extra_env)
    operator = None
    try:
        dynamic = DynamicClient(client, cache_file=os.fspath(tmp / "discovery.json"))
        kube = KubeAPI(controlplane.url, kubeconfig, namespace, client, dynamic)
        model, staged = cluster.model, cluster.rows
        root = tmp / "store"

        def stage(job: dict[str, Any]) -> None:
            write_trainset(open_store(arg(job, "out")), "", [staged[0::2], staged[1::2]], tmp)

        kubelet.script("*-stage-*", Succeed(before=stage))
        kubelet.script("*-eval-*", Hang())
        save_parent(open_store(root.as_uri() + "/"), "models/base", model, tmp,
                    tokenizer_size=250)  # fmt: skip
        kube.create(deployment(root))
        kube.create(base_checkpoint(root))
        spec = rlcycle(root)["spec"]
        spec["training"].update(TRAINING)
        kube.create(rlcycle(root, **spec))
        operator = OperatorProcess(
            controlplane,
            tmp / "operator",
            service_account=(RELEASE_NAMESPACE, release),
            args=["--namespace", namespace, "--standalone"],
        )
        yield Run(kube, kubelet, root, operator)
    finally:
        if operator is not None:
            operator.stop()
        kubelet.reset(env)
        admin.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
        client.close()


@dataclass
class Published:
    out: str
    train: dict[str, Any]
    weights: dict[str, Any]
    logs: dict[int, str]
    pods: dict[int, dict[str, Any]]
    hostnames: list[str]


def published(run: Run, attempt: int, hostnames: list[str]) -> Published:
    from safetensors.torch import load_file

    store = open_store(run.out())
    local = run.root.parent / f"published-{attempt}.safetensors"
    store.get_file("model.safetensors", local)
    pods = run.pods(attempt)
    return Published(
        out=run.out(),
        train=json.loads(store.get_bytes("train.json")),
        weights=load_file(os.fspath(local)),
        logs={i: run.log(pod) for i, pod in pods.items()},
        pods=pods,
        hostnames=hostnames,
    )


def endpoint_hostnames(run: Run) -> list[str]:
    slices = run.kube.list(
        "discovery.k8s.io/v1", "EndpointSlice", labels={"kubernetes.io/service-name": SERVICE}
    )
    return sorted(
        e["hostname"] for s in slices for e in s.get("endpoints") or [] if "hostname" in e
    )


@pytest.fixture(scope="module")
def uninterrupted(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Published:
    """The two-pod run, not interrupted: what it published."""
    with cycle(cluster, tmp_path_factory.mktemp("whole")) as run:
        # While they run (a finished pod leaves them), the Service's EndpointSlices list both
        # pods by hostname: the records the names resolve from.
        hostnames = run.kube.wait_for(
            lambda: both if len(both := endpoint_hostnames(run)) == 2 else None,
            timeout=200,
            interval=0.1,
            message=run.why,
        )
        done = run.wait_job(0)
        assert done["type"] == "Complete", run.why()
        return published(run, 0, hostnames)


def test_two_pods_rendezvous_through_the_service_and_publish_one_checkpoint(
    uninterrupted: Published, kubelet: Kubelet
) -> None:
    run = uninterrupted
    assert sorted(run.pods) == [0, 1]
    master = f"{CHECKPOINT}-train-0-0.{SERVICE}"
    for index, pod in run.pods.items():
        # The Job controller named each pod for the Service, the endpoint-slice controller
        # listed it, and each rank met the others at the master's name.
        assert pod["spec"]["hostname"] == f"{CHECKPOINT}-train-0-{index}"
        assert pod["spec"]["subdomain"] == SERVICE
        assert pod["status"]["phase"] == "Succeeded"
        if kubelet.network.resolves:
            assert f"rank {index} of 2 joined the group at {master}:" in run.logs[index], run.logs
    assert run.hostnames == [f"{CHECKPOINT}-train-0-0", f"{CHECKPOINT}-train-0-1"]
    # Rank 0 trained and published; both ranks trained (world size 2).
    total = run.train["run"]["total_steps"]
    assert SAVED_STEP < total < 2 * SAVED_STEP  # what the kill test needs: one saved state
    assert f"step {total}/{total}" in run.logs[0]
    assert run.train["run"]["world_size"] == 2
    assert run.train["run"]["resumed_from_step"] is None
    assert [h["step"] for h in run.train["history"]] == list(range(1, total + 1))
    store = open_store(run.out)
    assert store.committed("") is not None
    assert not cio.committed_steps(store)  # the DeepSpeed state is deleted once published


def test_a_pod_killed_mid_run_fails_the_job_and_the_retry_resumes_to_the_same_weights(
    cluster: Cluster, uninterrupted: Published, tmp_path: Path
) -> None:
    kubelet = cluster.kubelet
    with cycle(cluster, tmp_path) as run:
        # Rank 0 says so once every rank has uploaded its part and the manifest is committed.
        def state_saved() -> dict[int, dict[str, Any]] | None:
            pods = run.pods(0)
            if len(pods) == 2 and f"saved state at step {SAVED_STEP}" in run.log(pods[0]):
                return pods
            return None

        pods = run.kube.wait_for(state_saved, timeout=200, interval=0.1, message=run.why)
        run.node.kill(pods[1]["metadata"]["name"])  # rank 1, mid-step, SIGKILL
        killed = time.monotonic()

        failed = run.wait_job(0, timeout=60)
        assert failed["type"] == "Failed" and failed["reason"] == "BackoffLimitExceeded"
        # The surviving rank did not wait in a collective for the dead one: the Job ended,
        # with both pods, well before any collective timeout.
        assert time.monotonic() - killed < 45, run.why()
        # (the Job controller deletes a failed Job's pods that still run: rank 0's may be gone)
        assert not run.job(0)["status"].get("active")
        assert all(p["status"]["phase"] == "Failed" for p in run.pods(0).values())
        rank1 = run.pods(0).get(1)
        if rank1 is not None:
            terminated = rank1["status"]["containerStatuses"][0]["state"]["terminated"]
            assert terminated["exitCode"] == 137
        assert "published" not in run.log(pods[0])
        # What a retry can resume from: the last committed state (the kill came after it;
        # another save would come only at step 100).
        assert sorted(cio.committed_steps(open_store(run.out()))) == [SAVED_STEP]

        done = run.wait_job(1)  # the operator's retry: a new Job of the same two pods
        assert done["type"] == "Complete", run.why()
        retried = published(run, 1, [])

    assert f"resumed from the state saved at step {SAVED_STEP}" in retried.logs[0], retried.logs
    assert "step 1/" not in retried.logs[0] and f"step {SAVED_STEP + 1}/" in retried.logs[0]
    if kubelet.network.resolves:
        master = f"{CHECKPOINT}-train-1-0.{SERVICE}"
        for index in (0, 1):
            assert f"rank {index} of 2 joined the group at {master}:" in retried.logs[index]
    assert retried.train["run"]["world_size"] == 2
    assert retried.train["run"]["resumed_from_step"] == SAVED_STEP
    total = uninterrupted.train["run"]["total_steps"]
    assert [h["step"] for h in retried.train["history"]] == list(range(1, total + 1))
    # Exactly the uninterrupted run's weights: the schedule is a function of (seed, epoch,
    # rank, step) and the state holds each rank's optimizer partition (docs/train.md).
    assert retried.weights.keys() == uninterrupted.weights.keys()
    different = [
        name
        for name, tensor in retried.weights.items()
        if not bool((tensor == uninterrupted.weights[name]).all())
    ]
    assert not different, different
    assert retried.train["history"] == [
        {**h, "seconds": retried.train["history"][i]["seconds"]}
        for i, h in enumerate(uninterrupted.train["history"])
    ]
