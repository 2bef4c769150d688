"""Streaming reads of interaction shards, in canonical types, in bounded memory.

A shard set is hours of traffic: far more than fits in a Job pod. Files are therefore read
one at a time through the object store's ranged reader, batch by batch, with only the
columns asked for, and each batch is cast to the canonical schema on its way out. Memory is
bounded by one batch (plus Parquet's buffering of the row group being decoded), whatever
the number of rows or files.

Every file is held to the limits of :mod:`rtrl.core.shards.limits` from its footer before
a page of it is decoded, and its string columns are read as dictionaries (their size is
known from the dictionary before a value is copied out per row), so that a hostile file
costs what those limits allow and no more.

This reader trusts the data otherwise; the pipeline steps use the validating reader in
:mod:`rtrl.core.shards.validate`, which builds on the same primitives.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from rtrl.core.shards.footer import Footer, FooterError
from rtrl.core.shards.layout import PartitionFilter, list_shards, parse_partitions, resolve_store
from rtrl.core.shards.limits import (
    TOO_LONG,
    check_footer,
    oversized_strings,
    read_footer_of,
    string_columns,
)
from rtrl.core.shards.schema import REQUIRED_COLUMNS, CastPlan, SchemaProblem, plan_casts
from rtrl.core.store.base import ObjectNotFound, ObjectStore, StoreError

# ~30 MB of decoded rows at ~1.7 kB per interaction: big enough that per-batch overhead
# vanishes, small enough for many readers per pod.
DEFAULT_BATCH_SIZE = 16_384

MiB = 1 << 20
# Row groups up to this size (uncompressed, as the footer records it) are fetched whole, as
# a few coalesced range requests, which is what makes S3 fast. Producers choose their own
# row-group sizes, so a file with bigger ones is streamed page by page through a small
# buffer per column instead: slower on S3, but memory stays bounded whatever the file.
PREBUFFER_LIMIT = 256 * MiB
STREAM_BUFFER_SIZE = 1 * MiB


class ShardError(Exception):
    """A shard file cannot be used: unreadable, beyond the reader's limits, or its schema
    cannot be made canonical. The message names the file; ``reason`` is a validator reason
    code, ``detail`` the message without the file, ``rows`` the rows the file's footer
    plausibly holds (0 when not known)."""

    def __init__(self, url: str, reason: str, message: str, rows: int = 0) -> None:
        super().__init__(f"{url}: {message}")
        self.url = url
        self.reason = reason
        self.detail = message
        self.rows = rows


@dataclass(frozen=True)
class ShardFile:
    """One shard file of a listing, with the Hive partition values of its path."""

    key: str
    url: str
    size: int
    partitions: dict[str, str]


def list_files(
    store: ObjectStore, *, prefix: str = "", partitions: PartitionFilter | None = None
) -> Iterator[ShardFile]:
    """The shard files under ``prefix``, in key order, pruned by Hive ``partitions``
    (e.g. ``{"checkpoint": "composer-41"}``) without opening them."""
    for info in list_shards(store, prefix, partitions):
        yield ShardFile(
            key=info.key,
            url=store.url(info.key),
            size=info.size,
            partitions=parse_partitions(info.key),
        )


def describe_error(exc: BaseException) -> str:
    """An exception as one line for a report (pyarrow's messages can span lines)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return f"{type(exc).__name__}: {text}"


@dataclass(frozen=True)
class OpenShard:
    """A shard file opened for reading: ``parquet`` (its string columns read as
    dictionaries), ``rows`` (what its footer plausibly holds: the count to report) and
    ``schema`` (its Arrow schema as the file declares it, string columns as strings)."""

    parquet: pq.ParquetFile
    rows: int
    schema: pa.Schema
    # The footer as rtrl read it (pyarrow's accessors of row-group and column-chunk
    # metadata abort the process on some inconsistent footers: footer.py).
    footer: Footer

    @property
    def num_row_groups(self) -> int:
        return len(self.footer.row_groups)

    def row_group_rows(self, index: int) -> int:
        return self.footer.row_groups[index].num_rows

    def batches(
        self, columns: Sequence[str], batch_size: int, row_group: int | None = None
    ) -> Iterator[pa.RecordBatch]:
        """Raw batches of ``columns``, one row group at a time (pre-buffering a whole file
        would hold all of it in memory at once), or of ``row_group`` only; string columns
        still dictionary-encoded (see :func:`declared_types`)."""
        groups = range(self.num_row_groups) if row_group is None else [row_group]
        for index in groups:
            yield from self.parquet.iter_batches(
                batch_size=batch_size, row_groups=[index], columns=list(columns)
            )


@contextlib.contextmanager
def open_parquet(
    store: ObjectStore, shard: ShardFile, *, stream: bool = False
) -> Iterator[OpenShard]:
    """Open one shard for reading, closing the store's reader afterwards; ``stream``: read
    through a small buffer, never a row group whole (a reader of a few rows).

    Any failure of the file itself (gone since it was listed, truncated, not Parquet at all,
    a footer beyond :mod:`~rtrl.core.shards.limits` or contradicting itself) is a
    :class:`ShardError`, with reason ``unreadable`` or ``over_limit``: foreign files fail
    in many ways and none of them may take the reading process down. A failing store
    (``StoreError`` after the store's own retries) is not the file's fault and propagates,
    so a network outage fails the step instead of quietly quarantining good data.
    """
    try:
        handle = store.open_input(shard.key)
    except ObjectNotFound as exc:
        raise ShardError(shard.url, "unreadable", describe_error(exc)) from exc
    with handle:
        try:
            # The footer's size before it is parsed, its contents before a page is read.
            footer = read_footer_of(handle)
            check = check_footer(footer)
            check.raise_if_bad()
            metadata = pq.read_metadata(handle)
            if metadata.num_row_groups != len(footer.row_groups):
                raise FooterError("unreadable", "pyarrow reads another footer than rtrl")
            largest = max((group.total_byte_size for group in footer.row_groups), default=0)
            prebuffer = largest <= PREBUFFER_LIMIT and not stream
            parquet = pq.ParquetFile(
                handle,
                metadata=metadata,
                pre_buffer=prebuffer,
                buffer_size=0 if prebuffer else STREAM_BUFFER_SIZE,
                # Verified where the writer stored them (rtrl's writer does); a no-op otherwise.
                page_checksum_verification=True,
                read_dictionary=string_columns(footer),
            )
            schema = metadata.schema.to_arrow_schema()
        except StoreError:
            raise
        except FooterError as exc:
            raise ShardError(shard.url, exc.reason, str(exc), rows=exc.rows) from None
        except Exception as exc:
            raise ShardError(shard.url, "unreadable", describe_error(exc)) from exc
        yield OpenShard(parquet, check.rows, schema, footer)


def declared_types(batch: pa.RecordBatch, schema: pa.Schema) -> pa.RecordBatch:
    """``batch`` (read by :meth:`OpenShard.batches`) with each column in the type the file
    declares: the string columns read as dictionaries decoded, once
    :func:`~rtrl.core.shards.limits.oversized_strings` has let none through that would
    decode beyond the limits."""
    arrays = []
    changed = False
    for name, column in zip(batch.schema.names, batch.columns, strict=True):
        declared = schema.field(name).type if schema.get_field_index(name) >= 0 else None
        if pa.types.is_dictionary(column.type) and (
            declared is None or not pa.types.is_dictionary(declared)
        ):
            arrays.append(column.dictionary_decode())
            changed = True
        else:
            arrays.append(column)
    if not changed:
        return batch
    return pa.RecordBatch.from_arrays(arrays, names=batch.schema.names)


def plan_file(
    opened: OpenShard, shard: ShardFile, columns: Sequence[str]
) -> CastPlan | list[SchemaProblem]:
    """The cast plan of one opened shard for ``columns`` (see :func:`plan_casts`), from the
    types the file declares (batches are brought to them by :func:`declared_types`)."""
    return plan_casts(opened.schema, columns, partitions=shard.partitions)


def output_columns(columns: Sequence[str] | None) -> list[str]:
    """The columns a read yields: the canonical ones unless a projection is given."""
    return list(REQUIRED_COLUMNS) if columns is None else list(dict.fromkeys(columns))


def read_file(
    store: ObjectStore,
    shard: ShardFile,
    *,
    columns: Sequence[str] | None = None,
    batch_size: int = DEFAULT_BATCH_SIZE,
) -> Iterator[pa.RecordBatch]:
    """The canonical batches of one shard file; :class:`ShardError` when it cannot be used."""
    with open_parquet(store, shard) as opened:
        plan = plan_file(opened, shard, output_columns(columns))
        if not isinstance(plan, CastPlan):
            problems = "; ".join(p.message for p in plan)
            raise ShardError(shard.url, plan[0].reason, problems)
        try:
            for raw in decoded(opened.batches(plan.read_names, batch_size)):
                oversized = oversized_strings(raw)
                if oversized is not None:
                    raise ShardError(
                        shard.url, TOO_LONG, f"row {oversized[1]} of a batch: {oversized[2]}"
                    )
                try:
                    batch = plan.apply(declared_types(raw, opened.schema))
                except pa.ArrowInvalid as exc:
                    raise ShardError(shard.url, "wrong_type", describe_error(exc)) from exc
                yield batch
        except UnreadableBatchError as exc:
            raise ShardError(shard.url, "unreadable", str(exc)) from exc.__cause__


class UnreadableBatchError(Exception):
    """A batch pyarrow could not decode (a corrupt page); the message describes why."""


def decoded(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """``batches`` as pyarrow decodes them; a batch it cannot decode raises
    :class:`UnreadableBatchError` (the store's own errors pass through as they are)."""
    while True:
        try:
            raw = next(batches)
        except StopIteration:
            return
        except StoreError:
            raise
        except Exception as exc:
            raise UnreadableBatchError(describe_error(exc)) from exc
        yield raw


def iter_batches(
    source: ObjectStore | str | os.PathLike[str],
    *,
    columns: Sequence[str] | None = None,
    batch_size: int = DEFAULT_BATCH_SIZE,
    prefix: str = "",
    partitions: PartitionFilter | None = None,
) -> Iterator[pa.RecordBatch]:
    """Canonical record batches of every shard under ``source`` (a store, a store URI or a
    local directory), file by file in key order, without validating rows.

    ``columns`` projects (default: the required canonical columns; an optional canonical
    one asked for is read as nulls from a file that lacks it; extra columns are passed through
    in their own types); ``partitions`` prunes files by their Hive path. Raises
    :class:`ShardError` on the first file that cannot be used.
    """
    store = resolve_store(source)
    for shard in list_files(store, prefix=prefix, partitions=partitions):
        yield from read_file(store, shard, columns=columns, batch_size=batch_size)
