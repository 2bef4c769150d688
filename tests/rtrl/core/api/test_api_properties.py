"""Property-based fuzzing of the duration and cron parsers (hypothesis, derandomised, a
fixed budget): whatever the text, they answer a value or a ValueError, never another
exception (issue 19: an OverflowError stopped the operator), quickly; durations round-trip
through ``format_duration``; the CRD's duration pattern says exactly what the parser's
rules say; a cron is called never-firing exactly when eight years hold no firing."""

from __future__ import annotations

import re
import string
from datetime import UTC, datetime, timedelta

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rtrl.core.api.common import (
    DURATION_DIGITS,
    MAX_DURATION_SECONDS,
    POSITIVE_DURATION_PATTERN,
    DurationTooLongError,
    format_duration,
    parse_duration,
)
from rtrl.core.api.cron import MONTHS, WEEKDAYS, never_fires, next_firing, parse_cron

# The same examples on every run (CI must not flake), a fixed number of them, and a
# per-example deadline far above what one parse takes (microseconds) but below a hang.
settings.register_profile(
    "rtrl-parsers",
    derandomize=True,
    database=None,
    max_examples=400,
    deadline=timedelta(milliseconds=250),
    suppress_health_check=[HealthCheck.too_slow],
)
FUZZ = settings.get_profile("rtrl-parsers")
UNITS = list(DURATION_DIGITS)

# --- durations --------------------------------------------------------------------------

# Text near the duration syntax (digits, unit letters, the odd stray), and any text at all.
_NEAR = st.text(alphabet="0123456789msdh " + "x-.", max_size=80)
_ANY = st.text(max_size=200)


@FUZZ
@given(st.one_of(_NEAR, _ANY, st.text(alphabet="09d", min_size=60, max_size=70)))
def test_parse_duration_answers_a_bounded_number_or_a_value_error(text: str) -> None:
    try:
        seconds = parse_duration(text)
    except ValueError:
        return
    assert 0 <= seconds <= MAX_DURATION_SECONDS


# A well-formed duration as its parts: (digits as written, unit).
_PART = st.tuples(
    st.one_of(
        st.from_regex(r"\A0{0,3}[0-9]{1,4}\Z"),  # small, with leading zeros
        st.from_regex(r"\A[1-9][0-9]{3,13}\Z"),  # around each unit's digit bound
        st.just("0"),
    ),
    st.sampled_from(UNITS),
)
_PARTS = st.lists(_PART, min_size=1, max_size=4)


@FUZZ
@given(_PARTS)
def test_the_crd_pattern_says_what_the_parser_says(parts: list[tuple[str, str]]) -> None:
    """The pattern accepts a duration exactly when each part has at most its unit's
    significant digits and one part is positive; the parser accepts every such duration
    up to MAX_DURATION and rejects the rest as too long. So what the pattern rejects the
    models reject too, and the only values it lets through that the models refuse are
    sums over a field's maximum (docs/validation.md: model-only)."""
    text = "".join(number + unit for number, unit in parts)
    digits_ok = all(len(n.lstrip("0")) <= DURATION_DIGITS[u] for n, u in parts)
    positive = any(int(n) > 0 for n, _ in parts)
    assert (re.fullmatch(POSITIVE_DURATION_PATTERN, text) is not None) == (digits_ok and positive)
    scale = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
    total = sum(int(n) * scale[u] for n, u in parts)
    if total > MAX_DURATION_SECONDS:
        try:
            parse_duration(text)
        except DurationTooLongError:
            return
        raise AssertionError(f"{text} is over the maximum and parsed")
    assert digits_ok
    assert abs(parse_duration(text) - total) < 1e-6


@FUZZ
@given(st.integers(min_value=1, max_value=MAX_DURATION_SECONDS * 1000))
def test_format_duration_round_trips(milliseconds: int) -> None:
    seconds = milliseconds / 1000
    text = format_duration(seconds)
    assert parse_duration(text) == seconds
    assert re.fullmatch(POSITIVE_DURATION_PATTERN, text)


