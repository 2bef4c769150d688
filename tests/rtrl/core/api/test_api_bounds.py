"""Bounded inputs: every duration, count, list and float of the API has a maximum, and an
absurd value is rejected by the models with its field path (issue 19: a 3000000d interval
overflowed the operator's clock, a cron on 31 February was accepted, ``.inf`` passed as a
gate, 50,000 canary steps were read, an endpoint carried its credentials)."""

from __future__ import annotations

import copy
import re
import time
import typing
from collections.abc import Iterator
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from rtrl.core.api.checkpoint import Checkpoint
from rtrl.core.api.common import (
    MAX_DURATION,
    DurationTooLongError,
    MaxDuration,
    parse_duration,
)
from rtrl.core.api.errors import error_message, format_loc
from rtrl.core.api.rlcycle import RLCycle, RLCycleSpec
from rtrl.core.api.yamlfile import load
from tests.conftest import REPO

EXAMPLE = load((REPO / "examples" / "rlcycle.yaml").read_text())
CHECKPOINT = load((REPO / "examples" / "checkpoint-base.yaml").read_text())
CONDITION = {
    "type": "Ready",
    "status": "True",
    "reason": "Serving",
    "lastTransitionTime": "2026-11-29T10:00:00Z",
}


def _problems(body: dict[str, Any], model: type[BaseModel] = RLCycle) -> list[str]:
    """``path: message`` of each problem the models find, as ``rtrl validate`` prints it."""
    try:
        model.model_validate(body, strict=False)
    except ValidationError as exc:
        return [f"{format_loc(e['loc'])}: {error_message(e)}" for e in exc.errors()]
    return []


def _with(path: str, value: Any, body: dict[str, Any] = EXAMPLE) -> dict[str, Any]:
    """``body`` with the dotted ``path`` (``spec.rollout.steps.0.minDuration``) set."""
    out = copy.deepcopy(body)
    node = out
    parts = [int(p) if p.isdigit() else p for p in path.split(".")]
    for part in parts[:-1]:
        node = node.setdefault(part, {}) if isinstance(part, str) else node[part]
    node[parts[-1]] = value
    return out


# --- durations --------------------------------------------------------------------------


def _duration_fields(
    model: type[BaseModel], prefix: str = "spec"
) -> Iterator[tuple[str, MaxDuration]]:
    """(camelCase path, its MaxDuration) of every duration field under ``model``."""
    for name, info in model.model_fields.items():
        path = f"{prefix}.{info.alias or name}"
        found = [m for m in info.metadata if isinstance(m, MaxDuration)]
        found += [m for m in _annotated(info.annotation) if isinstance(m, MaxDuration)]
        for bound in found[:1]:
            yield path, bound
        for inner in _models(info.annotation):
            yield from _duration_fields(inner, path + ("[]" if _is_list(info.annotation) else ""))


def _annotated(tp: Any) -> list[Any]:
    out = list(getattr(tp, "__metadata__", ()))
    for arg in typing.get_args(tp):
        out += _annotated(arg)
    return out


def _models(tp: Any) -> list[type[BaseModel]]:
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return [tp]
    return [m for arg in typing.get_args(tp) for m in _models(arg)]


def _is_list(tp: Any) -> bool:
    return typing.get_origin(tp) is list or any(_is_list(a) for a in typing.get_args(tp))


DURATIONS = dict(_duration_fields(RLCycleSpec))
# The example's paths to each duration (a list field at its first item).
DURATION_PATHS = {path: path.replace("[]", ".0") for path in DURATIONS}


def test_every_duration_of_the_spec_has_a_maximum() -> None:
    """No field takes a bare string as a duration; each has its own maximum."""
    assert sorted(DURATIONS) == sorted(
        [
            "spec.schedule.interval",
            "spec.data.maturity",
            "spec.data.window",
            "spec.rollout.steps[].minDuration",
            "spec.rollout.readyTimeout",
            "spec.rollout.analysis.maxDuration",
            "spec.rollout.analysis.interval",
            "spec.rollout.analysis.preExposure",
            "spec.rollout.analysis.noveltyWindow",
            "spec.rollout.confirmWebhook.interval",
            "spec.jobs.backoff",
            "spec.jobs.activeDeadline",
            "spec.capture.commitInterval",
            "spec.capture.seal.delay",
            *(f"spec.capture.maturity.{signal}" for signal in (
                "editPersisted", "dissatisfiedFollowup", "askedClarification", "editsProposed",
                "toolCalls", "invalidToolCalls", "latencyMs",
            )),
        ]
    )  # fmt: skip
    assert all(0 < bound.seconds <= parse_duration(MAX_DURATION) for bound in DURATIONS.values())


