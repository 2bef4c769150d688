"""The ``file://`` object store: a directory tree that behaves like a bucket.

It exists so the demo, local runs and the tests use the very code path the cluster uses on
S3, with the same guarantees: a reader sees an old object, a new one or nothing (every write
goes to a temp file in the target directory and is renamed over the key), keys never escape
the root, and listings come back sorted the way S3 sorts them.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from rtrl.core.store.base import ObjectInfo, ObjectNotFound, ObjectStore, StoreError, check_key

# Temp files live next to their target (so the rename is atomic) and start with this prefix
# so that list() can hide writes in progress and crashed writers' leftovers.
TEMP_PREFIX = ".tmp-"
FILE_MODE = 0o644
_COPY_CHUNK = 1 << 20


class LocalStore(ObjectStore):
    """An object store rooted at a local directory (``file:///abs/path/``)."""

    def __init__(self, root: Path) -> None:
        root = Path(root)
        if not root.is_absolute():
            raise ValueError(f"local store root {str(root)!r} must be an absolute path")
        self.root = root
        self.uri = root.as_uri().rstrip("/") + "/"

    def __repr__(self) -> str:
        return f"LocalStore({str(self.root)!r})"

    def _path(self, key: str) -> Path:
        check_key(key)
        return self.root.joinpath(*key.split("/"))

    def _write(self, key: str, source: IO[bytes]) -> None:
        target = self._path(key)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot write {self.url(key)}: {exc.strerror}") from exc
        _replace_from(source, target, error_uri=self.url(key))

    def put_bytes(self, key: str, data: bytes) -> None:
        # BytesIO shares the bytes object until written to, so this does not copy ``data``.
        self._write(key, io.BytesIO(data))

    def put_file(self, key: str, path: Path) -> None:
        with Path(path).open("rb") as source:
            self._write(key, source)

    def get_bytes(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError) as exc:
            raise ObjectNotFound(f"{self.url(key)}: no such object") from exc
        except OSError as exc:
            raise StoreError(f"cannot read {self.url(key)}: {exc.strerror}") from exc

    def get_file(self, key: str, path: Path) -> None:
        path = Path(path)
        with self.open_input(key) as source:
            path.parent.mkdir(parents=True, exist_ok=True)
            _replace_from(source, path, error_uri=self.url(key))

    def open_input(self, key: str) -> io.BufferedReader:
        try:
            path = self._path(key)
            if path.is_dir():
                raise IsADirectoryError(str(path))
            return path.open("rb")
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError) as exc:
            raise ObjectNotFound(f"{self.url(key)}: no such object") from exc
        except OSError as exc:
            raise StoreError(f"cannot read {self.url(key)}: {exc.strerror}") from exc

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        # A prefix is a string prefix, as on S3 ("ckpt/1" matches "ckpt/10/x"): walk the
        # deepest directory the prefix names completely and filter by the rest.
        if prefix:
            check_key(prefix.removesuffix("/"))
        directory, _, _ = prefix.rpartition("/")
        start = self.root.joinpath(*directory.split("/")) if directory else self.root
        base = f"{directory}/" if directory else ""
        for info in _walk_sorted(start, base):
            if info.key.startswith(prefix):
                yield info

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            path.unlink(missing_ok=True)
        except (NotADirectoryError, IsADirectoryError):
            # A "directory" is not an object; like S3, deleting a non-object is a no-op.
            return
        except OSError as exc:
            raise StoreError(f"cannot delete {self.url(key)}: {exc.strerror}") from exc


def _replace_from(source: IO[bytes], target: Path, *, error_uri: str) -> None:
    """Copy ``source`` into a temp file next to ``target``, then rename it over ``target``."""
    try:
        fd, tmp_name = tempfile.mkstemp(prefix=TEMP_PREFIX, dir=target.parent)
    except OSError as exc:
        raise StoreError(f"cannot write {error_uri}: {exc.strerror}") from exc
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as handle:
            shutil.copyfileobj(source, handle, _COPY_CHUNK)
            handle.flush()
            # The rename is only atomic across a crash when the data is on disk first.
            os.fsync(handle.fileno())
        # mkstemp creates 0600; artifacts are read by other users (vLLM, the trainer).
        tmp.chmod(FILE_MODE)
        os.replace(tmp, target)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(exc, OSError):
            raise StoreError(f"cannot write {error_uri}: {exc.strerror or exc}") from exc
        raise


def _walk_sorted(directory: Path, base: str) -> Iterator[ObjectInfo]:
    """Files under ``directory`` in S3 key order, lazily.

    Sorting each directory's entries by name, with ``/`` appended to subdirectories, yields
    the global byte order of the full keys ("a-b" < "a/x" because "-" < "/").
    """
    try:
        with os.scandir(directory) as scan:
            entries = [
                (entry.name + "/" if entry.is_dir() else entry.name, entry)
                for entry in scan
                if not entry.name.startswith(TEMP_PREFIX)
            ]
    except (FileNotFoundError, NotADirectoryError):
        return
    except OSError as exc:
        raise StoreError(f"cannot list {directory.as_uri()}: {exc.strerror}") from exc
    for name, entry in sorted(entries, key=lambda item: item[0]):
        if name.endswith("/"):
            yield from _walk_sorted(Path(entry.path), base + name)
        elif entry.is_file():
            yield ObjectInfo(key=base + name, size=entry.stat().st_size)
