"""The looks of the analysis plan: when each one is, and the first look each row counts at.

The operator analyses a canary every ``analysis.interval`` from its start until
``analysis.maxDuration``; the group-sequential test (:mod:`.sequential`) spends its error
over exactly those looks. An analysis at any moment judges the data *as of* the last look
of the plan at or before it (``since + k interval``): a look between two of them (a retried
Job, an operator restarted, someone running ``rtrl-job analyze`` by hand) repeats that
look's answer and spends nothing. To compute its boundary the analysis replays every earlier
look of the plan from the same shards: a row counts at look ``k`` if it was created by
``look_k - maturity`` and its feedback arrived by ``look_k`` (the metrics), or was created by
``look_k`` (the assignment counts: sample ratio, rows per unit).

With ``analysis.sequentialTest: mixture`` there is one look, now: the mixture intervals are
valid at any moment.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np

BIN_US = 300_000_000  # exposure is measured in 5-minute bins of creation time
_INT64_MAX = np.iinfo(np.int64).max


def to_us(value: datetime) -> int:
    delta = value.astimezone(UTC) - datetime(1970, 1, 1, tzinfo=UTC)
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


def from_us(value: int) -> datetime:
    return datetime(1970, 1, 1, tzinfo=UTC) + timedelta(microseconds=int(value))


@dataclass(frozen=True)
class Looks:
    """The looks replayed, in microseconds since the epoch, and the calendar fraction of
    ``maxDuration`` each one is at (its share of the error: :func:`.sequential.spent`)."""

    times: np.ndarray  # int64, increasing; the last is the look judged now
    fractions: np.ndarray
    since: int
    maturity: int
    planned: bool  # the plan's grid (group-sequential); False: one look, now (mixture)

    @classmethod
    def plan(
        cls, *, since: datetime | None, now: datetime, interval: timedelta,
        max_duration: timedelta, maturity: timedelta, planned: bool = True,
    ) -> Looks:  # fmt: skip
        """Every ``interval`` from ``since`` up to ``now`` (at least one look: ``now`` when
        the first is still ahead, or without ``since``)."""
        now_us, step = to_us(now), int(interval.total_seconds() * 1_000_000)
        start = to_us(since) if since is not None else now_us
        count = (now_us - start) // step if planned and since is not None else 0
        times = (
            start + step * np.arange(1, count + 1, dtype=np.int64)
            if count > 0
            else np.array([now_us], dtype=np.int64)
        )
        span = max(max_duration.total_seconds() * 1_000_000, 1.0)
        return cls(
            times=times,
            fractions=(times - start) / span,
            since=start,
            maturity=int(maturity.total_seconds() * 1_000_000),
            planned=planned and count > 0,
        )

    @property
    def count(self) -> int:
        return int(self.times.size)

    @property
    def last(self) -> int:
        return int(self.times[-1])

    def counted(self, created: np.ndarray, feedback: np.ndarray) -> np.ndarray:
        """The first look at which each row's metrics count (``count``: none yet)."""
        by_age = np.searchsorted(self.times - self.maturity, created, side="left")
        by_feedback = np.searchsorted(self.times, feedback, side="left")
        result: np.ndarray = np.maximum(by_age, by_feedback)
        return result

    def judged(self, created: np.ndarray) -> np.ndarray:
        """The first look at which each row is old enough for its feedback to be due."""
        result: np.ndarray = np.searchsorted(self.times - self.maturity, created, side="left")
        return result

    def assigned(self, created: np.ndarray) -> np.ndarray:
        """The first look at which each row counts as assigned (created by then)."""
        result: np.ndarray = np.searchsorted(self.times, created, side="left")
        return result

    def bins(self, created: np.ndarray) -> np.ndarray:
        """Each row's 5-minute bin of creation since the canary's start."""
        result: np.ndarray = (created - self.since) // BIN_US
        return result

    def describe(self) -> dict[str, Any]:
        return {
            "looks": self.count,
            "as_of": from_us(self.last).isoformat().replace("+00:00", "Z"),
            "fraction": float(self.fractions[-1]),
        }
