"""What :meth:`S3Store.open_input <rtrl.core.store.s3.S3Store.open_input>` returns: a
seekable reader of one S3 object whose reads become ranged GETs, so a Parquet reader fetches
a footer and the column chunks it needs rather than the whole object."""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

__all__ = ["Fetch", "RangeReader", "S3InputFile"]

# (Range header, ETag to pin or None) -> the bytes of that range.
Fetch = Callable[[str, str | None], bytes]


class RangeReader(io.RawIOBase):
    """A seekable raw reader of one object: each read is one ranged GET, made by ``fetch``
    (the store's, with its retries) with the object's ETag."""

    def __init__(self, fetch: Fetch, name: str, *, size: int, etag: str | None) -> None:
        super().__init__()
        self._fetch = fetch
        self._size = size
        self._etag = etag
        self._pos = 0
        self.name = name
        self.mode = "rb"

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def size(self) -> int:
        return self._size

    def tell(self) -> int:
        self._checkClosed()
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self._checkClosed()
        if whence == io.SEEK_SET:
            pos = offset
        elif whence == io.SEEK_CUR:
            pos = self._pos + offset
        elif whence == io.SEEK_END:
            pos = self._size + offset
        else:
            raise ValueError(f"invalid whence {whence}")
        if pos < 0:
            raise OSError(f"negative seek position {pos}")
        self._pos = pos
        return pos

    def _read_range(self, length: int) -> bytes:
        length = min(length, self._size - self._pos)
        if length <= 0:
            # No request: a Range past the end (or on an empty object) is a 416 on S3.
            return b""
        end = self._pos + length - 1
        data = self._fetch(f"bytes={self._pos}-{end}", self._etag)
        self._pos += len(data)
        return data

    def readinto(self, buffer: WriteableBuffer) -> int:
        self._checkClosed()
        view = memoryview(buffer).cast("B")
        data = self._read_range(len(view))
        view[: len(data)] = data
        return len(data)

    def readall(self) -> bytes:
        # The default reads in 8 KiB chunks, one request each; fetch the rest at once.
        self._checkClosed()
        return self._read_range(self._size - self._pos)


class S3InputFile(io.BufferedReader):
    """What :meth:`S3Store.open_input` returns: a buffered, seekable binary reader whose
    reads become ranged GETs, plus :meth:`size`. Works as ``pyarrow.parquet.ParquetFile(f)``
    input."""

    raw: RangeReader

    def __init__(self, raw: RangeReader, buffer_size: int = io.DEFAULT_BUFFER_SIZE) -> None:
        super().__init__(raw, buffer_size)

    def size(self) -> int:
        return self.raw.size()
