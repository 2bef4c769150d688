"""The sealed rows: the decisions of the join, in input order, met with the generation
files read once, in the same order, batch by batch.

Each generation file is streamed (``batch_size`` rows at a time, only the columns a shard
carries) and the decided rows of each batch are taken from it, so memory holds one batch
of one file and one batch of decisions, whatever the hour's size. A row without a
completion (an engine error the status did not show, a client that hung up first) is left
out here, where its tokens are read, and counted as ``no_completion``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from datetime import datetime, timedelta
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from rtrl.core.events import SIGNALS
from rtrl.core.shards.schema import INTERACTION_SCHEMA, OPTIONAL_SCHEMA

# What a shard takes from the generation event, as it is there.
GENERATION_COLUMNS: tuple[str, ...] = tuple(
    name
    for name in (*INTERACTION_SCHEMA.names, *OPTIONAL_SCHEMA.names)
    if name not in SIGNALS and name != "feedback_at"
)
SEALED_SCHEMA = pa.schema([*INTERACTION_SCHEMA, *OPTIONAL_SCHEMA])


class _FileRows:
    """One generation file read forward once: :meth:`take` returns the rows asked for (in
    increasing order, across calls too) from the batches they are in."""

    def __init__(self, path: Path, batch_size: int) -> None:
        self.file = pq.ParquetFile(path)
        self.batches = self.file.iter_batches(
            batch_size=batch_size, columns=list(GENERATION_COLUMNS)
        )
        self.batch: pa.RecordBatch | None = None
        self.start = 0  # the file row of the current batch's first row

    def take(self, rows: npt.NDArray[np.int64]) -> Iterator[tuple[pa.RecordBatch, slice]]:
        """(the rows of one batch, which of ``rows`` they are) until all are taken."""
        done = 0
        while done < len(rows):
            while self.batch is None or rows[done] >= self.start + self.batch.num_rows:
                if self.batch is not None:
                    self.start += self.batch.num_rows
                self.batch = next(self.batches)
            end = self.start + self.batch.num_rows
            upto = done + int(np.searchsorted(rows[done:], end))
            local = rows[done:upto] - self.start
            first, count = int(local[0]), upto - done
            if int(local[-1]) - first + 1 == count:  # a run of rows, the common case
                yield self.batch.slice(first, count), slice(done, upto)
            else:
                yield self.batch.take(pa.array(local)), slice(done, upto)
            done = upto

    def close(self) -> None:
        self.file.close()


def sealed_batches(
    decisions: pa.RecordBatchReader,
    generations: Sequence[Path],
    *,
    final_after: timedelta,
    sealed_at: datetime,
    counts: Counter[str],
    batch_size: int,
) -> Iterator[pa.RecordBatch]:
    """The shard rows (SEALED_SCHEMA) of the decisions, in their order.

    ``feedback_at`` is when the row became available to train on: its last signal's
    maturity (``created_at + final_after``) or, later, the seal itself (``sealed_at``). A
    cycle stages the rows that became ready since the previous one started; with the
    maturity alone, a row sealed after a cycle started but ready (by its maturity) before
    it would be missed by that cycle (not yet sealed) and by the next (ready too early)."""
    opened: _FileRows | None = None
    opened_index = -1
    try:
        for decided in decisions:
            files = decided.column("file").to_numpy()
            rows = decided.column("row").to_numpy().astype(np.int64)
            cuts = np.flatnonzero(np.diff(files)) + 1
            for start, end in zip([0, *cuts], [*cuts, len(files)], strict=True):
                index = int(files[start])
                if index != opened_index:
                    if opened is not None:
                        opened.close()
                    opened, opened_index = _FileRows(generations[index], batch_size), index
                assert opened is not None
                piece = decided.slice(start, end - start)
                for taken, which in opened.take(rows[start:end]):
                    signals = piece.slice(which.start, which.stop - which.start)
                    batch = _row_batch(taken, signals, final_after, sealed_at, counts)
                    if batch.num_rows:
                        yield batch
    finally:
        if opened is not None:
            opened.close()


def _row_batch(
    generation: pa.RecordBatch,
    signals: pa.RecordBatch,
    final_after: timedelta,
    sealed_at: datetime,
    counts: Counter[str],
) -> pa.RecordBatch:
    created = generation.column("created_at")
    columns: dict[str, pa.Array] = {}
    for field in SEALED_SCHEMA:
        if field.name == "feedback_at":
            final = pc.add(created, pa.scalar(final_after, pa.duration("us")))
            sealed = pa.scalar(sealed_at, final.type)
            later = pc.if_else(pc.greater(final, sealed), final, sealed)
            columns[field.name] = later.cast(field.type)
        elif field.name in SIGNALS:
            columns[field.name] = signals.column(field.name).cast(field.type)
        else:
            columns[field.name] = generation.column(field.name).cast(field.type)
    batch = pa.RecordBatch.from_arrays(list(columns.values()), schema=SEALED_SCHEMA)
    lengths = pc.fill_null(pc.list_value_length(generation.column("completion_ids")), 0)
    has_completion = pc.greater(lengths, 0)
    missing = batch.num_rows - pc.sum(has_completion).as_py() if batch.num_rows else 0
    if missing:
        counts["no_completion"] += missing
        batch = batch.filter(has_completion)
    return batch
