"""The shard root as a reader of sealed data sees it: only the files the seal markers list.

The seal step writes an hour's shards, then its marker (:class:`SealMarker`) last. A stage
that trains on sealed data must read exactly those files: not a file of an hour whose seal
crashed before its marker (it may be rewritten), not a file some other writer put beside
them. :class:`SealedView` is the shard store with its listing narrowed to the files every
marker under ``_sealed/`` lists, so every reader built on the store's listing (the stage's
validating reader, its footer statistics) reads sealed data without knowing it.

A file a marker lists that is missing from the store is an error (:class:`StoreError`
naming it and its marker), never skipped: a sealed hour is complete or not read at all.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta
from pathlib import Path

from rtrl.core.events.layout import SEALED_DIR, SealMarker, parse_hour_partition
from rtrl.core.store.base import ObjectInfo, ObjectStore, StoreError

# Markers are small JSON objects: read many at once, as a listing's pages come.
READ_THREADS = 16


class SealedView(ObjectStore):
    """``store`` with :meth:`list` yielding only the files of seal markers; every other
    operation is the store's own. ``since``: markers of hours that end at or before it
    are not read (their rows are older than any the reader wants: a stage's window)."""

    def __init__(self, store: ObjectStore, *, since: datetime | None = None) -> None:
        self.store = store
        self.uri = store.uri
        self.since = since
        self._files: dict[str, str] | None = None  # key -> the marker that lists it

    def __repr__(self) -> str:
        return f"SealedView({self.store!r})"

    def sealed_files(self) -> dict[str, str]:
        """Every file the markers list (relative to the store), with its marker's key;
        read once, on first use."""
        if self._files is None:
            keys = [
                info.key
                for info in self.store.list(f"{SEALED_DIR}/")
                if info.key.endswith(".json") and self._wanted(info.key)
            ]
            files: dict[str, str] = {}
            with ThreadPoolExecutor(READ_THREADS, thread_name_prefix="sealed-markers") as pool:
                for key, raw in zip(keys, pool.map(self.store.get_bytes, keys), strict=True):
                    try:
                        marker = SealMarker.from_json(raw)
                    except (ValueError, KeyError, TypeError) as exc:
                        raise StoreError(
                            f"{self.store.url(key)}: not a seal marker ({exc})"
                        ) from exc
                    for entry in marker.files:
                        files[str(entry["key"])] = key
            self._files = files
        return self._files

    def _wanted(self, key: str) -> bool:
        hour = parse_hour_partition(key)
        if self.since is None or hour is None:
            return True
        return hour + timedelta(hours=1) > self.since

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        sealed = self.sealed_files()
        found: set[str] = set()
        for info in self.store.list(prefix):
            if info.key in sealed:
                found.add(info.key)
                yield info
        missing = sorted(k for k in sealed if k.startswith(prefix) and k not in found)
        if missing:
            raise StoreError(
                f"{self.store.url(missing[0])} is listed by the seal marker "
                f"{self.store.url(sealed[missing[0]])} but is not in the store"
                + (f" ({len(missing) - 1} more missing)" if len(missing) > 1 else "")
            )

    # --- everything else is the store's ---------------------------------------------------

    def put_bytes(self, key: str, data: bytes) -> None:
        self.store.put_bytes(key, data)

    def put_file(self, key: str, path: Path) -> None:
        self.store.put_file(key, path)

    def get_bytes(self, key: str) -> bytes:
        return self.store.get_bytes(key)

    def get_file(self, key: str, path: Path) -> None:
        self.store.get_file(key, path)

    def open_input(self, key: str) -> io.BufferedReader:
        return self.store.open_input(key)

    def exists(self, key: str) -> bool:
        return self.store.exists(key)

    def delete(self, key: str) -> None:
        self.store.delete(key)

    def url(self, key: str) -> str:
        return self.store.url(key)
