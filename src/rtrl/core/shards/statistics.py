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

import struct
from collections.abc import Callable, Iterable, Sequence
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
        with open_parquet(store, shard) as opened:
            footer = opened.footer
    except ShardError:
        return None  # rejected whole by the validating reader
    leaves = [
        (index, leaf)
        for index, leaf in enumerate(footer.leaves)
        if leaf.path.split(".")[0] in columns
    ]
    low: int | None = None
    high: int | None = None
    for group in footer.row_groups:
        for index, leaf in leaves:
            chunk = group.chunks[index]
            if chunk.min_value is not None and chunk.max_value is not None:
                decode = _INTEGERS.get(chunk.physical_type)
                if decode is None or leaf.unsigned:
                    raise _UndeclaredError
                least, most = decode(chunk.min_value), decode(chunk.max_value)
                low = least if low is None else min(low, least)
                high = most if high is None else max(high, most)
            elif chunk.num_values and chunk.null_count != chunk.num_values:
                # Values (or a chunk that does not say how many are null) without a range.
                raise _UndeclaredError
    if low is None or high is None:
        return None
    return low, high


def _integer(fmt: str) -> Callable[[bytes], int]:
    def decode(value: bytes) -> int:
        if len(value) != struct.calcsize(fmt):
            raise _UndeclaredError  # a statistic of another size than its type's
        return int(struct.unpack(fmt, value)[0])

    return decode


# Statistics are stored as the plain encoding of the value: little-endian, signed.
_INTEGERS = {"INT32": _integer("<i"), "INT64": _integer("<q")}
