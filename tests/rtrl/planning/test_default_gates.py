"""``spec.eval.gates``: unset means the default gates of the configured suites, ``[]`` no
gates (an explicit choice), a list is used as written; the operator says when a verdict
came from the defaults."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from rtrl.core.api.rlcycle import DEFAULT_GATES, EvalSpec, EvalSuite
from tests.rtrl.planning.test_plan import EVAL_PASS, World, run_cycle


def _gates(doc: dict[str, Any]) -> tuple[list[dict[str, Any]], str]:
    gates, source = EvalSpec.model_validate(doc).effective_gates()
    return [g.to_k8s() for g in gates], source


def test_unset_gates_are_the_defaults_of_the_default_suites() -> None:
    assert _gates({}) == (
        [
            {"metric": "replay.kl", "maxRegression": 0.05, "mode": "absolute"},
            {"metric": "tasks.pass_at_1", "maxRegression": 0.01, "mode": "absolute"},
            {"metric": "behaviour.tool_call_validity", "maxRegression": 0.005, "mode": "absolute"},
        ],
        "default",
    )


@pytest.mark.parametrize(
    "suites",
    [["replay"], ["tasks"], ["behaviour"], ["humaneval"], ["behaviour", "humaneval", "replay"]],
)
def test_unset_gates_cover_exactly_the_configured_suites(suites: list[str]) -> None:
    gates, source = _gates({"suites": suites})
    assert source == "default"
    assert [g["metric"].split(".", 1)[0] for g in gates] == suites
    assert all(g["mode"] == "absolute" for g in gates)


def test_default_gates_values() -> None:
    table = {
        s: [(g["metric"], g["maxRegression"]) for g in _gates({"suites": [s]})[0]]
        for s in EvalSuite
    }
    assert table == {
        "replay": [("replay.kl", 0.05)],
        "tasks": [("tasks.pass_at_1", 0.01)],
        "humaneval": [("humaneval.pass_at_1", 0.01)],
        "behaviour": [("behaviour.tool_call_validity", 0.005)],
    }
    assert set(DEFAULT_GATES) == set(EvalSuite)  # every suite has its default


def test_an_empty_list_means_no_gates() -> None:
    spec = EvalSpec.model_validate({"gates": []})
    assert spec.gates == [] and spec.effective_gates() == ([], "spec")
    assert spec.to_k8s()["gates"] == []  # written down, unlike unset
    assert "gates" not in EvalSpec.model_validate({}).to_k8s()


def test_an_explicit_list_is_kept_as_written() -> None:
    doc = {
        "suites": ["replay", "tasks"],
        "gates": [{"metric": "tasks.pass_at_1", "maxRegression": 0.2, "mode": "relative"}],
    }
    assert _gates(doc) == (
        [{"metric": "tasks.pass_at_1", "maxRegression": 0.2, "mode": "relative"}],
        "spec",
    )


def test_explicit_gates_are_still_checked_against_the_suites() -> None:
    with pytest.raises(ValidationError, match="needs suite 'replay'"):
        EvalSpec.model_validate(
            {"suites": ["tasks"], "gates": [{"metric": "replay.kl", "maxRegression": 1}]}
        )
    EvalSpec.model_validate({"gates": None})  # null: unset


def test_default_gates_are_named_in_the_checkpoint_status_and_condition() -> None:
    world = World()
    run_cycle(world, {**EVAL_PASS, "gates_source": "default"})
    ck = world.checkpoint("composer-1")
    assert [g["metric"] for g in ck["status"]["eval"]["gates"]] == ["tasks.pass_at_1"]
    assert any("(default gates)" in e.message for e in world.events if e.reason == "EvalPassed")


def test_spec_gates_are_not_called_defaults() -> None:
    world = World()
    failed = {**EVAL_PASS, "passed": False, "message": "failed gate(s): tasks.pass_at_1"}
    run_cycle(world, {**failed, "gates_source": "spec"})
    ck = world.checkpoint("composer-1")
    assert ck["status"]["message"] == "failed gate(s): tasks.pass_at_1"
    assert "(default gates)" not in world.condition("Progressing")["message"]


def test_rejected_by_default_gates_says_so() -> None:
    world = World()
    failed = {**EVAL_PASS, "passed": False, "message": "failed gate(s): replay.kl"}
    run_cycle(world, {**failed, "gates_source": "default"})
    ck = world.checkpoint("composer-1")
    assert ck["status"]["phase"] == "Rejected"
    assert ck["status"]["message"] == "failed gate(s): replay.kl (default gates)"
    assert world.condition("Progressing")["message"].endswith(
        "failed gate(s): replay.kl (default gates)"
    )
