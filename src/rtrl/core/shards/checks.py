"""Row-level checks of canonical interaction batches, vectorised.

A bad row (a positive log-prob, a completion whose token and log-prob lists disagree) does
not crash training; it silently biases it. A token id outside the model's vocabulary does
crash it, at every retry: it is stopped here too. So every row the pipeline consumes passes these
checks first, and they must cost little next to decoding the Parquet: each check works on
whole columns (list offsets, flattened values) with numpy, with a fast path that proves a
batch clean from a couple of reductions and only locates offending rows when there are any.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from rtrl.core.shards import sampling
from rtrl.core.shards.limits import MAX_LIST_LENGTH, TOO_LONG
from rtrl.core.shards.sampling import SAMPLING_OUT_OF_RANGE, UNKNOWN_LOGPROBS_MODE
from rtrl.core.shards.schema import COMPLETION_LIST_COLUMNS, NON_NULL_COLUMNS, TOKEN_ID_COLUMNS

BoolArray = npt.NDArray[np.bool_]
IntArray = npt.NDArray[np.int64]

# Stable order, used in reports and their text rendering.
NULL_REQUIRED = "null_required"
LIST_LENGTH_MISMATCH = "list_length_mismatch"
LOGPROB_POSITIVE = "logprob_positive"
LOGPROB_NON_FINITE = "logprob_non_finite"
SIGNAL_OUT_OF_RANGE = "signal_out_of_range"
# A negative token id, or one at or beyond the model's vocabulary (when it is known).
TOKEN_OUT_OF_RANGE = "token_out_of_range"
# A string column's value that is not UTF-8 (a foreign writer; Parquet does not check it):
# it would fail whoever reads it as text.
INVALID_UTF8 = "invalid_utf8"
DUPLICATE_INTERACTION_ID = "duplicate_interaction_id"
# A time no interaction can have (a writer's unit error, a corrupt value): Parquet holds any
# 64-bit count of microseconds, but whoever turns it into a date (Python's datetime ends in
# year 9999) fails, and the window and maturity arithmetic would be meaningless.
TIME_OUT_OF_RANGE = "time_out_of_range"
EARLIEST = int(np.datetime64("2000-01-01T00:00:00", "us").astype(np.int64))
LATEST = int(np.datetime64("9999-12-31T23:59:59", "us").astype(np.int64))
_TIME_COLUMNS = ("created_at", "feedback_at")

_LIST_COLUMNS = ("prompt_ids", *COMPLETION_LIST_COLUMNS)
_COUNT_COLUMNS = ("tool_calls", "invalid_tool_calls", "edits_proposed")


@dataclass
class RowFlags:
    """Which rows of one batch fail which check. Reasons map to boolean row masks; a row
    may fail several. An empty mapping means the whole batch is clean."""

    num_rows: int
    reasons: dict[str, BoolArray] = field(default_factory=dict)
    # The first offence of a reason, where a check can say more than its name: (row in
    # the batch, what is wrong with it).
    details: dict[str, tuple[int, str]] = field(default_factory=dict)

    def flag(self, reason: str, rows: BoolArray | IntArray) -> None:
        """Mark ``rows`` (a boolean mask or row indices) as failing ``reason``."""
        if rows.dtype == np.bool_:
            if not rows.any():
                return
            mask: BoolArray = rows.astype(np.bool_, copy=False)
        else:
            if rows.size == 0:
                return
            mask = np.zeros(self.num_rows, dtype=np.bool_)
            mask[rows] = True
        existing = self.reasons.get(reason)
        self.reasons[reason] = mask if existing is None else existing | mask

    def bad(self) -> BoolArray | None:
        """The union of all reasons, or None when no row is bad."""
        if not self.reasons:
            return None
        masks = iter(self.reasons.values())
        union = next(masks).copy()
        for mask in masks:
            union |= mask
        return union


def _offsets(array: pa.Array) -> IntArray:
    """A list array's ``num_rows + 1`` offsets into its (unsliced) ``values``."""
    offsets: IntArray = np.asarray(array.offsets)
    return offsets


def _rows_of_positions(offsets: IntArray, positions: IntArray) -> IntArray:
    """Rows owning the given positions in a list array's values (positions are absolute)."""
    rows: IntArray = np.searchsorted(offsets, positions, side="right") - 1
    return rows


def _valid(array: pa.Array) -> BoolArray:
    mask: BoolArray = np.asarray(array.is_valid())
    return mask


def _numbers(array: pa.Array, fill: float | int) -> npt.NDArray[Any]:
    """A numeric column as numpy, nulls replaced by a value that passes every check (nulls
    are judged separately, and may be allowed)."""
    if array.null_count:
        array = pc.fill_null(array, fill)
    values: npt.NDArray[Any] = array.to_numpy(zero_copy_only=False)
    return values


