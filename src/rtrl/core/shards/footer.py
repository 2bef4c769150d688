"""A shard file's footer read by rtrl itself, into plain values, before pyarrow sees it.

The limits (:mod:`.limits`) are judged on the footer before any page is decoded, and
pyarrow cannot be asked for it safely: its Python accessors of row-group and column-chunk
metadata call C++ that throws on an inconsistent footer with no way to catch it, so one
flipped bit (a definition level histogram of the wrong size) aborts the whole process
(``terminate called after throwing parquet::ParquetException``). So the footer, a Thrift
struct in the compact protocol, is read here: only the fields the limits and the declared
value ranges (:mod:`.statistics`) need, every other field skipped by its length, nothing
nested deeper than the format nests it, no list longer than the bytes it sits in. Anything
that does not decode is a :class:`FooterError` with reason ``unreadable``, never a crash.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass

OVER_LIMIT = "over_limit"
UNREADABLE = "unreadable"

# Compact protocol type ids.
_TRUE, _FALSE, _BYTE, _I16, _I32, _I64, _DOUBLE, _BINARY, _LIST, _SET, _MAP, _STRUCT = range(1, 13)
_MAX_DEPTH = 16  # Parquet's own structs nest 4 deep; logical types a few more

PHYSICAL_TYPES = tuple(
    ["BOOLEAN", "INT32", "INT64", "INT96", "FLOAT", "DOUBLE", "BYTE_ARRAY", "FIXED_LEN_BYTE_ARRAY"]
)
ENCODINGS = dict(
    enumerate(
        [
            "PLAIN",
            "GROUP_VAR_INT",
            "PLAIN_DICTIONARY",
            "RLE",
            "BIT_PACKED",
            "DELTA_BINARY_PACKED",
            "DELTA_LENGTH_BYTE_ARRAY",
            "DELTA_BYTE_ARRAY",
            "RLE_DICTIONARY",
            "BYTE_STREAM_SPLIT",
        ]
    )
)
_REPEATED, _OPTIONAL = 2, 1
_UNSIGNED_CONVERTED = frozenset({11, 12, 13, 14})  # UINT_8 ... UINT_64


class FooterError(Exception):
    """The file cannot be read within the limits; ``reason`` is ``over_limit`` or
    ``unreadable``, ``rows`` the rows its footer plausibly holds (0 when unknown)."""

    def __init__(self, reason: str, message: str, rows: int = 0) -> None:
        super().__init__(message)
        self.reason = reason
        self.rows = rows


@dataclass(frozen=True)
class Leaf:
    """A column of the file (a leaf of its schema): its dotted path, physical type, the
    levels that nest it and, for fixed-length byte arrays, the length."""

    path: str
    physical_type: str
    max_repetition_level: int
    max_definition_level: int
    type_length: int = 0
    # An unsigned integer (its statistics are in unsigned order).
    unsigned: bool = False


@dataclass(frozen=True)
class Chunk:
    """One column chunk of a row group, as its footer describes it."""

    physical_type: str
    encodings: frozenset[str]
    num_values: int
    total_uncompressed_size: int
    total_compressed_size: int
    data_page_offset: int
    dictionary_page_offset: int | None
    file_path: str
    # Statistics as stored (little-endian plain values); None when absent.
    min_value: bytes | None = None
    max_value: bytes | None = None
    null_count: int | None = None


@dataclass(frozen=True)
class RowGroup:
    num_rows: int
    total_byte_size: int
    chunks: tuple[Chunk, ...]


@dataclass(frozen=True)
class Footer:
    num_rows: int
    leaves: tuple[Leaf, ...]
    row_groups: tuple[RowGroup, ...]


def read_footer(data: bytes, max_row_groups: int) -> Footer:
    """The FileMetaData in ``data`` (the footer's bytes); FooterError when it does not
    decode, or lists more than ``max_row_groups`` row groups (judged from the list's
    header, before one of them is read)."""
    try:
        return _Reader(data, max_row_groups).file_metadata()
    except FooterError:
        raise
    except (IndexError, ValueError, struct.error, UnicodeDecodeError) as exc:
        raise FooterError(UNREADABLE, f"footer does not decode ({exc})") from None


class _Reader:
    def __init__(self, data: bytes, max_row_groups: int) -> None:
        self.max_row_groups = max_row_groups
        self.data = data
        self.at = 0
        self.depth = 0

    # --- the protocol ----------------------------------------------------------------

    def byte(self) -> int:
        value = self.data[self.at]
        self.at += 1
        return value

    def varint(self) -> int:
        shift = result = 0
        while True:
            b = self.byte()
            result |= (b & 0x7F) << shift
            if not b & 0x80:
                return result
            shift += 7
            if shift > 63:
                raise ValueError("a varint longer than 64 bits")

    def integer(self) -> int:
        n = self.varint()
        return (n >> 1) ^ -(n & 1)

    def binary(self) -> bytes:
        size = self.varint()
        if size > len(self.data) - self.at:
            raise ValueError(f"a binary of {size} bytes beyond the footer's end")
        self.at += size
        return self.data[self.at - size : self.at]

    def list_header(self) -> tuple[int, int]:
        header = self.byte()
        size = header >> 4
        if size == 15:
            size = self.varint()
        if size > len(self.data) - self.at:  # every element takes a byte at least
            raise ValueError(f"a list of {size} elements beyond the footer's end")
        return size, header & 0x0F

    def fields(self) -> Iterator[tuple[int, int]]:
        """(field id, type) of each field of the struct being read, to its end."""
        self.depth += 1
        if self.depth > _MAX_DEPTH:
            raise ValueError("structs nested deeper than Parquet nests them")
        last = 0
        while True:
            header = self.byte()
            if header == 0:
                self.depth -= 1
                return
            delta, type_id = header >> 4, header & 0x0F
            fid = last + delta if delta else self.integer()
            last = fid
            yield fid, type_id

    def skip(self, type_id: int) -> None:
        if type_id in (_TRUE, _FALSE):
            return
        if type_id == _BYTE:
            self.at += 1
        elif type_id in (_I16, _I32, _I64):
            self.varint()
        elif type_id == _DOUBLE:
            self.at += 8
        elif type_id == _BINARY:
            self.binary()
        elif type_id in (_LIST, _SET):
            size, element = self.list_header()
            for _ in range(size):
                self.skip_element(element)
        elif type_id == _MAP:
            size = self.varint()
            if size:
                kinds = self.byte()
                for _ in range(size):
                    self.skip_element(kinds >> 4)
                    self.skip_element(kinds & 0x0F)
        elif type_id == _STRUCT:
            for _, inner in self.fields():
                self.skip(inner)
        else:
            raise ValueError(f"unknown compact type {type_id}")
        if self.at > len(self.data):
            raise ValueError("a field beyond the footer's end")

    def skip_element(self, type_id: int) -> None:
        if type_id in (_TRUE, _FALSE):  # in a collection, a bool takes a byte
            self.at += 1
        else:
            self.skip(type_id)

    # --- Parquet's structs (parquet.thrift) -------------------------------------------

    def file_metadata(self) -> Footer:
        num_rows = 0
        elements: list[tuple[str, int, int, int, int, bool]] = []
        groups: list[RowGroup] = []
        for fid, type_id in self.fields():
            if fid == 2 and type_id == _LIST:
                size, _ = self.list_header()
                elements = [self.schema_element() for _ in range(size)]
            elif fid == 3 and type_id == _I64:
                num_rows = self.integer()
            elif fid == 4 and type_id == _LIST:
                size, _ = self.list_header()
                if size > self.max_row_groups:
                    raise FooterError(
                        OVER_LIMIT,
                        f"{size:,} row groups, over the limit of {self.max_row_groups:,}",
                    )
                groups = [self.row_group() for _ in range(size)]
            else:
                self.skip(type_id)
        return Footer(num_rows, _leaves(elements), tuple(groups))

    def schema_element(self) -> tuple[str, int, int, int, int, bool]:
        """(name, physical type or -1, type length, repetition, children, unsigned)."""
        name, physical, length, repetition, children = "", -1, 0, 0, 0
        unsigned = False
        for fid, type_id in self.fields():
            if fid == 1 and type_id == _I32:
                physical = self.integer()
            elif fid == 2 and type_id == _I32:
                length = self.integer()
            elif fid == 3 and type_id == _I32:
                repetition = self.integer()
            elif fid == 4 and type_id == _BINARY:
                name = self.binary().decode()
            elif fid == 5 and type_id == _I32:
                children = self.integer()
            elif fid == 6 and type_id == _I32:
                unsigned |= self.integer() in _UNSIGNED_CONVERTED
            elif fid == 10 and type_id == _STRUCT:
                unsigned |= self.unsigned_logical_type()
            else:
                self.skip(type_id)
        return name, physical, length, repetition, children, unsigned

    def unsigned_logical_type(self) -> bool:
        """Whether a LogicalType union is INTEGER(isSigned=false)."""
        unsigned = False
        for fid, type_id in self.fields():
            if fid == 10 and type_id == _STRUCT:  # IntType
                for inner, inner_type in self.fields():
                    if inner == 2 and inner_type in (_TRUE, _FALSE):
                        unsigned = inner_type == _FALSE
                    else:
                        self.skip(inner_type)
            else:
                self.skip(type_id)
        return unsigned

    def row_group(self) -> RowGroup:
        chunks: list[Chunk] = []
        num_rows = total = 0
        for fid, type_id in self.fields():
            if fid == 1 and type_id == _LIST:
                size, _ = self.list_header()
                chunks = [self.column_chunk() for _ in range(size)]
            elif fid == 2 and type_id == _I64:
                total = self.integer()
            elif fid == 3 and type_id == _I64:
                num_rows = self.integer()
            else:
                self.skip(type_id)
        return RowGroup(num_rows, total, tuple(chunks))

    def column_chunk(self) -> Chunk:
        file_path = ""
        chunk: Chunk | None = None
        for fid, type_id in self.fields():
            if fid == 1 and type_id == _BINARY:
                file_path = self.binary().decode(errors="replace")
            elif fid == 3 and type_id == _STRUCT:
                chunk = self.column_metadata()
            else:
                self.skip(type_id)
        if chunk is None:
            raise ValueError("a column chunk without its metadata")
        if file_path:
            return Chunk(**{**chunk.__dict__, "file_path": file_path})
        return chunk

    def column_metadata(self) -> Chunk:
        physical = -1
        encodings: set[str] = set()
        num_values = uncompressed = compressed = data_offset = 0
        dictionary_offset: int | None = None
        low = high = None
        nulls = None
        for fid, type_id in self.fields():
            if fid == 1 and type_id == _I32:
                physical = self.integer()
            elif fid == 2 and type_id == _LIST:
                size, _ = self.list_header()
                for _ in range(size):
                    code = self.integer()
                    encodings.add(ENCODINGS.get(code, f"ENCODING_{code}"))
            elif fid == 5 and type_id == _I64:
                num_values = self.integer()
            elif fid == 6 and type_id == _I64:
                uncompressed = self.integer()
            elif fid == 7 and type_id == _I64:
                compressed = self.integer()
            elif fid == 9 and type_id == _I64:
                data_offset = self.integer()
            elif fid == 11 and type_id == _I64:
                dictionary_offset = self.integer()
            elif fid == 12 and type_id == _STRUCT:
                low, high, nulls = self.statistics()
            else:
                self.skip(type_id)
        if not 0 <= physical < len(PHYSICAL_TYPES):
            raise ValueError(f"physical type {physical}")
        kind = PHYSICAL_TYPES[physical]
        offsets = (data_offset, dictionary_offset, "")
        sizes = (num_values, uncompressed, compressed)
        return Chunk(kind, frozenset(encodings), *sizes, *offsets, low, high, nulls)

    def statistics(self) -> tuple[bytes | None, bytes | None, int | None]:
        """(min, max, null count): the min_value/max_value fields, else the deprecated
        min/max (signed order, which is the order of the integer columns they serve)."""
        old_low = old_high = low = high = None
        nulls = None
        for fid, type_id in self.fields():
            if type_id == _BINARY and fid in (1, 2, 5, 6):
                value = self.binary()
                if fid == 1:
                    old_high = value
                elif fid == 2:
                    old_low = value
                elif fid == 5:
                    high = value
                else:
                    low = value
            elif fid == 3 and type_id == _I64:
                nulls = self.integer()
            else:
                self.skip(type_id)
        if low is None or high is None:
            low, high = old_low, old_high
        return low, high, nulls


def _leaves(elements: list[tuple[str, int, int, int, int, bool]]) -> tuple[Leaf, ...]:
    """The leaf columns of a flattened schema (depth first, the root first), with the
    repetition and definition levels their ancestors give them."""
    if not elements:
        raise ValueError("a footer without a schema")
    leaves: list[Leaf] = []
    # (children still to visit, path, repetition level, definition level) per open group
    stack: list[tuple[int, str, int, int]] = [(elements[0][4], "", 0, 0)]
    for name, physical, length, repetition, children, unsigned in elements[1:]:
        if not stack:
            raise ValueError("schema elements beyond the root's children")
        left, prefix, rep, definition = stack.pop()
        stack.append((left - 1, prefix, rep, definition))
        path = f"{prefix}.{name}" if prefix else name
        rep += repetition == _REPEATED
        definition += repetition in (_REPEATED, _OPTIONAL)
        if children > 0:
            stack.append((children, path, rep, definition))
        else:
            if not 0 <= physical < len(PHYSICAL_TYPES):
                raise ValueError(f"column {path}: physical type {physical}")
            leaves.append(Leaf(path, PHYSICAL_TYPES[physical], rep, definition, length, unsigned))
        while stack and stack[-1][0] == 0:
            stack.pop()
    if stack:
        raise ValueError("a schema whose groups lack children")
    return tuple(leaves)
