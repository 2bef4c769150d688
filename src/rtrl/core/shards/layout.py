"""Where shards live: Hive partition paths, which keys are shard files, and turning the
``s3://`` / ``file://`` / plain-path URIs users type into an :class:`ObjectStore`.

Reader, writer, validator and CLI all agree on these through this one module, so a file the
writer produces is exactly a file the reader lists.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path
from urllib.parse import quote, unquote

from rtrl.core.store.base import ObjectInfo, ObjectStore

# Hive's own spelling of "no value" (a null partition column), understood by Spark, Trino
# and pyarrow.dataset alike.
NULL_PARTITION = "__HIVE_DEFAULT_PARTITION__"

PARQUET_SUFFIX = ".parquet"

PartitionFilter = Mapping[str, str | Collection[str]]


def partition_segment(name: str, value: str | None) -> str:
    """``name=value`` with the value percent-encoded, so ids containing ``/`` or ``=``
    cannot change the directory structure."""
    return f"{name}={NULL_PARTITION if value is None else quote(value, safe='')}"


def parse_partitions(key: str) -> dict[str, str]:
    """The Hive partition values in ``key`` (``a=1/b=2/part-0.parquet`` -> ``{a: 1, b: 2}``)."""
    values: dict[str, str] = {}
    for segment in key.split("/")[:-1]:
        name, sep, value = segment.partition("=")
        if sep and name:
            values[name] = unquote(value)
    return values


def is_shard_key(key: str) -> bool:
    """Whether ``key`` names a data file: ``*.parquet`` whose name and directories do not
    start with ``_`` or ``.`` (manifests, ``_SUCCESS`` markers, temp files of writers)."""
    if not key.endswith(PARQUET_SUFFIX):
        return False
    return not any(part.startswith(("_", ".")) for part in key.split("/") if part)


def matches(partitions: Mapping[str, str], wanted: PartitionFilter | None) -> bool:
    """Whether a file's partition values satisfy ``wanted`` (each name: one value or a set).
    A file without the partition in its path is kept: its rows may still match, and the
    row-level ``checkpoint_id`` is what on-policy filtering finally relies on."""
    if not wanted:
        return True
    for name, accepted in wanted.items():
        value = partitions.get(name)
        if value is None:
            continue
        if isinstance(accepted, str):
            if value != accepted:
                return False
        elif value not in accepted:
            return False
    return True


def list_shards(
    store: ObjectStore, prefix: str = "", partitions: PartitionFilter | None = None
) -> Iterator[ObjectInfo]:
    """The shard files under ``prefix``, in key order (so every reader sees the same order
    and duplicate detection keeps the same first occurrence)."""
    base = prefix.strip("/")
    for info in store.list(f"{base}/" if base else ""):
        relative = info.key[len(base) :].lstrip("/") if base else info.key
        if is_shard_key(relative) and matches(parse_partitions(relative), partitions):
            yield info


def resolve_store(
    source: ObjectStore | str | os.PathLike[str], *, endpoint_url: str | None = None
) -> ObjectStore:
    """An :class:`ObjectStore` for a store, a store URI (``s3://``, ``file://``) or a local
    directory path (for convenience on the command line). ``endpoint_url`` applies to S3.

    Raises ``ValueError`` for a URI no store backend understands.
    """
    if isinstance(source, ObjectStore):
        return source
    from rtrl.core.store import open_store

    text = os.fspath(source)
    if "://" in text:
        return open_store(text, endpoint_url=endpoint_url)
    if not text:
        raise ValueError("an empty path is not a shard location")
    return open_store(Path(text).resolve().as_uri() + "/")
