"""Writing the stage step's output: the rank files of the training set, their advantages,
and the commit into the output store.

The training set is written while the shards are read (:mod:`rtrl_trainer.stage`), before
the advantages can be known: they need the baselines and the standard deviation of the
whole set. So each rank file is written with its ``advantage`` column stored PLAIN and
uncompressed, holding the row's reward as a placeholder, and every row's (reward, stratum)
is spilled to a small side file (8 bytes a row, on local disk, not in memory). Once the
set is complete the advantages are computed and written over the placeholders in place:
a few kilobytes per row group, the rest of the file is never touched again. Before
overwriting, the bytes found there must equal the spilled rewards, so a change in how
pyarrow lays out the column fails loudly instead of corrupting the set.

Files are staged where the commit will want them. A ``file://`` output store gets them in
place, under temp names that its listings hide (the store's own convention for writes in
progress), and the commit renames them: the set is written to disk once, never copied.
Any other store gets them in the local work directory, uploaded by the commit.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import queue
import secrets
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.parquet as pq

from rtrl.store import MANIFEST_NAME, ObjectStore, StoreError
from rtrl.store.base import check_key
from rtrl.store.local import FILE_MODE, TEMP_PREFIX, LocalStore
from rtrl_trainer.reward import RunningStats, advantages

TRAIN_DIR = "train"
HELDOUT_DIR = "heldout"
ADVANTAGE = "advantage"

# Rank files get row groups of about this many rows; with many ranks, smaller ones, so the
# rows waiting per rank stay within PENDING_BYTES in total. A row group's advantage column
# (4 bytes a row) then fits one data page, whose values end the column chunk.
ROW_GROUP_ROWS = 16_384
PENDING_BYTES = 256 << 20
MAX_ROWS_PER_PAGE = 1 << 20
# Token ids are high-entropy: only the string columns repeat enough for a dictionary to pay
# for itself. Column statistics and page checksums cost a fifth of the encoding time and
# serve no reader: the trainer reads whole files, and the manifest's sha256 of each file
# covers corruption.
STRING_COLUMNS = ["checkpoint_id", "org"]
SPLIT_COLUMNS = ("prompt_ids", "completion_ids")
UNCOMPRESSED_COLUMNS = ("completion_logprobs",)
# One row's spilled (reward, stratum), in file order.
_SIDE = np.dtype([("reward", "<f4"), ("stratum", "<i4")])
_HASH_CHUNK = 4 << 20


def rank_name(rank: int, ranks: int) -> str:
    return f"{TRAIN_DIR}/rank-{rank:05d}-of-{ranks:05d}.parquet"


class Worker:
    """A background thread running submitted calls in order, a couple at most queued (so
    memory stays bounded); the first error is re-raised in the submitting thread.

    Parquet encoding and file writes release the GIL, so a worker overlaps them with the
    main thread's reading and arithmetic, and several workers use several cores.
    """

    def __init__(self, name: str, depth: int = 2) -> None:
        self._queue: queue.Queue[tuple[Callable[..., object], tuple[Any, ...]] | None] = (
            queue.Queue(maxsize=depth)
        )
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        if exc_type is None:
            self.close()
            return
        # Already failing: stop the thread, but let the original error propagate.
        with contextlib.suppress(BaseException):
            self.close()

    def submit(self, function: Callable[..., object], *args: Any) -> None:
        if self._error is not None:
            raise self._error
        self._queue.put((function, args))

    def close(self) -> None:
        """Wait for everything submitted; re-raise the first error."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            if self._error is None:  # after an error, drain without running
                function, args = item
                try:
                    function(*args)
                except BaseException as exc:
                    self._error = exc


def _leaf_path(field: pa.Field) -> str:
    name = str(field.name)
    return f"{name}.list.element" if pa.types.is_list(field.type) else name


