"""The operator's planning core, driven through whole cycles against an in-memory world.

``World`` holds what the kube layer would observe and applies the plan's actions the way
the API server would (uids, "already exists", deletions), so each test reads as a story:
a cycle starts, its Jobs run, their results appear in the store, and the plan answers.
"""

from __future__ import annotations

import copy
import itertools
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from rtrl.api.cron import parse_cron
from rtrl.api.yamlfile import load
from rtrl.planning import (
    Create,
    Delete,
    DeploymentState,
    Emit,
    JobState,
    Observed,
    PatchStatus,
    SecretState,
    plan,
    plan_deletion,
    results_to_read,
)
from rtrl.planning import children as ch
from rtrl.planning.schedule import next_cron
from tests.conftest import REPO

T0 = datetime(2026, 11, 29, 0, 0, tzinfo=UTC)
_uids = itertools.count(1)

STAGE_OK = {
    "ok": True,
    "sufficient": True,
    "message": "2000 interactions",
    "interactions_used": 2000,
    "tokens_used": 90000,
    "on_policy_fraction": 0.95,
    "quarantined": {"truncated": 3},
    "quarantined_files": [],
}
TRAIN_OK = {"summary": {"steps": 4, "tokens": 90000, "loss": 0.12, "kl": 0.003}}
EVAL_PASS = {
    "passed": True,
    "message": "passed 1 gate(s)",
    "gates": [
        {"metric": "tasks.pass_at_1", "candidate": 0.5, "parent": 0.5, "ci_low": -0.1,
         "ci_high": 0.1, "passed": True, "mode": "absolute"}
    ],
}  # fmt: skip


def _doc(name: str) -> dict[str, Any]:
    return load((REPO / "examples" / name).read_text())


