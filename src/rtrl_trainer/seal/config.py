"""The seal step's configuration: where events and shards live, the present, and when each
signal is final."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path

from rtrl.core.api.common import parse_duration
from rtrl.core.events import SIGNALS
from rtrl_trainer.spec_file import ConfigError

DEFAULT_DELAY = "10m"
DEFAULT_LOOKBACK = "7d"
# DuckDB's memory limit: beyond it the join spills to the work dir, so the step's memory
# does not grow with the number of interactions of an hour.
DEFAULT_MEMORY_LIMIT = "512MB"


@dataclass(frozen=True)
class SealConfig:
    events: str  # the events root: generations/ under it
    feedback_events: str  # feedback/ under it (usually the same root)
    shards: str  # spec.data.shards
    now: datetime
    delay: timedelta = timedelta(minutes=10)
    lookback: timedelta = timedelta(days=7)
    maturity: dict[str, timedelta] = field(default_factory=dict)  # every signal
    memory_limit: str = DEFAULT_MEMORY_LIMIT
    threads: int = 2
    endpoint_url: str | None = None
    work_dir: Path | None = None

    @property
    def longest_maturity(self) -> timedelta:
        return max(self.maturity.values())


def duration(text: str, where: str) -> timedelta:
    """``text`` (``90s``, ``30m``, ``1h30m``, ``7d``) as a timedelta; ConfigError naming
    ``where`` otherwise."""
    try:
        return timedelta(seconds=parse_duration(text))
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def maturities(overrides: list[str]) -> dict[str, timedelta]:
    """Every signal's maturity: SIGNALS' defaults, then each ``signal=duration`` given (a
    later one for the same signal wins, as flags do)."""
    chosen = {name: signal.maturity for name, signal in SIGNALS.items()}
    for text in overrides:
        name, sep, value = text.partition("=")
        where = f"--maturity {text}"
        if not sep or not value:
            raise ConfigError(f"{where}: expected signal=duration, e.g. edit_persisted=2h")
        if name not in SIGNALS:
            raise ConfigError(f"{where}: unknown signal {name!r}; one of {', '.join(SIGNALS)}")
        chosen[name] = duration(value, where)
        if chosen[name] <= timedelta(0):
            raise ConfigError(f"{where}: must be longer than 0s")
    return chosen
