"""The rank files of the training set and their advantage files, as the stage step writes
them.

The training set is written while the shards are read (:mod:`rtrl_trainer.stage.select`),
before the advantages can be known: they need the baselines and the standard deviation of
the whole set. So each rank is two files (:mod:`rtrl_trainer.stagedset`): the rank file,
with every column of the set but the advantage, written in row groups as the rows come and
final once written (hashed and flushed as it grows, :mod:`rtrl_trainer.stage.workers`);
and its advantage file, written once the set is complete from the (reward, stratum) of
each row, spilled meanwhile to a small side file on local disk (8 bytes a row, not in
memory).
"""

from __future__ import annotations

import contextlib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.parquet as pq

from rtrl_trainer.reward import RunningStats, advantages
from rtrl_trainer.stage.commit import Staging
from rtrl_trainer.stage.workers import GrowingFileDigest, Worker
from rtrl_trainer.stagedset import (
    ADVANTAGE_SCHEMA,
    CARRIED_COLUMNS,
    advantage_name,
    element_type,
    packed_lengths,
    rank_name,
)

# Rank files get row groups of about this many rows; with many ranks, smaller ones, so the
# rows waiting per rank stay within PENDING_BYTES in total.
ROW_GROUP_ROWS = 16_384
PENDING_BYTES = 256 << 20
# Advantage files: rows per row group (4 MB).
ADVANTAGE_ROWS = 1 << 20
# Token ids are high-entropy: only the string columns repeat enough for a dictionary to pay
# for itself. Column statistics and page checksums cost a fifth of the encoding time and
# serve no reader: the trainer reads whole files, and the manifest's sha256 of each file
# covers corruption.
STRING_COLUMNS = ["checkpoint_id", "org", "logprobs_mode"]
SPLIT_COLUMNS = ("prompt_ids", "completion_ids")
UNCOMPRESSED_COLUMNS = ("completion_logprobs",)
# One row's spilled (reward, stratum), in file order.
_SIDE = np.dtype([("reward", "<f4"), ("stratum", "<i4")])


def _leaf_path(field: pa.Field) -> str:
    name = str(field.name)
    return f"{name}.list.element" if pa.types.is_list(field.type) else name


def parquet_writer(path: Path, schema: pa.Schema, **options: Any) -> pq.ParquetWriter:
    """A writer of the step's Parquet files, with the encodings chosen per column for speed
    (one CPU encodes a whole rank file; measured on 1M interactions):

    - token id lists: BYTE_STREAM_SPLIT, then zstd. The ids' high bytes are mostly zero;
      split into streams of equal significance they compress to a quarter less than PLAIN
      does, in a quarter less time. The step's own files pack their token ids
      (:mod:`rtrl_trainer.stagedset`): binary, which the split does not apply to, so zstd
      alone;
    - log-probs: uncompressed. A float's mantissa is noise: zstd saves a tenth of their
      size for 70% more time on the column;
    - everything else zstd; dictionaries only for the strings that repeat.

    ``options`` override or extend these (per Parquet leaf path, e.g.
    ``prompt_ids.list.element``)."""
    compression = {_leaf_path(f): "zstd" for f in schema}
    encoding: dict[str, str] = {}
    for field in schema:
        if field.name in SPLIT_COLUMNS and pa.types.is_list(field.type):
            encoding[_leaf_path(field)] = "BYTE_STREAM_SPLIT"
        if field.name in UNCOMPRESSED_COLUMNS:
            compression[_leaf_path(field)] = "none"
    compression.update(options.pop("compression", {}))
    encoding.update(options.pop("column_encoding", {}))
    return pq.ParquetWriter(
        path,
        schema,
        compression=compression,
        column_encoding=encoding,
        use_dictionary=[name for name in STRING_COLUMNS if name in schema.names],
        write_statistics=False,
        **options,
    )


def train_writer(path: Path, schema: pa.Schema) -> pq.ParquetWriter:
    """A rank file's writer (:func:`parquet_writer`)."""
    return parquet_writer(path, schema)


