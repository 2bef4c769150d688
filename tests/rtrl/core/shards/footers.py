"""Rewriting a Parquet file's footer, for hostile shards no writer would make: row groups
repeated by the hundred thousand, row counts that the pages do not hold.

A footer is a Thrift struct (FileMetaData) in the compact protocol. This is a small
codec of that protocol (what the footers use of it: structs, lists, integers, binary,
booleans, doubles) that keeps every value it does not understand as it was, so that a
file read, changed in one field and written back differs only there. Test code only: the
reader under test never uses it.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Compact protocol type ids.
BOOL_TRUE, BOOL_FALSE, BYTE, I16, I32, I64, DOUBLE, BINARY, LIST, SET, MAP, STRUCT = range(1, 13)
MAGIC = b"PAR1"

# FileMetaData and RowGroup field ids (parquet.thrift).
FILE_NUM_ROWS = 3
FILE_ROW_GROUPS = 4
ROW_GROUP_COLUMNS = 1
ROW_GROUP_NUM_ROWS = 3


@dataclass
class Struct:
    """A Thrift struct: field id -> (type id, value), in the order read."""

    fields: dict[int, tuple[int, Any]] = field(default_factory=dict)

    def get(self, fid: int) -> Any:
        return self.fields[fid][1]

    def set(self, fid: int, value: Any) -> None:
        self.fields[fid] = (self.fields[fid][0], value)


@dataclass
class List:
    element_type: int
    items: list[Any]


@dataclass
class Raw:
    """Elements already encoded (``count`` of them in ``data``): how a list of 200,000
    copies of one row group is written without encoding each."""

    count: int
    data: bytes


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.at = 0

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

    def zigzag(self) -> int:
        n = self.varint()
        return (n >> 1) ^ -(n & 1)

    def value(self, type_id: int) -> Any:
        if type_id in (BOOL_TRUE, BOOL_FALSE):  # inside a list: one byte
            return self.byte() == BOOL_TRUE
        if type_id == BYTE:
            return self.byte()
        if type_id in (I16, I32, I64):
            return self.zigzag()
        if type_id == DOUBLE:
            (number,) = struct.unpack("<d", self.data[self.at : self.at + 8])
            self.at += 8
            return number
        if type_id == BINARY:
            size = self.varint()
            self.at += size
            return self.data[self.at - size : self.at]
        if type_id in (LIST, SET):
            header = self.byte()
            size = header >> 4
            if size == 15:
                size = self.varint()
            element = header & 0x0F
            return List(element, [self.value(element) for _ in range(size)])
        if type_id == STRUCT:
            return self.struct()
        raise ValueError(f"compact type {type_id} is not used by Parquet footers")

    def struct(self) -> Struct:
        out = Struct()
        last = 0
        while True:
            header = self.byte()
            if header == 0:
                return out
            delta, type_id = header >> 4, header & 0x0F
            fid = last + delta if delta else self.zigzag()
            if type_id in (BOOL_TRUE, BOOL_FALSE):
                out.fields[fid] = (type_id, type_id == BOOL_TRUE)
            else:
                out.fields[fid] = (type_id, self.value(type_id))
            last = fid


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        if n < 0x80:
            out.append(n)
            return bytes(out)
        out.append((n & 0x7F) | 0x80)
        n >>= 7


def _zigzag(n: int) -> bytes:
    return _varint((n << 1) ^ (n >> 63))


def _value(type_id: int, value: Any) -> bytes:
    if type_id in (BOOL_TRUE, BOOL_FALSE):
        return bytes([BOOL_TRUE if value else BOOL_FALSE])
    if type_id == BYTE:
        return bytes([value])
    if type_id in (I16, I32, I64):
        return _zigzag(value)
    if type_id == DOUBLE:
        return struct.pack("<d", value)
    if type_id == BINARY:
        return _varint(len(value)) + value
    if type_id in (LIST, SET):
        if isinstance(value, Raw):
            count, body = value.count, value.data
            element = STRUCT
        else:
            count, element = len(value.items), value.element_type
            body = b"".join(_value(element, item) for item in value.items)
        header = bytes([(min(count, 15) << 4) | element])
        return header + (_varint(count) if count >= 15 else b"") + body
    if type_id == STRUCT:
        return encode(value)
    raise ValueError(f"compact type {type_id} is not used by Parquet footers")


def encode(s: Struct) -> bytes:
    out = bytearray()
    last = 0
    for fid, (type_id, value) in s.fields.items():
        wire = type_id
        if type_id in (BOOL_TRUE, BOOL_FALSE):
            wire = BOOL_TRUE if value else BOOL_FALSE
        if 0 < fid - last <= 15:
            out.append(((fid - last) << 4) | wire)
        else:
            out.append(wire)
            out += _zigzag(fid)
        if type_id not in (BOOL_TRUE, BOOL_FALSE):
            out += _value(type_id, value)
        last = fid
    out.append(0)
    return bytes(out)


def read_footer(path: Path) -> tuple[bytes, Struct]:
    """(the bytes before the footer, the FileMetaData)."""
    data = path.read_bytes()
    assert data[-4:] == MAGIC, "not a Parquet file"
    (length,) = struct.unpack("<I", data[-8:-4])
    start = len(data) - 8 - length
    reader = _Reader(data[start : len(data) - 8])
    return data[:start], reader.struct()


def write_footer(path: Path, body: bytes, metadata: Struct) -> None:
    footer = encode(metadata)
    path.write_bytes(body + footer + struct.pack("<I", len(footer)) + MAGIC)


def repeat_row_groups(path: Path, copies: int) -> None:
    """Make ``path``'s single row group appear ``copies`` times in its footer (every copy
    points at the same pages, as a reader is free to be told), with the file's row count
    to match: a footer of ``copies`` row groups in a second and a few bytes of data."""
    body, meta = read_footer(path)
    groups = meta.get(FILE_ROW_GROUPS)
    assert len(groups.items) == 1, "one row group to repeat"
    group = groups.items[0]
    meta.set(FILE_ROW_GROUPS, Raw(copies, encode(group) * copies))
    meta.set(FILE_NUM_ROWS, group.get(ROW_GROUP_NUM_ROWS) * copies)
    write_footer(path, body, meta)


def claim_rows(path: Path, rows: int) -> None:
    """Make the footer of ``path`` (one row group) claim ``rows`` rows, in the row group and
    the file, while its pages hold what they held."""
    body, meta = read_footer(path)
    (group,) = meta.get(FILE_ROW_GROUPS).items
    group.set(ROW_GROUP_NUM_ROWS, rows)
    meta.set(FILE_NUM_ROWS, rows)
    write_footer(path, body, meta)