class World:
    """What the cluster and the store hold for one RLCycle, and the plan applied to it."""

    def __init__(self, **spec_changes: Any):
        self.rlcycle = _doc("rlcycle.yaml")
        self.rlcycle["metadata"].update(
            uid="rlc-uid", generation=1, creationTimestamp="2026-11-29T00:00:00Z"
        )
        self.rlcycle["spec"].update(spec_changes)
        base = _doc("checkpoint-base.yaml")
        base["metadata"]["uid"] = "base-uid"
        self.checkpoints: dict[str, dict[str, Any]] = {"composer-0": base}
        self.jobs: dict[str, JobState] = {}
        self.config_maps: set[str] = set()
        self.services: set[str] = set()
        self.results: dict[str, Any] = {}
        self.deployment = DeploymentState(True, True, base["spec"]["uri"])
        self.secret: SecretState | None = SecretState(True)
        self.events: list[Emit] = []
        self.created: list[str] = []
        self.now = T0

    def observed(self) -> Observed:
        obs = Observed(
            rlcycle=copy.deepcopy(self.rlcycle),
            checkpoints=[copy.deepcopy(c) for c in self.checkpoints.values()],
            jobs=list(self.jobs.values()),
            services=frozenset(self.services),
            config_maps=frozenset(self.config_maps),
            deployment=self.deployment,
            secret=self.secret,
        )
        results = {uri: self.results.get(uri) for uri in results_to_read(obs)}
        return Observed(**{**obs.__dict__, "results": results})

    def reconcile(self, rounds: int = 1) -> Any:
        """Plan and apply ``rounds`` times (immediate requeues included); the last plan."""
        decided = None
        for _ in range(rounds):
            decided = plan(self.observed(), self.now)
            self.apply(decided.actions)
            self.rlcycle["status"] = decided.status
            while decided.requeue_after == 0:
                decided = plan(self.observed(), self.now)
                self.apply(decided.actions)
                self.rlcycle["status"] = decided.status
        return decided

    def apply(self, actions: list[Any]) -> None:
        for action in actions:
            if isinstance(action, Create):
                manifest = copy.deepcopy(action.manifest)
                meta = manifest["metadata"]
                if action.kind == "Checkpoint" and meta["name"] not in self.checkpoints:
                    meta["uid"] = f"uid-{next(_uids)}"
                    self.checkpoints[meta["name"]] = manifest
                    self.created.append(f"Checkpoint/{meta['name']}")
                elif action.kind == "Job" and meta["name"] not in self.jobs:
                    labels = meta["labels"]
                    self.jobs[meta["name"]] = JobState(
                        name=meta["name"],
                        checkpoint=labels[ch.LABEL_CHECKPOINT],
                        checkpoint_uid=labels[ch.LABEL_CHECKPOINT_UID],
                        step=labels[ch.LABEL_STEP],
                        attempt=int(labels[ch.LABEL_ATTEMPT]),
                    )
                    self.created.append(f"Job/{meta['name']}")
                    self.manifests = getattr(self, "manifests", {})
                    self.manifests[meta["name"]] = manifest
                elif action.kind == "ConfigMap":
                    self.config_maps.add(meta["name"])
                elif action.kind == "Service":
                    self.services.add(meta["name"])
            elif isinstance(action, Delete):
                {
                    "Checkpoint": self.checkpoints,
                    "Job": self.jobs,
                }.get(action.kind, {}).pop(action.name, None)  # type: ignore[attr-defined]
                self.config_maps.discard(action.name)
                self.services.discard(action.name)
            elif isinstance(action, PatchStatus):
                ck = self.checkpoints[action.name]
                ck["status"] = {**(ck.get("status") or {}), **action.status}
            elif isinstance(action, Emit):
                self.events.append(action)

    # Jobs finishing, as the Job controller and the step would leave them
    def finish(self, step: str, *, result: dict[str, Any] | None = None, fail: str = "") -> str:
        job = next(
            j for j in reversed(list(self.jobs.values())) if j.step == step and not j.finished
        )
        self.jobs[job.name] = JobState(
            **{**job.__dict__, "succeeded": not fail, "failed": bool(fail),
               "finished_at": self.now, "reason": "BackoffLimitExceeded" if fail else "",
               "message": fail},
        )  # fmt: skip
        if result is not None:
            ck = self.checkpoints[job.checkpoint or ""]
            self.results[ch.result_uri(ck["spec"]["uri"], step)] = result
        return job.name

    def checkpoint(self, name: str) -> dict[str, Any]:
        return self.checkpoints[name]

    def condition(self, type_: str) -> dict[str, Any]:
        return next(c for c in self.rlcycle["status"]["conditions"] if c["type"] == type_)

    def reasons(self) -> list[str]:
        return [e.reason for e in self.events]


def run_cycle(world: World, eval_doc: dict[str, Any] = EVAL_PASS) -> None:
    world.reconcile()
    world.finish("stage", result=STAGE_OK)
    world.reconcile()
    world.finish("train", result=TRAIN_OK)
    world.reconcile()
    world.finish("eval", result=eval_doc)
    world.reconcile()