def parquet_writer(path: Path, schema: pa.Schema, **options: Any) -> pq.ParquetWriter:
    """A writer of the step's Parquet files, with the encodings chosen per column for speed
    (one CPU encodes a whole rank file; measured on 1M interactions):

    - token id lists: BYTE_STREAM_SPLIT, then zstd. The ids' high bytes are mostly zero;
      split into streams of equal significance they compress to a quarter less than PLAIN
      does, in a quarter less time. The step's own files pack their token ids
      (:mod:`rtrl_trainer.packed`): binary, which the split does not apply to, so zstd
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
    """A rank file's writer (:func:`parquet_writer`), the advantage column PLAIN and
    uncompressed, so it can be patched in place."""
    return parquet_writer(
        path,
        schema,
        compression={ADVANTAGE: "none"},
        column_encoding={ADVANTAGE: "PLAIN"},
        # A row group is under 2 * ROW_GROUP_ROWS rows: its advantage chunk (4 bytes a
        # row) stays within one page of the default size, given no row limit per page.
        max_rows_per_page=MAX_ROWS_PER_PAGE,
    )


class RankFile:
    """One rank's Parquet file, written in row groups by a worker as its rows accumulate,
    with the advantage column holding each row's reward until :meth:`patch`."""

    def __init__(
        self, path: Path, side: Path, schema: pa.Schema, flush_bytes: int, worker: Worker
    ) -> None:
        self.path = path
        self.side_path = side
        self.flush_bytes = flush_bytes
        self.worker = worker
        self.schema = schema
        self.side: BinaryIO = side.open("wb")
        self.writer = train_writer(path, schema)
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

    def close(self) -> None:
        """Queue the last rows and the footer (the worker's close waits for them)."""
        self.flush()
        self.worker.submit(self._close)

    def _close(self) -> None:
        self.writer.close()
        self.side.close()

    def abort(self) -> None:
        """Release the file handles after a failure (the files are discarded)."""
        with contextlib.suppress(Exception):
            self.writer.close()
        self.side.close()

    def patch(self, baselines: npt.NDArray[np.float64], std: float) -> RunningStats:
        """Write every row's advantage over its placeholder; the advantages' statistics."""
        stats = RunningStats()
        metadata = pq.read_metadata(self.path)
        column = next(
            j for j in range(metadata.num_columns) if metadata.schema.column(j).path == ADVANTAGE
        )
        with self.path.open("r+b") as file, self.side_path.open("rb") as side:
            fd = file.fileno()
            for index in range(metadata.num_row_groups):
                chunk = metadata.row_group(index).column(column)
                n = chunk.num_values
                rows = np.fromfile(side, dtype=_SIDE, count=n)
                rewards = np.ascontiguousarray(rows["reward"])
                # The chunk is one PLAIN page without nulls: its last 4n bytes are the values.
                offset = chunk.data_page_offset + chunk.total_compressed_size - 4 * n
                if (
                    len(rows) != n
                    or chunk.compression != "UNCOMPRESSED"
                    or os.pread(fd, 4 * n, offset) != rewards.tobytes()
                ):
                    raise RuntimeError(
                        f"{self.path.name}: row group {index}: the advantage column is not "
                        "laid out as written (PLAIN, uncompressed, one page)"
                    )
                values = advantages(rewards, rows["stratum"], baselines, std)
                stats.update(values)
                os.pwrite(fd, values.astype("<f4", copy=False).tobytes(), offset)
        self.side_path.unlink()
        return stats