def test_the_interval_of_the_issue_is_rejected_with_its_field_path() -> None:
    body = _with("spec.schedule.interval", "3000000d")
    assert _problems(body) == [
        "spec.schedule.interval: duration '3000000d' is too long: the maximum is 365d"
    ]


@pytest.mark.parametrize("path", sorted(DURATIONS))
def test_each_duration_at_its_maximum_passes_and_beyond_it_fails(path: str) -> None:
    bound = DURATIONS[path]
    where = DURATION_PATHS[path]
    at_max = _with(where, bound.limit)
    if path.startswith("spec.rollout.steps"):  # the steps' sum must fit maxDuration
        at_max = _with("spec.rollout.analysis.maxDuration", "365d", at_max)
    base = EXAMPLE
    if path.startswith("spec.rollout.confirmWebhook"):  # not in the example
        base = _with("spec.rollout.confirmWebhook.urlSecret", {"name": "hooks", "key": "url"})
        at_max = _with(where, bound.limit, base)
    if path.startswith("spec.capture"):  # not in the example (commented out there)
        base = _with("spec.capture", {"events": "s3://events/x/", "image": "serving:1"})
        at_max = _with(where, bound.limit, base)
    assert _problems(at_max) == []
    over = f"{bound.limit}1ms"
    assert _problems(_with(where, over, base)) == [
        f"{where.replace('.0', '[0]')}: duration {over!r} is too long: the maximum is {bound.limit}"
    ]
    # Beyond anything a duration may be: the same message, never an overflow.
    assert _problems(_with(where, "99999999999d", base)) == [
        f"{where.replace('.0', '[0]')}: duration '99999999999d' is too long: "
        f"the maximum is {bound.limit}"
    ]


@pytest.mark.parametrize(
    "text", ["3651d", "3650d1ms", "87601h", "99999999999d", "9" * 40 + "ms", "1" + "0" * 30 + "s"]
)
def test_parse_duration_caps_every_duration_at_ten_years(text: str) -> None:
    with pytest.raises(DurationTooLongError, match=re.escape("the maximum is 3650d")):
        parse_duration(text)
    assert parse_duration("3650d") == 3650 * 86400
    assert parse_duration("0000000000000000000005d") == 5 * 86400  # leading zeros are free


def test_parse_duration_refuses_long_text_without_repeating_it() -> None:
    text = "1s" * 10_000
    with pytest.raises(ValueError, match="invalid duration") as error:
        parse_duration(text)
    assert len(str(error.value)) < 200


# --- cron -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cron", "why"),
    [
        ("0 0 31 2 *", "no day 31 in February"),
        ("0 0 30,31 feb *", "no day 30, 31 in February"),
        ("0 0 31 4,6,9,11 *", "no day 31 in April, June, September, November"),
    ],
)
def test_a_cron_that_never_fires_is_rejected_with_its_field_path(cron: str, why: str) -> None:
    assert _problems(_with("spec.schedule", {"cron": cron})) == [
        f"spec.schedule.cron: cron expression {cron!r} never fires: {why}"
    ]


@pytest.mark.parametrize(
    "cron", ["0 0 29 2 *", "0 0 31 2 mon", "0 0 31 1-12 *", "0 0 30 1,2 *", "@yearly"]
)
def test_a_cron_that_fires_rarely_is_accepted(cron: str) -> None:
    """29 February fires every four years; with a weekday too, either day field matches."""
    assert _problems(_with("spec.schedule", {"cron": cron})) == []