def test_a_cycle_runs_stage_train_eval_and_ends_evaluated() -> None:
    world = World()
    first = world.reconcile()
    status = world.rlcycle["status"]
    assert status["phase"] == "Staging" and status["cycle"] == 1
    assert status["serving"] == "composer-0" and status["candidate"] == "composer-1"
    assert world.created == ["Checkpoint/composer-1", "Job/composer-1-stage-0"]
    assert "composer-1-config" in world.config_maps
    assert first.requeue_after is None  # waiting on the Job: its events wake the reconciler
    ck = world.checkpoint("composer-1")
    assert ck["spec"]["parent"] == "composer-0" and ck["spec"]["cycle"] == 1
    assert ck["spec"]["uri"].startswith("s3://rtrl-artifacts/composer/cycles/composer-1-")
    assert ck["status"]["phase"] == "Staging"

    world.finish("stage", result=STAGE_OK)
    world.reconcile()
    ck = world.checkpoint("composer-1")
    assert ck["status"]["phase"] == "Training"
    assert ck["status"]["data"] == {
        "manifest": ch.step_out(ck["spec"]["uri"], "stage"),
        "interactions": 2000,
        "tokens": 90000,
        "onPolicyFraction": 0.95,
        "quarantined": {"truncated": 3},
        "filesBad": 0,
    }
    assert "composer-1-train" in world.services  # headless Service for the rendezvous
    assert world.rlcycle["status"]["phase"] == "Training"

    world.finish("train", result=TRAIN_OK)
    world.reconcile()
    ck = world.checkpoint("composer-1")
    assert ck["status"]["phase"] == "Evaluating" and ck["status"]["training"]["steps"] == 4

    world.finish("eval", result=EVAL_PASS)
    world.reconcile()
    ck = world.checkpoint("composer-1")
    assert ck["status"]["phase"] == "Evaluated" and ck["status"]["reason"] == "EvalPassed"
    assert ck["status"]["eval"]["verdict"] == "Passed"
    assert ck["status"]["eval"]["gates"][0]["metric"] == "tasks.pass_at_1"
    status = world.rlcycle["status"]
    assert status["phase"] == "Idle" and status["candidate"] == "composer-1"
    assert status["nextRun"] == "2026-11-29T05:00:00Z"  # interval 5h after the start
    assert {c["type"] for c in status["conditions"]} == {
        "Ready", "Progressing", "Degraded", "InsufficientData", "InvalidSpec"
    }  # fmt: skip
    assert world.condition("Ready")["status"] == "True"
    assert world.condition("Progressing")["reason"] == "EvalPassed"
    assert world.reasons() == [
        "CycleStarted", "StageStarted", "Staged", "TrainStarted", "Trained", "EvalStarted",
        "EvalPassed", "CycleCompleted",
    ]  # fmt: skip
    assert world.created == [
        "Checkpoint/composer-1", "Job/composer-1-stage-0", "Job/composer-1-train-0",
        "Job/composer-1-eval-0",
    ]  # fmt: skip


def test_replanning_without_change_creates_nothing_new() -> None:
    world = World()
    world.reconcile()
    again = plan(world.observed(), world.now)
    creates = [a for a in again.actions if isinstance(a, Create)]
    assert creates == [] and not [a for a in again.actions if isinstance(a, Emit)]


def test_next_cycle_waits_for_the_interval_then_starts() -> None:
    world = World()
    run_cycle(world)
    world.now = T0 + timedelta(hours=4, minutes=59)
    decided = world.reconcile()
    assert world.rlcycle["status"]["phase"] == "Idle"
    assert decided.requeue_after == pytest.approx(60)
    world.now = T0 + timedelta(hours=5)
    world.reconcile()
    assert world.rlcycle["status"]["cycle"] == 2
    assert world.checkpoint("composer-2")["spec"]["parent"] == "composer-0"


def test_rejected_candidate_leaves_serving_untouched() -> None:
    world = World()
    failed = {**EVAL_PASS, "passed": False, "message": "failed gate(s): tasks.pass_at_1"}
    run_cycle(world, failed)
    ck = world.checkpoint("composer-1")
    assert ck["status"]["phase"] == "Rejected" and ck["status"]["reason"] == "EvalGatesFailed"
    assert world.rlcycle["status"]["serving"] == "composer-0"
    assert "EvalGatesFailed" in world.reasons()


def test_insufficient_data_removes_the_attempt_and_retries_at_the_next_tick() -> None:
    world = World()
    world.reconcile()
    world.finish(
        "stage",
        result={**STAGE_OK, "sufficient": False, "message": "insufficient data: 12 interactions"},
    )
    world.reconcile()
    assert "composer-1" not in world.checkpoints  # no Checkpoint left dangling
    assert world.jobs == {} and world.config_maps == set()
    condition = world.condition("InsufficientData")
    assert condition["status"] == "True" and "12 interactions" in condition["message"]
    status = world.rlcycle["status"]
    assert status["phase"] == "Idle" and status["nextRun"] == "2026-11-29T05:00:00Z"
    world.now = T0 + timedelta(hours=5)
    world.reconcile()
    # a fresh cycle number and fresh store locations: nothing of the attempt is reused
    assert status["cycle"] == 1 and world.rlcycle["status"]["cycle"] == 2
    world.finish("stage", result=STAGE_OK)
    world.reconcile()
    assert world.condition("InsufficientData")["status"] == "False"


