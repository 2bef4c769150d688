"""The eval sandbox where it really runs: the eval Job the operator builds (job_manifest),
stored by the real API server and run by the kubelet stand-in *as its securityContext
says* (uid 1000, group 1000 and fsGroup 1000, every capability dropped, no_new_privs), with
the store's Secret mounted as files. Its container runs ``rtrl-job eval --samples`` on the
attacks of bench/attacks.py (the sequences of samples included, two sandbox servers as the
step runs them): every guarantee holds in that pod, only the honest samples pass, and no
attack leaves a file, a connection or a secret behind. (Where
uid 1000 cannot reach this checkout, a clone under a 0700 dir, the stand-in runs the pod as
root with no capability instead: src/rtrl_localkube/pods.py.)"""

from __future__ import annotations

import base64
import json
import shutil
import socket
import stat
import tempfile
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from bench import attacks

from rtrl.core.api.rlcycle import RLCycleSpec
from rtrl.core.api.yamlfile import load
from rtrl.planning.manifests.jobs import (
    CONFIG_FILE,
    CONFIG_MOUNT,
    SCRATCH,
    checkpoint_manifest,
    job_manifest,
)
from rtrl.planning.manifests.names import config_map_name
from rtrl_localkube import pods
from rtrl_localkube.api import KubeAPI
from rtrl_localkube.kubelet import Kubelet
from rtrl_trainer.evaluate import suite as tasks
from tests.conftest import REPO

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not pods.IDENTITY_PYTHON.exists(), reason="no system Python 3.11"),
]

SECRET = f"eval-pod-secret-{uuid.uuid4().hex}"


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    with attacks.tcp_listener() as server:
        yield server


@pytest.fixture
def unix_listener() -> Iterator[socket.socket]:
    directory = Path(tempfile.mkdtemp(prefix="rtrl-pod-sock-"))
    try:
        with attacks.unix_listener(directory) as server:
            yield server
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def eval_job(namespace: str) -> dict[str, Any]:
    raw = load((REPO / "examples" / "rlcycle.yaml").read_text())["spec"]
    raw["storage"] = {"artifacts": "s3://rtrl-artifacts/composer/", "credentialsSecret": "s3-creds"}
    # a CPU node: this kubelet has no GPU and not the example's instance type
    raw["training"].update(nodes=1, gpusPerNode=0)
    for key in ("nodeSelector", "tolerations", "resources"):
        raw["training"].pop(key, None)
    spec = RLCycleSpec.model_validate(raw)
    rlcycle = {"metadata": {"name": "composer", "namespace": namespace, "uid": "rlc-uid"}}
    checkpoint = checkpoint_manifest(
        rlcycle, spec, cycle=1, parent="composer-0", now=datetime.now(UTC), trigger=None
    )
    checkpoint["metadata"]["uid"] = "ck-uid"
    args = [
        "eval",
        "--samples", f"{CONFIG_MOUNT}/samples.jsonl",
        "--suite", "tasks",
        "--results", f"{SCRATCH}/results.jsonl",
    ]  # fmt: skip
    job = job_manifest(rlcycle, spec, checkpoint, step="eval", attempt=0, args=args)
    del job["metadata"]["ownerReferences"]  # no Checkpoint here: the collector would take it
    return job


def test_the_attacks_fail_in_the_eval_pod_the_operator_builds(
    kube: KubeAPI, node: Kubelet, listener: socket.socket, unix_listener: socket.socket
) -> None:
    node.runner.identities = True  # reset by the node fixture
    marker = f"rtrl-pod-attack-{uuid.uuid4().hex}"
    ctx = attacks.Context(
        evaluator_pid=1,  # not known before the pod starts: the attacks also scan /proc
        port=listener.getsockname()[1],
        marker=marker,
        secret=SECRET,
        suite_file=tasks.DEFAULT_SUITE,
        humaneval_file=tasks.humaneval_path(),
        credentials=f"{node.runner.work_dir}/{kube.namespace}/*/volumes/*/AWS_SECRET_ACCESS_KEY",
        unix_socket=unix_listener.getsockname(),
    )
    samples = node.runner.work_dir / f"{marker}.jsonl"
    expected = attacks.write_samples(samples, ctx)
    keys = {"AWS_ACCESS_KEY_ID": b"AKIAEVALPOD", "AWS_SECRET_ACCESS_KEY": SECRET.encode()}
    kube.create({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s3-creds"},
                 "data": {k: base64.b64encode(v).decode() for k, v in keys.items()}})  # fmt: skip
    kube.create({"apiVersion": "v1", "kind": "ConfigMap",
                 "metadata": {"name": config_map_name("composer-1")},
                 "data": {CONFIG_FILE: "{}", "samples.jsonl": samples.read_text()}})  # fmt: skip
    job = eval_job(kube.namespace)
    name = job["metadata"]["name"]
    kube.create(job)
    done = kube.wait_for_job(name, 240, message=lambda: node.logs(name, kube.namespace))
    logs = node.logs(name, kube.namespace)
    assert done["type"] == "Complete", logs[-4000:]
    (pod,) = kube.list("v1", "Pod", labels={"batch.kubernetes.io/job-name": name})
    pod_dir = node.runner.work_dir / kube.namespace / pod["metadata"]["name"]
    # the pod ran as its securityContext says, with the Secret as files only the sandbox hides
    assert pod["spec"]["securityContext"]["runAsUser"] == 1000
    assert pod["spec"]["containers"][0]["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    # uid 1000, unless that user cannot reach this checkout: then root without capabilities
    uid = 1000 if pods.reachable_by(pods.SITE_PACKAGES, 1000, {1000}) else 0
    assert f"--reuid={uid}" in logs.splitlines()[1] and "--bounding-set=-all" in logs
    secret_file = pod_dir / "volumes" / "storage-credentials" / "AWS_SECRET_ACCESS_KEY"
    info = secret_file.stat()
    assert stat.S_IMODE(info.st_mode) == 0o440 and info.st_gid == (1000 if uid else 0)
    summary = json.loads(logs.strip().splitlines()[-1])
    assert summary["sandbox"]["missing"] == [], summary["sandbox"]
    rows = [
        json.loads(line)
        for line in (pod_dir / "volumes" / "scratch" / "results.jsonl").read_text().splitlines()
    ]
    wrong = {
        name: row["result"]
        for (name, must_pass), row in zip(expected, rows, strict=True)
        if row["passed"] != must_pass
    }
    assert not wrong, wrong
    assert summary["samples"] == len(expected)
    assert summary["passed"] == sum(must for _, must in expected)
    results = (pod_dir / "volumes" / "scratch" / "results.jsonl").read_text()
    assert SECRET not in logs + results
    for where in ("/tmp", "/dev/shm", "/var/tmp"):
        for leftover in (Path(where) / marker, Path(where) / f"{marker}.sh"):
            assert not leftover.exists(), leftover
    with pytest.raises(BlockingIOError):
        listener.accept()
    with pytest.raises(BlockingIOError):
        unix_listener.accept()
