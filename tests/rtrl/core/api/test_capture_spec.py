"""``spec.capture``: its maturities name exactly the capture contract's signals, and the
rules that keep the sidecar's events apart from the seal's shards and its port apart from
the engine's hold in the models (the CRD's side: tests/contract/mutants.py)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from pydantic import ValidationError

from rtrl.core.api.rlcycle import (
    CAPTURE_OVERLAPS_SHARDS,
    CAPTURE_PORTS_DIFFER,
    CaptureSpec,
    RLCycleSpec,
    SignalMaturities,
    overlaps,
)
from rtrl.core.api.yamlfile import load
from rtrl.core.events import SIGNALS
from tests.conftest import REPO

SPEC = load((REPO / "examples" / "rlcycle.yaml").read_text())["spec"]
CAPTURE = {"events": "s3://rtrl-events/composer/", "image": "registry.example.com/serving:1"}


def _spec(**capture: Any) -> dict[str, Any]:
    spec = copy.deepcopy(SPEC)
    spec["capture"] = {**CAPTURE, **capture}
    return spec


def test_maturities_name_every_signal_and_nothing_else() -> None:
    assert set(SignalMaturities.model_fields) == set(SIGNALS)
    camel = {f.alias for f in SignalMaturities.model_fields.values()}
    assert "editPersisted" in camel and "latencyMs" in camel and "invalidToolCalls" in camel


def test_overrides_are_the_signals_set_by_their_contract_names() -> None:
    spec = RLCycleSpec.model_validate(
        _spec(maturity={"editPersisted": "2h", "invalidToolCalls": "20m"})
    )
    assert spec.capture is not None and spec.capture.maturity is not None
    overrides = spec.capture.maturity.overrides()
    assert overrides == {"edit_persisted": "2h", "invalid_tool_calls": "20m"}


def test_defaults() -> None:
    capture = CaptureSpec.model_validate(CAPTURE)
    assert (capture.port, capture.engine_port) == (8081, 8000)
    assert (capture.headers.user, capture.headers.session, capture.headers.org) == (
        "X-Rtrl-User", "X-Rtrl-Session", "X-Rtrl-Org",
    )  # fmt: skip
    assert (capture.seal.schedule, capture.seal.delay) == ("*/10 * * * *", "10m")
    assert capture.maturity is None and capture.commit_interval is None


@pytest.mark.parametrize(
    ("a", "b", "overlap"),
    [
        ("s3://b/x/", "s3://b/x/", True),
        ("s3://b/x", "s3://b/x/", True),
        ("s3://b/x/events/", "s3://b/x/", True),
        ("s3://b/", "s3://b/x/", True),
        ("s3://b/x-events/", "s3://b/x/", False),  # a sibling whose name starts the same
        ("s3://b/x/", "s3://c/x/", False),
        ("file:///data/events/", "file:///data/shards/", False),
    ],
)
def test_overlap_is_by_directory(a: str, b: str, overlap: bool) -> None:
    assert overlaps(a, b) is overlap and overlaps(b, a) is overlap


def test_events_inside_the_shards_are_refused_naming_both_fields() -> None:
    with pytest.raises(ValidationError) as caught:
        RLCycleSpec.model_validate(_spec(events="s3://interactions/composer/events/"))
    assert CAPTURE_OVERLAPS_SHARDS in str(caught.value)
    assert "capture.events" in CAPTURE_OVERLAPS_SHARDS and "data.shards" in CAPTURE_OVERLAPS_SHARDS


def test_the_sidecar_cannot_take_the_engines_port() -> None:
    with pytest.raises(ValidationError) as caught:
        RLCycleSpec.model_validate(_spec(port=8000))
    assert CAPTURE_PORTS_DIFFER in str(caught.value)
    RLCycleSpec.model_validate(_spec(port=8000, enginePort=8080))  # moved both: fine


@pytest.mark.parametrize(
    ("field", "value", "problem"),
    [
        ("maturity", {"editPersisted": "8d"}, "the maximum is 7d"),
        ("seal", {"delay": "2d"}, "the maximum is 1d"),
        ("seal", {"schedule": "0 0 31 2 *"}, "never fires"),
        ("commitInterval", "11s", "the maximum is 10s"),
    ],
)
def test_bounds_the_crd_cannot_check_are_the_models(field: str, value: Any, problem: str) -> None:
    with pytest.raises(ValidationError, match=problem):
        RLCycleSpec.model_validate(_spec(**{field: value}))


def test_the_examples_commented_capture_block_is_a_valid_capture() -> None:
    """examples/rlcycle.yaml ships capture commented out; uncommented, it must be valid."""
    from rtrl.validation import validate_with_crd, validate_with_models

    lines, inside = [], False
    for line in (REPO / "examples" / "rlcycle.yaml").read_text().splitlines():
        inside = inside or line.startswith("  # capture:")
        lines.append("  " + line[4:] if inside and line.startswith("  #") else line)
    body = load("\n".join(lines))
    assert body["spec"]["capture"]["events"] == "s3://rtrl-events/composer/"
    assert validate_with_models(body) == [] and validate_with_crd(body) == []
