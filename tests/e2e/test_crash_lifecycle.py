"""Crash coverage of an RLCycle's life around its cycles, on the real control plane
(tests/e2e/crash.py, src/rtrl_localkube/crashrun.py): history pruning and the next cycle's
hand-off from a promoted Checkpoint (ending in insufficient data), and the RLCycle's
deletion while it still carries the finalizer an earlier rtrl put on it."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from rtrl.core.api.names import ANNOTATION_STARTED, ANNOTATION_TRIGGER, FINALIZER
from rtrl.planning.timeutil import iso
from rtrl_localkube.api import KubeAPI
from rtrl_localkube.crashrun import CrashSweep, Step
from rtrl_localkube.cycle_world import (
    EVAL_PASS,
    RTRL,
    STAGE_INSUFFICIENT,
    base_checkpoint,
    deployment,
    rlcycle,
    script_all,
)
from rtrl_localkube.outcomes import Hang
from tests.e2e import crash
from tests.e2e.crash import CKPT, exists, killed, phase

pytestmark = pytest.mark.timeout(240)
forkserver, sweep = crash.forkserver, crash.sweep  # the fixtures


def history(kube: KubeAPI, root: Path, name: str, cycle: int, status: dict[str, Any]) -> str:
    """A Checkpoint an earlier cycle of ``composer`` left (its parent: the base)."""
    uri = (root / "artifacts" / name / "model").as_uri() + "/"
    annotations = {ANNOTATION_STARTED: iso(datetime.now(UTC))}
    kube.create({
        "apiVersion": RTRL, "kind": "Checkpoint",
        "metadata": {"name": name, "labels": {"rtrl.io/rlcycle": "composer"},
                     "annotations": annotations},
        "spec": {"uri": uri, "parent": "composer-0", "rlCycle": "composer", "cycle": cycle},
    })  # fmt: skip
    kube.patch(RTRL, "Checkpoint", name, {"status": status}, subresource="status")
    return uri


def test_history_pruned_then_the_next_cycle_from_the_promoted_one(
    sweep: CrashSweep, kube_api: KubeAPI, job_runner: Any, tmp_path: Path
) -> None:
    """composer-1 (rolled back) and composer-2 (promoted, serving) exist, historyLimit 1: the
    operator prunes composer-1, and the trigger starts cycle 3 from composer-2, whose stage
    finds too little data: composer-3 is removed again and InsufficientData said."""
    script_all(job_runner, tmp_path, stage=STAGE_INSUFFICIENT)
    kube_api.create(base_checkpoint(tmp_path))
    history(kube_api, tmp_path, "composer-1", 1, {"phase": "RolledBack"})
    serving = history(kube_api, tmp_path, "composer-2", 2, {
        "phase": "Promoted", "eval": {"verdict": "Passed"},
        "data": {"manifest": (tmp_path / "staged").as_uri() + "/", "interactions": 10},
    })  # fmt: skip
    kube_api.create(deployment(tmp_path, serving_uri=serving))
    doc = rlcycle(tmp_path, historyLimit=1)
    doc["metadata"]["annotations"] = {ANNOTATION_TRIGGER: "next"}
    kube_api.create(doc)
    sweep.sweeping = True

    def done() -> bool:
        cond = {c["type"]: c for c in sweep.status().get("conditions") or []}
        return (
            not exists(kube_api, "Checkpoint", "composer-1")
            and sweep.status().get("lastTrigger") == "next"
            and cond.get("InsufficientData", {}).get("status") == "True"
            and not exists(kube_api, "Checkpoint", "composer-3")
            and phase(sweep, "RLCycle", "composer") == "Idle"
        )

    sweep.run(done, timeout=120)
    sweep.settle()
    assert sweep.ledger.created("Checkpoint") == ["composer-0", CKPT, "composer-2", "composer-3"]
    stage = sweep.ledger.created("Job")
    assert stage == ["composer-3-stage-0"], sweep.explain()
    st = sweep.status()
    assert st["serving"] == "composer-2" and st["cycle"] == 3 and not st.get("candidate")
    assert ("DELETE", "checkpoints") in killed(sweep), sorted(killed(sweep))


def test_deleted_mid_cycle_with_an_old_finalizer(
    sweep: CrashSweep, kube_api: KubeAPI, job_runner: Any, tmp_path: Path
) -> None:
    """The RLCycle carries ``rtrl.io/finalizer`` (as an earlier rtrl left it) and is deleted
    while its train Job runs: kopf removes the finalizer, garbage collection its children."""
    script_all(job_runner, tmp_path, train=Hang(), eval=EVAL_PASS)
    kube_api.create(deployment(tmp_path))
    kube_api.create(base_checkpoint(tmp_path))
    doc = rlcycle(tmp_path)
    doc["metadata"]["finalizers"] = [FINALIZER]
    kube_api.create(doc)
    sweep.sweeping = True

    def delete() -> None:
        kube_api.delete(RTRL, "RLCycle", "composer")

    training = Step(lambda: exists(kube_api, "Job", f"{CKPT}-train-0"), delete)

    def done() -> bool:
        return not (
            exists(kube_api, "RLCycle", "composer")
            or exists(kube_api, "Checkpoint", CKPT)
            or kube_api.list("batch/v1", "Job")
        )

    sweep.run(done, steps=[training], timeout=120)
    sweep.settle(rounds=False)
    assert sweep.ledger.created("Job") == [f"{CKPT}-stage-0", f"{CKPT}-train-0"], sweep.explain()
