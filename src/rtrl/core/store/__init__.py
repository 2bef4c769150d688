"""Object stores by URI: ``open_store("s3://bucket/prefix/")`` or ``open_store("file:///path/")``.

Callers hold a URI from an RLCycle or a Job's flags and should not care which backend is
behind it; this is the one place that turns a URI into a store, so the accepted forms match
the ``StoreUri`` pattern of the API in one spot.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import unquote, urlsplit

from rtrl.core.redaction import redact
from rtrl.core.store.base import (
    MANIFEST_NAME,
    Manifest,
    ObjectInfo,
    ObjectNotFound,
    ObjectStore,
    StoreError,
    check_key,
    join_key,
)
from rtrl.core.store.credentials import FileCredentials

__all__ = [
    "MANIFEST_NAME",
    "FileCredentials",
    "Manifest",
    "ObjectInfo",
    "ObjectNotFound",
    "ObjectStore",
    "StoreError",
    "StoreURI",
    "check_key",
    "join_key",
    "open_store",
    "parse_store_uri",
    "read_committed_json",
    "redact",
    "split_uri",
]

# S3's bucket naming rules, loosely (the same as the API's STORE_URI_PATTERN).
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


@dataclass(frozen=True)
class StoreURI:
    """A parsed store URI: ``bucket`` and ``path`` (the key prefix, no surrounding ``/``)
    for ``s3``; ``path`` (an absolute directory) for ``file``."""

    scheme: Literal["s3", "file"]
    bucket: str
    path: str


def parse_store_uri(uri: str) -> StoreURI:
    """Parse ``s3://bucket[/prefix/]`` or ``file:///abs/path[/]``; ValueError otherwise (its
    message shows the URI :func:`redact`-ed: a presigned URL pasted by mistake stays secret)."""
    parts = urlsplit(uri)
    shown = redact(uri)
    if parts.query or parts.fragment:
        raise ValueError(f"store URI {shown!r} must not have a query or fragment")
    if "@" in parts.netloc:
        raise ValueError(f"store URI {shown!r}: credentials do not belong in a store URI")
    if parts.scheme == "s3":
        if not _BUCKET.match(parts.netloc):
            raise ValueError(f"store URI {shown!r}: {parts.netloc!r} is not a valid S3 bucket name")
        prefix = parts.path.strip("/")
        if prefix:
            try:
                check_key(prefix)
            except StoreError as exc:
                raise ValueError(f"store URI {shown!r}: invalid prefix ({exc})") from None
        return StoreURI("s3", parts.netloc, prefix)
    if parts.scheme == "file":
        # file:relative and file://host/path have no meaning in a pod; only local, absolute.
        if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
            raise ValueError(
                f"store URI {shown!r}: a file URI needs an absolute path, as in file:///data/rtrl/"
            )
        path = unquote(parts.path)
        if any(part in (".", "..") for part in path.split("/")):
            raise ValueError(f"store URI {shown!r}: '.' and '..' are not allowed in the path")
        return StoreURI("file", "", path.rstrip("/") or "/")
    raise ValueError(
        f"unsupported store URI {shown!r}: expected s3://bucket/prefix/ or file:///abs/path/"
    )


def open_store(
    uri: str,
    *,
    endpoint_url: str | None = None,
    region: str | None = None,
    credentials: FileCredentials | None = None,
) -> ObjectStore:
    """The store rooted at ``uri``. ``endpoint_url`` (else ``AWS_ENDPOINT_URL``),
    ``region`` and ``credentials`` apply to S3 only; without ``credentials`` they come
    from the files in ``$RTRL_STORAGE_CREDENTIALS_DIR`` when it is set (read at each call:
    a rotated Secret applies to the next store opened), else from boto3's default chain."""
    parsed = parse_store_uri(uri)
    if parsed.scheme == "file":
        from rtrl.core.store.local import LocalStore

        return LocalStore(Path(parsed.path))
    # Imported here so file:// users (the CLI's validate, the demo) do not pay for boto3.
    from rtrl.core.store.s3 import S3Store

    return S3Store(
        parsed.bucket,
        parsed.path,
        endpoint_url=endpoint_url,
        region=region,
        credentials=credentials,
    )


def split_uri(uri: str) -> tuple[str, str]:
    """Split an object URI into its directory's store URI and the object's name:
    ``s3://b/ckpt/1/result.json`` -> (``s3://b/ckpt/1/``, ``result.json``)."""
    parsed = parse_store_uri(uri)
    if uri.endswith("/") or (parsed.scheme == "s3" and not parsed.path):
        raise ValueError(f"URI {redact(uri)!r} names a prefix, not an object")
    root, _, name = uri.rpartition("/")
    return root + "/", unquote(name) if parsed.scheme == "file" else name


def read_committed_json(
    uri: str,
    *,
    endpoint_url: str | None = None,
    region: str | None = None,
    credentials: FileCredentials | None = None,
    committed_only: bool = True,
) -> dict[str, Any] | str | None:
    """The JSON object at ``uri`` once its prefix is committed (manifest written last), None
    while it is not, or a string saying why it could not be read. How the operator and the
    local demo read a step's result document (stage.json, eval.json, analysis.json...).
    ``committed_only=False``: whatever is there now (None when nothing is), as for the
    progress a running step writes before anything is committed."""
    prefix, name = split_uri(uri)
    try:
        store = open_store(
            prefix, endpoint_url=endpoint_url, region=region, credentials=credentials
        )
        if committed_only and store.committed("") is None:
            return None
        try:
            doc = json.loads(store.get_bytes(name))
        except ObjectNotFound:
            if committed_only:
                raise
            return None
    except (StoreError, ValueError, OSError) as exc:
        return redact(f"{type(exc).__name__}: {exc}")
    return doc if isinstance(doc, dict) else f"{name} is not a JSON object"
