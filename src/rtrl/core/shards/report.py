"""What validation found, per file and per reason, for people (text) and machines (JSON).

Bad rows are quarantined, never silently dropped: whoever reads a shard set gets this report
alongside the good rows, so a logging pipeline that starts writing positive log-probs shows
up as a count with example rows, and the stage step can refuse a set that is mostly bad.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from rtrl.core.shards.checks import (
    DUPLICATE_INTERACTION_ID,
    INVALID_UTF8,
    LIST_LENGTH_MISMATCH,
    LOGPROB_NON_FINITE,
    LOGPROB_POSITIVE,
    NULL_REQUIRED,
    SIGNAL_OUT_OF_RANGE,
    TIME_OUT_OF_RANGE,
    TOKEN_OUT_OF_RANGE,
)
from rtrl.core.shards.footer import OVER_LIMIT
from rtrl.core.shards.limits import TOO_LONG
from rtrl.core.shards.sampling import SAMPLING_OUT_OF_RANGE, UNKNOWN_LOGPROBS_MODE

UNREADABLE = "unreadable"
MISSING_COLUMN = "missing_column"
WRONG_TYPE = "wrong_type"

# Reasons that condemn a whole file (or, for wrong_type on a value that does not fit its
# canonical type, a whole batch of it) rather than individual rows. over_limit: the file's
# footer describes more than the reader's limits allow (rtrl.core.shards.limits).
FILE_REASONS: tuple[str, ...] = (UNREADABLE, OVER_LIMIT, MISSING_COLUMN, WRONG_TYPE)
ROW_REASONS: tuple[str, ...] = (
    TOO_LONG,
    NULL_REQUIRED,
    LIST_LENGTH_MISMATCH,
    LOGPROB_POSITIVE,
    LOGPROB_NON_FINITE,
    SIGNAL_OUT_OF_RANGE,
    TIME_OUT_OF_RANGE,
    TOKEN_OUT_OF_RANGE,
    SAMPLING_OUT_OF_RANGE,
    UNKNOWN_LOGPROBS_MODE,
    INVALID_UTF8,
    DUPLICATE_INTERACTION_ID,
)
REASONS: tuple[str, ...] = FILE_REASONS + ROW_REASONS

# Enough to find the offending rows with any Parquet tool, without a report that grows with
# the number of bad rows.
MAX_EXAMPLES = 5
MAX_MESSAGES = 10

FileStatus = Literal["ok", "bad", "rejected", "unreadable"]


def _ordered(counts: Counter[str]) -> dict[str, int]:
    return {reason: counts[reason] for reason in REASONS if counts[reason]}


def _summed(counts: Iterable[Iterable[str]]) -> dict[str, int]:
    """The counts added up (zero counts kept), in the order of :func:`_ordered`."""
    total: Counter[str] = Counter()
    for each in counts:
        total.update(each)
    return _ordered(total)


@dataclass
class FileReport:
    """One shard file: how many rows it has, how many were good, and why the others were not.

    ``rows_by_reason`` counts rows per reason (a row failing two checks counts under both;
    rows of a rejected file count under the file's reasons); ``examples`` holds the first
    row numbers within the file per row reason; ``messages`` explain file-level problems.
    ``rows_total`` is the footer's row count, 0 when even the footer was unreadable.
    """

    key: str
    url: str
    status: FileStatus = "ok"
    rows_total: int = 0
    rows_good: int = 0
    rows_by_reason: Counter[str] = field(default_factory=Counter)
    reasons: set[str] = field(default_factory=set)
    examples: dict[str, list[int]] = field(default_factory=dict)
    messages: list[str] = field(default_factory=list)

    @property
    def rows_bad(self) -> int:
        return self.rows_total - self.rows_good

    def add_problem(self, reason: str, message: str, rows: int = 0) -> None:
        """A file- or batch-level problem: ``rows`` rows are lost to it."""
        self.reasons.add(reason)
        self.rows_by_reason[reason] += rows
        if len(self.messages) < MAX_MESSAGES:
            self.messages.append(f"{reason}: {message}")

    def add_rows(
        self, reason: str, count: int, examples: list[int], detail: str | None = None
    ) -> None:
        """``count`` rows failed ``reason``; ``examples`` are some of their row numbers;
        ``detail`` says what is wrong with the first of them, kept for the first batch
        with such rows only (one message per reason and file)."""
        if detail is not None and reason not in self.reasons and len(self.messages) < MAX_MESSAGES:
            self.messages.append(f"{reason}: {detail}")
        self.reasons.add(reason)
        self.rows_by_reason[reason] += count
        kept = self.examples.setdefault(reason, [])
        kept.extend(examples[: MAX_EXAMPLES - len(kept)])

    def to_dict(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "url": self.url,
            "status": self.status,
            "rows_total": self.rows_total,
            "rows_good": self.rows_good,
            "rows_bad": self.rows_bad,
            "reasons": [r for r in REASONS if r in self.reasons],
            "rows_by_reason": _ordered(self.rows_by_reason),
            "examples": {r: self.examples[r] for r in REASONS if r in self.examples},
            "messages": list(self.messages),
        }

    def render(self) -> str:
        """One line: the file and what is wrong with it."""
        if self.status == "unreadable" and not self.rows_good:
            detail = "; ".join(self.messages) or UNREADABLE
            return f"{self.url}: unreadable: {detail.removeprefix(UNREADABLE + ': ')}"
        if self.status == "rejected":
            return f"{self.url}: rejected ({self.rows_total} rows): " + "; ".join(self.messages)
        counts = ", ".join(f"{r}={n}" for r, n in _ordered(self.rows_by_reason).items())
        line = f"{self.url}: {self.rows_bad} of {self.rows_total} rows bad: {counts}"
        if self.messages:
            line += " (" + "; ".join(self.messages) + ")"
        return line


@dataclass
class ValidationReport:
    """The running report of one pass over a shard set; updated while rows stream.
    ``vocab_size`` is the vocabulary token ids were checked against (None: only that they
    are not negative)."""

    uri: str
    files: list[FileReport] = field(default_factory=list)
    vocab_size: int | None = None

    @property
    def files_total(self) -> int:
        return len(self.files)

    @property
    def files_bad(self) -> int:
        return sum(1 for f in self.files if f.status != "ok")

    @property
    def rows_total(self) -> int:
        return sum(f.rows_total for f in self.files)

    @property
    def rows_good(self) -> int:
        return sum(f.rows_good for f in self.files)

    @property
    def rows_bad(self) -> int:
        return self.rows_total - self.rows_good

    @property
    def rows_by_reason(self) -> dict[str, int]:
        return _summed(f.rows_by_reason for f in self.files)

    @property
    def files_by_reason(self) -> dict[str, int]:
        """Files with at least one problem of each reason."""
        return _summed(f.reasons for f in self.files)

    @property
    def ok(self) -> bool:
        """True when there was something to read and all of it was good."""
        return self.files_total > 0 and self.files_bad == 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "uri": self.uri,
            "ok": self.ok,
            "vocab_size": self.vocab_size,
            "files_total": self.files_total,
            "files_bad": self.files_bad,
            "rows_total": self.rows_total,
            "rows_good": self.rows_good,
            "rows_bad": self.rows_bad,
            "files_by_reason": self.files_by_reason,
            "rows_by_reason": self.rows_by_reason,
            "files": [f.to_dict() for f in self.files],
        }

    def render(self) -> str:
        """One line per bad file with its reason counts, then the totals."""
        lines = [f.render() for f in self.files if f.status != "ok"]
        if not self.files:
            lines.append(f"{self.uri}: no shard files (*.parquet) found")
        lines.append(
            f"files: {self.files_total} total, {self.files_bad} bad; "
            f"rows: {self.rows_total} total, {self.rows_good} good, {self.rows_bad} bad"
        )
        by_reason = self.rows_by_reason
        files_by_reason = self.files_by_reason
        for reason, files in files_by_reason.items():
            lines.append(f"  {reason}: {by_reason.get(reason, 0)} rows in {files} files")
        return "\n".join(lines)
