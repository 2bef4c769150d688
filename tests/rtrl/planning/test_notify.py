"""Notifications decided by the pure planner (rtrl.planning.notify): the outbox in the
RLCycle's status gets one entry per decision, for the webhooks that want it; what the kube
layer delivered leaves it; a decision planned again after a crash keeps its id, so it is in
the outbox once; a delivery given up is a condition and a Warning Event."""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from typing import Any

from rtrl.core.results import AnalysisCause, AnalysisResult, CauseKind
from rtrl.planning import Observed, PatchStatus, plan
from tests.rtrl.planning.test_plan import World, analysis, run_cycle, to_canary

HOOKS = [
    {"name": "everything", "urlSecret": {"name": "hooks", "key": "all"}},
    {
        "name": "chat",
        "format": "slack",
        "events": ["Promoted", "RolledBack"],
        "urlSecret": {"name": "hooks", "key": "slack"},
    },
]


class NotifyingWorld(World):
    """A World whose kube layer reports the deliveries it is done with."""

    def __init__(self, **spec: Any) -> None:
        super().__init__(**spec)
        self.delivered: set[str] = set()
        self.undeliverable: list[tuple[str, str, str]] = []

    def observed(self) -> Observed:
        return dataclasses.replace(
            super().observed(),
            delivered=frozenset(self.delivered),
            undeliverable=tuple(self.undeliverable),
        )

    def outbox(self) -> list[dict[str, Any]]:
        return list(self.rlcycle["status"].get("outbox") or [])


def test_a_cycle_fills_the_outbox_with_its_decisions_for_the_webhooks_that_want_them() -> None:
    world = NotifyingWorld(notifications=HOOKS)
    run_cycle(world)
    events = [(e["event"], tuple(e["targets"])) for e in world.outbox()]
    assert events == [
        ("CycleStarted", ("everything",)),
        ("CanaryStarted", ("everything",)),
        ("Promoted", ("everything", "chat")),
        ("CycleCompleted", ("everything",)),
    ]
    promoted = world.outbox()[2]
    assert promoted["checkpoint"] == "composer-1" and promoted["cycle"] == 1
    assert promoted["message"] == "composer-1 now serves composer-vllm"
    assert len({e["id"] for e in world.outbox()}) == 4


def test_delivered_entries_leave_the_outbox_target_by_target() -> None:
    world = NotifyingWorld(notifications=HOOKS)
    run_cycle(world)
    promoted = next(e for e in world.outbox() if e["event"] == "Promoted")
    world.delivered = {f"{e['id']}/everything" for e in world.outbox()}
    world.reconcile()
    assert [(e["id"], e["targets"]) for e in world.outbox()] == [(promoted["id"], ["chat"])]
    assert world.condition("NotificationsDelivered")["status"] == "True"
    world.delivered.add(f"{promoted['id']}/chat")
    world.reconcile()
    assert world.rlcycle["status"]["outbox"] is None


def test_a_decision_planned_again_after_a_crash_is_in_the_outbox_once() -> None:
    """The kube layer writes the outbox before the round's changes; killed after that write
    (before or after the changes), the next operator plans the same decision again, with
    the same id."""
    world = NotifyingWorld(notifications=HOOKS)
    to_canary(world)
    world.now += timedelta(minutes=30)
    world.reconcile()
    world.finish("analyze-0", result=analysis("rollback"))
    decided = plan(world.observed(), world.now)  # the decision recorded on the Checkpoint
    world.apply(decided.actions)
    world.rlcycle["status"] = decided.status
    assert world.checkpoint("composer-1")["status"]["phase"] == "Canary"
    for crash_after_changes in (False, True):  # rounds that carry it out, killed
        decided = plan(world.observed(), world.now)
        status = dict(world.rlcycle["status"])
        world.rlcycle["status"] = {**status, "outbox": decided.status["outbox"]}
        if crash_after_changes:
            world.apply([a for a in decided.actions if isinstance(a, PatchStatus)])
    world.reconcile(2)
    rolled = [e for e in world.outbox() if e["event"] == "RolledBack"]
    assert len(rolled) == 1 and rolled[0]["targets"] == ["everything", "chat"]
    assert world.checkpoint("composer-1")["status"]["phase"] == "RolledBack"
    # the Event died with the operator that carried the rollback out; the notification not
    assert "RolledBack" not in world.reasons()
    assert [e["event"] for e in world.outbox()].count("CycleCompleted") == 1


