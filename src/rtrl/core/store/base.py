"""The object-store interface every rtrl component uses: one small API over ``s3://`` and
``file://`` so the operator, the Job steps, the demo and the tests share one code path.

Keys are relative to the store's root URI and always use ``/``. Writes of a single object
are atomic (readers see the old object, the new one, or nothing). Multi-object artifacts
(a checkpoint, a staged training set, a step's result) are *committed*: the writer puts its
files, then a manifest listing them with size and sha256, last. Readers call
:meth:`ObjectStore.committed` and treat a prefix without a manifest as absent, so a writer
killed half-way never exposes a half-written artifact.
"""

from __future__ import annotations

import hashlib
import io
import json
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Re-exported: store errors are where most redacted text comes from.
from rtrl.core.redaction import redact

MANIFEST_NAME = "_MANIFEST.json"
MANIFEST_VERSION = 1


class StoreError(Exception):
    """An object-store operation failed (after retries, where they apply). Its message
    is :func:`redact`-ed, whoever raises it."""

    def __init__(self, *args: object) -> None:
        super().__init__(*(redact(arg) if isinstance(arg, str) else arg for arg in args))


class ObjectNotFound(StoreError, KeyError):  # noqa: N818 (a public name callers match on)
    """The key does not exist."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "object not found"


@dataclass(frozen=True)
class ObjectInfo:
    key: str  # relative to the store root
    size: int


@dataclass(frozen=True)
class Manifest:
    """The commit record of a prefix: its files (relative to the prefix) with size and
    sha256, plus free-form metadata of the writer."""

    prefix: str
    files: Mapping[str, Mapping[str, Any]]
    metadata: Mapping[str, Any]

    def to_json(self) -> bytes:
        doc = {
            "version": MANIFEST_VERSION,
            "files": {k: dict(v) for k, v in sorted(self.files.items())},
            "metadata": dict(self.metadata),
        }
        return json.dumps(doc, indent=2, sort_keys=True).encode()

    @classmethod
    def from_json(cls, prefix: str, data: bytes) -> Manifest:
        try:
            doc = json.loads(data)
            files, metadata = doc["files"], doc.get("metadata", {})
        except (ValueError, KeyError, TypeError) as exc:
            raise StoreError(f"{prefix}{MANIFEST_NAME}: not a valid manifest ({exc})") from exc
        if not isinstance(files, dict) or not isinstance(metadata, dict):
            raise StoreError(f"{prefix}{MANIFEST_NAME}: not a valid manifest")
        return cls(prefix=prefix, files=files, metadata=metadata)


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def check_key(key: str) -> str:
    """``key`` unchanged when it names an object, else :class:`StoreError`.

    Every backend applies the same rules, so code tested against ``file://`` behaves the
    same on S3: no absolute keys, no ``..`` (a key must never escape the store root on
    disk), and no empty or ``.`` segments, which a filesystem collapses but S3 keeps.
    """
    if not key:
        raise StoreError("empty object key")
    if "\x00" in key:
        raise StoreError(f"object key {key!r} contains a NUL byte")
    if key.startswith("/"):
        raise StoreError(f"object key {key!r} is absolute; keys are relative to the store root")
    if any(part in ("", ".", "..") for part in key.split("/")):
        raise StoreError(
            f"object key {key!r} has an empty, '.' or '..' segment; keys are plain relative "
            "paths that stay inside the store root"
        )
    return key


def check_prefix(prefix: str) -> str:
    """``prefix`` unchanged when it is empty or a valid key with an optional trailing ``/``."""
    if prefix:
        check_key(prefix.removesuffix("/"))
    return prefix


def join_key(prefix: str, name: str) -> str:
    """``prefix`` + ``name`` with exactly one ``/`` between them (prefix may be empty)."""
    prefix = prefix.strip("/")
    return f"{prefix}/{name.lstrip('/')}" if prefix else name.lstrip("/")


class ObjectStore(ABC):
    """An object store rooted at ``uri``; all keys are relative to it."""

    uri: str

    @abstractmethod
    def put_bytes(self, key: str, data: bytes) -> None:
        """Write one object atomically."""

    @abstractmethod
    def put_file(self, key: str, path: Path) -> None:
        """Upload a local file (multipart when large); atomic like :meth:`put_bytes`."""

    @abstractmethod
    def get_bytes(self, key: str) -> bytes:
        """Read one object; :class:`ObjectNotFound` when absent."""

    @abstractmethod
    def get_file(self, key: str, path: Path) -> None:
        """Download one object to ``path`` (written via a temp file, then renamed)."""

    @abstractmethod
    def open_input(self, key: str) -> io.BufferedReader:
        """A seekable binary reader of one object, for formats that read a footer first
        (Parquet); ranges are fetched on demand, the object is never loaded whole.

        A :class:`io.BufferedReader` (so an ``IO[bytes]`` with ``readinto``); use it as a
        context manager. :class:`ObjectNotFound` when absent."""

    @abstractmethod
    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """All objects under ``prefix``, sorted by key, paginated lazily."""

    @abstractmethod
    def exists(self, key: str) -> bool:
        """Whether the object exists."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Delete one object; deleting an absent object is not an error."""

    def url(self, key: str) -> str:
        """The absolute URI of ``key``."""
        return self.uri.rstrip("/") + "/" + key.lstrip("/")

    # --- commit protocol -----------------------------------------------------------------

    def commit(
        self,
        prefix: str,
        files: Mapping[str, Path],
        metadata: Mapping[str, Any] | None = None,
        known: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> Manifest:
        """Upload ``files`` (name relative to ``prefix`` -> local path), then the manifest.

        Uploading is idempotent: re-running a commit after a crash rewrites the same objects
        and the manifest last, so a reader sees either nothing or the complete artifact. An
        existing manifest is deleted before the first file is written, so re-committing a
        prefix never shows the old manifest over a mix of old and new files.
        """
        # A previous manifest would vouch for files this commit is about to overwrite; drop
        # it first so that a rewrite in progress reads as absent, not as a mixed artifact.
        self.delete(join_key(prefix, MANIFEST_NAME))
        return self.write_manifest(prefix, self.upload_files(prefix, files, known), metadata)

    def upload_files(
        self,
        prefix: str,
        files: Mapping[str, Path],
        known: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> dict[str, dict[str, Any]]:
        """The first half of :meth:`commit`: upload ``files`` and return their manifest
        entries (size, sha256). Several writers (the ranks of a training Job) may each
        upload their own files; one of them then calls :meth:`write_manifest` with all
        entries. ``known``: entries the writer computed as it wrote the files (not hashed
        again; the size must still match)."""
        entries: dict[str, dict[str, Any]] = {}
        for name, path in sorted(files.items()):
            size = path.stat().st_size
            entry = (known or {}).get(name)
            if entry is not None and entry.get("size") == size and entry.get("sha256"):
                entries[name] = {"size": size, "sha256": str(entry["sha256"])}
            else:
                entries[name] = {"size": size, "sha256": sha256_file(path)}
            self.put_file(join_key(prefix, name), path)
        return entries

    def write_manifest(
        self,
        prefix: str,
        entries: Mapping[str, Mapping[str, Any]],
        metadata: Mapping[str, Any] | None = None,
    ) -> Manifest:
        """The second half of :meth:`commit`: write the manifest, the commit marker."""
        manifest = Manifest(prefix=prefix, files=entries, metadata=dict(metadata or {}))
        self.put_bytes(join_key(prefix, MANIFEST_NAME), manifest.to_json())
        return manifest

    def committed(self, prefix: str) -> Manifest | None:
        """The manifest of ``prefix``, or None when it was never (completely) committed."""
        try:
            data = self.get_bytes(join_key(prefix, MANIFEST_NAME))
        except ObjectNotFound:
            return None
        return Manifest.from_json(prefix, data)
