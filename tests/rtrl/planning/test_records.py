"""A canary's records as the planner reads and writes them (rtrl.planning.records): the
dicts written are the ones rtrl always wrote, a field another rtrl version wrote is kept
and not acted on, and a value this rtrl cannot take rolls the canary back saying which
field, instead of crashing every round."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

import pytest

from rtrl.planning.records import RecordError, read_records, written
from tests.rtrl.planning.test_plan import World, analysis, to_canary

# A record as rtrl writes it after an analysis held a promotion at a gate.
WRITTEN = {
    "weight": 10, "share": 50.0, "startedAt": "2026-11-29T00:00:00Z",
    "readyAt": "2026-11-29T00:01:00Z", "endedAt": "2026-11-29T02:00:00Z",
    "decision": "continue", "held": "promote", "reason": "edit_persistence: promote",
    "baselineSamples": 60000, "canarySamples": 60000,
    "metrics": [{"name": "edit_persistence", "baseline": 0.6, "canary": 0.62,
                 "difference": 0.02, "ciLow": 0.01, "ciHigh": 0.03, "verdict": "better"}],
    "analyses": 2, "awaitingApproval": "2026-11-29T01:00:00Z", "gate": "promotion",
    "approved": "rtrl.io/approve=ok-1", "step": 0, "stepsHash": "5d3ae4fd766100a2",
}  # fmt: skip


def _ck(*records: dict[str, Any]) -> dict[str, Any]:
    return {"status": {"rollout": list(records)}}


def test_a_record_is_written_back_as_it_was_read() -> None:
    restarted = {"weight": 5, "startedAt": "2026-11-29T02:00:00Z", "analyses": 0,
                 "restarted": "spec.rollout.steps changed at 10% (step 1)"}  # fmt: skip
    assert written(read_records(_ck(WRITTEN, restarted))) == [WRITTEN, restarted]


def test_a_field_this_rtrl_does_not_know_is_kept() -> None:
    newer = {**WRITTEN, "pausedAt": "2026-11-29T01:30:00Z"}
    records = read_records(_ck(newer))
    assert records[0].weight == 10
    assert written(records) == [newer]


@pytest.mark.parametrize(
    ("record", "field"),
    [
        ({**WRITTEN, "weight": 150}, "status.rollout[1].weight"),
        ({**WRITTEN, "decision": "pause"}, "status.rollout[1].decision"),
        ({k: v for k, v in WRITTEN.items() if k != "startedAt"}, "status.rollout[1].startedAt"),
        ("10%", "status.rollout[1]"),
    ],
)
def test_a_value_this_rtrl_cannot_take_names_its_field(record: Any, field: str) -> None:
    with pytest.raises(RecordError, match=rf"^{re.escape(field)}: "):
        read_records(_ck(WRITTEN, record))


def test_a_canary_whose_record_cannot_be_read_is_rolled_back_naming_the_field() -> None:
    world = World()
    to_canary(world)
    base_uri = world.serving_uri()
    ck = world.checkpoint("composer-1")
    ck["status"]["rollout"][0]["decision"] = "pause"  # no decision this rtrl knows
    world.now += timedelta(minutes=30)
    world.reconcile()
    status = world.checkpoint("composer-1")["status"]
    assert status["phase"] == "RolledBack"
    assert status["message"].startswith("status.rollout[0].decision: Input should be ")
    assert "this rtrl cannot read the canary's record" in status["message"]
    assert status["rollout"][0]["decision"] == "pause"  # left as it was found
    assert world.serving_uri() == base_uri
    assert "composer-vllm-canary" not in world.deployments
    rolled_back = next(e for e in world.events if e.reason == "RolledBack")
    assert "status.rollout[0].decision" in rolled_back.message
    progressing = world.condition("Progressing")
    assert (progressing["reason"], progressing["status"]) == ("RolledBack", "False")
    assert "status.rollout[0].decision" in progressing["message"]


def test_a_canary_whose_record_holds_a_field_this_rtrl_does_not_know_goes_on() -> None:
    world = World()
    to_canary(world)
    world.checkpoint("composer-1")["status"]["rollout"][0]["pausedAt"] = "2026-11-29T00:05:00Z"
    world.now += timedelta(minutes=30)
    world.reconcile()
    world.finish("analyze-0", result=analysis("continue"))
    world.reconcile()
    record = world.checkpoint("composer-1")["status"]["rollout"][0]
    assert (record["analyses"], record["decision"]) == (1, "continue")
    assert record["pausedAt"] == "2026-11-29T00:05:00Z"
    assert world.checkpoint("composer-1")["status"]["phase"] == "Canary"