def test_a_failed_job_is_retried_with_backoff_then_fails_the_checkpoint() -> None:
    world = World(jobs={"backoffLimit": 1, "backoff": "30s"})
    world.reconcile()
    world.finish("stage", fail="pod composer-1-stage-0-abcde: Error (exit 1): store unreachable")
    decided = world.reconcile()
    assert decided.requeue_after == pytest.approx(30)
    assert list(world.jobs) == ["composer-1-stage-0"]
    world.now += timedelta(seconds=30)
    world.reconcile()
    assert list(world.jobs) == ["composer-1-stage-0", "composer-1-stage-1"]
    assert "StageRetrying" in world.reasons()
    world.finish("stage", fail="pod composer-1-stage-1-fghij: OOMKilled (exit 137)")
    world.reconcile()
    ck = world.checkpoint("composer-1")
    assert ck["status"]["phase"] == "Failed" and ck["status"]["reason"] == "StageFailed"
    assert "OOMKilled (exit 137)" in ck["status"]["message"]
    assert world.condition("Degraded")["status"] == "True"
    assert world.rlcycle["status"]["serving"] == "composer-0"
    assert world.rlcycle["status"]["phase"] == "Idle"


def test_job_success_without_a_committed_result_fails_the_cycle() -> None:
    world = World()
    world.reconcile()
    world.finish("stage")  # exit 0, but nothing committed
    world.reconcile()
    ck = world.checkpoint("composer-1")
    assert ck["status"]["phase"] == "Failed" and ck["status"]["reason"] == "ResultMissing"


@pytest.mark.parametrize(
    ("change", "reason", "field"),
    [
        ({"deployment": DeploymentState(found=False)}, "DeploymentNotFound",
         "spec.target.deployment"),
        ({"deployment": DeploymentState(True, False)}, "ContainerNotFound",
         "spec.target.container"),
        ({"secret": SecretState(found=False)}, "SecretNotFound", "spec.storage.credentialsSecret"),
        ({"secret": SecretState(True, ("AWS_SECRET_ACCESS_KEY",))}, "SecretIncomplete",
         "spec.storage.credentialsSecret"),
        ({"deployment": DeploymentState(True, True, "s3://elsewhere/m/")},
         "ServingCheckpointUnknown", "spec.target"),
    ],
)  # fmt: skip
def test_missing_dependencies_are_conditions_with_the_field_and_recover(
    change: dict[str, Any], reason: str, field: str
) -> None:
    world = World()
    good = {"deployment": world.deployment, "secret": world.secret}
    for key, value in change.items():
        setattr(world, key, value)
    decided = world.reconcile()
    assert [a for a in decided.actions if isinstance(a, Create)] == []
    status = world.rlcycle["status"]
    assert status["phase"] == "Invalid"
    condition = world.condition("InvalidSpec")
    assert condition["status"] == "True" and condition["reason"] == reason
    assert condition["message"].startswith(field + ":") or condition["message"].startswith(field)
    assert world.condition("Ready")["status"] == "False"
    for key, value in good.items():
        setattr(world, key, value)
    world.reconcile()
    assert world.rlcycle["status"]["phase"] == "Staging"
    assert world.condition("InvalidSpec")["status"] == "False"
    assert "SpecValid" in world.reasons()


