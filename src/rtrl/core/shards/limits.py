"""The limits a shard file must keep, checked from its footer before a page is decoded.

Shards come from pipelines this project does not control, and Parquet lets a small file
describe a great deal of work: a footer of 200,000 one-row row groups took 3.4 GB and
minutes to parse, a dictionary of one 1 MiB string referenced by every row decodes to 16
GiB a batch, a list of 50 million ids in one row to ~0.9 GB, and a footer can claim rows
its pages do not hold (10^9 of them, all "quarantined"). So before any page is read:

- the footer's own size, from the file's last eight bytes, and the number of its row
  groups, from the header of their list (:func:`read_footer_of`, by :mod:`.footer`), then
- from the parsed footer (:func:`check_footer`): the number of rows, the
  bytes each column chunk decodes to (its uncompressed size, and its values times their
  width), the stored size of each dictionary page, list values per row, encodings whose
  decoded size the footer cannot bound, and whether the row counts agree with the column
  chunks (a row group of N rows has N values in each of its flat columns).

A file beyond a limit is rejected whole (reason ``over_limit``); a footer that contradicts
itself makes the file ``unreadable``. Either way it is counted with the rows the footer
*plausibly* holds (:attr:`FooterCheck.rows`), never with a number it merely claims.

What a footer cannot say is checked as rows are read (:func:`oversized_strings` on the
still dictionary-encoded batch, list lengths in :mod:`.checks`), and those rows are
quarantined (``too_long``). The limits are far beyond what rtrl's writer produces (16,384
rows a row group, rows up to ``training.maxSequenceLength``); a foreign writer keeps under
them by writing row groups of at most ~100 MB (``docs/writing-shards.md``).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import IO

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from rtrl.core.shards.footer import (
    OVER_LIMIT,
    UNREADABLE,
    Footer,
    FooterError,
    Leaf,
    RowGroup,
    read_footer,
)

MiB = 1 << 20
# The footer (FileMetaData) as stored; parsing one takes ~13 times its size in memory.
MAX_FOOTER_BYTES = 8 * MiB
MAX_ROW_GROUPS = 4096
MAX_FILE_ROWS = 1 << 24
# What one column chunk decodes to: its uncompressed pages, and its values x their width.
MAX_CHUNK_BYTES = 128 * MiB
# A dictionary page as stored (writers cap theirs at 1 MiB and fall back to plain pages).
MAX_DICTIONARY_PAGE_BYTES = 4 * MiB
# Values of one list (the longest training.maxSequenceLength allows), and bytes of one
# string (an id, an org, a mode name: dictionary-encoded strings decode to this per row).
MAX_LIST_LENGTH = 1 << 20
MAX_STRING_BYTES = 4096

TOO_LONG = "too_long"

_MAGIC = b"PAR1"
# Decoded bytes per value of each physical type (BYTE_ARRAY: its offset; its data is in
# the uncompressed size). Levels of nested columns add two bytes a value each.
_WIDTH = {
    "BOOLEAN": 1,
    "INT32": 4,
    "FLOAT": 4,
    "INT64": 8,
    "DOUBLE": 8,
    "INT96": 12,
    "BYTE_ARRAY": 4,
}
# Encodings of byte arrays whose decoded size no footer field bounds: each value may repeat
# a prefix of the one before it, so a page of small suffixes decodes to n^2 bytes.
_UNBOUNDED_ENCODINGS = frozenset({"DELTA_BYTE_ARRAY"})


def read_footer_of(handle: IO[bytes]) -> Footer:
    """The footer of the Parquet file ``handle``, read by :mod:`.footer`; FooterError when
    the file is no Parquet file, its footer is larger than :data:`MAX_FOOTER_BYTES` (a
    footer is parsed whole) or does not decode."""
    size = handle.seek(0, 2)
    if size < 12:
        raise FooterError(UNREADABLE, f"{size} bytes: too short for a Parquet file")
    handle.seek(size - 8)
    tail = handle.read(8)
    if len(tail) != 8 or tail[4:] != _MAGIC:
        raise FooterError(UNREADABLE, "no Parquet footer (the file does not end in PAR1)")
    (length,) = struct.unpack("<I", tail[:4])
    if length > size - 12:
        raise FooterError(
            UNREADABLE, f"footer length {length:,} is beyond the file's {size:,} bytes"
        )
    if length > MAX_FOOTER_BYTES:
        raise FooterError(
            OVER_LIMIT,
            f"footer of {length:,} bytes, over the {MAX_FOOTER_BYTES // MiB} MiB limit "
            f"(write fewer, larger row groups: at most {MAX_ROW_GROUPS:,})",
        )
    handle.seek(size - 8 - length)
    data = handle.read(length)
    handle.seek(0)
    if len(data) != length:
        raise FooterError(UNREADABLE, "the file ended inside its footer")
    return read_footer(data, MAX_ROW_GROUPS)


@dataclass(frozen=True)
class FooterCheck:
    """What a footer says that can be believed: ``rows`` (the sum over row groups whose
    row count agrees with their column chunks), and the problem that rejects the file."""

    rows: int
    reason: str = ""
    message: str = ""

    def raise_if_bad(self) -> None:
        if self.reason:
            raise FooterError(self.reason, self.message, self.rows)


def _plausible_rows(group: RowGroup, flat: list[int]) -> int | None:
    """The row count of ``group`` when each of its flat columns has one value per row;
    None when they do not agree with it."""
    if group.num_rows < 0:
        return None
    if any(group.chunks[i].num_values != group.num_rows for i in flat):
        return None
    return group.num_rows


def check_footer(footer: Footer) -> FooterCheck:
    """The footer against every limit, and the rows it plausibly holds."""
    leaves = footer.leaves
    flat = [i for i, leaf in enumerate(leaves) if leaf.max_repetition_level == 0]
    rows = 0
    for index, group in enumerate(footer.row_groups):
        if len(group.chunks) != len(leaves):
            return FooterCheck(
                0,
                UNREADABLE,
                f"row group {index} has {len(group.chunks)} column chunks for the "
                f"{len(leaves)} columns of the schema",
            )
        plausible = _plausible_rows(group, flat)
        if plausible is None:
            counts = {group.chunks[i].num_values for i in flat}
            held = counts.pop() if len(counts) == 1 else 0
            held = held if 0 <= held <= MAX_FILE_ROWS else 0
            disagree = " (they disagree)" if len(counts) > 1 else ""
            return FooterCheck(
                rows + held,
                UNREADABLE,
                f"row group {index}: its footer claims {group.num_rows:,} rows and its "
                f"columns hold {held:,} values each{disagree}; counted as the rows the "
                "columns hold",
            )
        rows += plausible
        if rows > MAX_FILE_ROWS:
            return FooterCheck(
                0, OVER_LIMIT, f"more than {MAX_FILE_ROWS:,} rows, over the limit of a file"
            )
        problem = _check_row_group(index, group, leaves)
        if problem:
            reason, message = problem
            return FooterCheck(_total_rows(footer, flat), reason, message)
    if footer.num_rows != rows:
        return FooterCheck(
            rows,
            UNREADABLE,
            f"its footer claims {footer.num_rows:,} rows and its row groups hold {rows:,}; "
            "counted as the row groups' rows",
        )
    return FooterCheck(rows)


def _total_rows(footer: Footer, flat: list[int]) -> int:
    """The rows of every row group whose count is plausible (a file over a limit is
    counted whole, as far as its footer can be believed)."""
    total = 0
    for group in footer.row_groups:
        if len(group.chunks) == len(footer.leaves):
            total += _plausible_rows(group, flat) or 0
    return min(total, MAX_FILE_ROWS)


def _check_row_group(
    index: int, group: RowGroup, leaves: tuple[Leaf, ...]
) -> tuple[str, str] | None:
    rows = group.num_rows
    for leaf, chunk in zip(leaves, group.chunks, strict=True):
        where = f"row group {index}, column {leaf.path}"
        if chunk.file_path:
            return UNREADABLE, f"{where}: its data is in another file ({chunk.file_path!r})"
        if chunk.physical_type != leaf.physical_type:
            kind = f"a {chunk.physical_type} chunk of a {leaf.physical_type} column"
            return UNREADABLE, f"{where}: {kind}"
        values = chunk.num_values
        if values < 0 or (leaf.max_repetition_level and values < rows):
            return UNREADABLE, f"{where}: {values:,} values for {rows:,} rows"
        if leaf.max_repetition_level and values > max(rows, 1) * MAX_LIST_LENGTH:
            return (
                OVER_LIMIT,
                f"{where}: {values:,} values in {rows:,} rows, so a list of more than "
                f"{MAX_LIST_LENGTH:,} (the limit of one list)",
            )
        width = _WIDTH.get(leaf.physical_type, max(leaf.type_length, 1))
        if leaf.max_definition_level:
            width += 2  # a definition level per value
        if leaf.max_repetition_level:
            width += 2  # and a repetition level
        decoded = max(chunk.total_uncompressed_size, values * width)
        if decoded > MAX_CHUNK_BYTES:
            return (
                OVER_LIMIT,
                f"{where}: decodes to {decoded / MiB:,.0f} MiB, over the "
                f"{MAX_CHUNK_BYTES // MiB} MiB limit of a column chunk (write smaller row "
                "groups)",
            )
        if chunk.dictionary_page_offset is not None:
            stored = chunk.data_page_offset - chunk.dictionary_page_offset
            if stored < 0:
                return UNREADABLE, f"{where}: its dictionary page comes after its data"
            if stored > MAX_DICTIONARY_PAGE_BYTES:
                return (
                    OVER_LIMIT,
                    f"{where}: a dictionary page of {stored / MiB:,.1f} MiB, over the "
                    f"{MAX_DICTIONARY_PAGE_BYTES // MiB} MiB limit",
                )
        unbounded = _UNBOUNDED_ENCODINGS & chunk.encodings
        if unbounded and leaf.physical_type == "BYTE_ARRAY":
            return (
                OVER_LIMIT,
                f"{where}: encoding {', '.join(sorted(unbounded))} can decode to any size "
                "its footer does not bound (write strings PLAIN or dictionary-encoded)",
            )
    return None


def string_columns(footer: Footer) -> list[str]:
    """The top-level byte-array columns of the file: read as dictionaries
    (``read_dictionary``), so that their decoded size is known, from the dictionary,
    before a value is copied out per row (:func:`oversized_strings`)."""
    return [
        leaf.path
        for leaf in footer.leaves
        if leaf.max_repetition_level == 0
        and "." not in leaf.path
        and leaf.physical_type == "BYTE_ARRAY"
    ]


BoolArray = npt.NDArray[np.bool_]


def oversized_strings(batch: pa.RecordBatch) -> tuple[BoolArray, int, str] | None:
    """Rows of ``batch`` holding a string of more than :data:`MAX_STRING_BYTES`, judged on
    dictionary-encoded columns before any value is copied out (the lengths of the
    dictionary's entries, taken by index): (their mask, the first of them, what is wrong
    with it). None when there is none."""
    bad: BoolArray | None = None
    first: tuple[int, str] | None = None
    for name, column in zip(batch.schema.names, batch.columns, strict=True):
        lengths = _lengths(column)
        if lengths is None:
            continue
        over = np.asarray(pc.fill_null(pc.greater(lengths, MAX_STRING_BYTES), False))
        if not over.any():
            continue
        row = int(np.flatnonzero(over)[0])
        if first is None or row < first[0]:
            size = int(lengths[row].as_py())
            first = (row, f"{name} is {size:,} bytes, over the {MAX_STRING_BYTES:,} of a string")
        bad = over if bad is None else bad | over
    if bad is None or first is None:
        return None
    return bad, first[0], first[1]


def _lengths(column: pa.Array) -> pa.Array | None:
    """Byte length of each value of a string or binary column (dictionary-encoded or not);
    None for other columns."""
    if pa.types.is_dictionary(column.type):
        value_type = column.type.value_type
        if not _is_binary_like(value_type):
            return None
        per_entry = pc.binary_length(column.dictionary)
        return pc.take(per_entry, column.indices)
    if _is_binary_like(column.type):
        return pc.binary_length(column)
    return None


def _is_binary_like(t: pa.DataType) -> bool:
    return bool(
        pa.types.is_string(t)
        or pa.types.is_large_string(t)
        or pa.types.is_binary(t)
        or pa.types.is_large_binary(t)
    )
