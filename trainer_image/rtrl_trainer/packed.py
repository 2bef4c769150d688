"""The training set's per-token columns, packed: each row's list as one ``binary`` value
holding its elements as little-endian fixed-width numbers.

The training set is internal (the stage step writes it, the train step reads it), so its
per-token columns need not be Parquet lists. Encoding a list column costs a repetition and
a definition level per element, which was two thirds of the time the stage step spent
writing its rank files; a ``binary`` value is one length and a ``memcpy``. Packing is
zero-copy from the list array the shards were decoded into (its values buffer, with byte
offsets derived from its offsets), except for the mask, whose bits become bytes.

| column | element |
|---|---|
| ``prompt_ids``, ``completion_ids`` | ``<i4`` (int32 token ids) |
| ``completion_logprobs`` | ``<f4`` (float32) |
| ``completion_mask`` | ``u1`` (0 or 1) |

Each packed field carries its element type in the field metadata (``rtrl.packed``), so a
file describes itself; readers (:func:`flat`) also accept the plain list columns of a set
staged before the format changed.
"""

from __future__ import annotations

import sys

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

METADATA_KEY = b"rtrl.packed"
# Column -> numpy dtype of its elements, as stored.
PACKED_COLUMNS: dict[str, str] = {
    "prompt_ids": "<i4",
    "completion_ids": "<i4",
    "completion_logprobs": "<f4",
    "completion_mask": "u1",
}
_LIST_TYPES = {
    "<i4": pa.list_(pa.int32()),
    "<f4": pa.list_(pa.float32()),
    "u1": pa.list_(pa.bool_()),
}
_INT32_MAX = np.iinfo(np.int32).max


class PackedError(ValueError):
    """A packed column that cannot be read back: an unknown element type, or row ``row``
    whose length is not a multiple of the element width."""

    def __init__(self, message: str, row: int | None = None) -> None:
        super().__init__(message if row is None else f"row {row}: {message}")
        self.row = row
        self.detail = message


def packed_field(name: str, nullable: bool = True) -> pa.Field:
    """The field of a packed column."""
    return pa.field(
        name, pa.binary(), nullable=nullable, metadata={METADATA_KEY: PACKED_COLUMNS[name]}
    )


def pack(array: pa.Array, dtype: str) -> pa.BinaryArray:
    """A list array as a binary array, each row's elements as ``dtype`` bytes.

    Zero-copy for numbers: the result shares the list's values buffer (honouring the
    offsets of a sliced list and of a sliced values array). Booleans become one byte each.
    Null lists and null elements are not representable: :class:`ValueError`.
    """
    if array.null_count:
        raise ValueError("a null list cannot be packed")
    offsets = np.asarray(array.offsets, dtype=np.int64)
    values = array.values
    start, stop = int(offsets[0]), int(offsets[-1])
    if values.slice(start, stop - start).null_count:
        raise ValueError("a list with a null element cannot be packed")
    width = np.dtype(dtype).itemsize
    if pa.types.is_boolean(values.type):
        # Bits to bytes for the rows' span only; offsets then count from its start.
        bits = np.frombuffer(values.buffers()[1], dtype=np.uint8)
        first = values.offset + start
        count = stop - start
        unpacked = np.unpackbits(bits[first // 8 : (first + count + 7) // 8 + 1], bitorder="little")
        data = pa.py_buffer(unpacked[first % 8 : first % 8 + count])
        byte_offsets = offsets - start
    else:
        if np.dtype(dtype) != values.type.to_pandas_dtype() or sys.byteorder != "little":
            raise TypeError(f"cannot pack {array.type} as {dtype}")
        data = values.buffers()[1] or pa.py_buffer(b"")  # None only when empty
        byte_offsets = (offsets + values.offset) * width
    if byte_offsets[-1] > _INT32_MAX:
        raise ValueError("a packed batch over 2 GiB")
    return pa.Array.from_buffers(
        pa.binary(), len(array), [None, pa.py_buffer(byte_offsets.astype(np.int32)), data]
    )


def packed_lengths(array: pa.Array, dtype: str) -> npt.NDArray[np.int64]:
    """Elements per row of a packed column (a null counts 0)."""
    lengths = np.asarray(pc.fill_null(pc.binary_length(array), 0), dtype=np.int64)
    return lengths // np.dtype(dtype).itemsize


def is_packed(field: pa.Field) -> bool:
    return (pa.types.is_binary(field.type) or pa.types.is_large_binary(field.type)) and bool(
        field.metadata and METADATA_KEY in field.metadata
    )


def flat(array: pa.Array, dtype: str) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.generic]]:
    """(offsets from 0, values) of a packed column (``binary``, elements ``dtype``), as
    numpy. Nulls are the caller's to reject first."""
    width = np.dtype(dtype).itemsize
    offset_type = np.int64 if pa.types.is_large_binary(array.type) else np.int32
    buffers = array.buffers()
    offsets = np.frombuffer(buffers[1], dtype=offset_type)[
        array.offset : array.offset + len(array) + 1
    ].astype(np.int64)
    lengths = np.diff(offsets)
    if np.any(lengths % width):
        row = int(np.flatnonzero(lengths % width)[0])
        raise PackedError(f"{lengths[row]} bytes, not a multiple of {width}", row)
    start, stop = int(offsets[0]), int(offsets[-1])
    data = buffers[2]
    raw = np.frombuffer(data, dtype=np.uint8)[start:stop] if data is not None else b""
    values: npt.NDArray[np.generic] = np.frombuffer(raw, dtype=dtype)
    return (offsets - start) // width, values


def unpack(array: pa.Array, dtype: str) -> pa.Array:
    """A packed column as the list column it came from (nulls kept); a list column as is."""
    if not pa.types.is_binary(array.type) and not pa.types.is_large_binary(array.type):
        return array
    mask = None
    if array.null_count:
        mask = pc.is_null(array)
        # A null's offsets may span bytes in general; empty ones do not.
        array = pc.fill_null(array, pa.scalar(b"", array.type))
    offsets, values = flat(array, dtype)
    elements = pa.array(values.astype(np.bool_) if dtype == "u1" else values)
    return pa.ListArray.from_arrays(
        pa.array(offsets.astype(np.int32)), elements, type=_LIST_TYPES[dtype], mask=mask
    )


def to_lists(table: pa.Table) -> pa.Table:
    """``table`` with its packed columns as lists (for people and tests; slow for big
    tables only in the way any list conversion is)."""
    for index, field in enumerate(table.schema):
        if not is_packed(field):
            continue
        assert field.metadata is not None
        dtype = field.metadata[METADATA_KEY].decode(errors="replace")
        if dtype not in _LIST_TYPES:
            raise PackedError(f"{field.name}: unknown packed element type {dtype!r}")
        column = pa.chunked_array(
            [unpack(chunk, dtype) for chunk in table.column(index).chunks],
            type=_LIST_TYPES[dtype],
        )
        table = table.set_column(index, pa.field(field.name, column.type), column)
    return table
