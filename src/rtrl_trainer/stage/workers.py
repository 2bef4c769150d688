"""Background threads of the stage step's writers: a worker that runs submitted calls in
order (Parquet encoding and file writes release the GIL, so it overlaps them with the
reading), and the digest of a file computed while it grows.

Because a rank file's bytes never change once written, its sha256 for the manifest is
computed while it is written (:class:`GrowingFileDigest`, a few row groups behind the
encoder), and its pages are flushed to disk as it grows: the commit has nothing left to
hash or sync but the small files. (Writing the advantages into the rank file itself, over
placeholders, left a serial sha256 of the whole file and its fsync after the last row,
~0.55 s of 4.1 s per million interactions on two CPUs.)
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import queue
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

# A growing file's digest reads back through a buffer of its own, one per rank file: small,
# so that many ranks do not add up (sha256 runs as fast on 1 MiB blocks).
_DIGEST_BUFFER = 1 << 20


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
