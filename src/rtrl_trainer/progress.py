"""Progress lines of the long steps (stage, train, eval, analyze): counts, rate and ETA.

A step runs in a pod for minutes to hours, and its log is what a user watches
(``kubectl logs -f``). Every long loop reports through :class:`Progress`, so all steps
print alike: single lines (no carriage returns: pods' logs keep every byte), at most one
every ``RTRL_PROGRESS_SECONDS`` (default 10) besides the first and the start and end lines,
so that a fast loop cannot flood the log and a slow one still shows its first rate at once.

``--log-format json`` (or ``RTRL_LOG_FORMAT=json``) makes every line one JSON object, for a
log pipeline: ``{"step", "event", "what", "done", "total", "unit", "rate", "eta_seconds",
"elapsed_seconds", "counts", "message", "time"}`` (absent when unknown). Text lines read
``rtrl-job <step>: <what> <done>/<total> <unit> (<pct>%), <rate> <unit>/s, ETA <eta>``.
Errors stay on stderr as the one plain line :mod:`rtrl_trainer.runner` prints.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from datetime import UTC, datetime
from typing import Any, TextIO, TypeVar

from rtrl.core.api.progress import duration

LOG_FORMAT_ENV = "RTRL_LOG_FORMAT"
INTERVAL_ENV = "RTRL_PROGRESS_SECONDS"
FORMATS = ("text", "json")
DEFAULT_INTERVAL = 10.0

_T = TypeVar("_T")
_format: str | None = None


def configure(flag: str | None) -> None:
    """The log format: ``flag`` (``--log-format``), else ``$RTRL_LOG_FORMAT``, else text;
    a ValueError naming the variable when it holds anything else."""
    global _format  # noqa: PLW0603 (one setting per process, read by every line)
    chosen = flag or os.environ.get(LOG_FORMAT_ENV) or "text"
    if chosen not in FORMATS:
        raise ValueError(f"{LOG_FORMAT_ENV}: must be one of {', '.join(FORMATS)}, got {chosen!r}")
    _format = chosen


def log_format() -> str:
    if _format is None:
        configure(None)
    assert _format is not None
    return _format


def interval() -> float:
    """Seconds between two progress lines of one loop (``$RTRL_PROGRESS_SECONDS``)."""
    raw = os.environ.get(INTERVAL_ENV)
    if not raw:
        return DEFAULT_INTERVAL
    try:
        seconds = float(raw)
    except ValueError:
        return DEFAULT_INTERVAL
    return seconds if math.isfinite(seconds) and seconds >= 0 else DEFAULT_INTERVAL


def emit(step: str, event: str, message: str, *, out: TextIO | None = None, **fields: Any) -> None:
    """One line on stdout: ``rtrl-job <step>: <message>``, or the JSON object of
    ``step``, ``event``, ``message`` and ``fields`` (None values left out)."""
    stream = out if out is not None else sys.stdout
    if log_format() == "json":
        doc = {"step": step, "event": event, "message": message, **fields}
        doc["time"] = datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
        line = json.dumps({k: _plain(v) for k, v in doc.items() if v is not None})
    else:
        line = f"rtrl-job {step}: {message}"
    print(" ".join(line.splitlines()), file=stream, flush=True)


def note(step: str, message: str) -> None:
    """A message that is not a count (``event: "note"``)."""
    emit(step, "note", message)


def result(step: str, line: str) -> None:
    """The step's one-line summary, as it has always been printed (``event: "result"``)."""
    if log_format() == "json":
        emit(step, "result", line)
    else:
        print(line, flush=True)


