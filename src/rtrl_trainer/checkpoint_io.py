"""Checkpoints and training state between the object store and local scratch, checksummed.

Everything the train step reads or writes goes through here so that one set of rules holds:
inputs are verified against their manifest's sha256 before use (a parent without a
manifest, such as a base model registered by hand, is checksummed on first use and gets
one); outputs are committed the rtrl way, files first and ``_MANIFEST.json`` last, so a
reader never sees a half-written checkpoint or half-saved optimizer state.

A checkpoint loaded as a model may be a LoRA adapter (train/adapter.py publishes them):
:func:`fetch_model` is the one place every step (stage, train, eval) resolves one, fetching
the base its manifest names (``metadata.base``) and refusing a base whose files are not the
ones the adapter was trained on (``metadata.baseDigest``); :func:`model_store` is the same
resolution for a reader of the model's config.json alone.

DeepSpeed state is written by every rank into its node's scratch; each rank uploads the
files it owns and rank 0 writes the manifest once all are in, which is why this module has
the pieces of :meth:`ObjectStore.commit` (upload, manifest) as separate functions.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rtrl.core.api.adapter import base_digest
from rtrl.core.store import (
    MANIFEST_NAME,
    Manifest,
    ObjectStore,
    StoreError,
    join_key,
    open_store,
)
from rtrl.core.store.base import sha256_file

STATE_PREFIX = "_deepspeed"
START_LOGPROBS = f"{STATE_PREFIX}/start-logprobs"
# The run's TensorBoard event files (train/events.py): next to the checkpoint, never in it.
TENSORBOARD_PREFIX = "tensorboard"
# What a checkpoint prefix holds besides the checkpoint: never downloaded, never checksummed.
_NOT_CHECKPOINT = (f"{STATE_PREFIX}/", f"{TENSORBOARD_PREFIX}/")
_STEP = re.compile(rf"^{STATE_PREFIX}/step-(\d+)/{re.escape(MANIFEST_NAME)}$")
# DeepSpeed names per-rank files ..._zero_pp_rank_<dp rank>_...; the rest (model states,
# the whole optimizer without ZeRO) is written by rank 0 and read by every rank.
_RANK_FILE = re.compile(r"zero_pp_rank_(\d+)_")
# Weight files of a Hugging Face checkpoint: the new checkpoint brings its own.
_WEIGHTS = re.compile(
    r"^(model|pytorch_model)(-\d+-of-\d+)?\.(safetensors|bin)$"
    r"|^(model\.safetensors|pytorch_model\.bin)\.index\.json$"
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")
FILE_MODE = 0o644
# A LoRA adapter (PEFT's files): its config names it one; its manifest's metadata.kind says so.
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_KIND = "adapter"


class InputError(Exception):
    """An input is missing, uncommitted or corrupt; the message names the URI or file."""


@dataclass(frozen=True)
class Fetched:
    """A prefix downloaded to ``directory``: file name -> sha256. ``manifest`` says how the
    checksums were established: ``verified`` against the prefix's manifest, or
    ``first-use`` (no manifest: computed now, and one written when the store allowed it)."""

    uri: str
    directory: Path
    files: dict[str, str]
    manifest: str
    notes: list[str] = field(default_factory=list)


def fetch_checkpoint(store: ObjectStore, dest: Path, *, label: str = "parent") -> Fetched:
    """Download a Hugging Face checkpoint prefix and check every file's sha256."""
    manifest = store.committed("")
    notes: list[str] = []
    if manifest is not None:
        entries = {
            name: dict(entry)
            for name, entry in manifest.files.items()
            if not name.startswith(_NOT_CHECKPOINT)
        }
    else:
        entries = {
            info.key: {"size": info.size}
            for info in store.list("")
            if not info.key.startswith(_NOT_CHECKPOINT)
            and not info.key.rsplit("/", 1)[-1].startswith((".", "_"))
        }
        if not entries:
            raise InputError(f"{label} {store.uri}: no such checkpoint (nothing under the prefix)")
    if "config.json" not in entries:
        raise InputError(
            f"{label} {store.uri}: not a Hugging Face checkpoint (no config.json in "
            f"{'its manifest' if manifest else 'the prefix'})"
        )
    if not any(_WEIGHTS.match(name) for name in entries):
        raise InputError(f"{label} {store.uri}: no model weights (model*.safetensors)")
    files = download(store, "", entries, dest, label=label, verify=manifest is not None)
    if manifest is None:
        # Checksummed on first use: from now on this model is verified like any other.
        first_use = Manifest(
            prefix="",
            files={n: {"size": (dest / n).stat().st_size, "sha256": s} for n, s in files.items()},
            metadata={"committedBy": "rtrl-job train (checksummed on first use)"},
        )
        try:
            store.put_bytes(MANIFEST_NAME, first_use.to_json())
            notes.append(f"{label} {store.uri} had no manifest: checksummed and committed one")
        except StoreError as exc:
            notes.append(f"{label} {store.uri} has no manifest and none could be written ({exc})")
    return Fetched(
        uri=store.uri,
        directory=dest,
        files=files,
        manifest="verified" if manifest is not None else "first-use",
        notes=notes,
    )