@FUZZ
@given(_PARTS)
def test_format_duration_is_a_normal_form(parts: list[tuple[str, str]]) -> None:
    text = "".join(number + unit for number, unit in parts)
    try:
        seconds = parse_duration(text)
    except ValueError:
        return
    assert parse_duration(format_duration(seconds)) == seconds


# --- cron -------------------------------------------------------------------------------

_CRON_CHARS = string.digits + "*/,- " + "janfebmonsun@hourlyx"


@FUZZ
@given(st.one_of(st.text(alphabet=_CRON_CHARS, max_size=60), st.text(max_size=100)))
def test_parse_cron_answers_a_schedule_or_a_value_error(text: str) -> None:
    try:
        schedule = parse_cron(text)
    except ValueError:
        return
    assert schedule.minutes and schedule.hours and schedule.months
    assert schedule.days_of_month and schedule.days_of_week


def _field(low: int, high: int, names: list[str], near: list[int]) -> st.SearchStrategy[str]:
    """One cron field: '*', values (favouring ``near``), ranges, lists, steps, names."""
    value = st.one_of(
        st.integers(low, high).map(str),
        st.sampled_from(near).map(str) if near else st.nothing(),
        st.sampled_from(names) if names else st.nothing(),
    )
    item = st.one_of(
        st.just("*"),
        value,
        st.tuples(st.integers(low, high), st.integers(low, high)).map(
            lambda ab: f"{min(ab)}-{max(ab)}"
        ),
    )
    stepped = st.tuples(item, st.one_of(st.just(""), st.integers(1, 20).map(lambda s: f"/{s}")))
    return st.lists(stepped.map("".join), min_size=1, max_size=3).map(",".join)


_ANY_CRON = st.tuples(
    _field(0, 59, [], []),
    _field(0, 23, [], []),
    _field(1, 31, [], [29, 30, 31]),
    _field(1, 12, MONTHS, [2, 4, 6, 9, 11]),
    st.one_of(st.just("*"), _field(0, 7, WEEKDAYS, [])),
).map(" ".join)
# The end of the month in the short months, on any weekday or on some: where a schedule
# may never fire (31 February), or rarely (29 February), or by weekday after all.
_MONTH_END = st.tuples(
    st.sampled_from(["0", "*/30", "15"]),
    st.sampled_from(["0", "12"]),
    st.sampled_from(["29", "30", "31", "30,31", "29-31", "28-31/2", "31", "1,31"]),
    st.sampled_from(["2", "feb", "4,6", "2,4", "9-11", "4-6/2", "11", "2,3", "*/2"]),
    st.sampled_from(["*", "*", "mon", "0-6"]),
).map(" ".join)
_CRON = st.integers(0, 2).flatmap(lambda i: _MONTH_END if i else _ANY_CRON)
_AFTER = st.datetimes(
    min_value=datetime(1970, 1, 1), max_value=datetime(2200, 1, 1), timezones=st.just(UTC)
)


@settings(FUZZ, max_examples=300, deadline=timedelta(milliseconds=500))
@given(_CRON, _AFTER)
def test_never_fires_exactly_when_eight_years_hold_no_firing(
    expression: str, after: datetime
) -> None:
    try:
        schedule = parse_cron(expression)
    except ValueError:
        return  # a reversed range: its own error
    found = next_firing(schedule, after)
    assert (found is None) == bool(never_fires(schedule)), expression
    if found is not None:
        assert found > after and found.second == 0


@FUZZ
@given(_CRON, st.datetimes(min_value=datetime(9999, 12, 1), timezones=st.just(UTC)))
def test_next_firing_at_the_end_of_the_calendar_is_none_not_an_overflow(
    expression: str, after: datetime
) -> None:
    try:
        schedule = parse_cron(expression)
    except ValueError:
        return
    found = next_firing(schedule, after)
    assert found is None or found > after
