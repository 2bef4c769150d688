"""Staging and committing the stage step's output.

Files are staged where the commit will want them. A ``file://`` output store gets them in
place, under temp names that its listings hide (the store's own convention for writes in
progress), and the commit renames them: the set is written to disk once, never copied.
Any other store gets them in the local work directory, uploaded by the commit.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from rtrl.core.store import MANIFEST_NAME, ObjectStore, StoreError
from rtrl.core.store.base import check_key
from rtrl.core.store.local import FILE_MODE, TEMP_PREFIX, LocalStore
from rtrl_trainer.stagedset import HELDOUT_DIR, TRAIN_DIR

_HASH_CHUNK = 4 << 20


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
