"""How records sit in a spool segment on disk, and how a segment is read back.

A segment is a plain file of records, each framed as::

    <payload length: u32 LE> <crc32 of the payload: u32 LE> <payload bytes>

Appends are the only writes, so a process killed mid-append (or a node that lost power
before the page cache reached the disk) leaves at most a *torn* last record: a header
without its full payload, a short header, or bytes whose checksum does not match. Reading
stops at the first such record: what came before it is whole (every earlier record's
checksum held), what follows cannot be trusted and is dropped, and the count says so.
"""

from __future__ import annotations

import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

HEADER = struct.Struct("<II")
# A record this large is a corrupt length field, not a record: generation events are a few
# hundred KiB at most (two token lists and their log-probs).
MAX_RECORD_BYTES = 64 << 20


def frame(payload: bytes) -> bytes:
    """``payload`` framed for appending to a segment."""
    if len(payload) > MAX_RECORD_BYTES:
        raise ValueError(f"record of {len(payload)} bytes exceeds {MAX_RECORD_BYTES}")
    return HEADER.pack(len(payload), zlib.crc32(payload)) + payload


@dataclass(frozen=True)
class SegmentContents:
    """The whole records of a segment, and what followed the last of them."""

    records: list[bytes]
    valid_bytes: int  # the offset just past the last whole record
    torn_bytes: int  # bytes after it: a torn or corrupt tail (0 when the file is whole)


def read_segment(path: Path) -> SegmentContents:
    """Every whole record of the segment at ``path``, in append order."""
    data = path.read_bytes()
    records: list[bytes] = []
    offset = 0
    end = len(data)
    while offset + HEADER.size <= end:
        length, crc = HEADER.unpack_from(data, offset)
        start = offset + HEADER.size
        if length > MAX_RECORD_BYTES or start + length > end:
            break
        payload = data[start : start + length]
        if zlib.crc32(payload) != crc:
            break
        records.append(payload)
        offset = start + length
    return SegmentContents(records, offset, end - offset)


def truncate_torn_tail(path: Path) -> SegmentContents:
    """Cut a segment back to its last whole record (fsynced), so that appending or shipping
    it never carries a torn record along; returns what it holds."""
    contents = read_segment(path)
    if contents.torn_bytes:
        with path.open("r+b") as handle:
            handle.truncate(contents.valid_bytes)
            handle.flush()
            os.fsync(handle.fileno())
    return contents
