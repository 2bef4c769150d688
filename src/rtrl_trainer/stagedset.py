"""The staged set: what ``rtrl-job stage`` commits under its ``--out`` and what the train and
eval steps read back. This module is its one owner: file names, schemas, the advantage
files and the packed per-token columns; the stage step writes through it
(:mod:`rtrl_trainer.stage`), readers read through it.

Layout (committed through the store's protocol, manifest last)::

    stage.json                                  the summary the operator reads (RESULT_NAME)
    train/rank-RRRRR-of-NNNNN.parquet           one rank's rows (train_schema), rank_name()
    train/rank-RRRRR-of-NNNNN.advantage.parquet its advantages, same rows, same order
    heldout/part-00000.parquet                  on-policy rows held out for eval (heldout_schema)

A rank file is written while the shards are read, before the advantages are known (they
need the whole set's baselines), so they sit in a file of their own (``advantage``,
float32); :func:`with_advantages` joins the two by position, as a reader must.

**Packed columns.** The set is internal, so its per-token columns need not be Parquet
lists: each row's list is one ``binary`` value holding its elements as little-endian
fixed-width numbers. Encoding a list column costs a repetition and a definition level per
element, which was two thirds of the time the stage step spent writing its rank files; a
``binary`` value is one length and a ``memcpy``. Packing is zero-copy from the list array
the shards were decoded into (its values buffer, with byte offsets derived from its
offsets), except for the mask, whose bits become bytes.

| column | element |
|---|---|
| ``prompt_ids``, ``completion_ids`` | ``<u2`` (uint16) if all ids fit, else ``<i4`` (int32) |
| ``completion_logprobs`` | ``<f4`` (float32) |
| ``completion_mask`` | ``u1`` (0 or 1) |

Token ids are narrowed to two bytes when they fit, as Megatron-LM's indexed datasets do for
vocabularies below 65,536: half the bytes to compress, hash, write, upload and read. Which
width a set gets is the stage step's decision, made before the first row is written;
narrowing checks every id and refuses one that does not fit.

Each packed field carries its element type in the field metadata (``rtrl.packed``), so a
file describes itself (:func:`element_type`); readers (:func:`flat`) also accept the plain
list columns of a set staged before the format changed.
"""

from __future__ import annotations

import re
import sys

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from rtrl.core.shards.schema import CANONICAL_SCHEMA
from rtrl.core.shards.statistics import TOKEN_ID_COLUMNS
from rtrl_trainer.monitors import MONITOR_COLUMNS

METADATA_KEY = b"rtrl.packed"
# Column -> numpy dtype of its elements, as stored.
PACKED_COLUMNS: dict[str, str] = {
    "prompt_ids": "<i4",
    "completion_ids": "<i4",
    "completion_logprobs": "<f4",
    "completion_mask": "u1",
}
# Token ids may also be stored narrow (see the module docstring).
NARROW_TOKEN_IDS = "<u2"
WIDE_TOKEN_IDS = PACKED_COLUMNS["prompt_ids"]
ELEMENT_TYPES: dict[str, tuple[str, ...]] = {
    name: (dtype, NARROW_TOKEN_IDS) if name in TOKEN_ID_COLUMNS else (dtype,)
    for name, dtype in PACKED_COLUMNS.items()
}
_LIST_TYPES = {
    "<i4": pa.list_(pa.int32()),
    "<u2": pa.list_(pa.int32()),  # unpacked token ids are int32 whatever their storage
    "<f4": pa.list_(pa.float32()),
    "u1": pa.list_(pa.bool_()),
}
_INT32_MAX = np.iinfo(np.int32).max


# --- file names ----------------------------------------------------------------------------

RESULT_NAME = "stage.json"
TRAIN_DIR = "train"
HELDOUT_DIR = "heldout"
HELDOUT_NAME = f"{HELDOUT_DIR}/part-00000.parquet"
ADVANTAGE = "advantage"
ADVANTAGE_SCHEMA = pa.schema([pa.field(ADVANTAGE, pa.float32(), nullable=False)])
ADVANTAGE_SUFFIX = ".advantage.parquet"


def rank_name(rank: int, ranks: int) -> str:
    return f"{TRAIN_DIR}/rank-{rank:05d}-of-{ranks:05d}.parquet"