def is_adapter(names: Iterable[str]) -> bool:
    """Whether a checkpoint's files are an adapter's (PEFT's config among them)."""
    return ADAPTER_CONFIG in set(names)


@dataclass(frozen=True)
class Lineage:
    """What an adapter's manifest says of the model it adapts: the base's store, and the
    digest of the base's files it was trained on (``metadata.baseDigest``). ``label``
    names the adapter in every message (``parent adapter s3://...``)."""

    label: str
    base: ObjectStore
    digest: object

    def check(self, files: Mapping[str, str]) -> None:
        """Refuse a base whose files (name -> sha256) are not the ones the adapter was
        trained on: it would compute something nobody measured."""
        found = base_digest(files)
        if self.digest != found:
            raise InputError(
                f"{self.label} was trained on other files than base {self.base.uri} holds now "
                f"(digest {str(self.digest)[:12]}..., now {found[:12]}...): it would run on a "
                "base it was not trained on; train a new adapter from the base"
            )


def lineage(store: ObjectStore, *, label: str, endpoint_url: str | None) -> Lineage | None:
    """The lineage of the checkpoint at ``store`` when it is a committed adapter (None: a
    whole checkpoint); an adapter whose manifest names no usable base is an InputError."""
    manifest = store.committed("")
    if manifest is None or not is_adapter(manifest.files):
        return None
    label = f"{label} adapter {store.uri}"
    base_uri = manifest.metadata.get("base")
    if not isinstance(base_uri, str) or not base_uri:
        raise InputError(
            f"{label}: its manifest names no base (metadata.base): the model it adapts is unknown"
        )
    try:
        base = open_store(base_uri, endpoint_url=endpoint_url)
    except ValueError as exc:
        raise InputError(f"{label}: metadata.base {base_uri!r}: {exc}") from None
    return Lineage(label=label, base=base, digest=manifest.metadata.get("baseDigest"))


def _checked_early(found: Lineage) -> None:
    """The digest checked against the base's manifest, before anything is downloaded (a
    base without one is checked once its files are fetched and checksummed)."""
    manifest = found.base.committed("")
    if manifest is None:
        return
    if is_adapter(manifest.files):
        raise InputError(f"{found.label}: its base {found.base.uri} is itself an adapter")
    found.check(
        {
            name: str(entry.get("sha256"))
            for name, entry in manifest.files.items()
            if not name.startswith(_NOT_CHECKPOINT)
        }
    )


def fetch_model(
    store: ObjectStore,
    dest: Path,
    *,
    label: str,
    endpoint_url: str | None,
    base_dest: Path | None = None,
) -> tuple[Fetched, Fetched | None]:
    """(the checkpoint at ``store``, the base under it when it is an adapter, else None).

    A whole checkpoint is fetched as :func:`fetch_checkpoint` fetches it. An adapter is
    fetched (committed, verified) into ``dest`` and the base its manifest names into
    ``base_dest`` (default: beside ``dest``, one directory per base URI, so two adapters on
    one base download it once: a file already there is kept), and the base's files must be
    the ones the adapter was trained on (their :func:`~rtrl.core.api.adapter.base_digest`,
    ``metadata.baseDigest``), or the InputError names the adapter and the base. The model
    is then the base with the adapter on it; its vocabulary and tokenizer are the base's."""
    found = lineage(store, label=label, endpoint_url=endpoint_url)
    if found is None:
        return fetch_checkpoint(store, dest, label=label), None
    adapter, _ = fetch_committed(store, dest, label=found.label)
    _checked_early(found)
    if base_dest is None:
        base_dest = dest.parent / f"base-{hashlib.sha256(found.base.uri.encode()).hexdigest()[:16]}"
    base = fetch_checkpoint(found.base, base_dest, label="base")
    if is_adapter(base.files):
        raise InputError(f"{found.label}: its base {found.base.uri} is itself an adapter")
    found.check(base.files)
    return adapter, base


def model_store(
    store: ObjectStore, *, label: str, endpoint_url: str | None
) -> tuple[ObjectStore, Lineage | None]:
    """The store that holds the model's config.json and tokenizer: ``store`` itself, or
    the base an adapter's manifest names, its digest checked against the base's manifest
    (a reader of config.json alone, such as the stage's vocabulary bound, refuses the same
    adapters :func:`fetch_model` refuses, without downloading the weights)."""
    found = lineage(store, label=label, endpoint_url=endpoint_url)
    if found is None:
        return store, None
    _checked_early(found)
    return found.base, found


