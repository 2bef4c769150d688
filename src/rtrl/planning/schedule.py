"""When the next cycle is due: ``interval`` after the previous start, or the next cron time."""

from __future__ import annotations

import functools
from datetime import datetime, timedelta

from rtrl.core.api.common import parse_duration
from rtrl.core.api.cron import CronSchedule, parse_cron
from rtrl.core.api.rlcycle import ScheduleSpec

# A cron expression that never fires (e.g. 30 February) is searched this far ahead.
_HORIZON_DAYS = 366 * 8


@functools.lru_cache(maxsize=1024)
def next_cron(schedule: CronSchedule, after: datetime) -> datetime | None:
    """The first minute strictly after ``after`` that ``schedule`` matches (UTC), or None.
    Memoised: ``after`` is the previous start, the same in every round until the next one,
    and a yearly schedule walks a year of days.

    Day of month and day of week follow cron: when both are restricted, either matches.
    """
    start = after.replace(second=0, microsecond=0) + timedelta(minutes=1)
    dom_any = len(schedule.days_of_month) == 31
    dow_any = len(schedule.days_of_week) == 7
    day = start.replace(hour=0, minute=0)
    for _ in range(_HORIZON_DAYS):
        if day.month in schedule.months:
            dom = day.day in schedule.days_of_month
            dow = (day.isoweekday() % 7) in schedule.days_of_week
            # cron: with both day fields restricted, either may match
            if (dom and dow) if (dom_any or dow_any) else (dom or dow):
                for hour in sorted(schedule.hours):
                    for minute in sorted(schedule.minutes):
                        moment = day.replace(hour=hour, minute=minute)
                        if moment >= start:
                            return moment
        day += timedelta(days=1)
    return None


def next_run(
    schedule: ScheduleSpec, last_start: datetime | None, created: datetime
) -> datetime | None:
    """When the next cycle is due. With ``interval``, the first cycle is due at once; with
    ``cron``, at the first matching minute after the previous start (or the RLCycle's
    creation)."""
    if schedule.interval is not None:
        if last_start is None:
            return created
        return last_start + timedelta(seconds=parse_duration(schedule.interval))
    assert schedule.cron is not None
    return next_cron(parse_cron(schedule.cron), last_start or created)
