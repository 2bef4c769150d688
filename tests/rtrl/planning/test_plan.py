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

import jsonpatch
import pytest

from rtrl.core.api import names
from rtrl.core.api.checkpoint import CheckpointStatus, Decision, TrainingSummary
from rtrl.core.api.cron import parse_cron
from rtrl.core.api.policy import UNRESTRICTED
from rtrl.core.api.rlcycle import RLCycleStatus
from rtrl.core.api.yamlfile import load
from rtrl.core.results import (
    AnalysisMetric,
    AnalysisResult,
    EvalGate,
    EvalResult,
    FidelityFigures,
    FidelityGate,
    RewardFigures,
    StageResult,
    TrainResult,
)
from rtrl.planning import (
    Create,
    Delete,
    DeploymentState,
    Emit,
    JobState,
    Observed,
    Patch,
    PatchStatus,
    SecretState,
    plan,
    results_to_read,
)
from rtrl.planning.manifests.jobs import CREDENTIALS_MOUNT
from rtrl.planning.manifests.names import result_uri, step_out
from rtrl.planning.schedule import next_cron
from tests.conftest import REPO

T0 = datetime(2026, 11, 29, 0, 0, tzinfo=UTC)
_uids = itertools.count(1)

# Step results built through their contracts (rtrl.core.results), as the steps write them.
STAGE_OK = StageResult(
    ok=True,
    sufficient=True,
    message="2000 interactions",
    interactions_used=2000,
    tokens_used=90000,
    on_policy_fraction=0.95,
    quarantined={"truncated": 3},
    quarantined_files=[],
    reward=RewardFigures(mean=0.31, std=0.42, min=-1.0, max=1.0),
    monitors={"edit_rate": 0.6, "invalid_tool_call_rate": None, "latency_p95_ms": 850.0},
    refused={"greedy": 2, "raw_logprobs_tempered": 0},
    fidelity=FidelityGate(
        checked=True, partitions_checked=2, partitions_quarantined=0,
        overall=FidelityFigures(rows=64, tokens=640, mean_abs_delta=0.004, max_abs_delta=0.03,
                                unsupported_fraction=0.0,
                                is_weight={"p01": 0.99, "p05": 0.995, "p50": 1.0, "p99": 1.01}),
    ),
).document()  # fmt: skip
TRAIN_OK = TrainResult(
    summary=TrainingSummary(steps=4, tokens=90000, loss=0.12, kl=0.003)
).document()
EVAL_PASS = EvalResult(
    passed=True,
    message="passed 1 gate(s)",
    gates=[
        EvalGate(metric="tasks.pass_at_1", candidate=0.5, parent=0.5, ci_low=-0.1, ci_high=0.1,
                 passed=True, mode="absolute")
    ],
).document()  # fmt: skip


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
        target = _doc("inference-deployment.yaml")
        target["metadata"].update(generation=1)
        target["spec"]["replicas"] = 19
        self.deployments: dict[str, dict[str, Any]] = {"composer-vllm": target}
        self.settle()
        # A test may replace what the kube layer reports about the target.
        self.deployment: DeploymentState | None = None
        # With the gatewayapi router: the stable Service the route's backendRef names.
        self.stable_service: dict[str, Any] | None = None
        self.secret: SecretState | None = SecretState(True)
        # The admin's policy the operator runs under (tests of it set one of their own).
        self.policy = UNRESTRICTED
        self.events: list[Emit] = []
        self.patches: list[Patch] = []
        self.analyses: list[str] = []
        self.created: list[str] = []
        self.now = T0

    def observed(self) -> Observed:
        obs = Observed(
            policy=self.policy,
            rlcycle=copy.deepcopy(self.rlcycle),
            checkpoints=[copy.deepcopy(c) for c in self.checkpoints.values()],
            jobs=list(self.jobs.values()),
            services=frozenset(self.services),
            config_maps=frozenset(self.config_maps),
            deployment=self.deployment or self.target_state(),
            secret=self.secret,
            target=copy.deepcopy(self.deployments.get("composer-vllm")),
            canary=copy.deepcopy(self.deployments.get("composer-vllm-canary")),
            http_route=copy.deepcopy(self.deployments.get("composer")),
            stable_service=copy.deepcopy(self.stable_service),
        )
        results = {uri: self.results.get(uri) for uri in results_to_read(obs)}
        return Observed(**{**obs.__dict__, "results": results})

    def target_state(self) -> DeploymentState:
        target = self.deployments.get("composer-vllm")
        if target is None:
            return DeploymentState(found=False)
        env = target["spec"]["template"]["spec"]["containers"][0]["env"]
        uri = next(e["value"] for e in env if e["name"] == "MODEL_URI")
        return DeploymentState(True, True, uri)

    def settle(self) -> None:
        """The Deployment controller: every Deployment rolled out and ready."""
        for dep in self.deployments.values():
            n = dep["spec"].get("replicas", 1)
            dep["status"] = {
                "observedGeneration": dep["metadata"]["generation"],
                "replicas": n, "updatedReplicas": n, "readyReplicas": n,
            }  # fmt: skip

    def serving_uri(self) -> str:
        return self.target_state().serving_uri or ""

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
                        checkpoint=labels[names.LABEL_CHECKPOINT],
                        checkpoint_uid=labels[names.LABEL_CHECKPOINT_UID],
                        step=labels[names.LABEL_STEP],
                        attempt=int(labels[names.LABEL_ATTEMPT]),
                    )
                    self.created.append(f"Job/{meta['name']}")
                    self.manifests = getattr(self, "manifests", {})
                    self.manifests[meta["name"]] = manifest
                elif action.kind == "Deployment" and meta["name"] not in self.deployments:
                    meta["generation"] = 1
                    self.deployments[meta["name"]] = manifest
                    self.created.append(f"Deployment/{meta['name']}")
                elif action.kind == "ConfigMap":
                    self.config_maps.add(meta["name"])
                elif action.kind == "Service":
                    self.services.add(meta["name"])
                    self.manifests = getattr(self, "manifests", {})
                    self.manifests[meta["name"]] = manifest
            elif isinstance(action, Patch) and action.kind == "RLCycle":
                self.patch_rlcycle(action.patch)
            elif isinstance(action, Patch):
                dep = self.deployments[action.name]
                before = copy.deepcopy(dep["spec"])
                if isinstance(action.patch, list):
                    try:
                        patched = jsonpatch.apply_patch(dep, action.patch)
                    except jsonpatch.JsonPatchTestFailed:
                        continue  # what the API server answers with 422
                    dep.clear()
                    dep.update(patched)
                else:
                    dep["spec"].update(action.patch["spec"])
                if dep["spec"] != before and "generation" in dep["metadata"]:
                    dep["metadata"]["generation"] += 1
                self.patches.append(action)
            elif isinstance(action, Delete):
                {
                    "Checkpoint": self.checkpoints,
                    "Job": self.jobs,
                    "Deployment": self.deployments,
                }.get(action.kind, {}).pop(action.name, None)  # type: ignore[attr-defined]
                self.config_maps.discard(action.name)
                self.services.discard(action.name)
            elif isinstance(action, PatchStatus) and action.kind == "RLCycle":
                self.rlcycle["status"] = {**(self.rlcycle.get("status") or {}), **action.status}
            elif isinstance(action, PatchStatus):
                ck = self.checkpoints[action.name]
                ck["status"] = {**(ck.get("status") or {}), **action.status}
            elif isinstance(action, Emit):
                self.events.append(action)

    def patch_rlcycle(self, patch: Any) -> None:
        """A merge patch of the RLCycle's metadata (its finalizers), as the API server
        applies it: refused (409) when it names a resourceVersion that is not the current."""
        meta, fields = self.rlcycle["metadata"], dict(patch["metadata"])
        wanted = fields.pop("resourceVersion", None)
        if wanted is not None and wanted != meta.get("resourceVersion"):
            raise RuntimeError(f"409: resourceVersion {wanted} is not {meta['resourceVersion']}")
        meta.update({k: v for k, v in fields.items() if v is not None})
        for key in [k for k, v in fields.items() if v is None]:
            meta.pop(key, None)
        meta["resourceVersion"] = str(int(meta.get("resourceVersion") or 0) + 1)

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
            self.results[result_uri(ck["spec"]["uri"], step)] = result
        return job.name

    def checkpoint(self, name: str) -> dict[str, Any]:
        return self.checkpoints[name]

    def condition(self, type_: str) -> dict[str, Any]:
        return next(c for c in self.rlcycle["status"]["conditions"] if c["type"] == type_)

    def reasons(self) -> list[str]:
        return [e.reason for e in self.events]


