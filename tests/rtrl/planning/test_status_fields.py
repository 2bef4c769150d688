"""What the operator writes into a Checkpoint's status for a user to read (issue 33, "status
a user can trust"): the base model's phase once it serves, through the same in-memory world
as test_plan.py."""

from __future__ import annotations

from rtrl.metrics import observe_plan
from rtrl.planning import PatchStatus, plan
from tests.rtrl.planning.test_plan import World, run_cycle
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
