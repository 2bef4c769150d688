"""The ``s3://`` object store over boto3, for AWS and any S3-compatible endpoint.

The cluster keeps every artifact here, so this module is where flaky networks and busy
endpoints are absorbed: botocore's own retry modes handle throttling, 5xx and connection
errors with backoff; s3transfer does multipart uploads and ranged downloads of large files;
and :meth:`S3Store.open_input` reads byte ranges on demand so Parquet readers fetch a
footer and the columns they need rather than whole objects.

Credentials are never an argument. In a step pod with ``storage.credentialsSecret`` they are
files, in the directory ``RTRL_STORAGE_CREDENTIALS_DIR`` names (the Secret's volume), read
each time a store is built and handed to boto3; they are never put in the environment, which
every child process inherits (the eval step runs model-written code). Without that variable,
boto3's default chain finds them (the pod's cloud role, or the environment, as the operator's
own Deployment has them). No error message carries them.
"""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NoReturn

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    IncompleteReadError,
    NoCredentialsError,
    ReadTimeoutError,
    ResponseStreamingError,
)

from rtrl.core.store.base import (
    ObjectInfo,
    ObjectNotFound,
    ObjectStore,
    StoreError,
    check_key,
    check_prefix,
)
from rtrl.core.store.credentials import (
    CREDENTIALS_DIR_ENV,
    file_credentials,
)
from rtrl.core.store.local import TEMP_PREFIX

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer
    from mypy_boto3_s3 import S3Client

MiB = 1 << 20

# Error codes S3 (and compatibles) use for an absent key; HEAD has no body, so only "404".
_NOT_FOUND_CODES = frozenset({"NoSuchKey", "404", "NotFound"})
# botocore retries a request until its response headers arrive; a body that breaks off
# while being read is outside its retry loop, so reads of a body are retried here (the
# same errors s3transfer retries for downloads).
_STREAM_ERRORS = (IncompleteReadError, ReadTimeoutError, ResponseStreamingError, ConnectionError)
_STREAM_ATTEMPTS = 3


def resolve_endpoint_url(endpoint_url: str | None = None) -> str | None:
    """The explicit endpoint, else the standard ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``
    environment variables, else None (AWS itself)."""
    return (
        endpoint_url
        or os.environ.get("AWS_ENDPOINT_URL_S3")
        or os.environ.get("AWS_ENDPOINT_URL")
        or None
    )


