"""Each staged row's sampling (temperature, and top-p/top-k where the engine logged
processed log-probs), read from the rank file's optional sampling columns.

The stage step carries the shards' sampling columns into the set (a set staged before it
did, or written by hand without them, has rows at temperature 1 from the full
distribution) and has already refused the rows whose log-probs cannot be matched. A set
written some other way may still hold such rows: they are skipped and counted like rows
with a token outside the vocabulary (:class:`~rtrl_trainer.train.examples.Skipped`);
values no engine accepts mean the set was not written by the stage step, and stop the run.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from rtrl.core.shards import sampling
from rtrl.core.shards.schema import OPTIONAL_SCHEMA
from rtrl_trainer.logprobs import DEFAULT, Sampling

COLUMNS = ("temperature", "top_p", "top_k", "logprobs_mode")


class SamplingError(ValueError):
    """Row ``row`` holds a sampling value no engine accepts; the message says which."""

    def __init__(self, row: int, message: str) -> None:
        super().__init__(message)
        self.row = row


@dataclass(frozen=True)
class RowSampling:
    """Each row's :class:`Sampling` (``rows``), and the rows that cannot be matched with
    their reason (:data:`rtrl.core.shards.sampling.UNMATCHED_REASONS`)."""

    rows: list[Sampling]
    unmatched: dict[int, str]


def read(table: pa.Table, vocab_size: int) -> RowSampling:
    """The sampling of every row of a rank file (:data:`COLUMNS`, each optional)."""
    n = table.num_rows
    present = [c for c in COLUMNS if c in table.column_names]
    if not present:
        return RowSampling([DEFAULT] * n, {})
    arrays = []
    for column in COLUMNS:
        target = OPTIONAL_SCHEMA.field(column).type
        if column not in present:
            arrays.append(pa.nulls(n, target))
            continue
        array = table.column(column).combine_chunks()
        try:
            arrays.append(array.cast(target))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
            raise SamplingError(0, f"{column} is {array.type}, expected {target} ({exc})") from None
    batch = pa.RecordBatch.from_arrays(arrays, names=list(COLUMNS))
    for check in (sampling.out_of_range, sampling.unknown_mode):
        bad = check(batch)
        if bad is not None and bad.any():
            row = int(np.flatnonzero(bad)[0])
            values = ", ".join(f"{c}={batch.column(c)[row].as_py()!r}" for c in COLUMNS)
            raise SamplingError(row, f"impossible sampling values: {values}")
    unmatched: dict[int, str] = {}
    for reason, mask in sampling.unmatched(batch, vocab_size).items():
        for row in np.flatnonzero(mask).tolist():
            unmatched.setdefault(row, reason)
    columns = [batch.column(c).to_pylist() for c in COLUMNS]
    rows = [Sampling.of_row(*values) for values in zip(*columns, strict=True)]
    rows = [DEFAULT if row.is_default else row for row in rows]  # one object for most rows
    return RowSampling(rows, unmatched)
