"""The operator process on the real control plane, under the chart's RBAC: how it runs,
what it creates and what it refuses, beyond the whole cycles of test_cycle.py."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from rtrl.core.api.yamlfile import load
from rtrl_localkube.api import KubeAPI
from rtrl_localkube.cycle_world import NAME, RTRL, condition
from rtrl_localkube.kubelet import Kubelet
from rtrl_localkube.outcomes import Hang
from rtrl_localkube.tools import Cli, OperatorProcess
from tests.conftest import REPO
from tests.contract.mutants import MODEL_ONLY, set_at
from tests.e2e.world import set_up

# a status 403, not the milliseconds of a log line's time ("10:11:50,403")
HTTP_403 = re.compile(r"(?<![,.\d])403\b")

pytestmark = pytest.mark.timeout(300)


def rlcycle_status(kube: KubeAPI) -> dict[str, Any]:
    return (kube.get(RTRL, "RLCycle", NAME) or {}).get("status") or {}


def test_one_namespace_under_the_clusterwide_chart(
    kube: KubeAPI,
    node: Kubelet,
    rtrl_operator: Callable[..., OperatorProcess],
    tmp_path: Path,
) -> None:
    """``rtrl operator --namespace NS``, as the README runs it, with the ServiceAccount of
    the default (cluster-wide) chart: no permission is missing."""
    set_up(kube, tmp_path / "store", tmp_path)
    operator = rtrl_operator("--namespace", kube.namespace, "--standalone")
    kube.wait_for(lambda: rlcycle_status(kube).get("cycle"), timeout=60, message=operator.output)
    # The one 403 that is no permission: for seconds after the chart installs the CRDs, the
    # server's owner-reference admission has no RESTMapping for RLCycle yet and refuses the
    # Checkpoint the operator creates (it retries; the first test on a fresh control plane
    # sees it).
    forbidden = [
        line for line in operator.output().splitlines()
        if (HTTP_403.search(line) or "Forbidden" in line or "permission" in line.lower())
        and "cannot find RESTMapping" not in line
    ]  # fmt: skip
    assert forbidden == [], "\n".join(forbidden)


def invalid_spec(kube: KubeAPI, operator: OperatorProcess, timeout: float) -> dict[str, Any]:
    """The RLCycle's InvalidSpec condition, once it is True."""
    return kube.wait_for(
        lambda: (
            condition(kube, "InvalidSpec").get("status") == "True"
            and condition(kube, "InvalidSpec")
        ),
        timeout=timeout,
        message=operator.output,
    )


def test_a_child_the_server_rejects_is_invalid_spec_until_fixed(
    kube: KubeAPI,
    node: Kubelet,
    rtrl_operator: Callable[..., OperatorProcess],
    tmp_path: Path,
) -> None:
    """A spec the CRD and the models accept, from which the operator derives a child the
    API server rejects (here a node label value with a space, in the training Job's pod
    template): the RLCycle says InvalidSpec with the server's words, the operator does not
    hammer the server, and the cycle resumes once the spec is fixed."""
    training = {
        "image": "rtrl-trainer:test", "nodes": 1, "gpusPerNode": 0, "precision": "fp32",
        "zeroStage": 0, "learningRate": 1e-3, "batchTokens": 512, "microBatchSize": 8,
        "maxSequenceLength": 64, "nodeSelector": {"pool": "gpu nodes"},
    }  # fmt: skip
    set_up(kube, tmp_path / "store", tmp_path, training=training)
    operator = rtrl_operator(env={"RTRL_RESYNC_SECONDS": "30"})
    invalid = invalid_spec(kube, operator, timeout=120)
    assert invalid["reason"] == "RejectedByAPIServer", invalid
    assert "Job composer-1-train-0" in invalid["message"], invalid
    assert "nodeSelector" in invalid["message"] and "gpu nodes" in invalid["message"], invalid
    assert rlcycle_status(kube)["phase"] == "Invalid"
    assert rlcycle_status(kube)["message"] == invalid["message"]
    rejected = operator.output().count("rejected Job composer-1-train-0")
    time.sleep(6)  # at the error back-off (0.5 s here) a dozen more tries would follow; the
    # next one is due at the resync (30 s)
    assert operator.output().count("rejected Job composer-1-train-0") <= rejected + 1
    kube.patch(RTRL, "RLCycle", NAME, {"spec": {"training": {"nodeSelector": {"pool": "gpu"}}}})
    kube.wait_for(
        lambda: condition(kube, "InvalidSpec").get("status") == "False",
        timeout=60,
        message=operator.output,
    )
    kube.wait_for(lambda: kube.get("batch/v1", "Job", "composer-1-train-0"), timeout=60)
    assert "InvalidSpec" not in rlcycle_status(kube)["message"]


