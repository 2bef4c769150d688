"""The capture contract: ids carry their serving time, signals refuse what they cannot be,
event files have fixed names, and a seal marker reads back what was written."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import pytest

from rtrl.core.events import (
    InteractionIdError,
    SealMarker,
    SignalValueError,
    event_file_key,
    new_interaction_id,
    parse_hour_partition,
    parse_signal_value,
    seal_marker_key,
    served_at,
)
from rtrl.core.events.layout import sealable

T = datetime(2026, 12, 3, 14, 59, 59, 999_000, tzinfo=UTC)


def test_an_interaction_id_is_a_uuid7_that_carries_its_serving_time() -> None:
    ids = {new_interaction_id(T) for _ in range(1000)}
    assert len(ids) == 1000
    for text in ids:
        assert uuid.UUID(text).version == 7
        assert served_at(text) == T
        assert served_at(text.upper()) == T
    assert abs(served_at(new_interaction_id()) - datetime.now(UTC)) < timedelta(seconds=5)


@pytest.mark.parametrize(
    "bad",
    [
        str(uuid.UUID(int=0x1A2B3C4D << 64, version=4)),
        "",
        "x" * 36,
        "01a23c2e-b06d-7653-bd78",
        17,
        None,
    ],
)
def test_anything_else_is_not_an_interaction_id(bad: object) -> None:
    with pytest.raises(InteractionIdError, match="not an interaction id"):
        served_at(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("signal", "value", "expected"),
    [
        ("dissatisfied_followup", True, 1.0),
        ("dissatisfied_followup", 0, 0.0),
        ("edit_persisted", 0.25, 0.25),
        ("edits_proposed", 3, 3.0),
        ("latency_ms", 812.5, 812.5),
    ],
)
def test_signal_values(signal: str, value: object, expected: float) -> None:
    assert parse_signal_value(signal, value) == expected


@pytest.mark.parametrize(
    ("signal", "value", "message"),
    [
        ("thumbs_up", 1, "unknown signal 'thumbs_up'; one of"),
        ("dissatisfied_followup", "yes", "true or false"),
        ("dissatisfied_followup", 2, "true or false"),
        ("edit_persisted", 1.5, r"fraction in \[0, 1\]"),
        ("edit_persisted", True, "is a number"),
        ("edit_persisted", float("nan"), "finite"),
        ("edits_proposed", 1.5, "whole number"),
        ("invalid_tool_calls", -1, "whole number"),
        ("latency_ms", -3, "milliseconds >= 0"),
    ],
)
def test_signal_values_refused(signal: str, value: object, message: str) -> None:
    with pytest.raises(SignalValueError, match=message):
        parse_signal_value(signal, value)


def test_event_files_have_fixed_names_under_their_hour() -> None:
    key = event_file_key("feedback", T, "rtrl-feedback-7d9f-abc123", 42)
    assert key == "feedback/date=2026-12-03/hour=14/rtrl-feedback-7d9f-abc123-000000000042.parquet"
    assert parse_hour_partition(key) == T.replace(minute=0, second=0, microsecond=0)
    with pytest.raises(ValueError, match="writer id"):
        event_file_key("feedback", T, "../escape", 1)
    with pytest.raises(ValueError, match="event kind"):
        event_file_key("sealed", T, "w", 1)


def test_a_seal_marker_reads_back() -> None:
    marker = SealMarker(
        hour=T,
        sealed_at=T + timedelta(hours=2),
        files=[{"key": "checkpoint=c/date=2026-12-03/hour=14/sealed-2026120314-00000.parquet",
                "rows": 3}],
        generations=["generations/date=2026-12-03/hour=14/w-000000000001.parquet"],
        counts={"interactions": 3, "late_feedback": 1},
    )  # fmt: skip
    assert seal_marker_key(T) == "_sealed/date=2026-12-03/hour=14.json"
    back = SealMarker.from_json(marker.to_json())
    assert back.hour == T.replace(minute=0, second=0, microsecond=0)
    assert back.files == marker.files and back.counts == marker.counts
    with pytest.raises(ValueError, match="seal marker"):
        SealMarker.from_json(b'{"version": 99}')


def test_an_hour_is_sealable_once_its_last_interaction_is_final() -> None:
    hour = T.replace(minute=0, second=0, microsecond=0)
    maturity, delay = timedelta(hours=1), timedelta(minutes=10)
    assert not sealable(hour, hour + timedelta(hours=2, minutes=9), maturity, delay)
    assert sealable(hour, hour + timedelta(hours=2, minutes=10), maturity, delay)