def fetch_committed(
    store: ObjectStore, dest: Path, *, label: str, names: Iterable[str] | None = None
) -> tuple[Fetched, Manifest]:
    """Download (``names`` of) a committed prefix, verified; an uncommitted one is absent."""
    manifest = store.committed("")
    if manifest is None:
        raise InputError(
            f"{label} {store.uri}: not committed (no {MANIFEST_NAME}); treated as absent"
        )
    wanted = set(manifest.files) if names is None else set(names)
    missing = sorted(wanted - set(manifest.files))
    if missing:
        raise InputError(f"{label} {store.uri}: {missing[0]} is not in its manifest")
    entries = {n: dict(e) for n, e in manifest.files.items() if n in wanted}
    files = download(store, "", entries, dest, label=label, verify=True)
    return Fetched(uri=store.uri, directory=dest, files=files, manifest="verified"), manifest


def download(
    store: ObjectStore,
    prefix: str,
    entries: Mapping[str, Mapping[str, Any]],
    dest: Path,
    *,
    label: str,
    verify: bool,
) -> dict[str, str]:
    """Download ``entries`` (name -> {size, sha256}) under ``prefix`` into ``dest``; with
    ``verify``, a size or sha256 that differs from the entry is an :class:`InputError`
    naming the file. A file already in ``dest`` with the expected checksum is kept (a
    restarted pod does not download the parent again)."""
    out: dict[str, str] = {}
    for name, entry in sorted(entries.items()):
        target = dest / name
        expected = entry.get("sha256") if verify else None
        if (
            expected
            and target.is_file()
            and target.stat().st_size == entry.get("size")
            and sha256_file(target) == expected
        ):
            out[name] = expected
            continue
        store.get_file(join_key(prefix, name), target)
        digest = sha256_file(target)
        if verify:
            size = target.stat().st_size
            if "size" in entry and size != entry["size"]:
                target.unlink()
                raise InputError(
                    f"{label} {store.url(join_key(prefix, name))}: size {size} does not match "
                    f"the manifest's {entry['size']}"
                )
            if digest != expected:
                target.unlink()
                raise InputError(
                    f"{label} {store.url(join_key(prefix, name))}: sha256 {digest} does not "
                    f"match the manifest's {expected}"
                )
        out[name] = digest
    return out


# --- committing from several ranks --------------------------------------------------------


def delete_prefix(store: ObjectStore, prefix: str) -> None:
    """Uncommit ``prefix`` (manifest first, so it reads as absent at once), then delete it."""
    store.delete(join_key(prefix, MANIFEST_NAME))
    for info in list(store.list(prefix.rstrip("/") + "/")):
        store.delete(info.key)


def owned_files(directory: Path, rank: int) -> dict[str, Path]:
    """The DeepSpeed files in ``directory`` that ``rank`` uploads: its own per-rank files,
    and for rank 0 also the shared ones."""
    out: dict[str, Path] = {}
    for path in sorted(directory.rglob("*")):
        if not path.is_file():
            continue
        name = path.relative_to(directory).as_posix()
        match = _RANK_FILE.search(path.name)
        owner = int(match.group(1)) if match else 0
        if owner == rank:
            out[name] = path
    return out


def needed_files(names: Iterable[str], rank: int, *, shared: bool) -> list[str]:
    """The saved DeepSpeed files ``rank`` loads: its own, plus (``shared``) the shared ones."""
    out = []
    for name in names:
        match = _RANK_FILE.search(name.rsplit("/", 1)[-1])
        if (match and int(match.group(1)) == rank) or (match is None and shared):
            out.append(name)
    return out


def committed_steps(store: ObjectStore) -> dict[int, Manifest]:
    """Committed DeepSpeed states under ``_deepspeed/step-<N>/``, by step."""
    out: dict[int, Manifest] = {}
    for info in store.list(f"{STATE_PREFIX}/"):
        match = _STEP.match(info.key)
        if match:
            manifest = store.committed(f"{STATE_PREFIX}/step-{match.group(1)}")
            if manifest is not None:
                out[int(match.group(1))] = manifest
    return out


def step_prefix(step: int) -> str:
    return f"{STATE_PREFIX}/step-{step}"


# --- publishing ---------------------------------------------------------------------------


def copy_parent_files(parent: Fetched, out_dir: Path) -> list[str]:
    """Copy the parent's files the new checkpoint needs unchanged (tokenizer, chat
    template, ...) into ``out_dir``: everything but weights, what the new checkpoint already
    has (config.json, generation_config.json) and the parent's own train.json."""
    copied = []
    for name in sorted(parent.files):
        if _WEIGHTS.match(name) or name in ("train.json", MANIFEST_NAME):
            continue
        target = out_dir / name
        if target.exists():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(parent.directory / name, target)
        copied.append(name)
    return copied


def checkpoint_files(directory: Path) -> dict[str, Path]:
    """Every file under ``directory`` (name relative to it), made world-readable (0644):
    serving pods run as other users, and safetensors writes 0600."""
    out = {}
    for path in sorted(directory.rglob("*")):
        if path.is_file():
            os.chmod(path, FILE_MODE)
            out[path.relative_to(directory).as_posix()] = path
    return out


def has_tokenizer(names: Iterable[str]) -> bool:
    return any(name in TOKENIZER_FILES for name in names)