class S3Store(ObjectStore):
    """An object store rooted at ``s3://bucket/prefix/``.

    ``endpoint_url`` defaults to ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL`` (unset: AWS);
    a custom endpoint switches to path-style addressing. ``max_attempts`` is the total number
    of tries per request under botocore's ``retry_mode`` (throttling, 5xx and connection
    errors back off exponentially with jitter). Files above ``multipart_threshold`` go up
    in ``multipart_chunksize`` parts (S3's minimum is 5 MiB). ``page_size`` is ListObjectsV2's
    MaxKeys. ``read_buffer_size`` is the smallest range :meth:`open_input` fetches: small
    reads (Parquet page headers) share one request, large ones (column chunks) go direct.

    ``client`` replaces the client this store would build (tests, or sharing one client);
    the endpoint, region, retry and timeout arguments then do not apply to it. A store built
    without one reads :func:`file_credentials` when ``RTRL_STORAGE_CREDENTIALS_DIR`` is set
    (StoreError if they cannot be read), boto3's default chain otherwise.
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        client: S3Client | None = None,
        multipart_threshold: int = 64 * MiB,
        multipart_chunksize: int = 16 * MiB,
        max_concurrency: int = 8,
        retry_mode: Literal["standard", "adaptive"] = "standard",
        max_attempts: int = 8,
        connect_timeout: float = 10.0,
        read_timeout: float = 60.0,
        page_size: int = 1000,
        read_buffer_size: int = 256 * 1024,
    ) -> None:
        if not bucket or "/" in bucket:
            raise ValueError(f"invalid S3 bucket name {bucket!r}")
        self.bucket = bucket
        self.prefix = check_prefix(prefix.strip("/"))
        self._root = f"{self.prefix}/" if self.prefix else ""
        self.uri = f"s3://{bucket}/{self._root}"
        self.endpoint_url = resolve_endpoint_url(endpoint_url)
        self.page_size = page_size
        self.read_buffer_size = read_buffer_size
        if client is None:
            custom = self.endpoint_url is not None
            config = Config(
                region_name=region,
                # total_max_attempts counts the first try; botocore's "max_attempts" does not.
                retries={"mode": retry_mode, "total_max_attempts": max_attempts},
                connect_timeout=connect_timeout,
                read_timeout=read_timeout,
                # s3transfer runs max_concurrency requests at once; a smaller pool would
                # make them queue for connections and log "pool is full" warnings.
                max_pool_connections=max(10, max_concurrency),
                tcp_keepalive=True,
                # Self-hosted S3 (MinIO, Ceph, GCS interop) serves buckets by path, not by
                # virtual host; and many do not understand the flexible checksums newer
                # botocore sends by default, so there only send them when S3 requires it.
                s3={"addressing_style": "path"} if custom else None,
                request_checksum_calculation="when_required" if custom else None,
                response_checksum_validation="when_required" if custom else None,
            )
            # Given explicitly, file credentials win over anything in the environment.
            creds = file_credentials()
            # A session per store: sessions are not thread-safe, the client built from one is.
            session = (
                boto3.session.Session()
                if creds is None
                else boto3.session.Session(
                    aws_access_key_id=creds.access_key_id,
                    aws_secret_access_key=creds.secret_access_key,
                    aws_session_token=creds.session_token,
                )
            )
            client = session.client(
                "s3", endpoint_url=self.endpoint_url, region_name=region, config=config
            )
        self._client = client
        self._transfer = TransferConfig(
            multipart_threshold=multipart_threshold,
            multipart_chunksize=multipart_chunksize,
            max_concurrency=max_concurrency,
        )

    def __repr__(self) -> str:
        endpoint = f", endpoint_url={self.endpoint_url!r}" if self.endpoint_url else ""
        return f"S3Store({self.bucket!r}, {self.prefix!r}{endpoint})"

    @property
    def client(self) -> S3Client:
        return self._client

    def _key(self, key: str) -> str:
        return self._root + check_key(key)

    # --- errors ----------------------------------------------------------------------------

    def _raise(self, exc: Exception, action: str, key: str) -> NoReturn:
        """Re-raise a boto error as StoreError naming the URI; never the request itself,
        which carries the signature and security token in its headers."""
        uri = self.url(key) if key else self.uri
        client_error = _find_client_error(exc)
        if client_error is not None:
            error = client_error.response.get("Error", {})
            meta = client_error.response.get("ResponseMetadata", {})
            code = str(error.get("Code") or "Unknown")
            status = meta.get("HTTPStatusCode", "?")
            if code in _NOT_FOUND_CODES:
                raise ObjectNotFound(f"{uri}: no such object") from exc
            detail = str(error.get("Message") or "").strip()
            retries = meta.get("RetryAttempts")
            message = f"{action} {uri} failed: {code} (HTTP {status})"
            if detail:
                message += f": {detail[:200]}"
            if retries:
                message += f" (after {retries} {'retry' if retries == 1 else 'retries'})"
            if code in ("403", "AccessDenied") and action == "head":
                message += " (S3 answers 403 for a missing key without s3:ListBucket)"
            raise StoreError(message) from exc
        if isinstance(exc, NoCredentialsError):
            raise StoreError(
                f"{action} {uri} failed: no AWS credentials found (the files of "
                f"${CREDENTIALS_DIR_ENV}, environment variables, shared config, or the pod's "
                "service-account role)"
            ) from exc
        raise StoreError(f"{action} {uri} failed: {type(exc).__name__}: {exc}") from exc

    @contextlib.contextmanager
    def _errors(self, action: str, key: str) -> Iterator[None]:
        try:
            yield
        except (ClientError, BotoCoreError) as exc:
            self._raise(exc, action, key)
        except Exception as exc:
            # boto3's upload wrapper (S3UploadFailedError) keeps the ClientError as context.
            if _find_client_error(exc) is None:
                raise
            self._raise(exc, action, key)

    def _fetch(self, key: str, *, byte_range: str | None = None, etag: str | None = None) -> bytes:
        extra: dict[str, Any] = {}
        if byte_range is not None:
            extra["Range"] = byte_range
        if etag is not None:
            # Pin the version opened: an overwrite between two range reads fails loudly
            # (412) instead of splicing bytes of two objects together.
            extra["IfMatch"] = etag
        for attempt in range(1, _STREAM_ATTEMPTS + 1):
            with self._errors("get", key):
                response = self._client.get_object(Bucket=self.bucket, Key=self._key(key), **extra)
                body = response["Body"]
                try:
                    return body.read()
                except _STREAM_ERRORS as exc:
                    if attempt == _STREAM_ATTEMPTS:
                        raise StoreError(
                            f"get {self.url(key)} failed: the response body broke off "
                            f"{_STREAM_ATTEMPTS} times ({type(exc).__name__})"
                        ) from exc
                finally:
                    body.close()
        raise AssertionError("unreachable")

    # --- the interface ---------------------------------------------------------------------

    def put_bytes(self, key: str, data: bytes) -> None:
        with self._errors("put", key):
            self._client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)

    def put_file(self, key: str, path: Path) -> None:
        # A single PUT below the threshold, a multipart upload above it; either way the
        # object appears only when complete. s3transfer aborts a failed multipart upload;
        # parts of a killed process linger until the bucket's AbortIncompleteMultipartUpload
        # lifecycle rule removes them.
        with self._errors("put", key):
            self._client.upload_file(str(path), self.bucket, self._key(key), Config=self._transfer)

    def get_bytes(self, key: str) -> bytes:
        return self._fetch(key)

    def get_file(self, key: str, path: Path) -> None:
        path = Path(path)
        s3_key = self._key(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        # Our own temp file (s3transfer renames its own onto it) so that the file has its
        # final mode before it appears under its name.
        fd, tmp_name = tempfile.mkstemp(prefix=TEMP_PREFIX, dir=path.parent)
        os.close(fd)
        tmp = Path(tmp_name)
        try:
            with self._errors("get", key):
                self._client.download_file(self.bucket, s3_key, tmp_name, Config=self._transfer)
            tmp.chmod(0o644)
            os.replace(tmp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()

    def open_input(self, key: str) -> S3InputFile:
        with self._errors("head", key):
            head = self._client.head_object(Bucket=self.bucket, Key=self._key(key))
        raw = _RangeReader(self, key, size=int(head["ContentLength"]), etag=head.get("ETag"))
        return S3InputFile(raw, buffer_size=self.read_buffer_size)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        check_prefix(prefix)
        paginator = self._client.get_paginator("list_objects_v2")
        pages = paginator.paginate(
            Bucket=self.bucket,
            Prefix=self._root + prefix,
            PaginationConfig={"PageSize": self.page_size},
        )
        with self._errors("list", prefix):
            for page in pages:
                for obj in page.get("Contents", []):
                    key = obj["Key"][len(self._root) :]
                    # Zero-byte "folder" markers made by consoles are not objects here.
                    if key and not key.endswith("/"):
                        yield ObjectInfo(key=key, size=int(obj["Size"]))

    def exists(self, key: str) -> bool:
        try:
            with self._errors("head", key):
                self._client.head_object(Bucket=self.bucket, Key=self._key(key))
        except ObjectNotFound:
            return False
        return True

    def delete(self, key: str) -> None:
        # S3 answers 204 for an absent key too, so no special case is needed.
        with self._errors("delete", key):
            self._client.delete_object(Bucket=self.bucket, Key=self._key(key))


class _RangeReader(io.RawIOBase):
    """A seekable raw reader of one S3 object: each read is one ranged GET."""

    def __init__(self, store: S3Store, key: str, *, size: int, etag: str | None) -> None:
        super().__init__()
        self._store = store
        self._key = key
        self._size = size
        self._etag = etag
        self._pos = 0
        self.name = store.url(key)
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
        data = self._store._fetch(self._key, byte_range=f"bytes={self._pos}-{end}", etag=self._etag)
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

    raw: _RangeReader

    def __init__(self, raw: _RangeReader, buffer_size: int = io.DEFAULT_BUFFER_SIZE) -> None:
        super().__init__(raw, buffer_size)

    def size(self) -> int:
        return self.raw.size()


def _find_client_error(exc: BaseException) -> ClientError | None:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, ClientError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None
