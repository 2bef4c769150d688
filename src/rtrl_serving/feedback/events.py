"""A ``POST /v1/feedback`` body turned into validated feedback events, or into every problem
found, each naming the field that has it (``events[3].observed_at``).

The body is one JSON object::

    {"events": [{"event_id": "fb-7f3a...", "interaction_id": "0193a6b2-...",
                 "signal": "edit_persisted", "value": 0.8,
                 "observed_at": "2026-12-03T15:04:05Z"}]}

A request is all-or-nothing: one bad event refuses the whole request (400) and stores none
of it, so a client never has to work out which of its events were kept; it fixes the named
field and sends the request again. Value rules are the signals' own
(:func:`rtrl.core.events.parse_signal_value`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from rtrl.core.events import InteractionIdError, SignalValueError, parse_signal_value, served_at

# The client's idempotency key: printable, no spaces, short enough to index.
_EVENT_ID = re.compile(r"^[A-Za-z0-9._:@/+=-]{1,128}$")
FIELDS = ("event_id", "interaction_id", "signal", "value", "observed_at")
# Problems listed in one answer at most: enough to fix a systematically wrong client.
MAX_PROBLEMS = 20


@dataclass(frozen=True)
class FeedbackEvent:
    """One validated event. ``interaction_id`` is lower-case; times are UTC."""

    event_id: str
    interaction_id: str
    signal: str
    value: float
    observed_at: datetime
    served_at: datetime

    @property
    def content(self) -> tuple[str, str, float, datetime]:
        """What a retry must repeat exactly: the same id with other content is a
        conflict, not a retry (``received_at`` is the service's, and differs)."""
        return (self.interaction_id, self.signal, self.value, self.observed_at)


@dataclass(frozen=True)
class Problem:
    field: str  # events[3].observed_at
    message: str

    def as_dict(self) -> dict[str, str]:
        return {"field": self.field, "message": self.message}


@dataclass(frozen=True)
class Limits:
    """What a request may hold, and how far the clients' clocks may be off the service's."""

    max_events: int = 1000
    max_skew: timedelta = timedelta(minutes=5)


class RequestProblemsError(ValueError):
    """The request cannot be stored; ``problems`` name each field (at most MAX_PROBLEMS)."""

    def __init__(self, problems: list[Problem]) -> None:
        super().__init__("; ".join(f"{p.field}: {p.message}" for p in problems))
        self.problems = problems


def _no_constants(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


def parse_request(body: bytes, *, now: datetime, limits: Limits) -> list[FeedbackEvent]:
    """The events of one request body, validated, in order; :class:`RequestProblemsError` when
    anything is wrong. Repeats of one event id within the request are kept once (the same
    content) or refused (other content)."""
    try:
        doc = json.loads(body, parse_constant=_no_constants)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RequestProblemsError([Problem("body", f"not JSON: {_short(str(exc))}")]) from None
    if not isinstance(doc, dict):
        raise RequestProblemsError([Problem("body", 'must be an object: {"events": [...]}')])
    unknown = sorted(set(doc) - {"events"})
    if unknown:
        raise RequestProblemsError(
            [Problem(_short(unknown[0]), "unknown field; the body has events")]
        )
    raw = doc.get("events")
    if not isinstance(raw, list) or not raw:
        raise RequestProblemsError([Problem("events", "required: a non-empty list of events")])
    if len(raw) > limits.max_events:
        raise RequestProblemsError(
            [Problem("events", f"{len(raw)} events; at most {limits.max_events} per request")]
        )
    events: list[FeedbackEvent] = []
    problems: list[Problem] = []
    first: dict[str, tuple[int, FeedbackEvent]] = {}
    for index, item in enumerate(raw):
        where = f"events[{index}]"
        try:
            event = parse_event(item, where=where, now=now, limits=limits)
        except RequestProblemsError as exc:
            problems.extend(exc.problems)
            if len(problems) >= MAX_PROBLEMS:
                break
            continue
        seen = first.get(event.event_id)
        if seen is None:
            first[event.event_id] = (index, event)
            events.append(event)
        elif seen[1].content != event.content:
            problems.append(
                Problem(
                    f"{where}.event_id",
                    f"repeats events[{seen[0]}].event_id with other content; an event id "
                    "names one event",
                )
            )
    if problems:
        raise RequestProblemsError(problems[:MAX_PROBLEMS])
    return events


def parse_event(item: Any, *, where: str, now: datetime, limits: Limits) -> FeedbackEvent:
    """One event object; :class:`RequestProblemsError` naming each bad field of it."""
    if not isinstance(item, dict):
        raise RequestProblemsError([Problem(where, "must be an object")])
    problems: list[Problem] = []
    for name in sorted(set(item) - set(FIELDS)):
        problems.append(
            Problem(f"{where}.{_short(str(name))}", f"unknown field; fields: {', '.join(FIELDS)}")
        )
    for name in FIELDS:
        if item.get(name) is None:
            problems.append(Problem(f"{where}.{name}", "required"))
    if problems:
        raise RequestProblemsError(problems)

    event_id = item["event_id"]
    if not isinstance(event_id, str) or not _EVENT_ID.match(event_id):
        problems.append(
            Problem(
                f"{where}.event_id",
                "1-128 characters of letters, digits and ._:@/+=- (the client's idempotency "
                "key: the same id for a retry of the same event)",
            )
        )
    interaction = item["interaction_id"]
    served: datetime | None = None
    try:
        served = served_at(interaction)
    except InteractionIdError as exc:
        problems.append(Problem(f"{where}.interaction_id", str(exc)))
    if served is not None and served > now + limits.max_skew:
        problems.append(
            Problem(
                f"{where}.interaction_id",
                f"its time ({_iso(served)}) is in the future: not an id the capture proxy minted",
            )
        )
    value: float | None = None
    try:
        value = parse_signal_value(item["signal"], item["value"])
    except SignalValueError as exc:
        bad = "signal" if str(exc).startswith("unknown signal") else "value"
        problems.append(Problem(f"{where}.{bad}", str(exc)))
    observed = _timestamp(item["observed_at"], f"{where}.observed_at", problems)
    if observed is not None:
        if observed > now + limits.max_skew:
            problems.append(
                Problem(
                    f"{where}.observed_at",
                    f"{_iso(observed)} is in the future (more than {_skew(limits)} ahead of "
                    "the service's clock)",
                )
            )
        elif served is not None and observed < served - limits.max_skew:
            problems.append(
                Problem(
                    f"{where}.observed_at",
                    f"{_iso(observed)} is before the interaction was served ({_iso(served)})",
                )
            )
    if problems:
        raise RequestProblemsError(problems)
    assert served is not None and value is not None and observed is not None
    return FeedbackEvent(
        event_id=event_id,
        interaction_id=interaction.lower(),
        signal=item["signal"],
        value=value,
        observed_at=observed,
        served_at=served,
    )


def _timestamp(raw: Any, where: str, problems: list[Problem]) -> datetime | None:
    if not isinstance(raw, str):
        problems.append(Problem(where, "an RFC 3339 time as a string, e.g. 2026-12-03T15:04:05Z"))
        return None
    try:
        moment = datetime.fromisoformat(raw)
    except ValueError:
        problems.append(Problem(where, f"{_short(raw)!r} is not an RFC 3339 time"))
        return None
    if moment.tzinfo is None:
        problems.append(Problem(where, f"{_short(raw)!r} has no timezone (add Z or +00:00)"))
        return None
    return moment.astimezone(UTC)


def _iso(moment: datetime) -> str:
    return moment.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _skew(limits: Limits) -> str:
    return f"{int(limits.max_skew.total_seconds())}s"


def _short(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
