"""A ConfigMap's keys projected into a directory as the kubelet's ConfigMap volume does.

The kubelet's atomic writer (``k8s.io/kubernetes/pkg/volume/util/atomic_writer.go``): the
keys are written into a new hidden, timestamped directory, a ``..data_tmp`` link to it is
renamed over ``..data`` (one atomic swap: a reader sees the old keys or the new ones, never
half of each), each key is a visible link ``<key> -> ..data/<key>``, and the keys the
ConfigMap no longer has and the previous timestamped directory are removed after the swap.
A reader that skips names starting with ``.`` (``rtrl-capture --adapters DIR``) sees exactly
the ConfigMap's keys. Local processes then read a "mounted" ConfigMap as pods do, and follow
its changes as the kubelet's sync brings them.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Mapping
from pathlib import Path

DATA = "..data"


def project(data: Mapping[str, str] | None, directory: Path) -> bool:
    """Make ``directory`` hold ``data``'s keys (None: a ConfigMap not there yet, projected
    as no keys); whether anything changed. Unchanged data writes nothing."""
    data = dict(data or {})
    directory.mkdir(parents=True, exist_ok=True)
    current = directory / DATA
    if current.is_dir() and _holds(current, data):
        return False
    stamp = directory / f"..{time.strftime('%Y_%m_%d_%H_%M_%S')}.{time.monotonic_ns()}"
    stamp.mkdir()
    for key, value in data.items():
        (stamp / key).write_text(value)
        os.chmod(stamp / key, 0o644)
    old = os.readlink(current) if current.is_symlink() else None
    tmp = directory / "..data_tmp"
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    tmp.symlink_to(stamp.name)
    os.replace(tmp, current)  # the swap
    for key in data:
        link = directory / key
        if not link.is_symlink():
            if link.exists():
                link.unlink()
            link.symlink_to(f"{DATA}/{key}")
    for entry in directory.iterdir():
        if not entry.name.startswith(".") and entry.name not in data and entry.is_symlink():
            entry.unlink()
    if old is not None and old != stamp.name:
        shutil.rmtree(directory / old, ignore_errors=True)
    return True


def _holds(current: Path, data: Mapping[str, str]) -> bool:
    have = {p.name for p in current.iterdir()}
    if have != set(data):
        return False
    return all((current / k).read_text() == v for k, v in data.items())
