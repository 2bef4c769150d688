"""When the next cycle is due: ``interval`` after the previous start, or the next cron time.

Never an exception for a spec the models accept: every duration is bounded (at most 365d
for ``interval``), a cron that never fires is rejected, and a start so close to the end
of the calendar (year 9999) that nothing can follow it means no next run.
"""

from __future__ import annotations

import functools
from datetime import datetime, timedelta

from rtrl.core.api.common import parse_duration
from rtrl.core.api.cron import CronSchedule, next_firing, parse_cron
from rtrl.core.api.rlcycle import ScheduleSpec


@functools.lru_cache(maxsize=1024)
def next_cron(schedule: CronSchedule, after: datetime) -> datetime | None:
    """The first minute strictly after ``after`` that ``schedule`` matches (UTC), or None.
    Memoised: ``after`` is the previous start, the same in every round until the next one,
    and a yearly schedule walks a year of days.

    Day of month and day of week follow cron: when both are restricted, either matches.
    """
    return next_firing(schedule, after)


def next_run(
    schedule: ScheduleSpec, last_start: datetime | None, created: datetime
) -> datetime | None:
    """When the next cycle is due (None: never). With ``interval``, the first cycle is due
    at once; with ``cron``, at the first matching minute after the previous start (or the
    RLCycle's creation)."""
    if schedule.interval is not None:
        if last_start is None:
            return created
        try:
            return last_start + timedelta(seconds=parse_duration(schedule.interval))
        except OverflowError:  # a start in year 9999, written by hand
            return None
    assert schedule.cron is not None
    return next_cron(parse_cron(schedule.cron), last_start or created)
