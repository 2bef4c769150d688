"""Writing interaction shards in the layout the logging pipelines use.

The real shards come from other teams, but the demo, the tests and the benchmark need to
produce the same thing: Hive-partitioned Parquet (``checkpoint=<id>/date=YYYY-MM-DD/
hour=HH/part-00000.parquet``) in canonical types, through the object store, so that what
we read in tests is what we read in production. Output is deterministic (same rows, same
files, same names) and memory is bounded by one row group per open partition, not by the
size of the input.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from rtrl.core.shards.layout import partition_segment, resolve_store
from rtrl.core.shards.limits import MAX_CHUNK_BYTES
from rtrl.core.shards.schema import REQUIRED_COLUMNS, CastPlan, plan_casts
from rtrl.core.store.base import ObjectStore, join_key

DEFAULT_ROW_GROUP_SIZE = 16_384
DEFAULT_ROWS_PER_FILE = 262_144
# A row group is cut earlier when one of its columns would decode to more than this: half
# the readers' limit of a column chunk (rtrl.core.shards.limits), so that long rows (8k-token
# prompts at 16,384 rows a group) never make a file the readers reject.
GROUP_COLUMN_BYTES = MAX_CHUNK_BYTES // 2


def _partition_checkpoint(batch: pa.RecordBatch) -> pa.Array:
    return batch.column("checkpoint_id")


def _partition_org(batch: pa.RecordBatch) -> pa.Array:
    return batch.column("org")


def _hour_formatted(batch: pa.RecordBatch, format: str) -> pa.DictionaryArray:
    """``created_at`` formatted by ``format`` (of its hour or day): the rows' hours are
    few, so each distinct hour is formatted once (formatting every row's time took most
    of the time spent routing rows to their partitions)."""
    hours = pc.dictionary_encode(pc.floor_temporal(batch.column("created_at"), unit="hour"))
    formatted = pc.strftime(hours.dictionary, format=format)
    return pa.DictionaryArray.from_arrays(hours.indices, formatted)


def _partition_date(batch: pa.RecordBatch) -> pa.Array:
    return _hour_formatted(batch, "%Y-%m-%d")


def _partition_hour(batch: pa.RecordBatch) -> pa.Array:
    return _hour_formatted(batch, "%H")


# Partition name -> its value per row. Dates and hours are of created_at in UTC, so a
# partition holds the interactions *served* in that hour, whenever their feedback arrived.
PARTITIONERS: dict[str, Callable[[pa.RecordBatch], pa.Array]] = {
    "checkpoint": _partition_checkpoint,
    "org": _partition_org,
    "date": _partition_date,
    "hour": _partition_hour,
}


@dataclass
class _OpenPartition:
    """One partition directory being written: rows waiting for a full row group, and the
    Parquet file currently open for it."""

    directory: str
    part: int = 0
    pending: list[pa.RecordBatch] = field(default_factory=list)
    pending_rows: int = 0
    rows_in_file: int = 0
    writer: pq.ParquetWriter | None = None
    path: Path | None = None


class _ShardWriter:
    def __init__(
        self,
        *,
        local_root: Path | None,
        store: ObjectStore | None,
        prefix: str,
        plan: CastPlan,
        row_group_size: int,
        rows_per_file: int,
        compression: str,
        staging: Path,
        file_prefix: str,
    ) -> None:
        self.local_root = local_root
        self.store = store
        self.prefix = prefix
        self.plan = plan
        self.schema = plan.schema
        self.row_group_size = row_group_size
        self.rows_per_file = rows_per_file
        self.compression = compression
        self.staging = staging
        self.file_prefix = file_prefix
        self.partitions: dict[str, _OpenPartition] = {}
        self.written: list[str] = []
        self.opened = 0

    def write(self, raw: pa.RecordBatch, partition_by: Sequence[str]) -> None:
        """Cast one input batch and route its rows to their partitions, in input order."""
        batch = self.plan.apply(raw.select(self.plan.names))
        if batch.num_rows == 0:
            return
        directories = _directories(batch, partition_by)
        labels = directories.dictionary.to_pylist()
        if len(labels) == 1:
            self.add(labels[0], batch)
            return
        indices = directories.indices
        for code, label in enumerate(labels):
            self.add(label, batch.filter(pc.equal(indices, code)))

    def add(self, directory: str, batch: pa.RecordBatch) -> None:
        state = self.partitions.get(directory)
        if state is None:
            state = self.partitions[directory] = _OpenPartition(directory)
        state.pending.append(batch)
        state.pending_rows += batch.num_rows
        while state.pending_rows >= self._next_group_rows(state):
            self._write_group(state)

    def close(self) -> list[str]:
        for state in self.partitions.values():
            while state.pending_rows:
                self._write_group(state)
            self._finish_file(state)
        return sorted(self.written)

    def abort(self) -> None:
        """Close and remove every file still being written, so a failed write leaves only
        complete files behind (never a truncated part a reader would pick up)."""
        for state in self.partitions.values():
            if state.writer is not None:
                with contextlib.suppress(Exception):
                    state.writer.close()
            if state.path is not None:
                state.path.unlink(missing_ok=True)
            state.writer, state.path = None, None

    def _next_group_rows(self, state: _OpenPartition) -> int:
        return min(self.row_group_size, self.rows_per_file - state.rows_in_file)

    def _write_group(self, state: _OpenPartition) -> None:
        rows = min(self._next_group_rows(state), state.pending_rows)
        table = pa.Table.from_batches(state.pending, schema=self.schema)
        rows = _rows_within_budget(table, rows)
        group, rest = table.slice(0, rows), table.slice(rows)
        if state.writer is None:
            state.path = self._file_path(state)
            state.path.parent.mkdir(parents=True, exist_ok=True)
            # Page checksums let readers tell a corrupted page from data: without them a
            # flipped byte in a compressed page can decode into plausible wrong tokens.
            state.writer = pq.ParquetWriter(
                state.path,
                self.schema,
                compression=self.compression,
                write_page_checksum=True,
                use_dictionary=_dictionary_columns(self.schema),
            )
        state.writer.write_table(group, row_group_size=rows)
        state.rows_in_file += rows
        state.pending = rest.to_batches()
        state.pending_rows = rest.num_rows
        if state.rows_in_file >= self.rows_per_file:
            self._finish_file(state)

    def _key(self, state: _OpenPartition) -> str:
        return join_key(
            self.prefix, f"{state.directory}/{self.file_prefix}-{state.part:05d}.parquet"
        )

    def _file_path(self, state: _OpenPartition) -> Path:
        key = self._key(state)
        self.opened += 1
        if self.local_root is None:
            # Several partitions can be open at once: one staging file each.
            return self.staging / f"{self.opened:06d}.parquet"
        # Written under a dot name and renamed when complete: readers skip dot files, so a
        # crashed writer never leaves a truncated shard where a reader would pick it up.
        final = self.local_root / key
        return final.with_name(f".{final.name}.tmp")

    def _finish_file(self, state: _OpenPartition) -> None:
        if state.writer is None or state.path is None:
            return
        state.writer.close()
        key = self._key(state)
        if self.store is not None:
            self.store.put_file(key, state.path)
            state.path.unlink()
        else:
            assert self.local_root is not None
            os.replace(state.path, self.local_root / key)
        self.written.append(key)
        state.writer, state.path = None, None
        state.part += 1
        state.rows_in_file = 0


def _rows_within_budget(table: pa.Table, rows: int) -> int:
    """The first ``rows`` rows of ``table``, or fewer (halved until they fit, one at
    least), so that no column of them takes more than :data:`GROUP_COLUMN_BYTES`."""
    while rows > 1 and max(c.nbytes for c in table.slice(0, rows).columns) > GROUP_COLUMN_BYTES:
        rows //= 2
    return rows


def _dictionary_columns(schema: pa.Schema) -> list[str]:
    """The columns worth dictionary-encoding: the scalar ones (ids, orgs, arms repeat).
    Token ids and log-probs do not: trying a dictionary on them and falling back doubled
    the time to write a shard and made the files larger."""
    return [f.name for f in schema if not pa.types.is_nested(f.type)]


def _batches(
    data: pa.Table | pa.RecordBatch | Iterable[pa.RecordBatch],
) -> Iterable[pa.RecordBatch]:
    if isinstance(data, pa.Table):
        batches: list[pa.RecordBatch] = data.to_batches()
        return batches
    if isinstance(data, pa.RecordBatch):
        return [data]
    return data


def _directories(batch: pa.RecordBatch, partition_by: Sequence[str]) -> pa.DictionaryArray:
    """Each row's partition directory (``checkpoint=a/date=.../hour=..``), dictionary-encoded
    in order of first appearance so part numbering follows the input order."""
    encoded: list[tuple[str, pa.Array, pa.DictionaryArray]] = []
    for name in partition_by:
        values = PARTITIONERS[name](batch)
        # Percent-encoding is per distinct value (few), not per row.
        dictionary = (
            values if isinstance(values, pa.DictionaryArray) else pc.dictionary_encode(values)
        )
        segments = pa.array(
            [partition_segment(name, v) for v in dictionary.dictionary.to_pylist()],
            pa.string(),
        )
        encoded.append((name, segments, dictionary))
    if not encoded:
        return pc.dictionary_encode(pa.repeat(pa.scalar("", pa.string()), batch.num_rows))
    if all(len(s) == 1 and not d.null_count for _, s, d in encoded):
        # the common case, one directory for the whole batch: no string per row
        label = "/".join(str(segments[0].as_py()) for _, segments, _ in encoded)
        indices = pa.array(np.zeros(batch.num_rows, dtype=np.int32))
        return pa.DictionaryArray.from_arrays(indices, pa.array([label]))
    parts = [
        pc.fill_null(segments.take(d.indices), pa.scalar(partition_segment(name, None)))
        for name, segments, d in encoded
    ]
    joined = pc.binary_join_element_wise(*parts, "/")
    result: pa.DictionaryArray = pc.dictionary_encode(joined)
    return result


def write_shards(
    data: pa.Table | pa.RecordBatch | Iterable[pa.RecordBatch],
    root: ObjectStore | str | os.PathLike[str],
    *,
    prefix: str = "",
    partition_by: Sequence[str] = ("checkpoint", "date", "hour"),
    row_group_size: int = DEFAULT_ROW_GROUP_SIZE,
    rows_per_file: int = DEFAULT_ROWS_PER_FILE,
    compression: str = "zstd",
    file_prefix: str = "part",
) -> list[str]:
    """Write interactions as Hive-partitioned Parquet under ``prefix`` of ``root``.

    ``root`` is an :class:`ObjectStore` (files are staged in a local temp directory and
    uploaded with ``put_file``), a store URI, or a local directory (written in place, each
    file renamed into its final name only when complete). Columns are cast to the canonical
    schema; columns beyond it are kept. Files within a partition are ``part-00000.parquet``,
    ``part-00001.parquet``... of at most ``rows_per_file`` rows, in input order. Returns the
    keys written (relative to ``root``), sorted.

    A pipeline that writes into the same partitions again (every few minutes, from several
    workers) passes a ``file_prefix`` unique to that write (``part-<flush id>``): the
    numbering restarts at 00000 each call, so the same prefix replaces the earlier files.

    Raises ``ValueError`` naming every column that is missing or of an unusable type. Row
    values are not validated: this writer is also how tests produce bad shards on purpose.
    """
    unknown = [name for name in partition_by if name not in PARTITIONERS]
    if unknown:
        raise ValueError(
            f"cannot partition by {unknown}: known partitions are {sorted(PARTITIONERS)}"
        )
    if row_group_size < 1 or rows_per_file < 1:
        raise ValueError("row_group_size and rows_per_file must be >= 1")
    if not file_prefix or "/" in file_prefix or file_prefix.startswith(("_", ".")):
        # readers skip names starting with _ or . (markers, temp files): data would vanish
        raise ValueError(
            f"file_prefix {file_prefix!r}: must be non-empty, without '/', and not start "
            "with '_' or '.'"
        )
    store: ObjectStore | None = None
    local_root: Path | None = None
    if isinstance(root, ObjectStore):
        store = root
    elif "://" in os.fspath(root):
        store = resolve_store(root)
    else:
        local_root = Path(root)
    with tempfile.TemporaryDirectory(prefix="rtrl-shards-") as staging:
        writer: _ShardWriter | None = None
        try:
            for raw in _batches(data):
                if writer is None:
                    plan = _writer_plan(raw.schema)
                    writer = _ShardWriter(
                        local_root=local_root,
                        store=store,
                        prefix=prefix,
                        plan=plan,
                        row_group_size=row_group_size,
                        rows_per_file=rows_per_file,
                        compression=compression,
                        staging=Path(staging),
                        file_prefix=file_prefix,
                    )
                writer.write(raw, partition_by)
            return writer.close() if writer is not None else []
        except BaseException:
            if writer is not None:
                writer.abort()
            raise


def _writer_plan(schema: pa.Schema) -> CastPlan:
    extras = [name for name in schema.names if name not in REQUIRED_COLUMNS]
    plan = plan_casts(schema, [*REQUIRED_COLUMNS, *extras])
    if isinstance(plan, CastPlan):
        return plan
    raise ValueError("cannot write shards: " + "; ".join(problem.message for problem in plan))
