"""The step result contracts (rtrl.core.results): files as main 99043cc wrote them still
read, to the same values its readers made of them; a newer version is refused, a broken
field named; a step cannot write a key the contract does not name."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from rtrl.core.api.checkpoint import RolloutRecord
from rtrl.core.results import (
    RESULTS,
    AnalysisResult,
    CauseKind,
    Decision,
    EvalResult,
    ResultError,
    StageResult,
    TrainResult,
)
from rtrl.planning.analysis import read_verdict, record_verdict
from rtrl.planning.cycle import eval_summary
from rtrl.planning.stage_result import data_summary

FIXTURES = Path(__file__).parents[3] / "fixtures" / "results-99043cc"
MAIN = json.loads((FIXTURES / "read-by-main.json").read_text())


def _load(name: str) -> dict[str, Any]:
    return dict(json.loads((FIXTURES / name).read_text()))


def _dump(model: Any) -> Any:
    return model.model_dump(mode="json", by_alias=True, exclude_none=True)


def test_a_stage_json_of_main_reads_to_the_same_status_data() -> None:
    doc = StageResult.read(_load("stage.json"))
    expected = MAIN["stage.json"]
    assert _dump(data_summary(doc, "file:///store/ck/stage/stage.json")) == expected["data"]
    assert (doc.sufficient, doc.message) == (expected["sufficient"], expected["message"])
    assert doc.version == 1


def test_a_train_json_of_main_reads_to_the_same_training_summary() -> None:
    doc = TrainResult.read(_load("train.json"))
    assert _dump(doc.summary) == MAIN["train.json"]["training"]


@pytest.mark.parametrize("name", ["eval.json", "eval-unsafe.json"])
def test_an_eval_json_of_main_reads_to_the_same_verdict(name: str) -> None:
    doc = EvalResult.read(_load(name))
    summary, message, reason = eval_summary(doc, "file:///store/ck/eval/eval.json")
    expected = MAIN[name]
    assert _dump(summary) == expected["eval"]
    assert (doc.passed, message) == (expected["passed"], expected["message"])
    assert reason == expected["condition_reason"]
    assert doc.reason == expected["reason"] and doc.gates_source == expected["gates_source"]


def test_an_analysis_json_of_main_reads_to_the_same_record_and_its_cause() -> None:
    """Version 1 had no cause: its guardrail trip is read from the lead reason, once, in
    the contract's upgrade (the planner asks the field)."""
    raw = _load("analysis.json")
    assert "version" not in raw and "cause" not in raw
    doc = read_verdict(raw)
    record = RolloutRecord(weight=10, started_at=datetime(2026, 12, 1, tzinfo=UTC))
    record_verdict(record, doc)
    verdict = record.model_dump(mode="json", by_alias=True, exclude_unset=True, exclude_none=True)
    del verdict["weight"], verdict["startedAt"]  # the step's, set above
    assert verdict == MAIN["analysis.json"]["verdict"]
    assert doc.guardrail_tripped == MAIN["analysis.json"]["tripped"] is True
    assert doc.cause is not None and doc.cause.kind == CauseKind.GUARDRAIL
    assert doc.cause.metrics == ["edit_rate", "clarification_rate"]
    assert doc.version == AnalysisResult.VERSION == 2


def test_a_version_1_analysis_that_did_not_trip_a_guardrail_has_no_cause() -> None:
    raw = {**_load("analysis.json"), "decision": "promote", "reasons": ["edit_persistence: x"]}
    assert AnalysisResult.read(raw).cause is None
    assert not AnalysisResult.read(raw).guardrail_tripped


@pytest.mark.parametrize("step", sorted(RESULTS))
def test_a_newer_version_is_refused_saying_so(step: str) -> None:
    model = RESULTS[step]
    name = {"stage": "stage.json", "train": "train.json", "eval": "eval.json"}.get(
        step, "analysis.json"
    )
    with pytest.raises(ResultError) as err:
        model.read({**_load(name), "version": model.VERSION + 1})
    assert str(err.value) == (
        f"{model.FILE}: version {model.VERSION + 1} is newer than this rtrl reads (1 to "
        f"{model.VERSION}): the step that wrote it is newer than the reader; upgrade rtrl"
    )


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ([1, 2], "stage.json: not a JSON object but list"),
        ({"version": "2"}, "stage.json: version: '2' is not a version number"),
        ({"version": 0}, "stage.json: version: 0 is not a version number"),
        ({"tokens_used": 5}, "stage.json: interactions_used: Field required"),
        (
            {"interactions_used": -1, "tokens_used": 5},
            "stage.json: interactions_used: Input should be greater than or equal to 0",
        ),
    ],
)
def test_a_broken_file_is_an_error_naming_the_field(doc: Any, message: str) -> None:
    with pytest.raises(ResultError) as err:
        StageResult.read(doc)
    assert str(err.value) == message


def test_a_non_finite_metric_is_refused() -> None:
    raw = _load("analysis.json")
    raw["metrics"][0]["canary"] = float("nan")
    with pytest.raises(ResultError, match=r"^analysis.json: metrics.0.canary: Input should be"):
        AnalysisResult.read(raw)


def test_keys_a_reader_does_not_know_are_kept_and_ignored_but_a_step_cannot_write_them() -> None:
    raw = {**_load("eval.json"), "from_a_newer_step": {"x": 1}}
    raw["gates"][0]["new_figure"] = 2.0
    doc = EvalResult.read(raw)
    assert doc.passed and doc.gates[0].to_status().metric == "replay.loglik"
    unknown = r"^eval.json: not in the contract: from_a_newer_step, gates.0.new_figure$"
    with pytest.raises(TypeError, match=unknown):
        EvalResult.written({k: v for k, v in raw.items() if k != "version"})


@pytest.mark.parametrize("name", ["stage.json", "train.json", "eval.json", "analysis.json"])
def test_what_main_wrote_is_what_the_contract_writes_but_the_version(name: str) -> None:
    """Every key today's steps write is in the contract (a step writing it through the
    model gets the same document, its version added)."""
    model = {"stage.json": StageResult, "train.json": TrainResult, "eval.json": EvalResult}.get(
        name, AnalysisResult
    )
    raw = _load(name)
    fields = {k: v for k, v in raw.items() if k != "version"}
    if model is AnalysisResult:  # version 2 writes the cause
        fields["cause"] = {"kind": "guardrail", "metrics": ["edit_rate", "clarification_rate"]}
    written = json.loads(model.written(fields).to_json())
    assert written.pop("version") == model.VERSION
    assert written == fields


def test_the_decision_is_the_api_enum() -> None:
    doc = AnalysisResult.written({"decision": "rollback"})
    assert doc.decision is Decision.ROLLBACK and doc.document()["decision"] == "rollback"