@pytest.mark.parametrize("label", sorted(MODEL_ONLY))
def test_what_only_the_models_reject_is_invalid_spec(
    label: str, kube: KubeAPI, node: Kubelet, rtrl_operator: Callable[..., OperatorProcess]
) -> None:
    """The rules the CRD cannot express (docs/validation.md): the server stores such an
    RLCycle, the operator marks it InvalidSpec naming the field, and starts nothing."""
    path, value = MODEL_ONLY[label]
    body = set_at(load((REPO / "examples" / "rlcycle.yaml").read_text()), path, value)
    body["metadata"].pop("namespace", None)
    kube.create(body)
    operator = rtrl_operator()
    invalid = invalid_spec(kube, operator, timeout=60)
    assert invalid["reason"] == "SpecInvalid", invalid
    assert ".".join(path[1:]) in invalid["message"], invalid
    assert rlcycle_status(kube)["phase"] == "Invalid"
    assert not kube.list("batch/v1", "Job") and not kube.list(RTRL, "Checkpoint")


def test_deleting_an_rlcycle_mid_training_removes_its_children_not_its_artifacts(
    kube: KubeAPI,
    node: Kubelet,
    admin: Cli,
    rtrl_operator: Callable[..., OperatorProcess],
    tmp_path: Path,
) -> None:
    """No finalizer holds the RLCycle: ``kubectl delete`` returns at once, even with no
    operator running, and the real garbage collector removes the Checkpoints it made and
    their Jobs, pods, Services and ConfigMaps. The base Checkpoint (made by hand) and the
    stored artifacts stay."""
    root = tmp_path / "store"
    node.script("composer-1-train-*", Hang())
    set_up(kube, root, tmp_path)
    operator = rtrl_operator()
    kube.wait_for(
        lambda: any(
            (p.get("status") or {}).get("phase") == "Running"
            for p in kube.list("v1", "Pod", labels={"rtrl.io/step": "train"})
        ),
        timeout=120,
        message=operator.output,
    )
    rlcycle = kube.get(RTRL, "RLCycle", NAME) or {}
    assert not rlcycle["metadata"].get("finalizers"), rlcycle["metadata"]
    assert operator.stop() == 0, operator.output()  # not even an operator is needed
    admin.kubectl("delete", "rlc", NAME, "-n", kube.namespace, "--timeout=20s")
    mine = {"rtrl.io/rlcycle": NAME}

    def children() -> list[str]:
        kinds = [("batch/v1", "Job"), ("v1", "Pod"), ("v1", "Service"), ("v1", "ConfigMap")]
        left = [f"{kind}/{o['metadata']['name']}" for api, kind in kinds
                for o in kube.list(api, kind, labels=mine)]  # fmt: skip
        return left + [f"Checkpoint/{c['metadata']['name']}" for c in kube.list(RTRL, "Checkpoint")
                       if c["metadata"]["name"] != "composer-0"]  # fmt: skip

    kube.wait_for(lambda: not children(), timeout=60, message=lambda: str(children()))
    assert kube.get(RTRL, "Checkpoint", "composer-0") is not None
    assert list((root / "artifacts" / "cycles").glob("composer-1-*/stage/stage.json"))