_RANK_NAME = re.compile(rf"^{TRAIN_DIR}/rank-(\d{{5}})-of-(\d{{5}})\.parquet$")


def parse_rank_name(name: str) -> tuple[int, int] | None:
    """(rank, ranks) of a :func:`rank_name`; None for any other key (advantage files too)."""
    match = _RANK_NAME.match(name)
    return (int(match.group(1)), int(match.group(2))) if match else None


def advantage_name(rank_file: str) -> str:
    """The advantage file of a rank file (``train/rank-00000-of-00002.parquet`` ->
    ``train/rank-00000-of-00002.advantage.parquet``)."""
    return rank_file.removesuffix(".parquet") + ADVANTAGE_SUFFIX


def with_advantages(rank: pa.Table, advantages: pa.Table, name: str) -> pa.Table:
    """The rank file ``name``'s rows with the ``advantage`` column of its advantage file
    (how a reader joins the two: by position). ValueError when the row counts differ."""
    if advantages.num_rows != rank.num_rows or ADVANTAGE not in advantages.column_names:
        raise ValueError(
            f"{advantage_name(name)} has {advantages.num_rows} advantages for the "
            f"{rank.num_rows} rows of {name}"
        )
    return rank.append_column(ADVANTAGE_SCHEMA.field(0), advantages.column(ADVANTAGE))


# --- schemas -------------------------------------------------------------------------------

_CANON = {f.name: f for f in CANONICAL_SCHEMA}
# How each row was sampled, as the shards say (nulls: temperature 1, no truncation, raw
# log-probs; rtrl.core.shards.sampling): the trainer computes its log-probs under the same
# distribution (rtrl_trainer.logprobs).
SAMPLING_COLUMNS = ("temperature", "top_p", "top_k", "logprobs_mode")
# The interaction's columns every staged row carries.
CARRIED_COLUMNS = (
    "interaction_id",
    "checkpoint_id",
    "org",
    "prompt_ids",
    "completion_ids",
    "completion_logprobs",
    "completion_mask",
    *SAMPLING_COLUMNS,
)
# The held-out split: what the eval step's replay and behaviour suites read (the
# interaction as logged, with its signals), never trained on.
HELDOUT_COLUMNS: tuple[str, ...] = tuple(dict.fromkeys((*CARRIED_COLUMNS, *MONITOR_COLUMNS)))


def set_fields(names: tuple[str, ...], tokens: str) -> list[pa.Field]:
    """Canonical fields of ``names``, the per-token ones packed (token ids as ``tokens``)."""
    return [
        packed_field(name, nullable=False, dtype=tokens if name in TOKEN_ID_COLUMNS else None)
        if name in PACKED_COLUMNS
        else _CANON[name]
        for name in names
    ]


def train_schema(tokens: str = WIDE_TOKEN_IDS) -> pa.Schema:
    """A rank file: what the trainer reads, one file per data-parallel rank, and next to
    each its advantage file (:data:`ADVANTAGE_SCHEMA`, same rows in the same order)."""
    return pa.schema(
        [
            *set_fields(CARRIED_COLUMNS, tokens),
            # The combined reward, the value the row's advantage is computed from; the
            # trainer reads it (when present) only to log each step's mean reward.
            pa.field("reward", pa.float32()),
            # 1.0 for every row: the trainer importance-weights per token from the logged
            # log-probs (off-policy rows included); this column is where a per-row weight
            # (e.g. rebalancing orgs) would go without changing the trainer's reader.
            pa.field("sample_weight", pa.float32()),
            pa.field("on_policy", pa.bool_()),
        ]
    )


def heldout_schema(tokens: str = WIDE_TOKEN_IDS) -> pa.Schema:
    """The held-out file: the interaction as logged, with its signals."""
    return pa.schema(set_fields(HELDOUT_COLUMNS, tokens))


# --- packed columns ------------------------------------------------------------------------


class PackedError(ValueError):
    """A packed column that cannot be read back: an unknown element type, or row ``row``
    whose length is not a multiple of the element width."""

    def __init__(self, message: str, row: int | None = None) -> None:
        super().__init__(message if row is None else f"row {row}: {message}")
        self.row = row
        self.detail = message