def test_a_spec_the_crd_accepts_but_the_models_reject_is_invalid_spec() -> None:
    world = World()
    world.rlcycle["spec"]["rollout"]["analysis"]["maxDuration"] = "1h"  # < the steps' sum
    decided = world.reconcile()
    assert decided.actions and all(isinstance(a, Emit) for a in decided.actions)
    condition = world.condition("InvalidSpec")
    assert condition["reason"] == "SpecInvalid"
    assert condition["message"].startswith("spec:") or "maxDuration" in condition["message"]
    world.reconcile()  # no second Event for the same problem
    assert world.reasons() == ["SpecInvalid"]


def test_invalid_spec_keeps_last_transition_time() -> None:
    world = World(schedule={"interval": "5h", "cron": "0 * * * *"})
    world.reconcile()
    first = world.condition("InvalidSpec")["lastTransitionTime"]
    world.now += timedelta(minutes=10)
    world.reconcile()
    assert world.condition("InvalidSpec")["lastTransitionTime"] == first


def test_suspend_starts_nothing_but_lets_a_running_cycle_finish() -> None:
    world = World(suspend=True)
    world.reconcile()
    assert world.rlcycle["status"]["phase"] == "Suspended" and world.created == []
    world.rlcycle["spec"]["suspend"] = False
    world.reconcile()
    world.rlcycle["spec"]["suspend"] = True
    world.finish("stage", result=STAGE_OK)
    world.reconcile()
    assert world.checkpoint("composer-1")["status"]["phase"] == "Training"


def test_trigger_annotation_starts_one_cycle_per_value() -> None:
    world = World()
    run_cycle(world)
    world.now = T0 + timedelta(hours=1)
    world.rlcycle["metadata"]["annotations"] = {ch.ANNOTATION_TRIGGER: "2026-11-29T01:00:00Z"}
    world.reconcile()
    assert world.rlcycle["status"]["cycle"] == 2
    assert world.rlcycle["status"]["lastTrigger"] == "2026-11-29T01:00:00Z"
    ck = world.checkpoint("composer-2")
    assert ck["metadata"]["annotations"][ch.ANNOTATION_TRIGGER] == "2026-11-29T01:00:00Z"
    world.finish("stage", result=STAGE_OK)
    world.finish  # noqa: B018
    world.reconcile()
    world.finish("train", result=TRAIN_OK)
    world.reconcile()
    world.finish("eval", result=EVAL_PASS)
    world.reconcile()
    # the same value again starts nothing, even if the status were lost
    world.rlcycle["status"]["lastTrigger"] = None
    world.reconcile()
    assert world.rlcycle["status"]["cycle"] == 2


def test_cron_schedule_first_run_after_creation() -> None:
    world = World(schedule={"cron": "30 */6 * * *"})
    decided = world.reconcile()
    assert world.rlcycle["status"]["nextRun"] == "2026-11-29T00:30:00Z"
    assert decided.requeue_after == pytest.approx(30 * 60)
    world.now = T0 + timedelta(minutes=30)
    world.reconcile()
    assert world.rlcycle["status"]["cycle"] == 1
    assert world.rlcycle["status"]["nextRun"] == "2026-11-29T06:30:00Z"


@pytest.mark.parametrize(
    ("expression", "after", "expected"),
    [
        ("0 */5 * * *", "2026-11-29T04:59:00", "2026-11-29T05:00:00"),
        ("0 0 1 * *", "2026-11-29T00:00:00", "2026-12-01T00:00:00"),
        ("0 9 * * mon", "2026-11-29T10:00:00", "2026-11-30T09:00:00"),  # 29 Nov 2026 is Sunday
        ("0 0 13 * fri", "2026-11-29T00:00:00", "2026-12-04T00:00:00"),  # dom OR dow
        ("0 0 29 2 *", "2026-11-29T00:00:00", "2028-02-29T00:00:00"),
        ("0 0 30 2 *", "2026-11-29T00:00:00", None),
    ],
)
def test_next_cron(expression: str, after: str, expected: str | None) -> None:
    moment = datetime.fromisoformat(after).replace(tzinfo=UTC)
    found = next_cron(parse_cron(expression), moment)
    assert (found.isoformat()[:19] if found else None) == expected


