"""What a shard set's footers declare about its values, before any row is read.

A Parquet writer records each column chunk's minimum and maximum in the file footer. The
stage step reads them for the token ids before its first row, to choose the width of the
training set's token ids (:mod:`rtrl_trainer.stagedset`): two bytes when every id of the set
is below 65,536, which it must know before it writes anything. A footer is a few kB, read
with one or two range requests, so this costs a fraction of reading the rows; remote files'
footers are read a few at a time.

Statistics are a producer's claim, not a fact: a reader that relies on them must still
check the values it reads (the stage step does, row by row, and quarantines what
contradicts its file's footer).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from rtrl.core.shards.reader import ShardError, ShardFile, open_parquet
from rtrl.core.shards.schema import TOKEN_ID_COLUMNS
from rtrl.core.store.base import ObjectStore

__all__ = ["TOKEN_ID_COLUMNS", "ValueRange", "declared_range"]
# Footers read at once from a remote store (each is one or two small range requests).
FOOTER_READS = 16


@dataclass(frozen=True)
class ValueRange:
    """The smallest and largest value the footers declare; ``files`` counts the footers
    that declared them."""

    low: int
    high: int
    files: int


class _UndeclaredError(Exception):
    """A file holds values of the columns but its footer declares no range for them."""


def declared_range(
    store: ObjectStore, files: Iterable[ShardFile], columns: Sequence[str] = TOKEN_ID_COLUMNS
) -> ValueRange | None:
    """The range of the integer values (list elements included) of ``columns`` across
    ``files``, as their footers' column statistics declare it; None when any file that
    holds such values declares no range for them (or stores them as something other than
    integers), or when no file holds any.

    A file whose footer cannot be read is left out: the validating reader rejects it, so
    none of its rows are ever read. A failing store (:class:`StoreError`) propagates.
    """
    files = list(files)
    if not files:
        return None
    with ThreadPoolExecutor(max_workers=min(FOOTER_READS, len(files))) as pool:
        try:
            ranges = [r for r in pool.map(lambda f: _file_range(store, f, columns), files) if r]
        except _UndeclaredError:
            return None
    if not ranges:
        return None
    return ValueRange(
        low=min(r[0] for r in ranges), high=max(r[1] for r in ranges), files=len(ranges)
    )


def _file_range(
    store: ObjectStore, shard: ShardFile, columns: Sequence[str]
) -> tuple[int, int] | None:
    """(min, max) over one file's chunks of ``columns``; None when it holds no values or
    its footer cannot be read; :class:`_UndeclaredError` when it holds values of unknown range."""
    try:
        # The reader's own opening: the same files count as unreadable, store errors raise.
        with open_parquet(store, shard) as parquet:
            metadata = parquet.metadata
    except ShardError:
        return None  # rejected whole by the validating reader
    leaves = [
        index
        for index in range(metadata.num_columns)
        if metadata.schema.column(index).path.split(".")[0] in columns
    ]
    low: int | None = None
    high: int | None = None
    for group in range(metadata.num_row_groups):
        row_group = metadata.row_group(group)
        for index in leaves:
            chunk = row_group.column(index)
            stats = chunk.statistics
            if stats is not None and stats.has_min_max:
                if chunk.physical_type not in ("INT32", "INT64"):
                    raise _UndeclaredError
                low = stats.min if low is None else min(low, stats.min)
                high = stats.max if high is None else max(high, stats.max)
            elif chunk.num_values and (stats is None or stats.null_count != chunk.num_values):
                # Values (or a chunk that does not say how many are null) without a range.
                raise _UndeclaredError
    if low is None or high is None:
        return None
    return int(low), int(high)
