"""What the watch cache keeps of an object: which kinds, which of their objects (the
operator's children), a slim copy, and each name's state (:class:`Entry`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..core.api.names import LABEL_RLCYCLE
from .changelog import Key

# The kinds the operator watches and a round reads (see rtrl.handlers for the watches).
CACHED_KINDS = ("RLCycle", "Checkpoint", "Job", "Deployment", "Service", "ConfigMap", "CronJob")
# Cached kinds that rtrl lists and watches itself, a namespace at a time (rtrl.kube.informer),
# not kopf: a namespace's Checkpoints are ten times its RLCycles, and kopf's memory of each
# object cost more than the cache's copy.
INFORMED_KINDS = frozenset({"Checkpoint"})
# Kinds of which only the operator's children are kept: objects with this label.
CHILD_LABEL = LABEL_RLCYCLE
CHILD_KINDS = frozenset({"Job", "Service", "ConfigMap", "CronJob"})
# How long a deleted object's tombstone is kept (a late answer or event is older than this).
TOMBSTONE_SECONDS = 300.0


def ids(obj: Mapping[str, Any]) -> tuple[Key, str, str]:
    """(namespace, name), uid and resourceVersion (opaque strings)."""
    meta = obj.get("metadata") or {}
    key = (str(meta.get("namespace") or ""), str(meta.get("name") or ""))
    return key, str(meta.get("uid") or ""), str(meta.get("resourceVersion") or "")


def labels_match(obj: Mapping[str, Any], labels: Mapping[str, str] | None) -> bool:
    have = (obj.get("metadata") or {}).get("labels") or {}
    return all(v == have.get(k) for k, v in (labels or {}).items())


def is_child(obj: Mapping[str, Any]) -> bool:
    return CHILD_LABEL in ((obj.get("metadata") or {}).get("labels") or {})


def copy_json(value: Any) -> Any:
    """A deep copy of parsed JSON (dicts, lists, scalars), several times faster than
    ``copy.deepcopy``; mappings (a kopf Body) come back as dicts."""
    if isinstance(value, Mapping):
        return {k: copy_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [copy_json(v) for v in value]
    return value


def slim(obj: Mapping[str, Any]) -> dict[str, Any]:
    """A copy to keep: managedFields (often half an object's size) is never read."""
    out = dict(obj)
    meta = dict(out.get("metadata") or {})
    meta.pop("managedFields", None)
    out["metadata"] = meta
    return out


@dataclass(slots=True)
class Entry:
    """One name's state. ``obj``: what reads get (None: exists, but not one of the
    operator's children); ``ahead``: ``obj`` came from an answer the watch has not delivered
    yet; ``watched``/``watched_obj``: the watch's last version of ``uid``; ``seq``: the
    cache's change count when it last changed; ``rivals``: see the field."""

    obj: dict[str, Any] | None
    uid: str
    rv: str
    watched: str
    watched_obj: dict[str, Any] | None
    ahead: bool
    seq: int
    rivals: tuple[str, ...] = ()  # uids of other incarnations seen, not known gone


__all__ = [
    "CACHED_KINDS",
    "CHILD_KINDS",
    "CHILD_LABEL",
    "INFORMED_KINDS",
    "TOMBSTONE_SECONDS",
    "Entry",
    "copy_json",
]