def test_pin_starts_no_cycles() -> None:
    world = World(pin="composer-0")
    world.reconcile()
    assert world.rlcycle["status"]["phase"] == "Pinned" and world.created == []
    world.rlcycle["spec"]["pin"] = "composer-9"
    world.reconcile()
    assert world.condition("InvalidSpec")["reason"] == "PinnedCheckpointNotFound"


def test_history_limit_prunes_old_checkpoints_but_never_protected_ones() -> None:
    world = World(historyLimit=2)
    for n in range(1, 6):
        world.now = T0 + timedelta(hours=5 * (n - 1))
        run_cycle(world, {**EVAL_PASS, "passed": n != 3})
    world.reconcile()
    owned = sorted(c for c in world.checkpoints if c != "composer-0")
    assert owned == ["composer-4", "composer-5"]
    assert "composer-0" in world.checkpoints  # the serving one (made by hand) stays
    assert world.reasons().count("CheckpointPruned") == 3


def test_history_limit_keeps_the_serving_checkpoint_and_its_parent() -> None:
    world = World(historyLimit=1)
    run_cycle(world)
    # composer-1 now serves (as a promotion would leave it)
    world.deployment = DeploymentState(True, True, world.checkpoint("composer-1")["spec"]["uri"])
    for n in (1, 2):
        world.now = T0 + timedelta(hours=5 * n)
        run_cycle(world)
    assert world.checkpoint("composer-3")["spec"]["parent"] == "composer-1"
    assert set(world.checkpoints) == {"composer-0", "composer-1", "composer-3"}


def test_stale_job_of_an_earlier_incarnation_is_deleted() -> None:
    world = World()
    world.reconcile()
    old = world.jobs.pop("composer-1-stage-0")
    world.jobs["composer-1-stage-0"] = JobState(**{**old.__dict__, "checkpoint_uid": "gone"})
    decided = plan(world.observed(), world.now)
    assert Delete("batch/v1", "Job", "composer-1-stage-0") in decided.actions


def test_step_jobs_follow_the_contract() -> None:
    world = World()
    world.reconcile()
    world.finish("stage", result=STAGE_OK)
    world.reconcile()
    job = world.manifests["composer-1-train-0"]
    ck = world.checkpoint("composer-1")
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == 2
    assert spec["backoffLimit"] == 0
    assert spec["activeDeadlineSeconds"] == 12 * 3600  # spec.jobs.activeDeadline
    pod = spec["template"]["spec"]
    assert pod["subdomain"] == "composer-1-train" and pod["restartPolicy"] == "Never"
    container = pod["containers"][0]
    assert container["command"] == ["torchrun"]
    assert f"--out={ck['spec']['uri']}" in container["args"]
    env = {e["name"]: e for e in container["env"]}
    assert env["MASTER_ADDR"]["value"] == "composer-1-train-0-0.composer-1-train"
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"] == {
        "name": "s3-creds", "key": "AWS_SECRET_ACCESS_KEY"
    }  # fmt: skip
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["nodeSelector"] == {"node.kubernetes.io/instance-type": "p5.48xlarge"}
    assert job["metadata"]["ownerReferences"][0]["uid"] == ck["metadata"]["uid"]
    stage = world.manifests["composer-1-stage-0"]["spec"]["template"]["spec"]["containers"][0]
    assert "--checkpoint=composer-0" in stage["args"]
    assert "--now=" + ck["metadata"]["annotations"][ch.ANNOTATION_STARTED] in stage["args"]
    assert "--ranks=16" in stage["args"]


def test_deletion_removes_children_but_not_the_serving_base() -> None:
    world = World()
    world.reconcile()
    actions, done = plan_deletion(world.observed())
    assert not done
    world.apply(actions)
    assert world.jobs == {} and list(world.checkpoints) == ["composer-0"]
    _, done = plan_deletion(world.observed())
    assert done
