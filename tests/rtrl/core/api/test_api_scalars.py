"""Durations and cron expressions: the parser and the CRD's regular expression accept the
same strings (one documented exception), and the messages name the part that is wrong."""

from __future__ import annotations

import random
import re

import pytest

from rtrl.core.api.common import POSITIVE_DURATION_PATTERN, format_duration, parse_duration
from rtrl.core.api.cron import MONTHS, WEEKDAYS, matches_cron_pattern, parse_cron


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90s", 90), ("30m", 1800), ("1h30m", 5400), ("7d", 604800), ("250ms", 0.25), ("1h1h", 7200)],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "1", "1 h", "1H", "-5m", "1.5h", "h", "5m30"])
def test_parse_duration_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="invalid duration"):
        parse_duration(text)


@pytest.mark.parametrize("seconds", [0.25, 1, 59, 60, 61, 3600, 5400, 86400, 90061.5])
def test_format_duration_round_trips(seconds: float) -> None:
    assert parse_duration(format_duration(seconds)) == seconds


def test_positive_duration_pattern_matches_the_parser() -> None:
    rng = random.Random(1)
    numbers, units = ["0", "00", "1", "7", "10", "05"], ["ms", "s", "m", "h", "d"]
    for _ in range(3000):
        parts = rng.randint(1, 3)
        text = "".join(f"{rng.choice(numbers)}{rng.choice(units)}" for _ in range(parts))
        regex = re.fullmatch(POSITIVE_DURATION_PATTERN, text) is not None
        assert regex == (parse_duration(text) > 0), text


def test_cron_parses_fields() -> None:
    schedule = parse_cron("*/15 9-17 * jan,JUL mon-fri")
    assert schedule.minutes == {0, 15, 30, 45}
    assert schedule.hours == set(range(9, 18))
    assert schedule.days_of_month == set(range(1, 32))
    assert schedule.months == {1, 7}
    assert schedule.days_of_week == {1, 2, 3, 4, 5}
    assert parse_cron("0 0 * * 7").days_of_week == {0}
    assert parse_cron("@hourly") == parse_cron("0 * * * *")
    assert parse_cron("5/20 * * * *").minutes == {5, 25, 45}


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("61 * * * *", "cron minute field: 61 is out of range 0-59"),
        ("* 24 * * *", "cron hour field: 24 is out of range 0-23"),
        ("* * 0 * *", "cron day of month field: 0 is out of range 1-31"),
        ("* * * 13 *", "cron month field: 13 is out of range 1-12"),
        ("* * * * 8", "cron day of week field: 8 is out of range 0-7"),
        ("* * * * funday", "cron day of week field: 'funday' is not a number or a name"),
        ("*/0 * * * *", "cron minute field: step '0' must be 1 or more"),
        ("30-10 * * * *", "cron minute field: range '30-10' runs backwards"),
        ("* * * *", "has 4 fields; it needs 5"),
        ("@fortnightly", "unknown cron macro '@fortnightly'"),
    ],
)
def test_cron_errors_name_the_field(expression: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_cron(expression)


def _random_cron(rng: random.Random) -> str:
    def value(low: int, high: int, names: list[str]) -> str:
        roll = rng.random()
        if roll < 0.1 and names:
            name = rng.choice(names)
            return rng.choice([name, name.upper(), name.title(), name + "x"])
        if roll < 0.15:
            return rng.choice(["", "x", "-1", "007", "1.5"])
        number = rng.randint(low - 2, high + 2)
        return str(number).zfill(rng.choice([1, 1, 2])) if number >= 0 else str(number)

    def item(low: int, high: int, names: list[str]) -> str:
        roll = rng.random()
        base = (
            "*"
            if roll < 0.3
            else f"{value(low, high, names)}-{value(low, high, names)}"
            if roll < 0.6
            else value(low, high, names)
        )
        if rng.random() < 0.3:
            base += f"/{rng.choice(['0', '1', '5', '15', '00', 'x', ''])}"
        return base

    bounds = [(0, 59, []), (0, 23, []), (1, 31, []), (1, 12, MONTHS), (0, 7, WEEKDAYS)]
    fields = [",".join(item(*b) for _ in range(rng.choice([1, 1, 2, 3]))) for b in bounds]
    if rng.random() < 0.05:
        fields = fields[: rng.randint(1, 4)]
    return " ".join(fields)


def test_cron_pattern_accepts_what_the_parser_accepts() -> None:
    rng = random.Random(7)
    agreed = reversed_ranges = 0
    for _ in range(20000):
        expression = _random_cron(rng)
        try:
            parse_cron(expression)
            parsed, reversed_range = True, False
        except ValueError as exc:
            parsed, reversed_range = False, "runs backwards" in str(exc)
        if reversed_range:
            # The documented exception: a regex cannot compare the ends of a range; it only
            # checks each end. So it must judge the expression as the parser judges it with
            # every range a-b written as the list a,b.
            swapped = re.sub(r"([^,\s/-]+)-([^,\s/-]+)", r"\1,\2", expression)
            try:
                parse_cron(swapped)
                parsed = True
            except ValueError:
                parsed = False
            assert matches_cron_pattern(expression) == parsed, expression
            reversed_ranges += 1
            continue
        assert matches_cron_pattern(expression) == parsed, expression
        agreed += parsed
    assert agreed > 100 and reversed_ranges > 100