def check_nulls(batch: pa.RecordBatch, flags: RowFlags) -> None:
    """Nulls in columns a row is useless without, including null tokens inside lists."""
    for name in NON_NULL_COLUMNS:
        array = batch.column(name)
        if array.null_count:
            flags.flag(NULL_REQUIRED, ~_valid(array))
    for name in _LIST_COLUMNS:
        array = batch.column(name)
        offsets = _offsets(array)
        values = array.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0]))
        if values.null_count:
            positions = np.flatnonzero(~_valid(values)) + offsets[0]
            flags.flag(NULL_REQUIRED, _rows_of_positions(offsets, positions))


def check_list_limits(batch: pa.RecordBatch, flags: RowFlags) -> None:
    """No list longer than :data:`~rtrl.core.shards.limits.MAX_LIST_LENGTH`: the longest
    sequence any training takes, and what keeps a row's cost bounded downstream."""
    for name in _LIST_COLUMNS:
        lengths = np.diff(_offsets(batch.column(name)))
        over = lengths > MAX_LIST_LENGTH
        if over.any():
            flags.flag(TOO_LONG, over)
            row = int(np.flatnonzero(over)[0])
            known = flags.details.get(TOO_LONG)
            if known is None or row < known[0]:
                flags.details[TOO_LONG] = (
                    row,
                    f"{name} holds {int(lengths[row]):,} values, over the "
                    f"{MAX_LIST_LENGTH:,} of a list",
                )


def check_list_lengths(batch: pa.RecordBatch, flags: RowFlags) -> None:
    """Completion token ids, log-probs and mask must describe the same tokens."""
    lengths = [np.diff(_offsets(batch.column(name))) for name in COMPLETION_LIST_COLUMNS]
    mismatch = lengths[0] != lengths[1]
    for other in lengths[2:]:
        mismatch |= lengths[0] != other
    if mismatch.any():
        # A null list is reported as null_required, not also as a length mismatch.
        for name in COMPLETION_LIST_COLUMNS:
            array = batch.column(name)
            if array.null_count:
                mismatch &= _valid(array)
        flags.flag(LIST_LENGTH_MISMATCH, mismatch)


def check_logprobs(batch: pa.RecordBatch, flags: RowFlags) -> None:
    """Log-probs must be finite and <= 0: anything else is a logging bug that would blow up
    the importance ratio."""
    array = batch.column("completion_logprobs")
    offsets = _offsets(array)
    start, stop = int(offsets[0]), int(offsets[-1])
    if stop == start:
        return
    values = _numbers(array.values.slice(start, stop - start), 0.0)
    # Fast path: NaN fails both comparisons, so two reductions prove the batch clean.
    if values.max() <= 0 and values.min() > -np.inf:
        return
    positive = np.flatnonzero(values > 0) + start
    flags.flag(LOGPROB_POSITIVE, _rows_of_positions(offsets, positive))
    non_finite = np.flatnonzero(~np.isfinite(values)) + start
    flags.flag(LOGPROB_NON_FINITE, _rows_of_positions(offsets, non_finite))


def check_signals(batch: pa.RecordBatch, flags: RowFlags) -> None:
    """Feedback signals within their domains: rewards are computed from them as they are."""
    edit = _numbers(batch.column("edit_persisted"), 0.0)
    flags.flag(SIGNAL_OUT_OF_RANGE, ~((edit >= 0) & (edit <= 1)))
    latency = _numbers(batch.column("latency_ms"), 0.0)
    flags.flag(SIGNAL_OUT_OF_RANGE, ~((latency >= 0) & np.isfinite(latency)))
    for name in _COUNT_COLUMNS:
        flags.flag(SIGNAL_OUT_OF_RANGE, _numbers(batch.column(name), 0) < 0)
    tool_calls = batch.column("tool_calls")
    invalid = batch.column("invalid_tool_calls")
    more_invalid = np.asarray(pc.fill_null(pc.greater(invalid, tool_calls), False))
    flags.flag(SIGNAL_OUT_OF_RANGE, more_invalid)


def check_times(batch: pa.RecordBatch, flags: RowFlags) -> None:
    """Interaction times between 2000 and the end of year 9999 (null ones are
    check_nulls' business)."""
    for name in _TIME_COLUMNS:
        array = batch.column(name)
        micros = _numbers(array.cast(pa.int64()), EARLIEST)
        outside = (micros < EARLIEST) | (micros > LATEST)
        if outside.any():
            flags.flag(TIME_OUT_OF_RANGE, outside)
            first = int(np.flatnonzero(outside)[0])
            flags.details.setdefault(
                TIME_OUT_OF_RANGE,
                (first, f"{name} is {int(micros[first])} microseconds since 1970, outside "
                        "the years 2000-9999"),
            )  # fmt: skip


