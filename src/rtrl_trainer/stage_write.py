"""Writing the stage step's output: the rank files of the training set, their advantage
files, and the commit into the output store.

The training set is written while the shards are read (:mod:`rtrl_trainer.stage`), before
the advantages can be known: they need the baselines and the standard deviation of the
whole set. So each rank is two files: the rank file, with every column of the set but the
advantage, written in row groups as the rows come and final once written; and its
advantage file (:func:`advantage_name`, one ``advantage`` column in the same row order,
4 bytes a row), written once the set is complete from the (reward, stratum) of each row,
spilled meanwhile to a small side file on local disk (8 bytes a row, not in memory).

Because a rank file's bytes never change once written, its sha256 for the manifest is
computed while it is written (:class:`GrowingFileDigest`, a few row groups behind the
encoder), and its pages are flushed to disk as it grows: the commit has nothing left to
hash or sync but the small files. (Writing the advantages into the rank file itself, over
placeholders, left a serial sha256 of the whole file and its fsync after the last row,
~0.55 s of 4.1 s per million interactions on two CPUs.)

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

from rtrl.core.store import MANIFEST_NAME, ObjectStore, StoreError
from rtrl.core.store.base import check_key
from rtrl.core.store.local import FILE_MODE, TEMP_PREFIX, LocalStore
from rtrl_trainer.reward import RunningStats, advantages

TRAIN_DIR = "train"
HELDOUT_DIR = "heldout"
ADVANTAGE = "advantage"
ADVANTAGE_SCHEMA = pa.schema([pa.field(ADVANTAGE, pa.float32(), nullable=False)])
ADVANTAGE_SUFFIX = ".advantage.parquet"

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
STRING_COLUMNS = ["checkpoint_id", "org"]
SPLIT_COLUMNS = ("prompt_ids", "completion_ids")
UNCOMPRESSED_COLUMNS = ("completion_logprobs",)
# One row's spilled (reward, stratum), in file order.
_SIDE = np.dtype([("reward", "<f4"), ("stratum", "<i4")])
_HASH_CHUNK = 4 << 20
# A growing file's digest reads back through a buffer of its own, one per rank file: small,
# so that many ranks do not add up (sha256 runs as fast on 1 MiB blocks).
_DIGEST_BUFFER = 1 << 20


def rank_name(rank: int, ranks: int) -> str:
    return f"{TRAIN_DIR}/rank-{rank:05d}-of-{ranks:05d}.parquet"


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


class GrowingFileDigest:
    """The size and sha256 of a file that its writer only appends to, computed while it is
    written: after each :meth:`poke` (the writer appended something) a thread of its own
    hashes what was appended since (read back from the page cache) and, with ``sync``,
    flushes it to disk, so that neither is left for after the last byte. On that thread,
    hashing and waiting for the disk never hold up the writer (which would let the rows
    waiting for it pile up in memory); both release the GIL."""

    def __init__(self, path: Path, *, sync: bool) -> None:
        self.sync = sync
        self._fd = os.open(path, os.O_RDONLY)
        self._digest = hashlib.sha256()
        self._done = 0
        self._buffer = memoryview(bytearray(_DIGEST_BUFFER))  # reused: no allocation per read
        self._wanted = threading.Event()
        self._stop = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"digest-{path.name}", daemon=True)
        self._thread.start()

    def poke(self) -> None:
        """The writer appended to the file: hash (and sync) it, soon."""
        self._wanted.set()

    def finish(self) -> dict[str, Any]:
        """The manifest entry (size, sha256) of the complete file, made durable; call once
        the writer has closed the file."""
        self._join()
        if self._error is not None:
            raise self._error
        self._catch_up()
        if self.sync:
            os.fsync(self._fd)
        self.close()
        return {"size": self._done, "sha256": self._digest.hexdigest()}

    def close(self) -> None:
        self._join()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _join(self) -> None:
        self._stop = True
        self._wanted.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            self._wanted.wait()
            self._wanted.clear()
            if self._stop:
                return
            try:
                self._catch_up()
            except BaseException as exc:  # re-raised by finish
                self._error = exc
                return

    def _catch_up(self) -> None:
        size = os.fstat(self._fd).st_size
        if size < self._done:
            raise OSError(f"file shrank while written ({size} bytes, {self._done} hashed)")
        while self._done < size:
            want = min(_DIGEST_BUFFER, size - self._done)
            got = os.preadv(self._fd, [self._buffer[:want]], self._done)
            if got <= 0:
                raise OSError(f"file shrank while written ({self._done} of {size} bytes)")
            self._digest.update(self._buffer[:got])
            self._done += got
        if self.sync:
            os.fdatasync(self._fd)


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
    """A rank file's writer (:func:`parquet_writer`)."""
    return parquet_writer(path, schema)


class RankFile:
    """One rank's Parquet file, written in row groups by a worker as its rows accumulate
    (hashed, and with ``sync`` flushed to disk, as it grows), and its advantage file,
    written by :meth:`write_advantages` once the set is complete."""

    def __init__(
        self,
        path: Path,
        *,
        advantage_path: Path,
        side: Path,
        schema: pa.Schema,
        flush_bytes: int,
        worker: Worker,
        sync: bool,
    ) -> None:
        self.path = path
        self.advantage_path = advantage_path
        self.side_path = side
        self.flush_bytes = flush_bytes
        self.worker = worker
        self.schema = schema
        self.side: BinaryIO = side.open("wb")
        self.writer = train_writer(path, schema)
        self.digest = GrowingFileDigest(path, sync=sync)
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
        # Flushing pages to disk as the files grow pays only where they stay (in place).
        self.files = [
            RankFile(
                staging.path(name),
                advantage_path=staging.path(advantage_name(name)),
                side=side_dir / f"rank-{r:05d}.side",
                schema=schema,
                flush_bytes=max(1 << 20, PENDING_BYTES // ranks),
                worker=workers[r % len(workers)],
                sync=staging.in_place,
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

    def commit(
        self,
        keys: list[str],
        metadata: dict[str, Any],
        known: dict[str, dict[str, Any]] | None = None,
    ) -> None:
        """Commit the staged ``keys`` at the root of the output store, removing rank and
        held-out files of an earlier run that this one does not write (e.g. another
        ``--ranks``): the old manifest goes first, so at no moment does a manifest vouch
        for a mix of old and new files. Other staged files are discarded. ``known``: the
        manifest entries of files already hashed (and, in place, made durable) while
        written."""
        files = {key: self.paths[key] for key in keys}
        self.discard([key for key in self.paths if key not in files])
        out = self.out
        if not isinstance(out, LocalStore):
            _remove_stale(out, files)
            out.commit("", files, metadata, known)
            return
        # In place: make the files durable and hash them (all at once: fsync waits on the
        # disk, sha256 runs on the CPUs, both without the GIL), then rename them into place.
        done = {key: entry for key, entry in (known or {}).items() if key in files}
        try:
            for key in done:
                files[key].chmod(FILE_MODE)
            entries = {**done, **_finalise({k: p for k, p in files.items() if k not in done})}
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
    if not items:
        return {}
    with ThreadPoolExecutor(max_workers=min(8, 2 * len(items)) or 1) as pool:
        syncs = [pool.submit(_fsync, path) for _, path in items]
        hashes = [pool.submit(_sha256, path) for _, path in items]
        for sync in syncs:
            sync.result()
        return {
            key: {"size": path.stat().st_size, "sha256": digest.result()}
            for (key, path), digest in zip(items, hashes, strict=True)
        }
