"""Cron expressions for ``spec.schedule.cron``: parsing with precise errors, and the
equivalent regular expression for the CRD.

The dialect is the one Kubernetes CronJobs accept: five fields (minute, hour, day of month,
month, day of week), ``*``, ranges, lists, steps, month and weekday names, and the macros
``@hourly``, ``@daily``, ``@weekly``, ``@monthly``, ``@yearly``/``@annually``. The regular
expression accepts exactly the same strings except reversed ranges (``5-3``), which a regular
expression cannot reject, and expressions that never fire (``0 0 31 2 *``: no 31 February),
which it cannot see either; ``rtrl validate`` and the operator reject both.
"""

from __future__ import annotations

import calendar
import functools
import re
from dataclasses import dataclass
from datetime import datetime, timedelta

MACROS = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}
MONTHS = ["jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"]
WEEKDAYS = ["sun", "mon", "tue", "wed", "thu", "fri", "sat"]


@dataclass(frozen=True)
class _Field:
    name: str
    low: int
    high: int
    number_regex: str  # one or two digits within low..high, leading zero allowed
    names: tuple[str, ...] = ()  # names[i] stands for low + i


FIELDS = (
    _Field("minute", 0, 59, "[0-5]?[0-9]"),
    _Field("hour", 0, 23, "[01]?[0-9]|2[0-3]"),
    _Field("day of month", 1, 31, "0?[1-9]|[12][0-9]|3[01]"),
    _Field("month", 1, 12, "0?[1-9]|1[0-2]", tuple(MONTHS)),
    _Field("day of week", 0, 7, "0?[0-7]", tuple(WEEKDAYS)),
)


@dataclass(frozen=True)
class CronSchedule:
    """A parsed cron expression: the set of allowed values per field."""

    minutes: frozenset[int]
    hours: frozenset[int]
    days_of_month: frozenset[int]
    months: frozenset[int]
    days_of_week: frozenset[int]  # 0 = Sunday; 7 is folded into 0


def _value(text: str, field: _Field) -> int:
    lowered = text.lower()
    if lowered in field.names:
        return field.low + field.names.index(lowered)
    if not re.fullmatch(r"[0-9]{1,2}", text):
        raise ValueError(f"cron {field.name} field: {text!r} is not a number or a name")
    number = int(text)
    if not field.low <= number <= field.high:
        raise ValueError(
            f"cron {field.name} field: {number} is out of range {field.low}-{field.high}"
        )
    return number


def _parse_field(text: str, field: _Field) -> frozenset[int]:
    values: set[int] = set()
    for item in text.split(","):
        base, slash, step_text = item.partition("/")
        step = 1
        if slash:
            if not step_text.isdigit() or int(step_text) == 0:
                raise ValueError(f"cron {field.name} field: step {step_text!r} must be 1 or more")
            step = int(step_text)
        if base == "*":
            low, high = field.low, field.high
        elif "-" in base:
            low_text, _, high_text = base.partition("-")
            low, high = _value(low_text, field), _value(high_text, field)
            if low > high:
                raise ValueError(f"cron {field.name} field: range {base!r} runs backwards")
        else:
            low = _value(base, field)
            high = field.high if slash else low
        values.update(range(low, high + 1, step))
    return frozenset(values)


@functools.lru_cache(maxsize=256)
def parse_cron(expression: str) -> CronSchedule:
    """Parse ``expression``; raise ValueError naming the field that is wrong. Memoised (the
    result is immutable): every reconcile round of a cron-scheduled RLCycle asks again."""
    text = MACROS.get(expression.strip(" "), expression.strip(" "))
    if text.startswith("@"):
        raise ValueError(f"unknown cron macro {expression!r}; use one of {', '.join(MACROS)}")
    parts = re.split(r" +", text)
    if len(parts) != len(FIELDS):
        raise ValueError(
            f"cron expression {expression!r} has {len(parts)} fields; it needs 5 "
            "(minute hour day-of-month month day-of-week)"
        )
    sets = [_parse_field(part, field) for part, field in zip(parts, FIELDS, strict=True)]
    days_of_week = frozenset(day % 7 for day in sets[4])
    return CronSchedule(sets[0], sets[1], sets[2], sets[3], days_of_week)


