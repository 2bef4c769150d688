"""A watch-fed view of the objects a reconcile round reads, so that a round triggered by an
event decides without a request to the API server.

:class:`ObjectCache` holds, per kind, the newest version known of each object, where
"newest" is by ``metadata.resourceVersion``. Three sources feed it:

- the watch streams (kopf's, through ``rtrl.handlers`` and ``rtrl.kube.watch``): every
  event's object, and DELETED;
- the operator's own writes: the object a create or patch answers, and a delete's result;
- live reads (a round that reads the cluster): every object listed or got, and the objects
  a list no longer contains.

Consistency rule: a version replaces the one held only if its resourceVersion is greater,
so an event that was in flight when the operator wrote never undoes the write, and the
operator's next round always sees its own writes (read-your-writes). A deleted object leaves
a tombstone with the resourceVersion at which it was known gone, so a late event or write
answer cannot bring it back. resourceVersions are compared as integers: every API server
backed by etcd issues them so (and the tests' emulator does); the first one that is not an
integer disables the cache for good, and every round reads live.

A re-list by kopf brings what exists, not what was deleted meanwhile: the next read of that
kind lists it all live first (:meth:`ObjectCache.relist`); nothing is re-read on a timer.

What the cache does not know makes a round read live instead (:meth:`ObjectCache.usable`):
before kopf has listed every cached kind (``mark_synced``), and for a kind of a namespace
after a write whose outcome it could not record (a create that met an existing object, a
JSON patch whose test failed: ``invalidate``) until a live read of that kind has refreshed
it. Objects the cache does not hold (Pods, Secrets, HTTPRoutes) are always read live.

Objects handed out are the cache's own: callers treat them as read-only (the planning core
copies before it changes anything).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any

from ..core.api.names import LABEL_RLCYCLE
from .client import KubeClient, KubeError

log = logging.getLogger("rtrl.kube")

# The kinds the operator watches and a round reads (see rtrl.handlers for the watches).
CACHED_KINDS = ("RLCycle", "Checkpoint", "Job", "Deployment", "Service", "ConfigMap", "CronJob")
# Kinds of which only the operator's children are kept: objects with this label.
CHILD_LABEL = LABEL_RLCYCLE
CHILD_KINDS = frozenset({"Job", "Service", "ConfigMap", "CronJob"})
# How long a deleted object's tombstone is kept (a late answer or event is older than this).
TOMBSTONE_SECONDS = 300.0

Key = tuple[str, str]  # (namespace, name)


def resource_version(obj: Mapping[str, Any] | None) -> int | None:
    """The object's resourceVersion as an integer; None when absent or not an integer."""
    rv = ((obj or {}).get("metadata") or {}).get("resourceVersion")
    if isinstance(rv, str) and rv.isdigit():
        return int(rv)
    return None


class _Any(str):
    """A label value that matches any value (the label must be present)."""

    def __eq__(self, other: object) -> bool:
        return other is not None

    __hash__ = str.__hash__


_any = _Any("*")


def _labels_match(obj: Mapping[str, Any], labels: Mapping[str, str] | None) -> bool:
    have = (obj.get("metadata") or {}).get("labels") or {}
    return all(v == have.get(k) for k, v in (labels or {}).items())