class Ranks:
    """The rank files of the training set; rows are dealt round-robin by their position in
    the set (deterministic and balanced). A context manager: leaving it waits for the
    workers, after which every file is complete (or the error propagates)."""

    def __init__(self, ranks: int, paths: list[Path], side_dir: Path, schema: pa.Schema) -> None:
        self.ranks = ranks
        self.schema = schema
        self._stack = contextlib.ExitStack()
        workers = [
            self._stack.enter_context(Worker(f"stage-rank-{w}"))
            for w in range(min(ranks, os.cpu_count() or 1))
        ]
        self.files = [
            RankFile(
                paths[r],
                side_dir / f"rank-{r:05d}.side",
                schema,
                max(1 << 20, PENDING_BYTES // ranks),
                workers[r % len(workers)],
            )
            for r in range(ranks)
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

    def patch(
        self, baselines: npt.NDArray[np.float64], std: float
    ) -> tuple[list[dict[str, Any]], RunningStats]:
        """Write the advantages into every file (a thread per CPU: pread/pwrite and numpy
        release the GIL); the per-rank summary and the statistics of the advantages."""
        with ThreadPoolExecutor(max_workers=min(self.ranks, os.cpu_count() or 1)) as pool:
            parts = list(pool.map(lambda f: f.patch(baselines, std), self.files))
        stats = RunningStats()
        for part in parts:
            stats.merge(part)
        summary = [
            {"rank": r, "file": rank_name(r, self.ranks), "rows": f.rows, "tokens": f.tokens}
            for r, f in enumerate(self.files)
        ]
        return summary, stats


# --- staging and commit --------------------------------------------------------------------


class Staging:
    """Local paths for the files the step commits: in place in a ``file://`` output store
    (temp names its listings hide; the commit renames them), else in ``work``.

    A context manager: leaving it removes every staged file the commit did not take.
    """

    def __init__(self, out: ObjectStore, work: Path) -> None:
        self.out = out
        self.work = work
        self.in_place = isinstance(out, LocalStore)
        self.paths: dict[str, Path] = {}

    def __enter__(self) -> Staging:
        return self

    def __exit__(self, *exc: object) -> None:
        self.discard(list(self.paths))

    def path(self, key: str) -> Path:
        """Where to write the object ``key``."""
        check_key(key)
        if isinstance(self.out, LocalStore):
            target = self.out.root.joinpath(*key.split("/"))
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise StoreError(f"cannot write {self.out.url(key)}: {exc.strerror}") from exc
            path = target.parent / f"{TEMP_PREFIX}{target.name}-{secrets.token_hex(6)}"
        else:
            path = self.work / key.replace("/", "--")
        self.paths[key] = path
        return path

    def discard(self, keys: list[str]) -> None:
        for key in keys:
            path = self.paths.pop(key, None)
            if path is None:
                continue
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)
                if self.in_place and "/" in key:
                    path.parent.rmdir()  # a directory this run created, if now empty

    def commit(self, keys: list[str], metadata: dict[str, Any]) -> None:
        """Commit the staged ``keys`` at the root of the output store, removing rank and
        held-out files of an earlier run that this one does not write (e.g. another
        ``--ranks``): the old manifest goes first, so at no moment does a manifest vouch
        for a mix of old and new files. Other staged files are discarded."""
        files = {key: self.paths[key] for key in keys}
        self.discard([key for key in self.paths if key not in files])
        out = self.out
        if not isinstance(out, LocalStore):
            _remove_stale(out, files)
            out.commit("", files, metadata)
            return
        # In place: make the files durable and hash them (all at once: fsync waits on the
        # disk, sha256 runs on the CPUs, both without the GIL), then rename them into place.
        try:
            entries = _finalise(files)
        except OSError as exc:
            raise StoreError(f"cannot write {out.uri}: {exc.strerror or exc}") from exc
        _remove_stale(out, files)
        for key, path in sorted(files.items()):
            try:
                os.replace(path, out.root.joinpath(*key.split("/")))
            except OSError as exc:
                raise StoreError(f"cannot write {out.url(key)}: {exc.strerror}") from exc
            del self.paths[key]
        out.write_manifest("", entries, metadata)


def _remove_stale(store: ObjectStore, files: dict[str, Path]) -> None:
    store.delete(MANIFEST_NAME)
    for directory in (TRAIN_DIR, HELDOUT_DIR):
        for info in list(store.list(f"{directory}/")):
            if info.key not in files:
                store.delete(info.key)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(_HASH_CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync(path: Path) -> None:
    with path.open("rb") as handle:
        os.fsync(handle.fileno())
    path.chmod(FILE_MODE)


def _finalise(files: dict[str, Path]) -> dict[str, dict[str, Any]]:
    """Manifest entries (size, sha256) of ``files``, each fsynced and made world-readable."""
    items = sorted(files.items())
    with ThreadPoolExecutor(max_workers=min(8, 2 * len(items)) or 1) as pool:
        syncs = [pool.submit(_fsync, path) for _, path in items]
        hashes = [pool.submit(_sha256, path) for _, path in items]
        for sync in syncs:
            sync.result()
        return {
            key: {"size": path.stat().st_size, "sha256": digest.result()}
            for (key, path), digest in zip(items, hashes, strict=True)
        }
