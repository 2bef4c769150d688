"""A request body to events: every problem named by its field, nothing half-accepted."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from rtrl.core.events import new_interaction_id
from rtrl_serving.feedback.events import (
    MAX_PROBLEMS,
    Limits,
    RequestProblemsError,
    parse_request,
)
from tests.rtrl_serving.feedback.helpers import event

NOW = datetime(2026, 12, 3, 15, 0, tzinfo=UTC)
SERVED = NOW - timedelta(minutes=10)


def parse(doc: Any, limits: Limits | None = None) -> list[Any]:
    body = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
    return parse_request(body, now=NOW, limits=limits or Limits())


def problems(doc: Any, limits: Limits | None = None) -> dict[str, str]:
    with pytest.raises(RequestProblemsError) as caught:
        parse(doc, limits)
    return {p.field: p.message for p in caught.value.problems}


def test_valid_events_parse_to_utc_times_and_lower_case_ids() -> None:
    interaction = new_interaction_id(SERVED)
    good = [
        event(interaction.upper(), value=0.25, served=SERVED),
        event(interaction, signal="dissatisfied_followup", value=True, served=SERVED,
              observed_at="2026-12-03T16:00:00+01:00"),
    ]  # fmt: skip
    events = parse({"events": good})
    assert [e.interaction_id for e in events] == [interaction, interaction]
    assert [e.value for e in events] == [0.25, 1.0]
    assert events[1].observed_at == datetime(2026, 12, 3, 15, 0, tzinfo=UTC)
    assert events[0].served_at == SERVED.replace(microsecond=0)


@pytest.mark.parametrize(
    ("change", "field", "says"),
    [
        ({"event_id": None}, "event_id", "required"),
        ({"event_id": "has space"}, "event_id", "1-128 characters"),
        ({"event_id": "x" * 129}, "event_id", "1-128 characters"),
        ({"interaction_id": str(uuid.uuid4())}, "interaction_id", "not an interaction id"),
        ({"interaction_id": 17}, "interaction_id", "not an interaction id"),
        ({"signal": "thumbs_up"}, "signal", "unknown signal 'thumbs_up'; one of"),
        ({"value": 1.5}, "value", "edit_persisted is a fraction in [0, 1], not 1.5"),
        ({"value": "0.5"}, "value", "is a number, not '0.5'"),
        ({"signal": "dissatisfied_followup", "value": 0.5}, "value", "true or false"),
        ({"signal": "edits_proposed", "value": 2.5}, "value", "whole number"),
        ({"observed_at": "2026-12-03T14:55:00"}, "observed_at", "has no timezone"),
        ({"observed_at": "yesterday"}, "observed_at", "not an RFC 3339 time"),
        ({"observed_at": 1764774000}, "observed_at", "as a string"),
        ({"observed_at": "2026-12-03T15:06:00Z"}, "observed_at", "is in the future"),
        ({"observed_at": "2026-12-03T14:40:00Z"}, "observed_at", "before the interaction was"),
        ({"observedAt": "2026-12-03T14:55:00Z"}, "observedAt", "unknown field"),
    ],
)  # fmt: skip
def test_a_bad_field_is_named_with_its_index(change: dict[str, Any], field: str, says: str) -> None:
    bad = event(served=SERVED, observed_at=SERVED + timedelta(minutes=1))
    bad.update(change)
    bad = {k: v for k, v in bad.items() if v is not None}
    found = problems({"events": [event(served=SERVED), bad]})
    assert f"events[1].{field}" in found, found
    assert says in found[f"events[1].{field}"]
    assert not any(name.startswith("events[0]") for name in found)


def test_an_interaction_served_in_the_future_is_refused() -> None:
    found = problems({"events": [event(new_interaction_id(NOW + timedelta(hours=1)))]})
    assert (
        "is in the future: not an id the capture proxy minted" in found["events[0].interaction_id"]
    )


@pytest.mark.parametrize(
    ("body", "field", "says"),
    [
        (b"{not json", "body", "not JSON"),
        (b'{"events": [{"value": NaN}]}', "body", "NaN is not a JSON number"),
        (b"[]", "body", "must be an object"),
        (b'{"events": []}', "events", "non-empty list"),
        (b'{"evnts": []}', "evnts", "unknown field"),
        (b'{"events": [7]}', "events[0]", "must be an object"),
    ],
)
def test_a_malformed_body_is_named(body: bytes, field: str, says: str) -> None:
    assert says in problems(body)[field]


def test_too_many_events_are_refused_before_any_is_read() -> None:
    found = problems({"events": [event()] * 3}, Limits(max_events=2))
    assert found == {"events": "3 events; at most 2 per request"}


def test_problems_are_listed_up_to_a_bound() -> None:
    found = problems({"events": [event(value=7.0) for _ in range(50)]})
    assert len(found) == MAX_PROBLEMS


def test_one_event_id_twice_in_a_request() -> None:
    same = event(served=SERVED)
    assert len(parse({"events": [same, dict(same)]})) == 1
    other = {**same, "value": 0.9}
    found = problems({"events": [same, other]})
    assert found == {
        "events[1].event_id": "repeats events[0].event_id with other content; an event id "
        "names one event"
    }