# Days in each month of a leap year: a schedule on 29 February fires, every four years.
_LEAP_MONTH_DAYS = {month: calendar.monthrange(2024, month)[1] for month in range(1, 13)}
# How far :func:`next_firing` looks: eight years hold every date a schedule can name, 29
# February included (leap years can be eight years apart: 2096, then 2104).
HORIZON_DAYS = 366 * 8


def _days_are_and(schedule: CronSchedule) -> bool:
    """Cron's day rule: with day of month and day of week both restricted, either one
    matching is enough; with either unrestricted (``*``), both must match."""
    return len(schedule.days_of_month) == 31 or len(schedule.days_of_week) == 7


def never_fires(schedule: CronSchedule) -> str:
    """Why ``schedule`` matches no minute ever (``""`` when it fires).

    Only the day of month can make it so: hours, minutes and months are never empty, and
    every month has every weekday. So it never fires exactly when its days must match
    (:func:`_days_are_and`) and none of its days of month falls in any of its months,
    counting 29 February. :func:`next_firing` agrees (a property test holds them to it).
    """
    if not _days_are_and(schedule):
        return ""  # any of its weekdays will do
    if any(day <= _LEAP_MONTH_DAYS[m] for m in schedule.months for day in schedule.days_of_month):
        return ""
    days = ", ".join(map(str, sorted(schedule.days_of_month)))
    months = ", ".join(calendar.month_name[m] for m in sorted(schedule.months))
    return f"no day {days} in {months}"


def next_firing(schedule: CronSchedule, after: datetime) -> datetime | None:
    """The first minute strictly after ``after`` that ``schedule`` matches (in ``after``'s
    time zone), or None when none comes within :data:`HORIZON_DAYS` (it never fires, or
    the calendar ends first: year 9999)."""
    try:
        start = after.replace(second=0, microsecond=0) + timedelta(minutes=1)
    except OverflowError:
        return None
    both = _days_are_and(schedule)
    hours, minutes = sorted(schedule.hours), sorted(schedule.minutes)
    day = start.replace(hour=0, minute=0)
    for _ in range(HORIZON_DAYS):
        if day.month in schedule.months:
            dom = day.day in schedule.days_of_month
            dow = (day.isoweekday() % 7) in schedule.days_of_week
            if (dom and dow) if both else (dom or dow):
                for hour in hours:
                    for minute in minutes:
                        moment = day.replace(hour=hour, minute=minute)
                        if moment >= start:
                            return moment
        try:
            day += timedelta(days=1)
        except OverflowError:
            return None
    return None


def _name_regex(name: str) -> str:
    return "".join(f"[{c}{c.upper()}]" for c in name)


def _field_regex(field: _Field) -> str:
    value = field.number_regex
    if field.names:
        value += "|" + "|".join(_name_regex(n) for n in field.names)
    item = rf"(\*|({value})(-({value}))?)(/[0-9]*[1-9][0-9]*)?"
    return rf"{item}(,{item})*"


def cron_pattern() -> str:
    """A regular expression (RE2- and ECMA-compatible) accepting the same cron strings."""
    macros = "|".join(m[1:] for m in MACROS)
    fields = " +".join(f"({_field_regex(f)})" for f in FIELDS)
    return rf"^ *(@({macros})|{fields}) *$"


CRON_PATTERN = cron_pattern()
_CRON_RE = re.compile(CRON_PATTERN)


def matches_cron_pattern(expression: str) -> bool:
    """True when the CRD's regular expression accepts ``expression``."""
    return _CRON_RE.fullmatch(expression) is not None