def copy_json(value: Any) -> Any:
    """A deep copy of parsed JSON (dicts, lists, scalars), several times faster than
    ``copy.deepcopy``; mappings (a kopf Body) come back as dicts."""
    if isinstance(value, Mapping):
        return {k: copy_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [copy_json(v) for v in value]
    return value


def _slim(obj: Mapping[str, Any]) -> dict[str, Any]:
    """A copy to keep: managedFields (often half an object's size) is never read."""
    out = dict(obj)
    meta = dict(out.get("metadata") or {})
    meta.pop("managedFields", None)
    out["metadata"] = meta
    return out


class ObjectCache:
    """The newest known version of each object of :data:`CACHED_KINDS`; thread-safe (fed on
    kopf's event loop, read by the reconcile threads)."""

    def __init__(self, kinds: Iterable[str] = CACHED_KINDS) -> None:
        self.kinds = frozenset(kinds)
        self._lock = threading.Lock()
        self._objects: dict[str, dict[Key, dict[str, Any]]] = {k: {} for k in self.kinds}
        self._tombstones: dict[tuple[str, Key], tuple[int, float]] = {}  # -> (gone at rv, time)
        self._invalid: set[tuple[str, str]] = set()  # (kind, namespace) to read live
        # (kind, namespace) kopf re-listed since the sync: to list in full before a read
        self._relisted: set[tuple[str, str]] = set()
        self.synced = False
        self.disabled = ""  # why, once a resourceVersion was not an integer

    # --- state -----------------------------------------------------------------------------
    def mark_synced(self) -> None:
        """kopf has listed every cached kind (its indexes are populated)."""
        self.synced = True

    def usable(self, kind: str, namespace: str) -> bool:
        """Whether a round may read ``kind`` in ``namespace`` from here."""
        return (
            kind in self.kinds
            and self.synced
            and not self.disabled
            and (kind, namespace) not in self._invalid
            and (kind, namespace) not in self._relisted
        )

    def relist(self, kind: str, namespace: str) -> None:
        """kopf re-lists ``kind`` in ``namespace`` (see :func:`rtrl.kube.watch.listing`)."""
        if kind in self.kinds:
            with self._lock:
                self._relisted.add((kind, namespace))

    def relisted(self, kind: str, namespace: str) -> bool:
        """Re-listed by kopf since the sync, and not yet listed in full live since."""
        return (kind, namespace) in self._relisted

    def invalidate(self, kind: str, namespace: str) -> None:
        """Read ``kind`` live in ``namespace`` until a live list refreshes it."""
        with self._lock:
            self._invalid.add((kind, namespace))

    def _disable(self, obj: Mapping[str, Any]) -> None:
        if not self.disabled:
            rv = (obj.get("metadata") or {}).get("resourceVersion")
            self.disabled = f"resourceVersion {rv!r} is not an integer"
            log.warning("object cache disabled, every round reads live: %s", self.disabled)

    # --- feeding ---------------------------------------------------------------------------
    def _put(self, kind: str, obj: Mapping[str, Any]) -> bool:
        """Keep ``obj`` unless a newer version (or a newer deletion) is known; lock held."""
        meta = obj.get("metadata") or {}
        key = (str(meta.get("namespace") or ""), str(meta.get("name") or ""))
        rv = resource_version(obj)
        if rv is None:
            self._disable(obj)
            return False
        held = self._objects[kind].get(key)
        held_rv = resource_version(held) if held is not None else None
        if held_rv is not None and held_rv >= rv:
            return False
        tomb = self._tombstones.get((kind, key))
        if tomb is not None:
            if tomb[0] >= rv:
                return False
            del self._tombstones[(kind, key)]
        self._objects[kind][key] = _slim(obj)
        return True

    def _drop(self, kind: str, key: Key, rv: int) -> None:
        """Known gone at ``rv``; lock held."""
        held = self._objects[kind].get(key)
        held_rv = resource_version(held) if held is not None else None
        if held_rv is not None and held_rv > rv:
            return  # a newer object of that name (re-created) is held
        self._objects[kind].pop(key, None)
        tomb = self._tombstones.get((kind, key))
        self._tombstones[(kind, key)] = (max(rv, tomb[0] if tomb else rv), time.monotonic())

    def feed(self, kind: str, event_type: str | None, obj: Mapping[str, Any]) -> None:
        """A watch event (``event_type`` None for kopf's listing)."""
        if kind not in self.kinds:
            return
        with self._lock:
            if event_type == "DELETED":
                meta = obj.get("metadata") or {}
                key = (str(meta.get("namespace") or ""), str(meta.get("name") or ""))
                rv = resource_version(obj)
                if rv is None:
                    self._disable(obj)
                    return
                self._drop(kind, key, rv)
            elif kind in CHILD_KINDS and not _labels_match(obj, {CHILD_LABEL: _any}):
                # not (or no longer) one of the operator's children: not kept
                meta = obj.get("metadata") or {}
                key = (str(meta.get("namespace") or ""), str(meta.get("name") or ""))
                rv = resource_version(obj)
                if rv is None:
                    self._disable(obj)
                elif key in self._objects[kind]:
                    self._drop(kind, key, rv)
            else:
                self._put(kind, obj)

    def wrote(self, kind: str, obj: Mapping[str, Any] | None) -> None:
        """What a create or patch of the operator answered (the object as written)."""
        if kind in self.kinds and obj:
            with self._lock:
                self._put(kind, obj)

    def deleted(
        self, kind: str, namespace: str, name: str, answer: Mapping[str, Any] | None
    ) -> None:
        """The operator deleted ``name`` (``answer``: the API's answer, when an object).

        With finalizers the answer is the object, now with a deletionTimestamp, and it is
        kept as such; otherwise the object is gone. When the answer says neither, the kind is
        read live until a list shows where things stand."""
        if kind not in self.kinds:
            return
        key = (namespace, name)
        with self._lock:
            if answer and answer.get("kind") == kind and resource_version(answer) is not None:
                if (answer.get("metadata") or {}).get("deletionTimestamp"):
                    self._put(kind, answer)
                else:
                    rv = resource_version(answer)
                    assert rv is not None
                    held = resource_version(self._objects[kind].get(key))
                    self._drop(kind, key, max(rv, held or rv))
            else:
                self._invalid.add((kind, namespace))

    def absorb_get(
        self, kind: str, namespace: str, name: str, obj: Mapping[str, Any] | None
    ) -> None:
        """A live GET's answer: the object, or None (not found: gone since what is held).
        Clears ``invalidate`` (the round that reads live after a conflict re-reads what it
        wrote; kinds read by name, as Deployments, are never listed)."""
        if kind not in self.kinds:
            return
        with self._lock:
            self._invalid.discard((kind, namespace))
            if obj is not None:
                self._put(kind, obj)
                return
            key = (namespace, name)
            held = self._objects[kind].get(key)
            held_rv = resource_version(held)
            if held_rv is not None:
                self._drop(kind, key, held_rv)

    def absorb_list(
        self,
        kind: str,
        namespace: str,
        labels: Mapping[str, str] | None,
        items: list[dict[str, Any]],
        list_rv: int | None,
    ) -> None:
        """A live LIST's answer (at ``list_rv``): its objects, and the held objects of that
        selection it no longer contains (gone by then). Clears ``invalidate``."""
        if kind not in self.kinds:
            return
        with self._lock:
            for obj in items:
                if kind not in CHILD_KINDS or _labels_match(obj, {CHILD_LABEL: _any}):
                    self._put(kind, obj)
            if list_rv is None:
                return  # nothing known about what is gone: leave the kind as it was
            listed = {str((o.get("metadata") or {}).get("name")) for o in items}
            for key, held in list(self._objects[kind].items()):
                if key[0] == namespace and key[1] not in listed and _labels_match(held, labels):
                    self._drop(kind, key, list_rv)
            self._invalid.discard((kind, namespace))
            if not labels:
                self._relisted.discard((kind, namespace))
            self._prune()

    def _prune(self) -> None:
        cutoff = time.monotonic() - TOMBSTONE_SECONDS
        for key, (_, at) in list(self._tombstones.items()):
            if at < cutoff:
                del self._tombstones[key]

    # --- reading ---------------------------------------------------------------------------
    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        with self._lock:
            return self._objects[kind].get((namespace, name))

    def list(  # namespace None: every namespace (the metrics' scrape)
        self, kind: str, namespace: str | None, labels: Mapping[str, str] | None = None
    ) -> list[dict[str, Any]]:
        with self._lock:
            if namespace is None:
                return [obj for obj in self._objects[kind].values() if _labels_match(obj, labels)]
            held = self._objects[kind].items()
            if not labels:  # every Checkpoint of a namespace: 10,000 at scale, each round
                return [obj for (ns, _), obj in held if ns == namespace]
            return [obj for (ns, _), obj in held if ns == namespace and _labels_match(obj, labels)]

    def size(self) -> int:
        with self._lock:
            return sum(len(objs) for objs in self._objects.values())


class CachingClient(KubeClient):
    """A :class:`KubeClient` whose writes feed an :class:`ObjectCache` and whose reads come
    from it where it is usable; with ``live=True`` every read goes to the API server (and
    refreshes the cache); ``live_kinds``: only reads of these kinds do. One per round: it
    shares the connection pool of ``client``."""

    def __init__(self, client: KubeClient, cache: ObjectCache, *, live: bool = False,
                 live_kinds: frozenset[str] = frozenset()):  # fmt: skip
        super().__init__(client.api)
        self.cache = cache
        self.live = live
        self.live_kinds = live_kinds
        self.cached_reads = 0
        self.write_failed = False  # a write failed or met a conflict: read live next round

    def _from_cache(self, kind: str, namespace: str) -> bool:
        return not self.live and kind not in self.live_kinds and self.cache.usable(kind, namespace)

    def reads_remotely(self, kind: str, namespace: str) -> bool:
        return self.cache.relisted(kind, namespace) or not self._from_cache(kind, namespace)

    def _refresh(self, kind: str, namespace: str) -> None:
        """After a re-list: one full live list, which drops what was deleted meanwhile."""
        if self.cache.relisted(kind, namespace):
            items, list_rv = self.list_with_version(kind, namespace)
            self.cache.absorb_list(kind, namespace, None, items, list_rv)

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        self._refresh(kind, namespace)
        if self._from_cache(kind, namespace):
            self.cached_reads += 1
            return self.cache.get(kind, namespace, name)
        found = super().get(kind, namespace, name)
        self.cache.absorb_get(kind, namespace, name, found)
        return found

    def list(
        self, kind: str, namespace: str, labels: dict[str, str] | None = None
    ) -> list[dict[str, Any]]:
        self._refresh(kind, namespace)
        if self._from_cache(kind, namespace):
            self.cached_reads += 1
            return self.cache.list(kind, namespace, labels)
        items, list_rv = self.list_with_version(kind, namespace, labels)
        self.cache.absorb_list(kind, namespace, labels, items, list_rv)
        return items

    def create(self, manifest: dict[str, Any]) -> dict[str, Any] | None:
        kind, namespace = str(manifest["kind"]), str(manifest["metadata"].get("namespace"))
        try:
            created = super().create(manifest)
        except KubeError:
            self._failed(kind, namespace)
            raise
        if created is None:  # it existed already: whatever it is, the cache may not know it
            self._failed(kind, namespace)
        self.cache.wrote(kind, created)
        return created

    def delete(self, kind: str, namespace: str, name: str) -> bool:
        try:
            gone, answer = self.delete_with_answer(kind, namespace, name)
        except KubeError:
            self._failed(kind, namespace)
            raise
        self.cache.deleted(kind, namespace, name, answer if gone else None)
        return gone

    def patch(
        self, kind: str, namespace: str, name: str, patch: Any, **options: Any
    ) -> dict[str, Any] | None:
        """:meth:`KubeClient.patch` (``options``: its ``sub`` and ``json_patch``)."""
        try:
            patched = super().patch(kind, namespace, name, patch, **options)
        except KubeError:
            self._failed(kind, namespace)  # e.g. a JSON patch whose test no longer holds
            raise
        if patched is None:
            self.cache.absorb_get(kind, namespace, name, None)
        else:
            self.cache.wrote(kind, patched)
        return patched

    def _failed(self, kind: str, namespace: str) -> None:
        if kind in self.cache.kinds:
            self.write_failed = True
            self.cache.invalidate(kind, namespace)


__all__ = ["CACHED_KINDS", "CachingClient", "ObjectCache", "copy_json", "resource_version"]