class RankFile:
    """One rank's Parquet file, written in row groups by a worker as its rows accumulate
    (hashed, and in a ``file://`` store flushed to disk, as it grows), and its advantage file,
    written by :meth:`write_advantages` once the set is complete."""

    def __init__(
        self,
        staging: Staging,
        name: str,
        side: Path,
        *,
        schema: pa.Schema,
        flush_bytes: int,
        worker: Worker,
    ) -> None:
        self.path = staging.path(name)
        self.advantage_path = staging.path(advantage_name(name))
        self.side_path = side
        self.flush_bytes = flush_bytes
        self.worker = worker
        self.schema = schema
        self.side: BinaryIO = side.open("wb")
        self.writer = train_writer(self.path, schema)
        # Flushing pages to disk as the file grows pays only where it stays (in place).
        self.digest = GrowingFileDigest(self.path, sync=staging.in_place)
        self.entry: dict[str, Any] | None = None  # the manifest entry, once closed
        self.pending: list[pa.RecordBatch] = []
        self.pending_side: list[npt.NDArray[Any]] = []
        self.pending_rows = 0
        self.pending_bytes = 0
        self.rows = 0
        self.tokens = 0

    def add(self, batch: pa.RecordBatch, strata: npt.NDArray[np.int32], tokens: int) -> None:
        if batch.num_rows == 0:
            return
        side = np.empty(batch.num_rows, dtype=_SIDE)
        side["reward"] = batch.column("reward").to_numpy()
        side["stratum"] = strata
        self.pending.append(batch)
        self.pending_side.append(side)
        self.pending_rows += batch.num_rows
        self.pending_bytes += batch.nbytes
        self.rows += batch.num_rows
        self.tokens += tokens
        if self.pending_rows >= ROW_GROUP_ROWS or self.pending_bytes >= self.flush_bytes:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        table = pa.Table.from_batches(self.pending, schema=self.schema)
        self.worker.submit(self._write, table, np.concatenate(self.pending_side))
        self.pending, self.pending_side, self.pending_rows, self.pending_bytes = [], [], 0, 0

    def _write(self, table: pa.Table, side: npt.NDArray[Any]) -> None:
        self.writer.write_table(table, row_group_size=table.num_rows)
        self.side.write(side.tobytes())
        self.digest.poke()

    def close(self) -> None:
        """Queue the last rows and the footer (the worker's close waits for them)."""
        self.flush()
        self.worker.submit(self._close)

    def _close(self) -> None:
        self.writer.close()
        self.side.close()
        self.entry = self.digest.finish()

    def abort(self) -> None:
        """Release the file handles after a failure (the files are discarded)."""
        with contextlib.suppress(Exception):
            self.writer.close()
        self.side.close()
        self.digest.close()

    def write_advantages(self, baselines: npt.NDArray[np.float64], std: float) -> RunningStats:
        """Write the advantage file from the spilled (reward, stratum) of every row, in the
        rank file's order; the advantages' statistics."""
        stats = RunningStats()
        with (
            self.side_path.open("rb") as side,
            pq.ParquetWriter(
                self.advantage_path, ADVANTAGE_SCHEMA, compression="none", write_statistics=False
            ) as writer,
        ):
            written = 0
            while len(rows := np.fromfile(side, dtype=_SIDE, count=ADVANTAGE_ROWS)):
                rewards = np.ascontiguousarray(rows["reward"])
                values = advantages(rewards, rows["stratum"], baselines, std)
                stats.update(values)
                column = pa.array(values.astype("<f4", copy=False), pa.float32())
                writer.write_table(pa.Table.from_arrays([column], schema=ADVANTAGE_SCHEMA))
                written += len(rows)
        if written != self.rows:
            raise RuntimeError(
                f"{self.side_path.name}: {written} rewards spilled for {self.rows} rows"
            )
        self.side_path.unlink()
        return stats


