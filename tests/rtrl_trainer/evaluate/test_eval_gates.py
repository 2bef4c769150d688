"""The gates' statistics (paired bootstrap, one-sided test against the allowed regression)
and the behaviour suite's tool-call grammar."""

from __future__ import annotations

import numpy as np
import pytest

from rtrl.core.api.rlcycle import EvalGate
from rtrl_trainer.evaluate import behaviour
from rtrl_trainer.evaluate.gates import GateError, Metric, compare, judge, value


def _metric(values: list[float], direction: int = 1, groups: list[int] | None = None) -> Metric:
    return Metric("tasks.pass_at_1", tuple(values), direction,
                  None if groups is None else tuple(groups))  # fmt: skip


def _gate(t: float, mode: str = "absolute") -> EvalGate:
    return EvalGate.model_validate({"metric": "tasks.pass_at_1", "maxRegression": t, "mode": mode})


def test_equal_models_pass_even_with_a_zero_threshold() -> None:
    m = _metric([1, 0, 1, 1, 0] * 10)
    doc = compare(m, m, alpha=0.05, gate=_gate(0.0))
    assert doc["gate"]["passed"] and doc["difference"] == 0 and doc["ci_low"] == doc["ci_high"] == 0


def test_a_large_significant_regression_fails_a_small_one_passes() -> None:
    parent = _metric([1.0] * 100)
    much_worse = _metric([1.0] * 50 + [0.0] * 50)
    slightly_worse = _metric([1.0] * 98 + [0.0] * 2)
    assert not compare(much_worse, parent, alpha=0.05, gate=_gate(0.1))["gate"]["passed"]
    assert compare(slightly_worse, parent, alpha=0.05, gate=_gate(0.1))["gate"]["passed"]


def test_a_noisy_small_sample_is_not_failed_on_noise() -> None:
    rng = np.random.default_rng(0)
    parent = _metric(list(rng.integers(0, 2, 10).astype(float)))
    candidate = _metric([v if i % 5 else 1 - v for i, v in enumerate(parent.values)])
    doc = compare(candidate, parent, alpha=0.05, gate=_gate(0.1))
    assert doc["gate"]["passed"]
    assert (
        doc["ci_low"] < 0 < doc["ci_high"] or doc["ci_low"] <= doc["difference"] <= doc["ci_high"]
    )


def test_direction_lower_is_better_and_relative_mode() -> None:
    parent = _metric([10.0] * 50, direction=-1)
    longer = _metric([13.0] * 50, direction=-1)
    assert not compare(longer, parent, alpha=0.05, gate=_gate(0.2, "relative"))["gate"]["passed"]
    assert compare(longer, parent, alpha=0.05, gate=_gate(0.5, "relative"))["gate"]["passed"]
    shorter = _metric([5.0] * 50, direction=-1)
    assert compare(shorter, parent, alpha=0.05, gate=_gate(0.0))["gate"]["passed"]


def test_grouped_statistic_is_a_difference_of_group_means() -> None:
    m = _metric([3.0, 1.0, 5.0, 0.0], groups=[1, 0, 1, -1])
    assert value(m) == pytest.approx(4.0 - 1.0)


def test_resampling_is_deterministic() -> None:
    rng = np.random.default_rng(1)
    a, b = _metric(list(rng.normal(size=40))), _metric(list(rng.normal(size=40)))
    assert compare(a, b, alpha=0.05) == compare(a, b, alpha=0.05)


def test_an_unknown_gate_metric_is_an_error() -> None:
    m = _metric([1.0])
    gate = EvalGate.model_validate({"metric": "tasks.nope", "maxRegression": 0.1})
    with pytest.raises(GateError, match=r"tasks\.nope"):
        judge([m], [m], [gate], alpha=0.05)


def test_no_data_is_reported_not_judged() -> None:
    empty = _metric([])
    doc = compare(empty, empty, alpha=0.05, gate=_gate(0.1))
    assert doc["candidate"] is None and doc["gate"]["passed"] and "no data" in doc["gate"]["note"]


@pytest.mark.parametrize(
    ("text", "calls"),
    [
        (
            '<tool>{"name": "read_file", "arguments": {"path": "a.py"}}</tool>',
            [("read_file", True)],
        ),
        ('<tool>{"name": "rm_rf", "arguments": {}}</tool>', [("rm_rf", False)]),
        ('<tool>{"name": "search", "arguments": "x"}</tool>', [("search", False)]),
        ('<tool>{"name": "search"}</tool>', [("search", False)]),
        ("<tool>not json</tool>", [(None, False)]),
        ('<tool>{"name": "search", "arguments": {}}', [(None, False)]),
        ("no calls here", []),
    ],
)
def test_tool_call_grammar(text: str, calls: list[tuple[str | None, bool]]) -> None:
    assert behaviour.tool_calls(text) == calls


def test_behaviour_classification() -> None:
    assert behaviour.classify("Which file do you mean?")["clarification"]
    assert not behaviour.classify("```py\nx = 1\n```\nOk?")["clarification"]
    assert behaviour.classify("```py\nx = 1\n```")["edit"]
    edit = '<tool>{"name": "edit_file", "arguments": {"path": "a", "diff": "-x"}}</tool>'
    assert behaviour.classify(edit) == {
        "tool_call": True, "invalid_tool_call": False, "clarification": False, "edit": True,
    }  # fmt: skip
    metrics = {m.name: value(m) for m in behaviour.metrics(["Why?", "<tool>x</tool>"], [3, 5])}
    assert metrics["behaviour.clarification_rate"] == 0.5
    assert metrics["behaviour.invalid_tool_call_rate"] == 0.5
    assert metrics["behaviour.completion_tokens"] == 4.0


def test_tool_call_validity_is_a_ratio_of_sums() -> None:
    texts = [
        '<tool>{"name": "search", "arguments": {}}</tool><tool>x</tool>',
        "none",
        "<tool>y</tool>",
    ]
    metrics = {m.name: m for m in behaviour.metrics(texts, [1, 1, 1])}
    assert value(metrics["behaviour.tool_call_validity"]) == pytest.approx(1 / 3)
    none = {m.name: m for m in behaviour.metrics(["a", "b"], [1, 1])}
    assert value(none["behaviour.tool_call_validity"]) is None