def packed_field(name: str, nullable: bool = True, dtype: str | None = None) -> pa.Field:
    """The field of a packed column, its elements ``dtype`` (default: the column's wide
    type, :data:`PACKED_COLUMNS`)."""
    dtype = PACKED_COLUMNS[name] if dtype is None else dtype
    if dtype not in ELEMENT_TYPES[name]:
        raise ValueError(f"{name} cannot be packed as {dtype}")
    return pa.field(name, pa.binary(), nullable=nullable, metadata={METADATA_KEY: dtype})


def element_type(field: pa.Field) -> str:
    """The element type a packed field declares (:class:`PackedError` when it declares
    none, or one its column cannot have)."""
    declared = (field.metadata or {}).get(METADATA_KEY)
    if declared is None:
        raise PackedError(f"{field.name}: binary without the {METADATA_KEY.decode()} metadata")
    dtype = str(declared.decode(errors="replace"))
    if dtype not in ELEMENT_TYPES.get(field.name, tuple(_LIST_TYPES)):
        raise PackedError(f"{field.name}: unknown packed element type {dtype!r}")
    return dtype


def fits_narrow(array: pa.Array) -> bool:
    """Whether every element of an int32 list array lies in 0-65535 (the range of narrow
    token ids): one pass, OR-ing the elements (a negative one sets the sign bit)."""
    values = _span(array)
    return not (int(np.bitwise_or.reduce(values)) >> 16) if values.size else True


def rows_not_narrow(array: pa.Array) -> npt.NDArray[np.bool_]:
    """Which rows of an int32 list array hold an element outside 0-65535."""
    values = _span(array)
    offsets = np.asarray(array.offsets, dtype=np.int64)
    outside = np.flatnonzero((values < 0) | (values > 0xFFFF))
    rows = np.zeros(len(array), dtype=np.bool_)
    rows[np.searchsorted(offsets, outside + offsets[0], side="right") - 1] = True
    return rows


def _span(array: pa.Array) -> npt.NDArray[np.int32]:
    """The elements of an int32 list array's rows, as numpy (zero-copy)."""
    offsets = np.asarray(array.offsets, dtype=np.int64)
    values = array.values
    start, stop = int(offsets[0]), int(offsets[-1])
    data = values.buffers()[1]
    if data is None or stop == start:
        return np.zeros(0, dtype=np.int32)
    span: npt.NDArray[np.int32] = np.frombuffer(data, dtype=np.int32)[
        values.offset + start : values.offset + stop
    ]
    return span


def pack(array: pa.Array, dtype: str) -> pa.BinaryArray:
    """A list array as a binary array, each row's elements as ``dtype`` bytes.

    Zero-copy for numbers: the result shares the list's values buffer (honouring the
    offsets of a sliced list and of a sliced values array). Booleans become one byte each;
    int32 narrowed to ``<u2`` is one conversion, refused (:class:`ValueError`) when an
    element does not fit. Null lists and null elements are not representable:
    :class:`ValueError`.
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
    elif dtype == NARROW_TOKEN_IDS and pa.types.is_int32(values.type):
        if not fits_narrow(array):
            raise ValueError(f"an element outside 0-65535 cannot be packed as {dtype}")
        data = pa.py_buffer(_span(array).astype(dtype))
        byte_offsets = (offsets - start) * width
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
    if dtype == "u1":
        values = values.astype(np.bool_)
    elif dtype == NARROW_TOKEN_IDS:
        values = values.astype(np.int32)
    elements = pa.array(values)
    return pa.ListArray.from_arrays(
        pa.array(offsets.astype(np.int32)), elements, type=_LIST_TYPES[dtype], mask=mask
    )


def to_lists(table: pa.Table) -> pa.Table:
    """``table`` with its packed columns as lists (for people and tests; slow for big
    tables only in the way any list conversion is)."""
    for index, field in enumerate(table.schema):
        if not is_packed(field):
            continue
        dtype = element_type(field)
        column = pa.chunked_array(
            [unpack(chunk, dtype) for chunk in table.column(index).chunks],
            type=_LIST_TYPES[dtype],
        )
        table = table.set_column(index, pa.field(field.name, column.type), column)
    return table
