"""The ``s3://`` object store over boto3, for AWS and any S3-compatible endpoint.

The cluster keeps every artifact here, so this module is where flaky networks and busy
endpoints are absorbed: botocore's own retry modes handle throttling, 5xx and connection
errors with backoff, and the store fetches again a body that breaks off mid-read, both
within the budgets of :mod:`rtrl.core.store.retries`; s3transfer does multipart uploads and
ranged downloads of large files; and :meth:`S3Store.open_input` reads byte ranges on demand
so Parquet readers fetch a footer and the columns they need rather than whole objects.

Credentials are never an argument. In a step pod with ``storage.credentialsSecret`` they are
files, in the directory ``RTRL_STORAGE_CREDENTIALS_DIR`` names (the Secret's volume), read
each time a store is built and handed to boto3; they are never put in the environment, which
every child process inherits (the eval step runs model-written code). Without that variable,
boto3's default chain finds them (the pod's cloud role, or the environment, as the operator's
own Deployment has them). No error message carries them, nor any URL's userinfo or
presigned query (:func:`~rtrl.core.store.base.redact`); an endpoint URL with credentials in
it is refused.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, cast
from urllib.parse import urlsplit

import boto3
import botocore.session
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from rtrl.core.redaction import redact
from rtrl.core.store.base import (
    ObjectInfo,
    ObjectNotFound,
    ObjectStore,
    StoreError,
    check_key,
    check_prefix,
)
from rtrl.core.store.credentials import FileCredentials, file_credentials
from rtrl.core.store.local import TEMP_PREFIX
from rtrl.core.store.retries import (
    BODY_ATTEMPTS_ENV,
    BODY_RETRY_BUDGET_S,
    MAX_ATTEMPTS_ENV,
    RETRY_MODE_ENV,
    RetryMode,
    RetrySettings,
    body_backoff,
    broken_body,
    retry_settings,
)
from rtrl.core.store.s3errors import (
    DOWNLOAD_RETRIES_EXCEEDED,
    find_client_error,
    redacted_already,
    store_error,
)
from rtrl.core.store.s3input import RangeReader, S3InputFile

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

MiB = 1 << 20


def resolve_endpoint_url(endpoint_url: str | None = None) -> str | None:
    """The explicit endpoint, else the standard ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``
    environment variables, else None (AWS itself)."""
    return (
        endpoint_url
        or os.environ.get("AWS_ENDPOINT_URL_S3")
        or os.environ.get("AWS_ENDPOINT_URL")
        or None
    )


def check_endpoint_url(endpoint_url: str) -> str:
    """``endpoint_url`` unchanged, or :class:`StoreError` when it carries credentials
    (``http://KEY:SECRET@host``) or a query or fragment (a presigned URL pasted as the
    endpoint): botocore never signs with them, and a URL is shown in errors, logs and the
    RLCycle itself."""
    parts = urlsplit(endpoint_url)
    if "@" in parts.netloc:
        raise StoreError(
            f"endpoint URL {redact(endpoint_url)} has credentials in it (user:password@); "
            "S3 credentials come from storage.credentialsSecret or the pod's cloud role, "
            "never from the endpoint"
        )
    if parts.query or parts.fragment:
        raise StoreError(
            f"endpoint URL {redact(endpoint_url)} has a query or fragment; an S3 endpoint is "
            "a scheme, a host and a port"
        )
    return endpoint_url


def _botocore_retry_config(session: botocore.session.Session) -> dict[str, object]:
    """``retry_mode`` and ``max_attempts`` as botocore resolves them (the environment, then
    the AWS config file), None where neither sets them; a value botocore cannot convert is
    passed on as written, for :func:`retry_settings` to name."""
    config: dict[str, object] = {}
    for name, env in (("retry_mode", RETRY_MODE_ENV), ("max_attempts", MAX_ATTEMPTS_ENV)):
        try:
            config[name] = session.get_config_variable(name)
        except ValueError:
            config[name] = os.environ.get(env, "?")
    return config


class S3Store(ObjectStore):
    """An object store rooted at ``s3://bucket/prefix/``.

    ``endpoint_url`` defaults to ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL`` (unset: AWS);
    a custom endpoint switches to path-style addressing (and one with credentials in it is a
    :class:`StoreError`). ``retry_mode`` and ``max_attempts`` (tries per request in all,
    under botocore's retry modes: throttling, 5xx and connection errors back off
    exponentially with jitter) and ``body_attempts`` (tries of a body that breaks off)
    default to :func:`~rtrl.core.store.retries.retry_settings`: ``AWS_RETRY_MODE``,
    ``AWS_MAX_ATTEMPTS``, ``RTRL_S3_BODY_ATTEMPTS``, else rtrl's defaults; ``retries`` holds
    what applies. Files above ``multipart_threshold`` go up
    in ``multipart_chunksize`` parts (S3's minimum is 5 MiB). ``page_size`` is ListObjectsV2's
    MaxKeys. ``read_buffer_size`` is the smallest range :meth:`open_input` fetches: small
    reads (Parquet page headers) share one request, large ones (column chunks) go direct.

    ``client`` replaces the client this store would build (tests, or sharing one client);
    the endpoint, region, botocore retry and timeout arguments then do not apply to it
    (``body_attempts`` does). A store built without one uses ``credentials`` when given
    (the operator reading a step's result with the RLCycle's own Secret), else reads
    :func:`file_credentials` when ``RTRL_STORAGE_CREDENTIALS_DIR`` is set (StoreError if
    they cannot be read), boto3's default chain otherwise.
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
        retry_mode: RetryMode | None = None,
        max_attempts: int | None = None,
        body_attempts: int | None = None,
        connect_timeout: float = 10.0,
        read_timeout: float = 60.0,
        page_size: int = 1000,
        read_buffer_size: int = 256 * 1024,
        credentials: FileCredentials | None = None,
    ) -> None:
        if not bucket or "/" in bucket:
            raise ValueError(f"invalid S3 bucket name {bucket!r}")
        self.bucket = bucket
        self.prefix = check_prefix(prefix.strip("/"))
        self._root = f"{self.prefix}/" if self.prefix else ""
        self.uri = f"s3://{bucket}/{self._root}"
        endpoint = resolve_endpoint_url(endpoint_url)
        self.endpoint_url = check_endpoint_url(endpoint) if endpoint else None
        self.page_size = page_size
        self.read_buffer_size = read_buffer_size
        core = botocore.session.Session() if client is None else None
        settings = retry_settings(_botocore_retry_config(core) if core else None)
        self.retries: RetrySettings = replace(
            settings,
            mode=retry_mode or settings.mode,
            max_attempts=max_attempts or settings.max_attempts,
            body_attempts=body_attempts or settings.body_attempts,
        )
        if core is not None:
            custom = self.endpoint_url is not None
            config = Config(
                region_name=region,
                # total_max_attempts counts the first try; botocore's "max_attempts" does not.
                retries={
                    "mode": self.retries.mode,
                    "total_max_attempts": self.retries.max_attempts,
                },
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
            # Given explicitly, credentials win over anything in the environment: the
            # argument's (the operator reading with an RLCycle's own Secret), else the files'.
            creds = credentials if credentials is not None else file_credentials()
            # A session per store: sessions are not thread-safe, the client built from one is.
            session = (
                boto3.session.Session(botocore_session=core)
                if creds is None
                else boto3.session.Session(
                    aws_access_key_id=creds.access_key_id,
                    aws_secret_access_key=creds.secret_access_key,
                    aws_session_token=creds.session_token,
                    botocore_session=core,
                )
            )
            try:
                client = session.client(
                    "s3", endpoint_url=self.endpoint_url, region_name=region, config=config
                )
            except ValueError as exc:  # botocore's "Invalid endpoint: <url>"
                raise StoreError(f"cannot use S3 endpoint: {exc}") from None
        self._client = cast("S3Client", client)
        self._transfer = TransferConfig(
            multipart_threshold=multipart_threshold,
            multipart_chunksize=multipart_chunksize,
            max_concurrency=max_concurrency,
            # s3transfer fetches a download's broken-off ranges again itself.
            num_download_attempts=self.retries.body_attempts,
        )

    def __repr__(self) -> str:
        endpoint = f", endpoint_url={redact(self.endpoint_url)!r}" if self.endpoint_url else ""
        return f"S3Store({self.bucket!r}, {self.prefix!r}{endpoint})"

    @property
    def client(self) -> S3Client:
        return self._client

    def _key(self, key: str) -> str:
        return self._root + check_key(key)

    # --- errors ----------------------------------------------------------------------------

    def _raise(self, exc: Exception, action: str, key: str) -> NoReturn:
        raise store_error(exc, action, self.url(key) if key else self.uri, self.retries)

    @contextlib.contextmanager
    def _errors(self, action: str, key: str) -> Iterator[None]:
        try:
            yield
        except (ClientError, BotoCoreError, *DOWNLOAD_RETRIES_EXCEEDED) as exc:
            self._raise(exc, action, key)
        except Exception as exc:
            # boto3's upload wrapper (S3UploadFailedError) keeps the ClientError as context.
            if find_client_error(exc) is None:
                raise
            self._raise(exc, action, key)

    def _fetch(self, key: str, *, byte_range: str | None = None, etag: str | None = None) -> bytes:
        """One object (or range of it). botocore retries the request; a body that breaks off
        while read is fetched again here, ``retries.body_attempts`` tries in all, with
        backoff, and no new try after ``BODY_RETRY_BUDGET_S`` from the first."""
        extra: dict[str, Any] = {}
        if byte_range is not None:
            extra["Range"] = byte_range
        if etag is not None:
            # Pin the version opened: an overwrite between two range reads fails loudly
            # (412) instead of splicing bytes of two objects together.
            extra["IfMatch"] = etag
        started = time.monotonic()
        for attempt in itertools.count(1):
            with self._errors("get", key):
                response = self._client.get_object(Bucket=self.bucket, Key=self._key(key), **extra)
                body = response["Body"]
                try:
                    return body.read()
                except Exception as exc:
                    if not broken_body(exc):
                        raise
                    elapsed = time.monotonic() - started
                    if attempt >= self.retries.body_attempts or elapsed >= BODY_RETRY_BUDGET_S:
                        limit = (
                            f"{BODY_ATTEMPTS_ENV} allows {self.retries.body_attempts} tries"
                            if attempt >= self.retries.body_attempts
                            else f"retried for {BODY_RETRY_BUDGET_S:.0f} s at most"
                        )
                        message = (
                            f"get {self.url(key)} failed: the response body broke off "
                            f"{attempt} times in {elapsed:.1f} s ({type(exc).__name__}; {limit})"
                        )
                        raise StoreError(message) from (exc if redacted_already(exc) else None)
                finally:
                    body.close()
            time.sleep(body_backoff(attempt))
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

        def fetch(byte_range: str, etag: str | None) -> bytes:
            return self._fetch(key, byte_range=byte_range, etag=etag)

        raw = RangeReader(
            fetch, self.url(key), size=int(head["ContentLength"]), etag=head.get("ETag")
        )
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
