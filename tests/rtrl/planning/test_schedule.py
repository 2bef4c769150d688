"""The schedule never stops an RLCycle: a spec the planner cannot use is InvalidSpec, with
its field, from the first round (issue 19: ``interval: 3000000d`` passed ``rtrl validate``,
then every round after cycle 1 raised OverflowError and no condition said why), and every
value the models accept plans without an exception, up to the end of the calendar."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from rtrl.core.api.cron import parse_cron
from rtrl.core.api.rlcycle import ScheduleSpec
from rtrl.planning.schedule import next_cron, next_run
from tests.rtrl.planning.test_plan import (
    EVAL_PASS,
    STAGE_OK,
    T0,
    TRAIN_OK,
    World,
    analysis,
    run_cycle,
)


@pytest.mark.parametrize(
    ("schedule", "field", "problem"),
    [
        ({"interval": "3000000d"}, "spec.schedule.interval", "the maximum is 365d"),
        ({"interval": "366d"}, "spec.schedule.interval", "the maximum is 365d"),
        ({"cron": "0 0 31 2 *"}, "spec.schedule.cron", "never fires: no day 31 in February"),
    ],
)
def test_a_schedule_the_planner_cannot_use_is_invalid_spec(
    schedule: dict[str, str], field: str, problem: str
) -> None:
    world = World(schedule=schedule)
    world.reconcile()
    status = world.rlcycle["status"]
    invalid = world.condition("InvalidSpec")
    assert (status["phase"], invalid["status"], invalid["reason"]) == (
        "Invalid",
        "True",
        "SpecInvalid",
    )
    assert invalid["message"].startswith(f"{field}: ") and problem in invalid["message"]
    assert world.created == [] and world.jobs == {}


def test_a_schedule_stored_before_the_bounds_is_invalid_spec_after_cycle_1() -> None:
    """The issue's RLCycle: cycle 1 ran, then its spec says 3000000d. The next rounds say
    InvalidSpec (and keep saying it) instead of raising on every round."""
    world = World()
    run_cycle(world)
    world.rlcycle["spec"]["schedule"] = {"interval": "3000000d"}
    world.rlcycle["metadata"]["generation"] = 2
    for hours in (1, 6, 48):
        world.now = T0 + timedelta(hours=hours)
        world.reconcile()
        invalid = world.condition("InvalidSpec")
        assert invalid["status"] == "True", invalid
        assert invalid["message"].startswith("spec.schedule.interval: ")
    assert world.reasons().count("SpecInvalid") == 1  # one Event, not one per round
    world.rlcycle["spec"]["schedule"] = {"interval": "365d"}
    world.reconcile()
    assert world.condition("InvalidSpec")["status"] == "False"
    assert world.rlcycle["status"]["nextRun"] == "2027-11-29T00:00:00Z"


def test_every_duration_at_its_maximum_runs_a_cycle() -> None:
    """The bounds are ones the operator's arithmetic can take: a whole cycle with every
    duration at its maximum plans without an exception."""
    world = World(
        schedule={"interval": "365d"},
        jobs={"backoff": "1d", "activeDeadline": "30d", "backoffLimit": 10},
    )
    spec = world.rlcycle["spec"]
    spec["data"].update(maturity="365d", window="365d")
    spec["rollout"].update(
        readyTimeout="7d", steps=[{"weight": w, "minDuration": "30d"} for w in (5, 25, 50)]
    )
    spec["rollout"]["analysis"].update(maxDuration="365d", interval="1d", preExposure="365d")
    world.reconcile()
    for step, result in (("stage", STAGE_OK), ("train", TRAIN_OK), ("eval", EVAL_PASS)):
        world.finish(step, result=result)
        world.reconcile()
    world.settle()
    world.reconcile()
    for analysis_step in range(3):  # each canary step holds 30d, then its analysis promotes
        world.now += timedelta(days=31)
        world.reconcile()
        world.finish(f"analyze-{analysis_step}", result=analysis("promote"))
        world.reconcile()
        world.settle()
        world.reconcile()
        if world.checkpoint("composer-1")["status"]["phase"] == "Promoted":
            break
    assert world.checkpoint("composer-1")["status"]["phase"] == "Promoted"
    assert world.condition("InvalidSpec")["status"] == "False"
    assert world.rlcycle["status"]["nextRun"] == "2027-11-29T00:00:00Z"


@pytest.mark.parametrize("schedule", [{"interval": "365d"}, {"cron": "59 23 31 12 *"}])
def test_next_run_at_the_end_of_the_calendar_is_none_not_an_overflow(
    schedule: dict[str, str],
) -> None:
    """A start written by hand in year 9999: nothing can follow it."""
    spec = ScheduleSpec.model_validate(schedule)
    last = datetime(9999, 12, 31, 23, 59, tzinfo=UTC)
    assert next_run(spec, last, T0) is None


def test_next_cron_searches_eight_years_for_29_february() -> None:
    """2096 and 2104 are leap years, 2100 is not: the longest wait for a 29 February."""
    after = datetime(2096, 3, 1, tzinfo=UTC)
    found = next_cron(parse_cron("0 0 29 2 *"), after)
    assert found == datetime(2104, 2, 29, tzinfo=UTC)
