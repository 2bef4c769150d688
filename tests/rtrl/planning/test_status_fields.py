"""What the operator writes into a Checkpoint's status for a user to read (issue 33, "status
a user can trust"): the base model's phase once it serves, the share of traffic a canary
step actually got, the training's progress while it runs, through the same in-memory world
as test_plan.py."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from rtrl.kubectl_plugin.render import checkpoint_lines
from rtrl.metrics import observe_plan
from rtrl.planning import Observed, PatchStatus, plan, progress_to_read
from tests.rtrl.planning.test_plan import STAGE_OK, TRAIN_OK, World, run_cycle, to_canary
from tests.rtrl.test_metrics import value


def test_the_base_checkpoint_registered_by_hand_reads_promoted_once_it_serves() -> None:
    world = World()
    assert "status" not in world.checkpoint("composer-0")  # as examples/ registers it
    world.reconcile()
    base = world.checkpoint("composer-0")["status"]
    assert (base["phase"], base["reason"]) == ("Promoted", "Serving"), base
    assert base["message"] == "serves composer-vllm (RLCycle composer); registered by hand"
    # written once: the next rounds leave it to the cycles
    assert not [
        a for a in plan(world.observed(), world.now).actions
        if isinstance(a, PatchStatus) and a.name == "composer-0"
    ]  # fmt: skip
    run_cycle(world)  # composer-1 promoted: the base model is superseded, as any parent
    assert world.checkpoint("composer-0")["status"]["phase"] == "Superseded"
    assert world.checkpoint("composer-1")["status"]["phase"] == "Promoted"


def test_the_base_checkpoint_s_first_status_is_no_promotion_in_the_metrics() -> None:
    world = World()
    world.rlcycle["metadata"]["name"] = "m-base"
    decided = plan(world.observed(), world.now)
    assert any(isinstance(a, PatchStatus) and a.name == "composer-0" for a in decided.actions)
    observe_plan("m-base", "metrics-test", {}, decided.status, decided.actions)
    assert value("rtrl_last_promotion_age_seconds", rlcycle="m-base") == 0.0


def test_a_canary_step_records_the_share_it_got_next_to_the_stable_replicas() -> None:
    """With the replicas router one canary pod next to one stable pod is 50% whatever the
    step's weight: the RLCycle said 50% and the Candidate block 25% (its record's weight),
    as the quick start shows it (steps 25 and 50, one replica)."""
    world = World()
    world.rlcycle["spec"]["rollout"]["steps"] = [
        {"weight": 25, "minDuration": "30m", "minSamples": 20000},
        {"weight": 50, "minDuration": "30m", "minSamples": 20000},
    ]
    world.deployments["composer-vllm"]["spec"]["replicas"] = 1
    world.settle()
    to_canary(world)
    (record,) = world.checkpoint("composer-1")["status"]["rollout"]
    assert (record["weight"], record["share"]) == (25, 50.0), record
    assert world.rlcycle["status"]["canaryWeight"] == 50
    lines = checkpoint_lines(world.checkpoint("composer-1"), "Candidate", datetime.now(UTC))
    row = next(line.split() for line in lines if line.split()[:1] == ["1"])
    assert row[1:4] == ["50%", "(step:", "25%)"], lines
    # the target scaled to 3 replicas mid-step: one canary pod is 25% now, and says so
    world.deployments["composer-vllm"]["spec"]["replicas"] = 3
    world.settle()
    world.reconcile()
    (record,) = world.checkpoint("composer-1")["status"]["rollout"]
    assert (record["weight"], record["share"]) == (25, 25.0), record
    lines = checkpoint_lines(world.checkpoint("composer-1"), "Candidate", datetime.now(UTC))
    row = next(line.split() for line in lines if line.split()[:1] == ["1"])
    assert row[1:3] == ["25%", "2026-11-29T00:00:00Z"], lines


class ReportingWorld(World):
    """The world, with the files a running step writes beside its results (progress.json)."""

    def __init__(self) -> None:
        super().__init__()
        self.written: dict[str, Any] = {}

    def observed(self) -> Observed:
        obs = super().observed()
        uri = progress_to_read(obs)
        return Observed(**{**obs.__dict__, "progress": self.written.get(uri) if uri else None})


PROGRESS = {"step": "train", "done": 12, "total": 40, "unit": "steps", "rate": 0.5,
            "etaSeconds": 56.0, "elapsedSeconds": 24.0,
            "updatedAt": "2026-11-29T00:00:30Z"}  # fmt: skip


def test_training_shows_its_progress_from_the_file_the_step_writes() -> None:
    """Training read only "Running" although the pod logged progress and an ETA: the train
    step now writes progress.json, and the round of a running train Job copies it into the
    Checkpoint's status.progress (and the messages), reading no pod log."""
    world = ReportingWorld()
    world.reconcile()
    assert progress_to_read(world.observed()) is None  # the stage step writes none
    world.finish("stage", result=STAGE_OK)
    world.reconcile()
    uri = progress_to_read(world.observed())
    model = world.checkpoint("composer-1")["spec"]["uri"]
    assert uri == f"{model}progress.json"
    world.reconcile()  # nothing written yet: nothing shown, nothing fails
    assert "progress" not in world.checkpoint("composer-1")["status"]
    world.written[uri] = {"version": 1, "progress": PROGRESS}
    world.reconcile()
    status = world.checkpoint("composer-1")["status"]
    assert status["phase"] == "Training" and status["progress"] == PROGRESS
    assert (status["reason"], status["message"]) == (
        "TrainRunning", "train step running: 12/40 steps (30%), 0.5 steps/s, ETA 56s")  # fmt: skip
    assert world.rlcycle["status"]["message"].endswith(
        "(composer-1-train-0): 12/40 steps (30%), 0.5 steps/s, ETA 56s")  # fmt: skip
    shown = checkpoint_lines(world.checkpoint("composer-1"), "Candidate",
                             datetime(2026, 11, 29, 0, 1, tzinfo=UTC))  # fmt: skip
    assert "  Progress:  train: 12/40 steps (30%), 0.5 steps/s, ETA 56s (reported 30s ago)" in (
        shown), shown  # fmt: skip
    # unchanged: not written again
    again = plan(world.observed(), world.now)
    assert not [a for a in again.actions if isinstance(a, PatchStatus) and a.name == "composer-1"]
    # a layout this operator does not know is not shown, and stops nothing
    world.written[uri] = {"version": 2, "progress": {**PROGRESS, "done": 13}}
    world.reconcile()
    assert world.checkpoint("composer-1")["status"]["progress"]["done"] == 12
    # once the Job ended the file is not read again; the last report stays
    world.finish("train", result=TRAIN_OK)
    assert progress_to_read(world.observed()) is None
    world.reconcile()
    status = world.checkpoint("composer-1")["status"]
    assert status["phase"] == "Evaluating" and status["progress"]["done"] == 12
