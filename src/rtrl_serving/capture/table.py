"""The routing table as the sidecar reads it (``--adapters PATH``): one file, or a directory
of files, one per writer.

A directory is how a ConfigMap that several RLCycles write (each its own key,
``<rlcycle>.yaml``) is mounted: every ``*.yaml``, ``*.yml`` and ``*.json`` in it is an
:class:`~rtrl.core.api.adapter.AdapterRouting` document (an empty one routes nothing), and
the table is their union. Entries whose names start with ``.`` are the kubelet's (its
``..data`` link, swapped atomically, and the timestamped directory it points to) and are
skipped, as is a visible link whose target the kubelet has just taken away. An organisation
routed by two files, or one adapter name given two URIs, refuses the whole table, the
message naming both files.

:func:`snapshot` is the files' names and bytes: the sidecar compares it with the last one
(polled every second, a few small files) and parses that same snapshot (:func:`parse`), so
what it applies is what it compared.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import ValidationError

from rtrl.core.api.adapter import AdapterRouting, OrgRoute
from rtrl.core.store import redact

SUFFIXES = (".yaml", ".yml", ".json")
# each file of the table and its bytes, or why it could not be read
Snapshot = tuple[tuple[Path, bytes | str], ...]


class TableError(Exception):
    """The routing table cannot be read; the message names the file and the field."""


def snapshot(path: Path) -> Snapshot | None:
    """The table's files at ``path`` (a file, or a directory of them) with their bytes;
    None where ``path`` does not exist."""
    if not path.is_dir():
        one = _read(path)
        return None if one is None else ((path, one),)
    try:
        entries = sorted(path.iterdir())
    except FileNotFoundError:
        return None
    except OSError as exc:
        return ((path, exc.strerror or str(exc)),)
    files = []
    for entry in entries:
        if entry.name.startswith(".") or entry.suffix not in SUFFIXES or not entry.is_file():
            continue
        content = _read(entry)
        if content is not None:  # else gone since it was listed: the kubelet's swap
            files.append((entry, content))
    return tuple(files)


def _read(path: Path) -> bytes | str | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        return exc.strerror or str(exc)


def parse(files: Snapshot) -> AdapterRouting:
    """The union of the files' tables; TableError naming the file(s) and the field."""
    orgs: dict[str, OrgRoute] = {}
    routed_by: dict[str, Path] = {}  # org -> the file that routes it
    named: dict[str, tuple[str, Path]] = {}  # adapter name -> (uri, the file naming it first)
    tables = [(path, _parse_one(path, content)) for path, content in files]
    if len(tables) == 1:
        return tables[0][1]  # one file: its table as it is
    for path, table in tables:
        for org, route in table.orgs.items():
            if org in routed_by:
                raise TableError(
                    f"{routed_by[org]} and {path}: orgs.{org}: the organisation is routed by "
                    "both files; one organisation, one file"
                )
            routed_by[org], orgs[org] = path, route
            for ref in (route.stable, route.canary):
                if ref is None:
                    continue
                uri, first = named.setdefault(ref.name, (ref.uri, path))
                if uri != ref.uri:
                    raise TableError(
                        f"{first} and {path}: orgs.{org}: adapter name {ref.name!r} names two "
                        f"adapters ({redact(uri)} and {redact(ref.uri)}); one name, one adapter"
                    )
    try:
        return AdapterRouting(orgs=orgs)
    except ValidationError as exc:  # what only the union breaks: too many organisations
        raise TableError(f"{files[0][0].parent}: {_problems(exc)}") from None


def read_table(path: Path) -> AdapterRouting:
    """The table at ``path`` (a YAML or JSON file, or a directory of them)."""
    files = snapshot(path)
    if files is None:
        raise TableError(f"{path}: no such file or directory")
    return parse(files)


def _parse_one(path: Path, content: bytes | str) -> AdapterRouting:
    if isinstance(content, str):
        raise TableError(f"{path}: cannot read: {content}")
    try:
        doc = yaml.safe_load(content)
    except yaml.YAMLError as exc:
        raise TableError(f"{path}: not YAML or JSON: {' '.join(str(exc).split())}") from None
    try:
        return AdapterRouting.model_validate(doc if doc is not None else {})
    except ValidationError as exc:
        raise TableError(f"{path}: {_problems(exc)}") from None


def _problems(exc: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(p) for p in e['loc']) or '(top)'}: {e['msg']}" for e in exc.errors()
    )
