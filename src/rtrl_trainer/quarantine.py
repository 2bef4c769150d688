"""The quarantine verdict of a step that reads the interaction shards (stage, analyze).

The validating reader (:class:`~rtrl.core.shards.ValidatingReader`) quarantines bad files
and rows and counts them by reason; a step may quarantine more rows itself, that only it
can judge: a row whose ``checkpoint_id`` contradicts its file's ``checkpoint=`` path
(:data:`CHECKPOINT_MISMATCH`), or one whose token ids contradict its file's footer
(:data:`STATISTICS_MISMATCH`), or one of a partition whose logged log-probs the serving
checkpoint does not reproduce (:data:`FIDELITY`, the stage's fidelity gate).
:func:`quarantine` adds them up, per reason and per file, the same way for every step, so
stage.json and analysis.json count alike.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from rtrl.core.shards.report import ValidationReport

CHECKPOINT_MISMATCH = "checkpoint_mismatch"
# A row holding a token id outside the range its file's footer declares, when the set's
# token ids were narrowed on the strength of those declarations.
STATISTICS_MISMATCH = "statistics_mismatch"
# A row of a partition whose sampled rows' log-probs, recomputed with the serving checkpoint
# under their sampling parameters, disagree with the logged ones beyond the bound.
FIDELITY = "fidelity"
# Bad files listed in a result document; the counts cover all of them.
MAX_BAD_FILES = 100


@dataclass
class Quarantined:
    """What a step's pass over the shards quarantined: the reader's report, and the rows
    the step left out itself, per file url."""

    report: ValidationReport
    mismatched: Counter[str] = field(default_factory=Counter)  # CHECKPOINT_MISMATCH
    undeclared: Counter[str] = field(default_factory=Counter)  # STATISTICS_MISMATCH
    unfaithful: Counter[str] = field(default_factory=Counter)  # FIDELITY


@dataclass(frozen=True)
class Quarantine:
    rows_read: int
    rows_bad: int
    files_total: int
    files_bad: int
    by_reason: dict[str, int]  # rows per reason (a row failing two checks counts twice)
    files_by_reason: dict[str, int]  # files with at least one problem of each reason
    bad_files: list[dict[str, Any]]

    @property
    def bad_fraction(self) -> float:
        if self.rows_read:
            return self.rows_bad / self.rows_read
        # Files whose footers could not even be read have no row count: all of it is bad.
        return 1.0 if self.files_bad else 0.0


def quarantine(found: Quarantined) -> Quarantine:
    """The reader's quarantine plus the rows the step itself quarantined (rows that
    contradict their file's path or footer), per reason and per file."""
    report = found.report
    by_reason = dict(report.rows_by_reason)
    files_by_reason = dict(report.files_by_reason)
    own = {
        CHECKPOINT_MISMATCH: found.mismatched,
        STATISTICS_MISMATCH: found.undeclared,
        FIDELITY: found.unfaithful,
    }
    for reason, per_file in own.items():
        if per_file:
            by_reason[reason] = sum(per_file.values())
            files_by_reason[reason] = len(per_file)
    bad_files: list[dict[str, Any]] = []
    files_bad = 0
    for file in report.files:
        lost = {reason: n for reason, per_file in own.items() if (n := per_file.get(file.url))}
        if file.status == "ok" and not lost:
            continue
        files_bad += 1
        if len(bad_files) < MAX_BAD_FILES:
            entry = file.to_dict()
            for reason, n in lost.items():
                entry["rows_bad"] += n
                entry["rows_by_reason"][reason] = n
                entry["reasons"].append(reason)
                if entry["status"] == "ok":
                    entry["status"] = "bad"
            bad_files.append(entry)
    return Quarantine(
        rows_read=report.rows_total,
        rows_bad=report.rows_bad + sum(sum(per_file.values()) for per_file in own.values()),
        files_total=report.files_total,
        files_bad=files_bad,
        by_reason=by_reason,
        files_by_reason=files_by_reason,
        bad_files=bad_files,
    )


def _percent(value: float) -> str:
    return f"{100 * value:.3g}%"


def quarantine_message(q: Quarantine, limit: float) -> str:
    """``3.2% of rows are bad (limit 1%): list_length_mismatch=12; 2 of 40 files bad
    (unreadable=1, list_length_mismatch=1)``"""
    text = f"{_percent(q.bad_fraction)} of rows are bad (limit {_percent(limit)})"
    if q.by_reason:
        text += ": " + ", ".join(f"{reason}={n}" for reason, n in q.by_reason.items())
    if q.files_bad:
        reasons = ", ".join(f"{reason}={n}" for reason, n in q.files_by_reason.items())
        text += f"; {q.files_bad} of {q.files_total} files bad ({reasons})"
    return text