def check_sampling(batch: pa.RecordBatch, flags: RowFlags) -> None:
    """The sampling parameters within what an engine accepts, the log-prob mode one of the
    known two (:mod:`rtrl.core.shards.sampling`); null values pass. A batch without the
    optional columns (projected away by the caller) is not checked."""
    names = batch.schema.names
    if "temperature" in names and "top_p" in names and "top_k" in names:
        bad = sampling.out_of_range(batch)
        if bad is not None and bad.any():
            flags.flag(SAMPLING_OUT_OF_RANGE, bad)
            first = int(np.flatnonzero(bad)[0])
            values = {n: batch.column(n)[first].as_py() for n in ("temperature", "top_p", "top_k")}
            flags.details.setdefault(
                SAMPLING_OUT_OF_RANGE,
                (first, ", ".join(f"{n}={v}" for n, v in values.items())),
            )
    if "logprobs_mode" in names:
        unknown = sampling.unknown_mode(batch)
        if unknown is not None and unknown.any():
            flags.flag(UNKNOWN_LOGPROBS_MODE, unknown)
            first = int(np.flatnonzero(unknown)[0])
            mode = batch.column("logprobs_mode")[first].as_py()
            flags.details.setdefault(
                UNKNOWN_LOGPROBS_MODE,
                (first, f"logprobs_mode {mode!r}, expected one of {sampling.LOGPROBS_MODES}"),
            )


def check_token_ids(batch: pa.RecordBatch, flags: RowFlags, vocab_size: int | None) -> None:
    """Token ids must be embeddable: never negative, and below ``vocab_size`` when the
    vocabulary of the model to be trained is known. (Null ids are check_nulls' business.)"""
    for name in TOKEN_ID_COLUMNS:
        array = batch.column(name)
        offsets = _offsets(array)
        start, stop = int(offsets[0]), int(offsets[-1])
        if stop == start:
            continue
        values = _numbers(array.values.slice(start, stop - start), 0)
        # Fast path: two reductions prove the column clean.
        if values.min() >= 0 and (vocab_size is None or values.max() < vocab_size):
            continue
        outside = values < 0
        if vocab_size is not None:
            outside |= values >= vocab_size
        positions = np.flatnonzero(outside)
        rows = _rows_of_positions(offsets, positions + start)
        flags.flag(TOKEN_OUT_OF_RANGE, rows)
        first = (int(rows[0]), int(values[positions[0]]))
        known = flags.details.get(TOKEN_OUT_OF_RANGE)
        if known is None or first[0] < known[0]:
            bound = f"outside [0, {vocab_size})" if vocab_size is not None else "negative"
            flags.details[TOKEN_OUT_OF_RANGE] = (
                first[0],
                f"{name} has token id {first[1]}, {bound}",
            )


def check_rows(batch: pa.RecordBatch, vocab_size: int | None = None) -> RowFlags:
    """All stateless row checks of one canonical batch (duplicates need state across
    batches: see :mod:`rtrl.core.shards.dedup`); token ids against ``vocab_size`` when
    given, else only against 0."""
    flags = RowFlags(batch.num_rows)
    check_list_limits(batch, flags)
    check_nulls(batch, flags)
    check_list_lengths(batch, flags)
    check_logprobs(batch, flags)
    check_signals(batch, flags)
    check_times(batch, flags)
    check_token_ids(batch, flags, vocab_size)
    check_sampling(batch, flags)
    check_utf8(batch, flags)
    return flags


def check_utf8(batch: pa.RecordBatch, flags: RowFlags) -> None:
    """Rows whose string values are not UTF-8. The whole column is validated at once (as
    fast as a copy); only a column that fails is looked at value by value."""
    for name, column in zip(batch.schema.names, batch.columns, strict=True):
        if not pa.types.is_string(column.type) and not pa.types.is_large_string(column.type):
            continue
        try:
            column.validate(full=True)
        except pa.ArrowInvalid:
            raw = column.cast(
                pa.large_binary() if pa.types.is_large_string(column.type) else pa.binary()
            )
            bad = np.zeros(batch.num_rows, dtype=np.bool_)
            for row, value in enumerate(raw.to_pylist()):
                if value is not None:
                    try:
                        value.decode("utf-8")
                    except UnicodeDecodeError:
                        bad[row] = True
            if bad.any():
                first = int(np.flatnonzero(bad)[0])
                flags.details.setdefault(INVALID_UTF8, (first, f"{name} is not UTF-8"))
            flags.flag(INVALID_UTF8, bad)
