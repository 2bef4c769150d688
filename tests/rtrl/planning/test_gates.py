"""Approval gates of the canary (rtrl.planning.gates), decided by the pure planner: a gate
holds the canary while the analyses go on, a rollback is never held, an approval is taken
once (also when the status write that recorded it was lost), and one given while nothing
waited releases nothing."""

from __future__ import annotations

import copy
import dataclasses
from datetime import timedelta
from typing import Any

from rtrl.planning import Observed, PatchStatus, plan
from rtrl.planning.plan import validate_spec
from tests.rtrl.planning.test_plan import World, analysis, to_canary


class GatedWorld(World):
    """A World whose kube layer reports what the confirm webhook answered."""

    def __init__(self, **spec: Any) -> None:
        super().__init__(**spec)
        self.confirmed: bool | None = None

    def observed(self) -> Observed:
        return dataclasses.replace(super().observed(), confirmed=self.confirmed)


def gated(step_approval: str | None = "manual", promotion: str | None = None) -> GatedWorld:
    world = GatedWorld()
    rollout = copy.deepcopy(world.rlcycle["spec"]["rollout"])
    if step_approval:
        rollout["steps"][1]["approval"] = step_approval
    if promotion:
        rollout["approval"] = promotion
    if "webhook" in (step_approval, promotion):
        rollout["confirmWebhook"] = {
            "urlSecret": {"name": "hooks", "key": "confirm"},
            "interval": "2m",
        }
    world.rlcycle["spec"]["rollout"] = rollout
    return world


def judge(world: World, decision: str) -> None:
    """The next analysis runs and decides ``decision`` (with enough samples to move on)."""
    world.now += timedelta(hours=1)
    world.reconcile()
    job = next(j for j in world.jobs.values() if "analyze" in (j.step or "") and not j.finished)
    world.finish(job.step or "", result=analysis(decision, samples=200_000))
    world.reconcile()
    world.settle()
    world.reconcile()


def records(world: World) -> list[dict[str, Any]]:
    return list(world.checkpoint("composer-1")["status"]["rollout"])


def approve(world: World, token: str) -> None:
    world.rlcycle["metadata"]["annotations"] = {"rtrl.io/approve": token}


def test_a_manual_gate_holds_the_step_while_the_analyses_go_on_until_approved() -> None:
    world = gated("manual")
    to_canary(world)
    judge(world, "continue")
    judge(world, "continue")
    status = world.rlcycle["status"]
    assert [r["weight"] for r in records(world)] == [5]  # held at 5%, not moved to 25%
    assert records(world)[0]["analyses"] == 2 and records(world)[0]["gate"] == "step"
    assert status["phase"] == "AwaitingApproval"
    assert status["awaitingApproval"]["mode"] == "manual"
    assert status["awaitingApproval"]["weight"] == 25
    assert world.condition("AwaitingApproval")["status"] == "True"
    assert world.reasons().count("AwaitingApproval") == 1  # once, not every analysis
    approve(world, "ok-1")
    world.reconcile()
    world.settle()
    world.reconcile()
    assert [r["weight"] for r in records(world)] == [5, 25]
    assert records(world)[0]["approved"] == "rtrl.io/approve=ok-1"
    status = world.rlcycle["status"]
    assert status["lastApprove"] == "ok-1" and status["awaitingApproval"] is None
    assert status["phase"] == "Canary"
    assert world.condition("AwaitingApproval")["status"] == "False"
    assert "Approved" in world.reasons()


def test_a_rollback_is_never_held_by_a_gate() -> None:
    world = gated("manual", promotion="manual")
    to_canary(world)
    judge(world, "continue")
    assert world.rlcycle["status"]["phase"] == "AwaitingApproval"
    judge(world, "rollback")
    assert world.checkpoint("composer-1")["status"]["phase"] == "RolledBack"
    assert world.rlcycle["status"]["phase"] == "Idle"
    assert world.rlcycle["status"]["awaitingApproval"] is None


def test_an_approval_is_taken_once_when_its_status_write_is_lost() -> None:
    world = gated("manual")
    to_canary(world)
    judge(world, "continue")
    approve(world, "ok-1")
    decided = plan(world.observed(), world.now)
    # the crash: the Checkpoint's write was done, the RLCycle's status write never came
    world.apply([a for a in decided.actions if isinstance(a, PatchStatus) and a.kind != "RLCycle"])
    world.reconcile(2)
    world.settle()
    judge(world, "continue")
    judge(world, "continue")
    assert [r["weight"] for r in records(world)] == [5, 25, 50]  # no gate on 50%
    assert world.rlcycle["status"]["lastApprove"] == "ok-1"
    assert "ApprovalIgnored" not in world.reasons()


def test_an_approval_given_while_no_gate_waits_releases_nothing_later() -> None:
    world = gated("manual")
    to_canary(world)
    approve(world, "early")
    world.reconcile()
    assert world.rlcycle["status"]["lastApprove"] == "early"
    assert "ApprovalIgnored" in world.reasons()
    judge(world, "continue")
    assert world.rlcycle["status"]["phase"] == "AwaitingApproval"
    assert [r["weight"] for r in records(world)] == [5]


def test_a_webhook_gate_holds_until_the_confirm_webhook_answers_200() -> None:
    world = gated("webhook")
    to_canary(world)
    judge(world, "continue")
    assert world.rlcycle["status"]["awaitingApproval"]["mode"] == "webhook"
    world.confirmed = False  # it answered 403
    decided = world.reconcile()
    assert [r["weight"] for r in records(world)] == [5]
    assert decided.requeue_after is not None and decided.requeue_after <= 120  # asked again
    world.confirmed = True
    world.reconcile()
    assert [r["weight"] for r in records(world)] == [5, 25]
    assert records(world)[0]["approved"] == "confirm webhook answered 200"


def test_a_promotion_gate_holds_the_analysis_promotion_until_approved() -> None:
    world = gated(None, promotion="manual")
    to_canary(world)
    judge(world, "promote")
    ck = world.checkpoint("composer-1")
    assert ck["status"]["phase"] == "Canary"
    assert records(world)[-1]["decision"] == "continue"
    # held, as a field; the words a user reads are those of before
    assert records(world)[-1]["held"] == "promote"
    assert not records(world)[-1]["reason"].startswith("promotion awaits approval: ")
    held = [e.message for e in world.events if e.reason == "AnalysisPromote"]
    assert held == ["composer-1: promotion awaits approval: edit_persistence: promote"]
    assert world.rlcycle["status"]["awaitingApproval"]["gate"] == "promotion"
    approve(world, "ship")
    world.reconcile()
    world.settle()
    world.reconcile()
    assert world.checkpoint("composer-1")["status"]["phase"] == "Promoted"
    assert records(world)[-1]["decision"] == "promote" and "held" not in records(world)[-1]
    assert records(world)[-1]["reason"] == (
        "edit_persistence: promote (approved: rtrl.io/approve=ship)"
    )


def test_gate_rules_name_the_field() -> None:
    world = gated(None)
    spec = copy.deepcopy(world.rlcycle["spec"])
    spec["rollout"]["steps"][0]["approval"] = "manual"
    _, problem = validate_spec(spec)
    assert problem.startswith("spec.rollout.steps: steps[0].approval: "), problem
    spec = copy.deepcopy(world.rlcycle["spec"])
    spec["rollout"]["approval"] = "webhook"
    _, problem = validate_spec(spec)
    assert problem.startswith("spec.rollout: approval webhook needs confirmWebhook"), problem
