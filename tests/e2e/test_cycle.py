"""Whole cycles on the real control plane, as a platform team runs them: the chart installed
with ``helm install``, the operator running with the chart's ServiceAccount token, the real
``rtrl-job`` steps in the pods the real Job controller creates (CPU DeepSpeed, a tiny GPT-2,
a ``file://`` store), the canary and the promotion rolled out by the real Deployment
controller, and ``kubectl`` (with the ``kubectl rtrl`` plugin) to watch and steer.

Cycle 1 is promoted (its canary's users keep more edits), cycle 2 is rolled back by the
analysis (fewer), and ``kubectl rtrl rollback`` then serves the base model again."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from rtrl.core.api.progress import ProgressDocument
from rtrl.core.store import open_store
from rtrl_localkube.api import KubeAPI
from rtrl_localkube.cycle_world import NAME, RTRL
from rtrl_localkube.kubelet import Kubelet
from rtrl_localkube.tools import Cli, OperatorProcess
from tests.e2e.world import canary_counted_from, checkpoint, phase, serve_arms, set_up

pytestmark = pytest.mark.timeout(600)


def analyses(kube: KubeAPI, name: str) -> int:
    records = (checkpoint(kube, name).get("status") or {}).get("rollout") or []
    return sum(int(r.get("analyses") or 0) for r in records)


def serving_uri(kube: KubeAPI) -> str:
    target = kube.get("apps/v1", "Deployment", "composer-vllm") or {}
    container = target["spec"]["template"]["spec"]["containers"][0]
    return next(e["value"] for e in container["env"] if e["name"] == "MODEL_URI")


def test_cycles_promoted_rolled_back_and_rolled_back_by_hand(
    kube: KubeAPI,
    node: Kubelet,
    admin: Cli,
    rtrl_operator: Callable[..., OperatorProcess],
    tmp_path: Path,
) -> None:
    root = tmp_path / "store"
    set_up(kube, root, tmp_path)
    operator = rtrl_operator()
    ns = kube.namespace

    def why() -> str:
        jobs = "\n".join(f"=== {job}\n{node.logs(job, ns)[-3000:]}" for job in node.jobs_seen)
        rlc = (kube.get(RTRL, "RLCycle", NAME) or {}).get("status")
        return f"RLCycle status: {rlc}\n--- operator\n{operator.output()[-5000:]}\n{jobs}"

    def reaches(name: str, *phases: str, timeout: float = 240) -> str:
        return kube.wait_for(
            lambda: phase(kube, name) if phase(kube, name) in phases else None,
            timeout=timeout,
            interval=0.2,
            message=lambda: f"{name} never reached {phases} (is {phase(kube, name)})\n{why()}",
        )

    # Cycle 1: nobody uses the canary for its first analyses (each says continue), then its
    # users keep more of its edits: promoted.
    reaches("composer-1", "Canary")
    kube.wait_for(lambda: analyses(kube, "composer-1") >= 2, timeout=120, message=why)
    since = kube.wait_for(lambda: canary_counted_from(kube, "composer-1"), timeout=30)
    serve_arms(
        root / "interactions", "composer-0", "composer-1", since=since, canary_edit_persistence=0.8
    )
    reaches("composer-1", "Promoted", timeout=120)
    # The judged analyses' Jobs (and their pods) do not pile up: the last one is kept.
    jobs = kube.list("batch/v1", "Job", labels={"rtrl.io/checkpoint": "composer-1"})
    analysis_jobs = [j["metadata"]["name"] for j in jobs if "-analyze-" in j["metadata"]["name"]]
    assert 1 <= len(analysis_jobs) <= 2, analysis_jobs
    # Step pods carry no API token: they talk to the object store only.
    for pod in kube.list("v1", "Pod", labels={"rtrl.io/checkpoint": "composer-1"}):
        if "rtrl.io/step" in pod["metadata"]["labels"]:
            assert pod["spec"]["automountServiceAccountToken"] is False
            assert not any("projected" in v for v in pod["spec"].get("volumes") or []), pod
    assert serving_uri(kube) == checkpoint(kube, "composer-1")["spec"]["uri"]
    # The real train step left its last progress report beside the checkpoint, not in it.
    model = open_store(checkpoint(kube, "composer-1")["spec"]["uri"])
    report = ProgressDocument.model_validate_json(model.get_bytes("progress.json")).progress
    assert report.step == "train" and report.done == report.total and report.total
    manifest = model.committed("")
    assert manifest is not None and "progress.json" not in manifest.files
    kube.wait_for(lambda: kube.get("apps/v1", "Deployment", "composer-vllm-canary") is None,
                  timeout=60, message=why)  # fmt: skip

    # Cycle 2, started with `kubectl rtrl trigger`: its canary's users keep fewer edits.
    admin.kubectl("rtrl", "trigger", NAME, "-n", ns)
    reaches("composer-2", "Canary")
    since = kube.wait_for(lambda: canary_counted_from(kube, "composer-2"), timeout=30)
    serve_arms(
        root / "interactions", "composer-1", "composer-2", since=since, canary_edit_persistence=0.2
    )
    reaches("composer-2", "RolledBack", timeout=120)
    assert serving_uri(kube) == checkpoint(kube, "composer-1")["spec"]["uri"]
    # The data watermark: composer-2 staged only what became ready after composer-1's
    # stage (the server keeps the status field and the annotation: the CRD declares them).
    started = checkpoint(kube, "composer-1")["metadata"]["annotations"]["rtrl.io/started-at"]
    second = checkpoint(kube, "composer-2")
    assert second["metadata"]["annotations"]["rtrl.io/data-since"] == started
    assert second["status"]["data"]["since"] == started
    assert (kube.get(RTRL, "RLCycle", NAME) or {})["status"]["dataWatermark"] == started

    # `kubectl rtrl rollback` with no cycle running: the base model serves again.
    admin.kubectl("rtrl", "rollback", NAME, "-n", ns)
    reaches("composer-1", "RolledBack", timeout=60)
    kube.wait_for(lambda: serving_uri(kube) == checkpoint(kube, "composer-0")["spec"]["uri"],
                  timeout=60, message=why)  # fmt: skip
    # The base model's lineage holds none of the shards: no watermark.
    watermark = lambda: (kube.get(RTRL, "RLCycle", NAME) or {})["status"].get("dataWatermark")  # noqa: E731
    kube.wait_for(lambda: watermark() is None, timeout=30, message=why)

    # What a platform engineer reads: kubectl get (the printer columns) and kubectl rtrl.
    rows = [line.split() for line in admin.kubectl("get", "ckpt", "-n", ns).stdout.splitlines()]
    assert rows[0] == ["NAME", "PHASE", "CYCLE", "PARENT", "EVAL", "DECISION", "AGE"]
    # registered by hand (no cycle); superseded by composer-1, serving again since its rollback
    assert rows[1][:2] == ["composer-0", "Promoted"], rows
    assert [row[:5] for row in rows[2:]] == [
        ["composer-1", "RolledBack", "1", "composer-0", "Passed"],
        ["composer-2", "RolledBack", "2", "composer-1", "Passed"],
    ], rows
    # Decision: the canary's last word; composer-1 was promoted, then rolled back by hand.
    assert [row[5] for row in rows[2:]] == ["promote", "rollback"], rows
    kube.wait_for(lambda: (kube.get(RTRL, "RLCycle", NAME) or {})["status"]["phase"] == "Idle",
                  timeout=60, message=why)  # fmt: skip
    _, row = admin.kubectl("get", "rlc", "-n", ns).stdout.splitlines()
    assert row.split()[:3] == [NAME, "Idle", "composer-0"], row
    history = admin.kubectl("rtrl", "history", NAME, "-n", ns).stdout
    assert history.index("composer-2") < history.index("composer-1") < history.index("composer-0")
    # kubectl rtrl says the last word was the person's: rolled back, and why
    line = next(row for row in history.splitlines() if "composer-1" in row.split()[:2])
    assert "rollback" in line.split() and "rtrl.io/rollback=" in line, history
    assert "Serving:        composer-0" in admin.kubectl("rtrl", "status", NAME, "-n", ns).stdout

    # Pin a checkpoint by hand (the GitOps way, through the plugin), then leave the pin.
    admin.kubectl("rtrl", "rollback", NAME, "--to", "composer-1", "-n", ns)
    kube.wait_for(lambda: serving_uri(kube) == checkpoint(kube, "composer-1")["spec"]["uri"],
                  timeout=60, message=why)  # fmt: skip
    kube.wait_for(lambda: (kube.get(RTRL, "RLCycle", NAME) or {})["status"]["phase"] == "Pinned",
                  timeout=30, message=why)  # fmt: skip
    admin.kubectl("rtrl", "pause", NAME, "-n", ns)
    admin.kubectl("rtrl", "resume", NAME, "--unpin", "-n", ns)
    spec = (kube.get(RTRL, "RLCycle", NAME) or {})["spec"]
    assert "pin" not in spec and spec["suspend"] is False
    refused = admin.kubectl("rtrl", "promote", NAME, "-n", ns, check=False)
    assert refused.returncode == 1 and refused.stderr.startswith("error: ")
    assert operator.stop() == 0, operator.output()