def test_the_base_checkpoint_reads_promoted_once_it_serves(
    kube: KubeAPI,
    node: Kubelet,
    admin: Cli,
    rtrl_operator: Callable[..., OperatorProcess],
    tmp_path: Path,
) -> None:
    """The base model's Checkpoint, registered by hand with no status, reads ``Promoted``
    in ``kubectl get ckpt`` and ``kubectl rtrl status`` once the RLCycle serves it (it read
    nothing and ``Pending``). Suspended: no cycle needs to run for it."""
    set_up(kube, tmp_path / "store", tmp_path, suspend=True)
    operator = rtrl_operator()
    ns = kube.namespace
    base = lambda: (kube.get(RTRL, "Checkpoint", "composer-0") or {}).get("status") or {}  # noqa: E731
    kube.wait_for(lambda: base().get("phase"), timeout=60, message=operator.output)
    assert (base()["phase"], base()["reason"]) == ("Promoted", "Serving"), base()
    rows = [line.split() for line in admin.kubectl("get", "ckpt", "-n", ns).stdout.splitlines()]
    assert rows[0][:2] == ["NAME", "PHASE"] and rows[1][:2] == ["composer-0", "Promoted"], rows
    kube.wait_for(lambda: rlcycle_status(kube).get("phase") == "Suspended", timeout=30,
                  message=operator.output)  # fmt: skip
    shown = admin.kubectl("rtrl", "status", NAME, "-n", ns).stdout
    lines = [line.split() for line in shown.splitlines()]
    tree = next(row for row in lines if "composer-0" in row and "Checkpoint" in row)
    assert tree[2:4] == ["Checkpoint", "Promoted"], shown
    assert operator.stop() == 0, operator.output()


def test_training_shows_the_progress_its_step_reports(
    kube: KubeAPI,
    node: Kubelet,
    admin: Cli,
    rtrl_operator: Callable[..., OperatorProcess],
    tmp_path: Path,
) -> None:
    """Training read only "Running" while its pod logged progress and an ETA: the train
    step writes progress.json beside its output (rtrl_trainer.train.events, here with its
    own writer while the pod hangs), and the operator's next round puts it in the
    Checkpoint's status, which ``kubectl rtrl status`` shows."""
    from rtrl.core.store import open_store
    from rtrl_localkube.cycle_world import arg
    from rtrl_trainer.progress import Progress
    from rtrl_trainer.train.events import progress_document

    node.script("composer-1-train-*", Hang())
    set_up(kube, tmp_path / "store", tmp_path)
    operator = rtrl_operator(env={"RTRL_RESYNC_SECONDS": "2"})
    ns = kube.namespace
    job = kube.wait_for(lambda: kube.get("batch/v1", "Job", "composer-1-train-0"), timeout=120,
                        message=operator.output)  # fmt: skip
    progress = Progress("train", "training", total=40, unit="steps", done=12, quiet=True)
    open_store(arg(job, "out")).put_bytes("progress.json", progress_document(progress))
    reported = lambda: (  # noqa: E731
        (kube.get(RTRL, "Checkpoint", "composer-1") or {}).get("status") or {}
    ).get("progress")
    shown = kube.wait_for(reported, timeout=60, message=operator.output)
    assert (shown["step"], shown["done"], shown["total"], shown["unit"]) == (
        "train", 12, 40, "steps"), shown  # fmt: skip
    out = admin.kubectl("rtrl", "status", NAME, "-n", ns).stdout
    assert "  Progress:  train: 12/40 steps (30%) (reported " in out, out
    assert "Phase:     Training (TrainRunning: train step running: 12/40 steps (30%))" in out
    assert "12/40 steps (30%)" in rlcycle_status(kube)["message"], rlcycle_status(kube)
    assert operator.stop() == 0, operator.output()
