"""Feedback signals: which ones a client may report, what their values may be, and when
each one is final.

Each signal is a column of the interaction shards (docs/shards.md). Clients report them as
feedback events naming the interaction; a signal is *final* ``maturity`` after the
interaction was served (a dissatisfied follow-up comes within minutes, whether an edit
stayed in the codebase is known after an hour). The seal step takes, per interaction and
signal, the last value observed before the signal's maturity; a value observed later is
*late*: counted, never trained on. An RLCycle may set other maturities per signal
(``spec.capture.maturity``).

Three signals are also measured by the capture proxy itself: ``latency_ms`` (the engine's
time to the full completion), ``tool_calls`` and ``invalid_tool_calls`` (the response's tool
calls checked against the request's tool schemas). A client's report of ``latency_ms``
replaces the proxy's (the client sees the whole task); for the tool-call counts the seal
keeps the larger of the two, so a client can add an invalid call the proxy could not see
(one its agent failed to run) but never hide one the proxy saw: an invalid tool call must
reach the reward as a negative.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import timedelta
from enum import StrEnum


class SignalKind(StrEnum):
    BOOL = "bool"  # true/false (or 1/0)
    FRACTION = "fraction"  # a number in [0, 1]
    COUNT = "count"  # a whole number >= 0
    MILLISECONDS = "milliseconds"  # a number >= 0


class Merge(StrEnum):
    """How a client's value combines with the capture proxy's own measurement."""

    FEEDBACK_ONLY = "feedback"  # only clients report it
    REPLACES_CAPTURE = "replaces"  # the client's value, else the proxy's
    MAX_WITH_CAPTURE = "max"  # the larger of the two


@dataclass(frozen=True)
class Signal:
    name: str  # the shard column, and the name clients post
    kind: SignalKind
    maturity: timedelta  # default: when the value is final, after the interaction was served
    merge: Merge = Merge.FEEDBACK_ONLY
    description: str = ""


MINUTES_15 = timedelta(minutes=15)

SIGNALS: dict[str, Signal] = {
    s.name: s
    for s in (
        Signal("edit_persisted", SignalKind.FRACTION, timedelta(hours=1),
               description="share of the agent's edit still in the codebase"),
        Signal("dissatisfied_followup", SignalKind.BOOL, MINUTES_15,
               description="the user sent a dissatisfied follow-up"),
        Signal("asked_clarification", SignalKind.BOOL, MINUTES_15,
               description="the model asked a clarifying question instead of editing"),
        Signal("edits_proposed", SignalKind.COUNT, MINUTES_15,
               description="edits the model proposed"),
        Signal("tool_calls", SignalKind.COUNT, MINUTES_15, Merge.MAX_WITH_CAPTURE,
               description="tool calls emitted"),
        Signal("invalid_tool_calls", SignalKind.COUNT, MINUTES_15, Merge.MAX_WITH_CAPTURE,
               description="tool calls that did not parse, validate or run"),
        Signal("latency_ms", SignalKind.MILLISECONDS, MINUTES_15, Merge.REPLACES_CAPTURE,
               description="time to the full completion, as the client saw it"),
    )
}  # fmt: skip


class SignalValueError(ValueError):
    """A feedback value that the signal cannot take; the message names what is allowed."""


def parse_signal_value(signal: str, value: object) -> float:
    """The value of one feedback event as the float the events store holds (a bool as
    1.0/0.0). Raises :class:`SignalValueError` naming the allowed signals or values."""
    spec = SIGNALS.get(signal)
    if spec is None:
        raise SignalValueError(
            f"unknown signal {str(signal)[:64]!r}; one of {', '.join(sorted(SIGNALS))}"
        )
    if spec.kind is SignalKind.BOOL:
        if isinstance(value, bool):
            return 1.0 if value else 0.0
        if isinstance(value, int) and value in (0, 1):
            return float(value)
        raise SignalValueError(f"{signal} is true or false, not {_show(value)}")
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SignalValueError(f"{signal} is a number, not {_show(value)}")
    number = float(value)
    if not math.isfinite(number):
        raise SignalValueError(f"{signal} must be finite, not {_show(value)}")
    if spec.kind is SignalKind.FRACTION and not 0.0 <= number <= 1.0:
        raise SignalValueError(f"{signal} is a fraction in [0, 1], not {_show(value)}")
    whole = number == int(number) and 0 <= number <= 2**31 - 1
    if spec.kind is SignalKind.COUNT and not whole:
        raise SignalValueError(f"{signal} is a whole number >= 0, not {_show(value)}")
    if spec.kind is SignalKind.MILLISECONDS and number < 0:
        raise SignalValueError(f"{signal} is a duration in milliseconds >= 0, not {_show(value)}")
    return number


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