def _plain(value: Any) -> Any:
    """JSON has no NaN or infinity: such a number is reported as unknown."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _number(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


class Progress:
    """One long loop's progress: ``done`` of ``total`` ``unit`` (total None: unknown, no
    ETA). ``done`` starts where the loop starts (a resumed run's earlier steps are not in
    its rate). ``quiet``: count but print nothing (every rank but rank 0)."""

    def __init__(
        self,
        step: str,
        what: str,
        *,
        total: int | None = None,
        unit: str = "items",
        done: int = 0,
        quiet: bool = False,
        every: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        out: TextIO | None = None,
    ) -> None:
        self.step, self.what, self.total, self.unit = step, what, total, unit
        self.done = self.first = done
        self.quiet = quiet
        self.every = interval() if every is None else every
        self.clock = clock
        self.out = out
        self.started = clock()
        self.last: float | None = None  # when the last progress line was printed
        self._lock = threading.RLock()  # a pool's workers count on one Progress

    # --- the numbers ----------------------------------------------------------------------

    def elapsed(self) -> float:
        return self.clock() - self.started

    def rate(self) -> float | None:
        """``unit`` per second since the start of this loop (None before any is done)."""
        elapsed = self.elapsed()
        return (
            (self.done - self.first) / elapsed if elapsed > 0 and self.done > self.first else None
        )

    def eta(self) -> float | None:
        """Seconds left at the rate so far (None: no total, or no rate yet)."""
        rate = self.rate()
        if self.total is None or not rate:
            return None
        return max(0, self.total - self.done) / rate

    # --- the lines ------------------------------------------------------------------------

    def start(self, detail: str | None = None, **counts: Any) -> None:
        """The first line: what starts, and how much of it there is."""
        self.started = self.clock()
        size = f" {self.total} {self.unit}" if self.total is not None else ""
        resumed = f" (from {self.done})" if self.done else ""
        message = detail or f"{self.what}: started{size and ','}{size}{resumed}"
        self._line("start", message, counts)

    def update(
        self, done: int | None = None, *, detail: str | None = None, force: bool = False,
        **counts: Any,
    ) -> bool:  # fmt: skip
        """Set ``done`` (default: one more); print a line when the interval has passed since
        the last one, on the first update, or when ``force``d. True when it printed."""
        with self._lock:
            self.done = self.done + 1 if done is None else done
            now = self.clock()
            due = self.last is None or now - self.last >= self.every
            if not (due or force):
                return False
            self.last = now
            self._line("progress", self._message(detail, counts), counts)
            return True

    def advance(self, count: int = 1, **counts: Any) -> bool:
        """``count`` more done (safe from several threads)."""
        with self._lock:
            return self.update(self.done + count, **counts)

    def track(self, items: Iterable[_T]) -> Iterator[_T]:
        """``items``, counting one done after each is handled."""
        for item in items:
            yield item
            self.advance()

    def end(self, detail: str | None = None, **counts: Any) -> None:
        """The last line: how much was done, in how long, at what rate."""
        rate = self.rate()
        done = f"{self.done - self.first}" if self.total is None else f"{self.done}/{self.total}"
        extra = "".join(f", {k} {v:,}" for k, v in counts.items() if isinstance(v, int))
        message = detail or (
            f"{self.what}: done, {done} {self.unit}{extra} in {duration(self.elapsed())}"
            + (f", {_number(rate)} {self.unit}/s" if rate else "")
        )
        self._line("end", message, counts)

    def _message(self, detail: str | None, counts: dict[str, Any]) -> str:
        eta = self.eta()
        tail = f", ETA {duration(eta)}" if eta is not None else ""
        if detail:
            return detail + tail
        rate = self.rate()
        if self.total:
            count = f"{self.done}/{self.total} {self.unit} ({100 * self.done / self.total:.0f}%)"
        else:
            count = f"{self.done} {self.unit}"
        speed = f", {_number(rate)} {self.unit}/s" if rate else ""
        extra = "".join(f", {k} {v:,}" for k, v in counts.items() if isinstance(v, int))
        return f"{self.what}: {count}{extra}{speed}{tail}"

    def _line(self, event: str, message: str, counts: dict[str, Any]) -> None:
        if self.quiet:
            return
        emit(
            self.step,
            event,
            message,
            out=self.out,
            what=self.what,
            done=self.done,
            total=self.total,
            unit=self.unit,
            rate=self.rate(),
            eta_seconds=self.eta(),
            elapsed_seconds=round(self.elapsed(), 3),
            counts=counts or None,
        )


@contextlib.contextmanager
def running(step: str, what: str, *, total: int | None, unit: str) -> Iterator[Progress]:
    """A :class:`Progress` from its start line to its end line (not printed when the loop
    raises: the step's error line says what happened)."""
    progress = Progress(step, what, total=total, unit=unit)
    progress.start()
    yield progress
    progress.end()