def analysis(decision: str, samples: int = 60_000) -> dict[str, Any]:
    return AnalysisResult(
        decision=Decision(decision),
        reasons=[f"edit_persistence: {decision}"],
        baseline_samples=samples,
        canary_samples=samples,
        metrics=[
            AnalysisMetric(name="edit_persistence", kind="goal", baseline=0.6, canary=0.62,
                           difference=0.02, ci_low=0.01, ci_high=0.03)
        ],
    ).document()  # fmt: skip


def analyse(world: World, decision: str) -> None:
    """An hour on: the next analysis runs and decides ``decision``; the plan follows it."""
    world.now += timedelta(hours=1)
    world.reconcile()
    world.finish(f"analyze-{len(world.analyses)}", result=analysis(decision))
    world.analyses.append(decision)
    world.reconcile()
    world.settle()
    world.reconcile()


def run_canary(world: World, *decisions: str) -> None:
    """From Evaluated: the canary comes up, each analysis decides in turn."""
    world.reconcile()
    world.settle()
    for decision in decisions:
        analyse(world, decision)


def run_cycle(world: World, eval_doc: dict[str, Any] = EVAL_PASS, canary: str = "promote") -> None:
    world.reconcile()
    world.finish("stage", result=STAGE_OK)
    world.reconcile()
    world.finish("train", result=TRAIN_OK)
    world.reconcile()
    world.finish("eval", result=eval_doc)
    world.reconcile()
    world.analyses = []
    if eval_doc["passed"]:
        run_canary(world, canary)


