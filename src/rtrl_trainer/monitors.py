"""Behaviour monitors of a staged set, accumulated batch by batch in bounded memory.

A policy trained on implicit feedback can learn to game it: ask clarifying questions
instead of editing (no edit, so nothing fails to persist), stop calling tools, answer
shorter. The reward alone does not show that; these monitors do, every cycle, and the
rollout's guardrails compare them between arms. They are computed while the rows stream
past, with counters and a fixed histogram, so memory does not depend on the number of rows.

Signals follow the reward's missing-signal rule (:mod:`rtrl_trainer.reward`): a null count
is 0 and a null flag is false; ``edit_persistence`` averages only the rows where it was
measured, and latency quantiles only rows that reported a latency.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from rtrl_trainer.reward import SIGNAL_COLUMNS, filled

# The columns the monitors read: small ones only (completion lengths are passed in), so
# selecting rows for them never copies token lists.
MONITOR_COLUMNS: tuple[str, ...] = (*SIGNAL_COLUMNS, "edits_proposed")

MONITOR_NAMES: tuple[str, ...] = (
    "edit_rate",
    "clarification_rate",
    "invalid_tool_call_rate",
    "invalid_tool_call_interaction_rate",
    "mean_completion_tokens",
    "latency_p50_ms",
    "latency_p95_ms",
    "edit_persistence",
    "dissatisfied_rate",
)


class LatencyHistogram:
    """Latencies in fixed log-spaced bins: quantiles with a relative error below 0.5%
    (each bin spans a factor ``GROWTH`` and reports its geometric midpoint), in ~20 kB
    whatever the number of values.

    Values below ``LOW_MS`` (sub-10-microsecond latencies, i.e. zero) share one bin that
    reports 0; values above ``HIGH_MS`` (11.6 days) one that reports ``HIGH_MS``.
    """

    LOW_MS = 0.01
    HIGH_MS = 1e9
    GROWTH = 1.01

    def __init__(self) -> None:
        self._log_growth = math.log(self.GROWTH)
        inner = math.ceil(math.log(self.HIGH_MS / self.LOW_MS) / self._log_growth)
        # [0]: below LOW_MS; [1..inner]: log bins; [inner + 1]: at or above HIGH_MS.
        self.counts = np.zeros(inner + 2, dtype=np.int64)
        self._inner = inner

    @property
    def count(self) -> int:
        return int(self.counts.sum())

    def add(self, values: npt.NDArray[np.float64]) -> None:
        if values.size == 0:
            return
        # Zero (and anything below LOW_MS) lands in bin 0 through the clip below.
        floor = np.maximum(values, self.LOW_MS / 2)
        scaled = np.log(floor / self.LOW_MS) / self._log_growth
        index = np.floor(scaled).astype(np.int64, copy=False) + 1
        np.clip(index, 0, self._inner + 1, out=index)
        self.counts += np.bincount(index, minlength=self.counts.size)

    def quantile(self, q: float) -> float | None:
        """The nearest-rank ``q`` quantile (numpy's ``inverted_cdf``), within the bin
        resolution; None when empty."""
        total = self.count
        if total == 0:
            return None
        rank = max(1, math.ceil(q * total))
        index = int(np.searchsorted(np.cumsum(self.counts), rank))
        if index == 0:
            return 0.0
        if index > self._inner:
            return self.HIGH_MS
        return float(self.LOW_MS * math.pow(self.GROWTH, index - 0.5))


@dataclass
class Monitors:
    """Running behaviour monitors of the rows passed to :meth:`update`."""

    rows: int = 0
    edits: int = 0
    clarifications: int = 0
    tool_calls: int = 0
    invalid_tool_calls: int = 0
    rows_with_invalid: int = 0
    completion_tokens: int = 0
    edit_persisted_sum: float = 0.0
    edit_persisted_rows: int = 0
    dissatisfied: int = 0
    latency: LatencyHistogram = field(default_factory=LatencyHistogram)
    missing: dict[str, int] = field(default_factory=lambda: dict.fromkeys(MONITOR_COLUMNS, 0))

    def update(
        self, batch: pa.RecordBatch | pa.Table, completion_tokens: npt.NDArray[np.integer[Any]]
    ) -> None:
        """Add the rows of ``batch`` (the :data:`MONITOR_COLUMNS`; others are ignored) whose
        completions have ``completion_tokens`` tokens each."""
        if batch.num_rows == 0:
            return
        self.rows += batch.num_rows
        for name in self.missing:
            self.missing[name] += batch.column(name).null_count
        self.edits += int(np.count_nonzero(filled(batch.column("edits_proposed"), 0) > 0))
        self.clarifications += int(
            np.count_nonzero(filled(batch.column("asked_clarification"), False))
        )
        self.dissatisfied += int(
            np.count_nonzero(filled(batch.column("dissatisfied_followup"), False))
        )
        self.tool_calls += int(filled(batch.column("tool_calls"), 0).sum(dtype=np.int64))
        invalid = filled(batch.column("invalid_tool_calls"), 0)
        self.invalid_tool_calls += int(invalid.sum(dtype=np.int64))
        self.rows_with_invalid += int(np.count_nonzero(invalid > 0))
        self.completion_tokens += int(completion_tokens.sum(dtype=np.int64))
        edit = batch.column("edit_persisted")
        measured = len(edit) - edit.null_count
        if measured:
            self.edit_persisted_rows += measured
            self.edit_persisted_sum += float(pc.sum(edit).as_py() or 0.0)
        latency = batch.column("latency_ms")
        if latency.null_count:
            latency = pc.drop_null(latency)
        self.latency.add(latency.to_numpy(zero_copy_only=False).astype(np.float64, copy=False))

    def result(self) -> dict[str, Any]:
        """The monitors by name (None where undefined, e.g. no rows or no tool calls)."""
        rows = self.rows

        def share(count: int, total: int) -> float | None:
            return count / total if total else None

        return {
            "edit_rate": share(self.edits, rows),
            "clarification_rate": share(self.clarifications, rows),
            "invalid_tool_call_rate": share(self.invalid_tool_calls, self.tool_calls),
            "invalid_tool_call_interaction_rate": share(self.rows_with_invalid, rows),
            "mean_completion_tokens": share(self.completion_tokens, rows),
            "latency_p50_ms": self.latency.quantile(0.50),
            "latency_p95_ms": self.latency.quantile(0.95),
            "edit_persistence": (
                self.edit_persisted_sum / self.edit_persisted_rows
                if self.edit_persisted_rows
                else None
            ),
            "dissatisfied_rate": share(self.dissatisfied, rows),
        }