class Ranks:
    """The rank files of the training set, staged in ``staging``; rows are dealt
    round-robin by their position in the set (deterministic and balanced). A context
    manager: leaving it waits for the workers, after which every rank file is complete (or
    the error propagates)."""

    def __init__(self, ranks: int, staging: Staging, side_dir: Path, schema: pa.Schema) -> None:
        self.ranks = ranks
        self.schema = schema
        self.names = [rank_name(r, ranks) for r in range(ranks)]
        self._stack = contextlib.ExitStack()
        workers = [
            self._stack.enter_context(Worker(f"stage-rank-{w}"))
            for w in range(min(ranks, os.cpu_count() or 1))
        ]
        self.files = [
            RankFile(
                staging,
                name,
                side_dir / f"rank-{r:05d}.side",
                schema=schema,
                flush_bytes=max(1 << 20, PENDING_BYTES // ranks),
                worker=workers[r % len(workers)],
            )
            for r, name in enumerate(self.names)
        ]
        self.position = 0
        self._closed = False

    def __enter__(self) -> Ranks:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        if exc_type is None:
            self.close()
        else:  # already failing: stop the workers, let the original error propagate
            with contextlib.suppress(BaseException):
                self._stack.close()
            for file in self.files:
                file.abort()

    def deal(
        self,
        out: pa.RecordBatch,
        strata: npt.NDArray[np.int32],
        lengths: npt.NDArray[np.int64],
        rows: npt.NDArray[np.int64] | None = None,
    ) -> None:
        """Deal ``rows`` of ``out`` (a batch of the training schema; None: all of them);
        ``strata`` and ``lengths`` (completion tokens) are per row of ``out``."""
        n = out.num_rows if rows is None else len(rows)
        if n == 0:
            return
        index = np.arange(out.num_rows) if rows is None else rows
        ranks = self.ranks
        for rank in range(ranks):
            mine = index[(rank - self.position) % ranks :: ranks]
            if mine.size == 0:
                continue
            # Per-token columns are packed: gathering a row is one memcpy per column.
            part = out if mine.size == out.num_rows else out.take(pa.array(mine))
            self.files[rank].add(part, strata[mine], int(lengths[mine].sum(dtype=np.int64)))
        self.position += n

    def close(self) -> None:
        """Write the last rows and the footers; wait for every file to be complete."""
        if self._closed:
            return
        self._closed = True
        for file in self.files:
            file.close()
        self._stack.close()

    def write_advantages(
        self, baselines: npt.NDArray[np.float64], std: float
    ) -> tuple[list[dict[str, Any]], RunningStats]:
        """Write every rank's advantage file (a thread per CPU: file reads and writes and
        numpy release the GIL); the per-rank summary and the statistics of the
        advantages."""
        with ThreadPoolExecutor(max_workers=min(self.ranks, os.cpu_count() or 1)) as pool:
            parts = list(pool.map(lambda f: f.write_advantages(baselines, std), self.files))
        stats = RunningStats()
        for part in parts:
            stats.merge(part)
        summary = [
            {
                "rank": r,
                "file": name,
                "advantages": advantage_name(name),
                "rows": f.rows,
                "tokens": f.tokens,
            }
            for r, (name, f) in enumerate(zip(self.names, self.files, strict=True))
        ]
        return summary, stats

    def keys(self) -> list[str]:
        """Every file of the training set: the rank files and their advantage files."""
        return sorted([*self.names, *(advantage_name(n) for n in self.names)])

    def entries(self) -> dict[str, dict[str, Any]]:
        """The rank files' manifest entries, computed as they were written."""
        return {n: f.entry for n, f in zip(self.names, self.files, strict=True) if f.entry}


def train_batch(batch: pa.RecordBatch, schema: pa.Schema) -> pa.RecordBatch:
    """A scratch-schema batch (selected rows with rewards) as a batch of a rank file
    (``schema``: :func:`train_schema`)."""
    arrays = [batch.column(name) for name in CARRIED_COLUMNS]
    arrays += [
        batch.column("reward"),
        pa.repeat(pa.scalar(1.0, pa.float32()), batch.num_rows),
        batch.column("on_policy"),
    ]
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def deal(ranks: Ranks, batch: pa.RecordBatch, rows: npt.NDArray[np.int64] | None = None) -> None:
    """Deal ``rows`` of a scratch-schema batch (None: all) to the rank files."""
    strata = batch.column("stratum").to_numpy()
    tokens = element_type(batch.schema.field("completion_ids"))
    lengths = packed_lengths(batch.column("completion_ids"), tokens)
    ranks.deal(train_batch(batch, ranks.schema), strata, lengths, rows)