def test_a_cycle_runs_stage_train_eval_canary_and_promotes() -> None:
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
        "manifest": step_out(ck["spec"]["uri"], "stage"),
        "interactions": 2000,
        "tokens": 90000,
        "onPolicyFraction": 0.95,
        "quarantined": {"truncated": 3},
        "filesBad": 0,
        "reward": {"mean": 0.31, "std": 0.42, "min": -1.0, "max": 1.0},
        # a monitor undefined for the set (no tool calls) is left out, not made a 0
        "monitors": {"edit_rate": 0.6, "latency_p95_ms": 850.0},
        "refused": {"greedy": 2},  # a zero count is left out
        "fidelity": {
            "partitionsChecked": 2, "partitionsQuarantined": 0, "rows": 64, "tokens": 640,
            "meanAbsDelta": 0.004, "maxAbsDelta": 0.03, "unsupportedFraction": 0.0,
            "isWeightP01": 0.99, "isWeightP50": 1.0, "isWeightP99": 1.01,
        },
    }  # fmt: skip
    assert "composer-1-train" in world.services  # headless Service for the rendezvous
    assert world.rlcycle["status"]["phase"] == "Training"

    world.finish("train", result=TRAIN_OK)
    world.reconcile()
    ck = world.checkpoint("composer-1")
    assert ck["status"]["phase"] == "Evaluating" and ck["status"]["training"]["steps"] == 4

    world.finish("eval", result=EVAL_PASS)
    world.reconcile()
    ck = world.checkpoint("composer-1")
    assert ck["status"]["eval"]["verdict"] == "Passed"
    assert ck["status"]["eval"]["gates"][0]["metric"] == "tasks.pass_at_1"
    # eval passed: the canary comes up at the first step (5%) next to the 19 stable pods
    assert ck["status"]["phase"] == "Canary"
    (first,) = ck["status"]["rollout"]
    assert first == {"weight": 5, "share": 5.0, "startedAt": "2026-11-29T00:00:00Z",
                     "analyses": 0, "step": 0, "stepsHash": first["stepsHash"]}  # fmt: skip
    assert len(first["stepsHash"]) == 16
    canary = world.deployments["composer-vllm-canary"]
    assert canary["spec"]["replicas"] == 1
    env = {
        e["name"]: e["value"] for e in canary["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    # the candidate's URI and id; the rest of the template's env (the store's region) kept
    assert env == {"MODEL_URI": ck["spec"]["uri"], "RTRL_CHECKPOINT_ID": "composer-1",
                   "AWS_DEFAULT_REGION": "us-east-1"}  # fmt: skip
    labels = canary["spec"]["template"]["metadata"]["labels"]
    assert labels["app"] == "composer" and labels["rtrl.io/arm"] == "canary"
    status = world.rlcycle["status"]
    assert status["phase"] == "Canary" and status["canaryWeight"] == 5
    assert world.condition("Progressing")["status"] == "True"

    world.settle()
    world.reconcile()
    assert not [j for j in world.jobs if "analyze" in j]  # before the step's minDuration
    world.now += timedelta(minutes=30)
    world.reconcile()
    job = world.manifests["composer-1-analyze-0-0"]
    args = job["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[:3] == ["analyze", "--shards=s3://interactions/composer/", "--baseline=composer-0"]
    assert "--canary-weight=5.00" in args and "--since=2026-11-29T00:00:00Z" in args

    world.finish("analyze-0", result=analysis("continue", samples=25_000))
    world.reconcile()
    records = world.checkpoint("composer-1")["status"]["rollout"]
    assert [r["weight"] for r in records] == [5, 25]  # minSamples 20000 met: next step
    assert records[0]["decision"] == "continue" and records[0]["analyses"] == 1
    assert records[0]["metrics"][0]["name"] == "edit_persistence"
    assert world.deployments["composer-vllm-canary"]["spec"]["replicas"] == 6  # 6/25 = 24%

    world.settle()
    world.now += timedelta(hours=1)
    world.reconcile()
    world.finish("analyze-1", result=analysis("promote"))
    world.reconcile()
    assert world.rlcycle["status"]["phase"] == "Promoting"
    assert world.serving_uri() == ck["spec"]["uri"]  # the target now serves the candidate
    world.settle()
    world.reconcile()
    ck = world.checkpoint("composer-1")
    assert ck["status"]["phase"] == "Promoted"
    assert world.checkpoint("composer-0")["status"]["phase"] == "Superseded"
    assert "composer-vllm-canary" not in world.deployments
    status = world.rlcycle["status"]
    assert status["phase"] == "Idle" and status["serving"] == "composer-1"
    assert status["lastPromoted"] == "composer-1" and status["canaryWeight"] == 0
    assert status["nextRun"] == "2026-11-29T05:00:00Z"  # interval 5h after the start
    assert {c["type"] for c in status["conditions"]} == {
        "Ready", "Progressing", "Degraded", "InsufficientData", "InvalidSpec"
    }  # fmt: skip
    assert world.condition("Progressing")["reason"] == "Promoted"
    assert world.reasons() == [
        "CycleStarted", "StageStarted", "Staged", "TrainStarted", "Trained", "EvalStarted",
        "EvalPassed", "CanaryStarted", "AnalysisStarted", "AnalysisContinue", "CanaryStep",
        "AnalysisStarted", "AnalysisPromote", "Promoted",
    ]  # fmt: skip
    # the promotion touched exactly the checkpoint env vars of the target
    promotion = [p for p in world.patches if p.name == "composer-vllm"][-1]
    assert {op["path"] for op in promotion.patch if op["op"] == "replace"} == {
        "/spec/template/spec/containers/0/env/0/value",
        "/spec/template/spec/containers/0/env/1/value",
    }


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
    assert world.checkpoint("composer-2")["spec"]["parent"] == "composer-1"  # promoted


def test_rejected_candidate_leaves_serving_untouched() -> None:
    world = World()
    failed = {**EVAL_PASS, "passed": False, "message": "failed gate(s): tasks.pass_at_1"}
    run_cycle(world, failed)
    ck = world.checkpoint("composer-1")
    assert ck["status"]["phase"] == "Rejected" and ck["status"]["reason"] == "EvalGatesFailed"
    assert world.rlcycle["status"]["serving"] == "composer-0"
    assert "EvalGatesFailed" in world.reasons()


def test_a_candidate_whose_code_suites_were_not_scored_is_rejected_as_sandbox_unsafe() -> None:
    world = World()
    message = "not scored: tasks: sandbox guarantee(s) missing: no_network (a task can ...)"
    unsafe = {**EVAL_PASS, "passed": False, "reason": "SandboxUnsafe", "message": message}
    run_cycle(world, unsafe)
    ck = world.checkpoint("composer-1")
    assert ck["status"]["phase"] == "Rejected" and ck["status"]["reason"] == "SandboxUnsafe"
    assert ck["status"]["message"].startswith("not scored: tasks: sandbox guarantee(s)")
    assert world.rlcycle["status"]["serving"] == "composer-0"
    assert "SandboxUnsafe" in world.reasons()


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


def test_a_cycle_removed_for_insufficient_data_keeps_its_number_when_a_write_was_lost() -> None:
    """The status write of the round that created composer-1 was lost (the operator killed
    after the Checkpoint's creation): only the Checkpoint knew it was cycle 1. The verdict
    written before the Checkpoint is deleted must say so, or the restarted operator counted
    cycle 1 again (tests/e2e/test_crash_lifecycle.py: status.cycle 2 for 3 cycles, in CI)."""
    world = World()
    world.reconcile()
    world.rlcycle["status"]["cycle"] = 0  # the lost write
    world.finish("stage", result={**STAGE_OK, "sufficient": False, "message": "12 rows"})
    decided = plan(world.observed(), world.now)
    verdict = next(a for a in decided.actions if isinstance(a, PatchStatus))
    assert verdict.kind == "RLCycle" and verdict.status["cycle"] == 1
    world.apply(decided.actions[: decided.actions.index(verdict) + 2])  # verdict, delete: killed
    assert "composer-1" not in world.checkpoints
    world.reconcile()
    assert world.rlcycle["status"]["cycle"] == 1


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


def test_a_huge_failure_message_is_cut_to_what_the_api_accepts() -> None:
    """A pod's message is not ours to bound: the statuses must still validate, or the
    server would refuse every status write of the RLCycle from then on."""
    world = World(jobs={"backoffLimit": 0, "backoff": "1s"})
    world.reconcile()
    world.finish("stage", fail="pod composer-1-stage-0-abcde: Error (exit 1): " + "x" * 100_000)
    world.reconcile()
    ck = world.checkpoint("composer-1")
    assert ck["status"]["phase"] == "Failed"
    CheckpointStatus.model_validate(ck["status"])
    RLCycleStatus.model_validate(world.rlcycle["status"])
    assert len(world.condition("Degraded")["message"]) <= 32768


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


def test_a_name_children_cannot_carry_is_invalid_spec() -> None:
    """Stored before the CRD checked names: ``composer.v2`` would make Checkpoint and Job
    names the API server refuses, on every round."""
    world = World()
    world.rlcycle["metadata"]["name"] = "composer.v2"
    world.reconcile()
    status = world.rlcycle["status"]
    assert status["phase"] == "Invalid"
    invalid = world.condition("InvalidSpec")
    assert invalid["status"] == "True" and invalid["reason"] == "NameInvalid"
    assert invalid["message"].startswith("metadata.name: ")
    assert world.created == [] and world.jobs == {}


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


def test_a_trigger_whose_cycle_found_too_little_data_starts_no_second_cycle() -> None:
    """Killed after creating the cycle's Checkpoint, before the RLCycle's status named the
    trigger: once insufficient data has removed that Checkpoint, the trigger must not look
    new again (the crash suite saw cycles 3, 4 ... 22 started by one trigger)."""
    world = World()
    world.now = T0 + timedelta(
        minutes=10
    )  # after the first tick's start: only a trigger starts one
    run_cycle(world)
    world.rlcycle["metadata"]["annotations"] = {names.ANNOTATION_TRIGGER: "once"}
    decided = plan(world.observed(), world.now)
    world.apply([a for a in decided.actions if isinstance(a, Create)])  # then the crash
    world.reconcile()
    world.finish("stage", result={**STAGE_OK, "sufficient": False, "message": "too little"})
    world.reconcile(3)
    assert "composer-2" not in world.checkpoints
    assert world.rlcycle["status"]["lastTrigger"] == "once"
    world.reconcile(3)
    assert "composer-3" not in world.checkpoints and world.rlcycle["status"]["cycle"] == 2


def test_trigger_annotation_starts_one_cycle_per_value() -> None:
    world = World()
    run_cycle(world)
    world.now = T0 + timedelta(hours=1)
    world.rlcycle["metadata"]["annotations"] = {names.ANNOTATION_TRIGGER: "2026-11-29T01:00:00Z"}
    world.reconcile()
    assert world.rlcycle["status"]["cycle"] == 2
    assert world.rlcycle["status"]["lastTrigger"] == "2026-11-29T01:00:00Z"
    ck = world.checkpoint("composer-2")
    assert ck["metadata"]["annotations"][names.ANNOTATION_TRIGGER] == "2026-11-29T01:00:00Z"
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
    # credentials as files of the Secret, not env (planning/manifests/test_step_credentials.py)
    assert "AWS_SECRET_ACCESS_KEY" not in env
    assert env["RTRL_STORAGE_CREDENTIALS_DIR"]["value"] == CREDENTIALS_MOUNT
    assert {"name": "storage-credentials", "mountPath": CREDENTIALS_MOUNT,
            "readOnly": True} in container["volumeMounts"]  # fmt: skip
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["nodeSelector"] == {"node.kubernetes.io/instance-type": "p5.48xlarge"}
    assert job["metadata"]["ownerReferences"][0]["uid"] == ck["metadata"]["uid"]
    stage = world.manifests["composer-1-stage-0"]["spec"]["template"]["spec"]["containers"][0]
    assert "--checkpoint=composer-0" in stage["args"]
    assert "--now=" + ck["metadata"]["annotations"][names.ANNOTATION_STARTED] in stage["args"]
    assert "--ranks=16" in stage["args"]


def to_canary(world: World) -> None:
    """A cycle up to a ready canary at its first step."""
    world.reconcile()
    world.finish("stage", result=STAGE_OK)
    world.reconcile()
    world.finish("train", result=TRAIN_OK)
    world.reconcile()
    world.finish("eval", result=EVAL_PASS)
    world.reconcile()
    world.settle()
    world.reconcile()


def test_a_rollback_decision_restores_stable_and_excludes_the_checkpoint() -> None:
    world = World()
    to_canary(world)
    base_uri = world.serving_uri()
    world.now += timedelta(minutes=30)
    world.reconcile()
    harm = analysis("rollback")
    harm["reasons"] = ["edit_persistence: canary 0.55 vs 0.60: worse"]
    world.finish("analyze-0", result=harm)
    world.reconcile()
    ck = world.checkpoint("composer-1")
    assert ck["status"]["phase"] == "RolledBack"
    assert "edit_persistence: canary 0.55 vs 0.60: worse" in ck["status"]["message"]
    assert ck["status"]["rollout"][0]["metrics"][0]["name"] == "edit_persistence"
    assert "composer-vllm-canary" not in world.deployments
    assert world.serving_uri() == base_uri
    assert world.rlcycle["status"]["canaryWeight"] == 0
    assert "RolledBack" in world.reasons()
    # the next cycle never stages what the rolled-back checkpoint served
    world.now = T0 + timedelta(hours=5)
    world.reconcile()
    stage = world.manifests["composer-2-stage-0"]["spec"]["template"]["spec"]["containers"][0]
    assert "--exclude-checkpoint=composer-1" in stage["args"]


def test_a_canary_never_ready_is_rolled_back_after_the_ready_timeout() -> None:
    world = World()
    to_canary(world)
    world.deployments["composer-vllm-canary"]["status"] = {"readyReplicas": 0}
    world.now += timedelta(minutes=29)
    world.reconcile()
    assert world.checkpoint("composer-1")["status"]["phase"] == "Canary"
    world.now += timedelta(minutes=2)
    world.reconcile()
    ck = world.checkpoint("composer-1")
    assert ck["status"]["phase"] == "RolledBack"
    assert ck["status"]["message"] == "canary not ready within 30m"


def test_a_failing_analysis_rolls_back() -> None:
    world = World(jobs={"backoffLimit": 0, "backoff": "1s"})
    to_canary(world)
    world.now += timedelta(minutes=30)
    world.reconcile()
    world.finish("analyze-0", fail="pod x: Error (exit 1): store unreachable")
    world.reconcile()
    ck = world.checkpoint("composer-1")
    assert ck["status"]["phase"] == "RolledBack"
    assert "analysis failed" in ck["status"]["message"]


@pytest.mark.parametrize(
    "corrupt",
    [
        {"decision": "ship it"},
        {"metrics": [{"name": "edit_persistence", "kind": "goal", "canary": float("nan")}]},
        {"metrics": "edit_persistence"},
        {"baseline_samples": "many"},
        {"reasons": 7},
    ],
    ids=["decision", "nan-metric", "metrics-not-a-list", "samples", "reasons"],
)
def test_an_analysis_result_that_is_not_one_rolls_back_once(corrupt: dict) -> None:
    """A corrupt analysis.json (by hand, or a step of another version) is a failed analysis:
    the canary cannot be judged, so it is rolled back, once, not a round that raises for
    ever (a crash loop of the RLCycle's reconciler)."""
    world = World()
    to_canary(world)
    world.now += timedelta(minutes=30)
    world.reconcile()
    world.finish("analyze-0", result={**analysis("promote"), **corrupt})
    world.reconcile()
    ck = world.checkpoint("composer-1")
    assert ck["status"]["phase"] == "RolledBack"
    assert "is not a valid analysis result" in ck["status"]["message"]
    world.reconcile()
    assert world.reasons().count("RolledBack") == 1


@pytest.mark.parametrize("how", ["annotation", "pin"])
def test_manual_rollback_mid_canary(how: str) -> None:
    world = World()
    to_canary(world)
    if how == "annotation":
        world.rlcycle["metadata"]["annotations"] = {"rtrl.io/rollback": "oops-1"}
    else:
        world.rlcycle["spec"]["pin"] = "composer-0"
    world.reconcile()
    ck = world.checkpoint("composer-1")
    assert ck["status"]["phase"] == "RolledBack"
    assert "composer-vllm-canary" not in world.deployments
    if how == "annotation":
        assert "rtrl.io/rollback=oops-1" in ck["status"]["message"]
        assert world.rlcycle["status"]["lastRollback"] == "oops-1"
    else:  # in the same round the phase and the Progressing condition agree
        assert world.rlcycle["status"]["phase"] == "Pinned"
        assert world.condition("Progressing")["reason"] == "Pinned"


@pytest.mark.parametrize("key", ["rtrl.io/rollback", "rtrl.io/promote"])
def test_a_manual_decision_is_taken_once_when_its_status_write_is_lost(key: str) -> None:
    """Killed after the Checkpoint recorded the decision and before the RLCycle's status
    named the token, the next operator must not take the token again (once idle, a
    rollback would roll back the serving model a second time)."""
    world = World()
    to_canary(world)
    world.rlcycle["metadata"]["annotations"] = {key: "by-hand-1"}
    decided = plan(world.observed(), world.now)
    # the crash: the Checkpoint's write was done, the RLCycle's status write never came
    world.apply([a for a in decided.actions if isinstance(a, PatchStatus) and a.kind != "RLCycle"])
    world.reconcile(3)
    status_key = "lastRollback" if key.endswith("rollback") else "lastPromote"
    assert world.rlcycle["status"][status_key] == "by-hand-1"
    world.settle()
    world.reconcile(3)
    world.now += timedelta(minutes=1)
    world.reconcile(3)
    ck = world.checkpoint("composer-1")
    assert ck["status"]["phase"] == ("RolledBack" if key.endswith("rollback") else "Promoted")
    assert world.rlcycle["status"]["phase"] == "Idle"
    assert "RollbackImpossible" not in world.reasons()
    assert world.reasons().count("RolledBack") == (1 if key.endswith("rollback") else 0)
    # what took the token: the field the Checkpoint's write carried, not its words
    assert ck["status"]["requests"] == [{"annotation": key, "value": "by-hand-1"}]


def test_a_request_is_taken_by_the_checkpoints_requests_field_not_by_its_words() -> None:
    """Only ``status.requests`` says a request was carried out: a Checkpoint whose words
    end with the token (rtrl 99043cc matched ``<key>=<token>`` at the end of its messages
    and reasons by a regex) does not take it."""
    world = World()
    to_canary(world)
    ck = world.checkpoint("composer-1")
    ck["status"]["message"] = "the user wrote: (rtrl.io/rollback=oops-7)"
    world.rlcycle["metadata"]["annotations"] = {"rtrl.io/rollback": "oops-7"}
    world.reconcile()
    ck = world.checkpoint("composer-1")
    assert ck["status"]["phase"] == "RolledBack"
    assert ck["status"]["requests"] == [{"annotation": "rtrl.io/rollback", "value": "oops-7"}]
    assert world.rlcycle["status"]["lastRollback"] == "oops-7"


def test_manual_promotion_skips_the_analysis() -> None:
    world = World()
    to_canary(world)
    world.rlcycle["metadata"]["annotations"] = {"rtrl.io/promote": "ship-it"}
    world.reconcile()
    world.settle()
    world.reconcile()
    assert world.checkpoint("composer-1")["status"]["phase"] == "Promoted"
    assert world.rlcycle["status"]["lastPromote"] == "ship-it"


def test_inconclusive_until_max_duration_asks_for_the_policy() -> None:
    world = World()
    to_canary(world)
    for _ in range(12):
        world.now += timedelta(hours=1)
        world.reconcile()
        name = next(j for j in world.jobs if "analyze" in j and not world.jobs[j].finished)
        world.finish(world.jobs[name].step or "", result=analysis("continue", samples=10))
        world.reconcile()
        world.settle()
    last = [c.split("/")[1] for c in world.created if "-analyze-" in c][-1]
    args = world.manifests[last]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--max-duration-reached" in args  # 12h after the canary began
    records = world.checkpoint("composer-1")["status"]["rollout"]
    assert len(records) == 1 and records[0]["analyses"] >= 11  # minSamples never met
    # a Job per analysis would pile up over the hours: only the last judged one is kept
    # (the verdicts are in status.rollout)
    assert [j for j in world.jobs if "-analyze-" in j] == ["composer-1-analyze-11-0"]


def test_a_restarted_operator_carries_out_a_recorded_decision() -> None:
    world = World()
    to_canary(world)
    world.now += timedelta(minutes=30)
    world.reconcile()
    world.finish("analyze-0", result=analysis("promote"))
    decided = plan(world.observed(), world.now)
    # apply only the Checkpoint's status patch (the operator dies right after it)
    world.apply([a for a in decided.actions if isinstance(a, PatchStatus)])
    world.reconcile()
    world.settle()
    world.reconcile()
    assert world.checkpoint("composer-1")["status"]["phase"] == "Promoted"
    assert [j for j in world.created if "analyze" in j] == ["Job/composer-1-analyze-0-0"]


def test_gateway_api_router_weights_the_http_route() -> None:
    world = World(
        rollout={
            "router": "gatewayapi", "httpRoute": "composer", "service": "composer",
            "steps": [{"weight": 10, "minDuration": "10m"}], "analysis": {"maxDuration": "1h"},
        }
    )  # fmt: skip
    rules = [{"backendRefs": [{"name": "composer", "port": 8000}]}]
    route = {
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "HTTPRoute",
        "metadata": {"name": "composer", "generation": 1},
        "spec": {"rules": rules},
    }
    world.deployments["composer"] = route  # the World keeps patchable objects by name
    ports = [{"name": "http", "port": 8000, "targetPort": "http", "nodePort": 30080}]
    world.stable_service = {"metadata": {"name": "composer"}, "spec": {"ports": ports}}
    to_canary(world)
    refs = world.deployments["composer"]["spec"]["rules"][0]["backendRefs"]
    assert refs == [
        {"name": "composer", "port": 8000, "weight": 90},
        {"name": "composer-canary", "port": 8000, "weight": 10},
    ]
    # the canary Service serves the port the route names, on the pods' same target port
    canary_ports = world.manifests["composer-canary"]["spec"]["ports"]
    assert canary_ports == [{"name": "http", "port": 8000, "targetPort": "http"}]
    # a route already at the weight (as the server stores it, with defaults) is left alone
    for ref in refs:
        ref.update(group="", kind="Service")
    patches = len(world.patches)
    world.reconcile()
    assert len(world.patches) == patches
    labels = world.deployments["composer-vllm-canary"]["spec"]["template"]["metadata"]["labels"]
    assert "app" not in labels  # only the canary Service reaches these pods
    assert "composer-canary" in world.services
    world.rlcycle["metadata"]["annotations"] = {"rtrl.io/rollback": "r1"}
    world.reconcile()
    refs = world.deployments["composer"]["spec"]["rules"][0]["backendRefs"]
    assert refs == [{"name": "composer", "port": 8000, "weight": 100, "group": "",
                     "kind": "Service"}]  # fmt: skip
    assert "composer-canary" not in world.services


def test_gateway_api_router_with_unit_user_sends_the_bucketed_users_to_the_canary() -> None:
    world = World(
        rollout={
            "router": "gatewayapi", "httpRoute": "composer", "service": "composer",
            "unit": "user", "bucketHeader": "x-rtrl-bucket",
            "steps": [{"weight": 10, "minDuration": "10m"}, {"weight": 30, "minDuration": "10m"}],
            "analysis": {"maxDuration": "3h"},
        }
    )  # fmt: skip
    stable_ref = {"name": "composer", "port": 8000, "group": "", "kind": "Service", "weight": 1}
    world.deployments["composer"] = {
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "HTTPRoute",
        "metadata": {"name": "composer", "generation": 1},
        "spec": {"rules": [{"matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
                            "backendRefs": [stable_ref]}]},
    }  # fmt: skip
    world.stable_service = {"metadata": {"name": "composer"},
                            "spec": {"ports": [{"name": "http", "port": 8000}]}}  # fmt: skip

    def rules() -> list[dict[str, Any]]:
        return world.deployments["composer"]["spec"]["rules"]

    def canary_regex() -> str:
        return str(rules()[1]["matches"][0]["headers"][0]["value"])

    to_canary(world)
    assert rules()[0]["backendRefs"] == [{**stable_ref, "weight": 100}]
    assert rules()[1]["name"] == "rtrl-canary" and canary_regex() == "^[0-9]$"
    assert rules()[1]["backendRefs"] == [{**stable_ref, "name": "composer-canary", "weight": 100}]
    assert world.rlcycle["status"]["canaryWeight"] == 10
    patches = len(world.patches)
    world.reconcile()
    assert len(world.patches) == patches  # a route at the weight is left alone
    world.now += timedelta(minutes=30)
    world.reconcile()
    world.finish("analyze-0", result=analysis("continue"))
    world.reconcile()
    assert len(rules()) == 2 and canary_regex() == "^(?:[0-9]|[1-2][0-9])$"
    world.rlcycle["metadata"]["annotations"] = {"rtrl.io/rollback": "r1"}
    world.reconcile()
    assert rules() == [{"matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
                        "backendRefs": [{**stable_ref, "weight": 100}]}]  # fmt: skip
    assert world.checkpoint("composer-1")["status"]["phase"] == "RolledBack"


def test_gateway_api_router_without_its_service_rolls_the_canary_back() -> None:
    world = World(
        rollout={
            "router": "gatewayapi", "httpRoute": "composer", "service": "composer",
            "steps": [{"weight": 10, "minDuration": "10m"}], "analysis": {"maxDuration": "1h"},
        }
    )  # fmt: skip
    world.deployments["composer"] = {
        "metadata": {"name": "composer", "generation": 1},
        "spec": {"rules": [{"backendRefs": [{"name": "composer", "port": 8000}]}]},
    }
    to_canary(world)
    status = world.checkpoint("composer-1")["status"]
    assert status["phase"] == "RolledBack"
    assert "spec.rollout.service: Service composer not found" in status["message"]


def test_manual_rollback_without_a_canary_serves_the_previous_checkpoint_once() -> None:
    world = World()
    run_cycle(world)
    assert world.rlcycle["status"]["serving"] == "composer-1"
    world.now = T0 + timedelta(hours=2)
    world.rlcycle["metadata"]["annotations"] = {"rtrl.io/rollback": "back-1"}
    world.reconcile()
    world.settle()
    world.reconcile()
    assert world.serving_uri() == world.checkpoint("composer-0")["spec"]["uri"]
    assert world.checkpoint("composer-1")["status"]["phase"] == "RolledBack"
    assert "back-1: serving composer-0 again" in world.checkpoint("composer-1")["status"]["message"]
    # the parent serves again: Promoted, not Superseded (as the promotion had left it)
    parent = world.checkpoint("composer-0")["status"]
    assert parent["phase"] == "Promoted" and parent["reason"] == "ServingAgain"
    status = world.rlcycle["status"]
    assert status["serving"] == "composer-0" and status["lastRollback"] == "back-1"
    world.reconcile()  # the same annotation value never rolls back again
    assert world.serving_uri() == world.checkpoint("composer-0")["spec"]["uri"]
    assert world.reasons().count("RolledBack") == 1


def test_pin_serves_the_pinned_checkpoint() -> None:
    world = World()
    run_cycle(world)
    world.rlcycle["spec"]["pin"] = "composer-0"
    world.reconcile()
    assert world.serving_uri() == world.checkpoint("composer-0")["spec"]["uri"]
    assert world.rlcycle["status"]["phase"] == "Pinned"
    assert "Pinned" in world.reasons()


@pytest.mark.parametrize("how", ["pin", "annotation"])
def test_pin_or_rollback_during_training_cancels_the_cycle_and_acts_now(how: str) -> None:
    world = World()
    run_cycle(world)  # composer-1 serves
    world.now = T0 + timedelta(hours=5)
    world.reconcile()
    world.finish("stage", result=STAGE_OK)
    world.reconcile()  # composer-2 is training
    assert world.checkpoint("composer-2")["status"]["phase"] == "Training"
    if how == "pin":
        world.rlcycle["spec"]["pin"] = "composer-0"
    else:
        world.rlcycle["metadata"]["annotations"] = {"rtrl.io/rollback": "now"}
    world.reconcile()
    ck = world.checkpoint("composer-2")
    assert ck["status"]["phase"] == "Failed" and ck["status"]["reason"] == "Cancelled"
    assert "composer-2-train-0" not in world.jobs  # the running training Job is stopped
    assert world.serving_uri() == world.checkpoint("composer-0")["spec"]["uri"]
    assert "CycleCancelled" in world.reasons()


def test_a_checkpoint_status_rtrl_never_writes_is_invalid_not_a_crash() -> None:
    """Every step recorded yet a running phase (a stale writer before rtrl's status writes
    were conditional, or a hand edit): the round says so and acts on nothing."""
    world = World()
    run_cycle(world)
    ck = world.checkpoint("composer-1")
    ck["status"]["phase"] = "Evaluating"
    decided = world.reconcile()
    assert decided.status["phase"] == "Invalid"
    invalid = world.condition("InvalidSpec")
    assert invalid["reason"] == "CheckpointInconsistent"
    assert "composer-1: status.phase Evaluating" in invalid["message"]
    assert "kubectl patch checkpoint composer-1 --subresource=status" in invalid["message"]
    assert [a for a in decided.actions if not isinstance(a, Emit)] == []
    ck["status"]["phase"] = "Promoted"  # a person sets what is true: the RLCycle recovers
    assert world.reconcile().status["phase"] == "Idle"
    assert "SpecValid" in world.reasons()


EDITED_STEPS = [
    {"weight": 10, "minDuration": "30m", "minSamples": 20000},
    {"weight": 60, "minDuration": "1h", "minSamples": 50000},
]


@pytest.mark.parametrize("at", [0, 1, 2])
def test_steps_edited_mid_canary_restart_the_canary_at_the_new_first_step(at: int) -> None:
    """A GitOps commit edits spec.rollout.steps while the canary is at step ``at``. The step
    was the number of records, so the canary at 5% (step 0 of 3) jumped to the new list's
    weight at that index with no Event, and its record still said 5%. Now, as Argo Rollouts
    does on a new step hash, the steps restart at the new first step, the ended step says
    why, and an Event and the Progressing condition say what happened."""
    world = World()
    to_canary(world)
    for _ in range(at):  # each analysis moves the canary one step (minSamples met)
        analyse(world, "continue")
    before = world.checkpoint("composer-1")["status"]["rollout"]
    assert [r["weight"] for r in before] == [5, 25, 50][: at + 1]
    world.rlcycle["spec"]["rollout"]["steps"] = copy.deepcopy(EDITED_STEPS)
    world.rlcycle["metadata"]["generation"] += 1
    world.now += timedelta(minutes=1)
    world.reconcile()
    world.settle()
    world.reconcile()
    records = world.checkpoint("composer-1")["status"]["rollout"]
    assert [r["weight"] for r in records] == [*[5, 25, 50][: at + 1], 10]
    assert records[-1]["step"] == 0 and records[-1]["stepsHash"] != records[-2]["stepsHash"]
    assert "spec.rollout.steps changed" in records[-2]["reason"] and records[-2]["endedAt"]
    assert world.rlcycle["status"]["canaryWeight"] == 10
    assert world.deployments["composer-vllm-canary"]["spec"]["replicas"] == 2  # 2/21: 10%
    restarted = [e for e in world.events if e.reason == "RolloutRestarted"]
    assert len(restarted) == 1 and f"{[5, 25, 50][at]}%" in restarted[0].message
    assert "restarts at step 1 (10%)" in restarted[0].message
    CheckpointStatus.model_validate(world.checkpoint("composer-1")["status"])
    # the new steps run to the end: 10% then 60%, then the promotion
    analyse(world, "continue")
    records = world.checkpoint("composer-1")["status"]["rollout"]
    assert [r["weight"] for r in records][-2:] == [10, 60] and records[-1]["step"] == 1
    assert len([e for e in world.events if e.reason == "RolloutRestarted"]) == 1


def test_steps_edited_when_the_record_is_full_roll_the_canary_back() -> None:
    """Checkpoint.status.rollout holds 64 entries: a restart that needs one more rolls back,
    saying why, instead of a status write the API server would refuse in every round."""
    world = World()
    to_canary(world)
    ck = world.checkpoint("composer-1")
    first = ck["status"]["rollout"][0]
    ck["status"]["rollout"] = [{**first, "endedAt": first["startedAt"]}] * 62 + [first]
    world.rlcycle["spec"]["rollout"]["steps"] = copy.deepcopy(EDITED_STEPS)
    world.reconcile()
    world.settle()
    world.reconcile()
    status = world.checkpoint("composer-1")["status"]
    assert status["phase"] == "RolledBack" and len(status["rollout"]) == 63
    assert "spec.rollout.steps changed again with 63 canary steps" in status["message"]
    CheckpointStatus.model_validate(status)