def test_a_delivery_given_up_is_a_condition_and_a_warning_event() -> None:
    world = NotifyingWorld(notifications=HOOKS[:1])
    world.reconcile()
    started = world.outbox()[0]
    assert started["event"] == "CycleStarted"
    key = f"{started['id']}/everything"
    world.delivered = {key}
    world.undeliverable = [(started["id"], "everything", "HTTP 500")]
    world.reconcile()
    assert world.rlcycle["status"]["outbox"] is None
    condition = world.condition("NotificationsDelivered")
    assert condition["status"] == "False" and condition["reason"] == "DeliveryFailed"
    assert "HTTP 500" in condition["message"]
    failed = [e for e in world.events if e.reason == "NotificationFailed"]
    assert failed and failed[0].warning and "everything" in failed[0].message


def test_a_failed_notification_stays_failed_until_it_delivers_again() -> None:
    world = NotifyingWorld(notifications=HOOKS)
    run_cycle(world)
    first, *_ = world.outbox()
    promoted = next(e for e in world.outbox() if e["event"] == "Promoted")
    world.delivered = {f"{first['id']}/everything"}
    world.undeliverable = [(first["id"], "everything", "HTTP 502")]
    world.reconcile()
    world.undeliverable = []
    world.delivered = {f"{promoted['id']}/chat"}  # another webhook delivers: still failed
    world.reconcile()
    assert world.condition("NotificationsDelivered")["status"] == "False"
    world.delivered = {f"{promoted['id']}/everything"}
    world.reconcile()
    assert world.condition("NotificationsDelivered")["status"] == "True"


def test_without_notifications_the_status_has_no_outbox() -> None:
    world = NotifyingWorld()
    run_cycle(world)
    assert "outbox" not in world.rlcycle["status"]
    assert not any(
        c["type"] == "NotificationsDelivered" for c in world.rlcycle["status"]["conditions"]
    )


def test_a_notification_removed_from_the_spec_is_not_delivered() -> None:
    world = NotifyingWorld(notifications=HOOKS)
    run_cycle(world)
    world.rlcycle["spec"]["notifications"] = HOOKS[1:]
    world.reconcile()
    assert [e["targets"] for e in world.outbox()] == [["chat"]]


def _guardrail_world(doc: dict[str, Any]) -> list[Any]:
    """The canary's first analysis commits ``doc``: the Emits of the round that judges it."""
    world = NotifyingWorld(notifications=HOOKS)
    to_canary(world)
    world.now += timedelta(minutes=30)
    world.reconcile()
    world.finish("analyze-0", result=doc)
    world.reconcile()
    return [e for e in world.events if e.reason == "AnalysisRollback"]


def test_a_guardrail_trip_is_told_by_the_analysis_cause_not_its_words() -> None:
    """GuardrailTripped follows analysis.json's ``cause`` (kind guardrail), whatever its
    reasons say (rtrl 99043cc matched "guardrail tripped:" in the reasons' text: this
    trip, worded otherwise, sent no GuardrailTripped, and a rollback for another cause
    whose words began so sent one)."""
    tripped = AnalysisResult.written(
        {
            **analysis("rollback"),
            "cause": AnalysisCause(kind=CauseKind.GUARDRAIL, metrics=["clarification_rate"]),
            "reasons": ["clarification_rate rose beyond its band (+50%)"],
        }
    ).document()
    [emit] = _guardrail_world(tripped)
    assert emit.notify == ("GuardrailTripped",)
    worse = AnalysisResult.written(
        {
            **analysis("rollback"),
            "cause": AnalysisCause(kind=CauseKind.GOAL_WORSE, metrics=["edit_persistence"]),
            "reasons": ["guardrail tripped: none; edit_persistence significantly worse"],
        }
    ).document()
    [emit] = _guardrail_world(worse)
    assert emit.notify == ()


def test_a_guardrail_trip_in_an_analysis_of_rtrl_before_causes_still_notifies() -> None:
    """An analysis.json of version 1 (no cause): its lead reason, read once by the contract."""
    old = {
        **analysis("rollback"),
        "reasons": ["guardrail tripped: edit_rate moved beyond its band", "edit_rate: tripped"],
    }
    del old["version"]
    [emit] = _guardrail_world(old)
    assert emit.notify == ("GuardrailTripped",)