# --- floats -----------------------------------------------------------------------------


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_floats_are_rejected(value: float) -> None:
    gates = [{"metric": "tasks.pass_at_1", "maxRegression": value}]
    assert _problems(_with("spec.eval.gates", gates)) == [
        "spec.eval.gates[0].maxRegression: Input should be a finite number"
    ]
    assert _problems(_with("spec.training.learningRate", value)) == [
        "spec.training.learningRate: Input should be a finite number"
    ]
    status = {"training": {"loss": value}}
    assert _problems(_with("status", status, CHECKPOINT), Checkpoint) == [
        "status.training.loss: Input should be a finite number"
    ]


def test_max_regression_has_a_maximum() -> None:
    gates = [{"metric": "tasks.pass_at_1", "maxRegression": 1e7}]
    assert _problems(_with("spec.eval.gates", gates)) == [
        "spec.eval.gates[0].maxRegression: Input should be less than or equal to 1000000"
    ]


# --- counts and lists -------------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    [
        "spec.data.minInteractions",
        "spec.data.minTokens",
        "spec.training.batchTokens",
        "spec.training.seed",
        "spec.rollout.steps.0.minSamples",
        "spec.historyLimit",
    ],
)
def test_integers_of_2_to_the_63_are_out_of_range(path: str) -> None:
    (problem,) = _problems(_with(path, 2**63))
    assert problem.startswith(path.replace(".0", "[0]") + ": Input should be less than or equal")


@pytest.mark.parametrize(
    ("path", "item"),
    [
        ("spec.rollout.steps", {"weight": 5, "minDuration": "1m"}),
        ("spec.eval.gates", {"metric": "tasks.pass_at_1", "maxRegression": 0.1}),
        ("spec.eval.suites", "tasks"),
        ("spec.data.population.orgs", "acme"),
        ("spec.data.population.excludeOrgs", "acme"),
        ("spec.training.tolerations", {"key": "gpu", "operator": "Exists"}),
    ],
)
def test_a_list_of_50000_items_is_rejected_fast(path: str, item: Any) -> None:
    body = _with(path, [item] * 50_000)
    started = time.perf_counter()
    problems = _problems(body)
    elapsed = time.perf_counter() - started
    assert any(p.startswith(f"{path}: List should have at most") for p in problems), problems
    assert elapsed < 2.0


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("spec.training.nodeSelector", {f"k{i}": "v" for i in range(65)}),
        ("spec.training.resources", {"limits": {f"r{i}": "1" for i in range(17)}}),
        ("status.data.quarantined", {f"r{i}": 1 for i in range(65)}),
        ("status.conditions", [CONDITION] * 33),
    ],
)
def test_maps_and_status_lists_are_bounded(path: str, value: Any) -> None:
    model: type[BaseModel] = Checkpoint if path.startswith("status") else RLCycle
    body = _with(path, value, CHECKPOINT if model is Checkpoint else EXAMPLE)
    problems = _problems(body, model)
    assert any(
        re.match(rf"{re.escape(path)}(\.\w+)?: \w+ should have at most", p) for p in problems
    )


# --- the endpoint -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "endpoint",
    ["http://KEY:SECRET@minio:9000", "https://SECRET@s3.example.com/", "http://a:b@c/d@e"],
)
def test_credentials_in_the_endpoint_are_rejected_without_repeating_them(endpoint: str) -> None:
    (problem,) = _problems(_with("spec.storage.endpoint", endpoint))
    assert problem == (
        "spec.storage.endpoint: must not hold credentials (user:password@host): put them in a "
        "Secret and set credentialsSecret"
    )
    assert "SECRET" not in problem


@pytest.mark.parametrize(
    "endpoint", ["http://minio:9000", "https://s3.example.com/base/", "http://minio/a@b"]
)
def test_an_endpoint_without_credentials_is_accepted(endpoint: str) -> None:
    """An ``@`` in the path is not userinfo."""
    assert _problems(_with("spec.storage.endpoint", endpoint)) == []


# --- the reference ----------------------------------------------------------------------


def test_the_limits_table_in_the_docs_says_what_the_models_check() -> None:
    text = (REPO / "docs" / "validation.md").read_text()
    for path, bound in DURATIONS.items():
        field = path.removeprefix("spec.")
        assert re.search(rf"\| `{re.escape(field)}` \| {bound.limit} \|", text), field
