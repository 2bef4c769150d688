"""A watch-fed view of the objects a reconcile round reads, so that a round triggered by an
event decides without a request to the API server, and reads only its own objects.

:class:`ObjectCache` holds, per kind, the newest version known of each object. Three
sources feed it:

- the watch streams (kopf's, through ``rtrl.handlers`` and ``rtrl.kube.watch``, and the
  Checkpoints' own, ``rtrl.kube.informer``): every event's object, and DELETED;
- the operator's own writes: the object a create or patch answers, and a delete's result;
- live reads (a round that reads the cluster): every object listed or got, and the objects
  a list no longer contains.

resourceVersions are opaque (Kubernetes compares them for equality only), so "newest" is
decided without ordering them: the watch delivers each object's versions in order (kopf
hands one object's events, by uid, to one worker); an answer (to a write or a live read)
is at least as new as all the cache knew when its request was sent, and is ordered against
the watch's events meanwhile by :mod:`rtrl.kube.changelog`. An answer newer than the watch
is held "ahead", hiding the watch's older events until the watch delivers that very version
(equality): an event in flight never undoes the operator's write, and its next round sees
its own writes. A deleted object's uid is a tombstone: nothing of that uid comes back (an
object created again under its name has another uid). Where neither settles it (two
incarnations of one name delivered by two workers), the kind is read live in that
namespace until a live read has; two answers crossing need not be (the watch delivers both,
in their order).

A re-list by kopf brings what exists, not what was deleted meanwhile: the next read of that
kind lists it all live first (:meth:`ObjectCache.relist`); nothing is re-read on a timer.

What the cache does not know makes a round read live instead (:meth:`ObjectCache.usable`):
before kopf has listed every cached kind (``mark_synced``), Checkpoints of a namespace
before their informer's first listing (``informed``), and for a kind of a namespace
after a write whose outcome it could not record (a create that met an existing object, a
JSON patch whose test failed: ``invalidate``) until a live read of that kind has refreshed
it. Objects the cache does not hold (Pods, Secrets, HTTPRoutes) are always read live.

Objects are indexed by the fields a round finds them by (:mod:`rtrl.kube.index`: the
RLCycle label; a Checkpoint's RLCycle, URI and phase), so a round costs its own objects,
not its namespace's. Objects handed out are the cache's own: callers treat them as
read-only (the planning core copies before it changes anything).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from ..core.api.names import LABEL_RLCYCLE
from .changelog import Change, ChangeLog, Key
from .index import LABEL, values
from .kept import (
    CACHED_KINDS,
    CHILD_KINDS,
    CHILD_LABEL,
    TOMBSTONE_SECONDS,
    Entry,
    copy_json,
    ids,
    is_child,
    labels_match,
    slim,
)

log = logging.getLogger("rtrl.kube")


class ObjectCache:
    """The newest known version of each object of :data:`CACHED_KINDS`; thread-safe (fed on
    kopf's event loop, read by the reconcile threads)."""

    def __init__(self, kinds: Iterable[str] = CACHED_KINDS, informed: Iterable[str] = ()) -> None:
        self.kinds = frozenset(kinds)
        # kinds listed a namespace at a time (rtrl.kube.informer): usable in a namespace
        # once its listing is in (``informed``)
        self.informed_kinds = frozenset(informed)
        self._informed: set[tuple[str, str]] = set()
        self._lock = threading.Lock()
        # kind -> namespace -> name -> entry
        self._objects: dict[str, dict[str, dict[str, Entry]]] = {k: {} for k in self.kinds}
        # (kind, namespace, field, value) -> names (a dict: insertion-ordered set)
        self._index: dict[tuple[str, str, str, str], dict[str, None]] = {}
        self._gone: dict[str, float] = {}  # uid -> when known deleted
        self._changes = ChangeLog()  # what changed while requests were in flight
        self._invalid: set[tuple[str, str]] = set()  # (kind, namespace) to read live
        # (kind, namespace) kopf re-listed since the sync: to list in full before a read
        self._relisted: set[tuple[str, str]] = set()
        self.synced = False

    # --- state -----------------------------------------------------------------------------
    def mark_synced(self) -> None:
        """kopf has listed every cached kind (its indexes are populated)."""
        self.synced = True

    def informed(self, kind: str, namespace: str) -> None:
        """The first listing of ``kind`` (one of ``informed``) in ``namespace`` is in."""
        with self._lock:
            self._informed.add((kind, namespace))

    def usable(self, kind: str, namespace: str) -> bool:
        """Whether a round may read ``kind`` in ``namespace`` from here."""
        return (
            kind in self.kinds
            and self.synced
            and (kind not in self.informed_kinds or (kind, namespace) in self._informed)
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

    def _unsure(self, kind: str, namespace: str, why: str) -> None:
        if (kind, namespace) not in self._invalid:
            log.info("%s in %s read live until a live read settles it: %s", kind, namespace, why)
        self._invalid.add((kind, namespace))

    # --- requests in flight ----------------------------------------------------------------
    def begin(self) -> int:
        """A request whose answer will feed the cache is sent now: the mark to pass with
        its answer (:mod:`rtrl.kube.changelog`); :meth:`end` when it is in."""
        with self._lock:
            return self._changes.begin()

    def end(self, mark: int) -> None:
        with self._lock:
            self._changes.end(mark)

    @contextlib.contextmanager
    def request(self) -> Iterator[int]:
        mark = self.begin()
        try:
            yield mark
        finally:
            self.end(mark)

    def _since(self, kind: str, namespace: str, mark: int) -> dict[Key, list[Change]]:
        return self._changes.since(kind, namespace, mark)

    # --- the store ---------------------------------------------------------------------------
    def _entry(self, kind: str, key: Key) -> Entry | None:
        return self._objects[kind].get(key[0], {}).get(key[1])

    def _unindex(self, kind: str, key: Key, obj: Mapping[str, Any] | None) -> None:
        for field, value in values(kind, obj) if obj is not None else ():
            names = self._index.get((kind, key[0], field, value))
            if names is not None:
                names.pop(key[1], None)
                if not names:
                    del self._index[(kind, key[0], field, value)]

    def _set(self, kind: str, key: Key, entry: Entry | None, *, watch: bool) -> None:
        """Make ``entry`` the name's state (None: gone); lock held."""
        before = self._entry(kind, key)
        self._changes.seq += 1
        uid = entry.uid if entry else (before.uid if before else "")
        was = (before.uid, before.rv, before.watched) if before else None
        self._changes.record(
            Change(self._changes.seq, kind, key, uid, entry.rv if entry else "", watch, was)
        )
        old = before.obj if before is not None else None
        new = entry.obj if entry is not None else None
        if old is not new:
            self._unindex(kind, key, old)
            for field, value in values(kind, new) if new is not None else ():
                self._index.setdefault((kind, key[0], field, value), {})[key[1]] = None
        names = self._objects[kind].setdefault(key[0], {})
        if entry is None:
            names.pop(key[1], None)
            if not names:
                del self._objects[kind][key[0]]
        else:
            entry.seq = self._changes.seq
            names[key[1]] = entry

    def _bury(self, kind: str, key: Key, uid: str, *, watch: bool) -> None:
        """``uid`` is deleted: never brought back; its name is empty unless another
        incarnation holds it."""
        if uid:
            self._gone[uid] = time.monotonic()
            if len(self._gone) % 256 == 0:  # tombstones outlive no late event: bounded
                self._prune()
        held = self._entry(kind, key)
        if held is not None and (held.uid == uid or not uid):
            self._set(kind, key, None, watch=watch)

    # --- feeding ---------------------------------------------------------------------------
    def feed(self, kind: str, event_type: str | None, obj: Mapping[str, Any]) -> None:
        """A watch event (``event_type`` None for kopf's listing)."""
        if kind not in self.kinds:
            return
        key, uid, rv = ids(obj)
        with self._lock:
            if uid and uid in self._gone:
                return  # a late event of a deleted object
            if event_type == "DELETED":
                self._bury(kind, key, uid, watch=True)
                return
            kept = slim(obj) if kind not in CHILD_KINDS or is_child(obj) else None
            held = self._entry(kind, key)
            if held is None:
                if kept is not None:
                    self._set(kind, key, Entry(kept, uid, rv, rv, None, False, 0), watch=True)
            elif held.uid != uid:
                # another incarnation of the name, each delivered by its own worker: which
                # is the newer? The deletion of the older one is on its way.
                self._unsure(kind, key[0], f"two objects named {key[1]} (uids {held.uid}, {uid})")
                rivals = tuple({*held.rivals, held.uid} - {uid})
                self._set(kind, key, Entry(kept, uid, rv, rv, None, False, 0, rivals), watch=True)
            elif held.ahead and held.rv != rv:
                # older than the answer held (in flight when it was written): not shown
                behind = Entry(held.obj, uid, held.rv, rv, kept, True, 0)
                self._set(kind, key, behind, watch=True)
            else:  # the next version, or the very one an answer held ahead
                self._set(kind, key, Entry(kept, uid, rv, rv, None, False, 0), watch=True)

    def _answer(self, kind: str, obj: Mapping[str, Any], mark: int, changes: list[Change]) -> None:
        """An answer from the API server (a write's, a live read's) to a request sent at
        ``mark``, ``changes`` the name's changes since; lock held."""
        key, uid, rv = ids(obj)
        if uid and uid in self._gone:
            return  # deleted since (the answer left the server before the deletion)
        held = self._entry(kind, key)
        kept = slim(obj) if kind not in CHILD_KINDS or is_child(obj) else None
        first = changes[0].before if changes else None
        at_mark = first if changes else ((held.uid, held.rv, held.watched) if held else None)
        if held is not None and held.seq <= mark:
            for rival in held.rivals if uid in (held.uid, *held.rivals) else ():
                if rival != uid:  # the answer says which incarnation exists: not this one
                    self._gone[rival] = time.monotonic()
            if held.rivals and held.uid == uid:
                self._set(kind, key, dataclasses.replace(held, rivals=()), watch=False)
                held = self._entry(kind, key)
        if held is not None and held.uid != uid:
            if at_mark is not None and at_mark[0] == held.uid:
                self._bury(kind, key, held.uid, watch=False)  # replaced before the answer
            else:
                self._unsure(kind, key[0], f"{key[1]} was created again meanwhile")
            held = None
        if held is None:
            self._set(kind, key, Entry(kept, uid, rv, "", None, True, 0), watch=False)
            return
        # Two answers crossing (a round's write, a notifier's) need no live read: whichever
        # is held ahead, the watch delivers both in their order and the later one stays.
        watched = {c.rv for c in changes if c.watch and c.uid == uid}
        if at_mark is not None and at_mark[0] == uid:
            watched.add(at_mark[2])
        watched.discard("")
        if rv in watched:
            # the watch has delivered this version, and perhaps newer ones since: it leads
            if held.ahead:
                self._set(kind, key, Entry(held.watched_obj, uid, held.watched, held.watched,
                                            None, False, 0), watch=False)  # fmt: skip
        elif rv != held.rv:  # newer than anything the watch said: held until it says so
            watched_obj = held.watched_obj if held.ahead else held.obj
            self._set(kind, key, Entry(kept, uid, rv, held.watched, watched_obj, True, 0),
                      watch=False)  # fmt: skip

    def _mark(self, mark: int | None) -> int:
        return self._changes.seq if mark is None else mark

    def wrote(self, kind: str, obj: Mapping[str, Any] | None, mark: int | None = None) -> None:
        """What a create or patch of the operator answered (the object as written); ``mark``:
        :meth:`begin` before its request (None: just now)."""
        if kind in self.kinds and obj:
            with self._lock:
                since = self._mark(mark)
                key = ids(obj)[0]
                self._answer(kind, obj, since, self._since(kind, key[0], since).get(key, []))

    def deleted(self, kind: str, namespace: str, name: str, answer: Mapping[str, Any] | None,
                mark: int | None = None) -> None:  # fmt: skip
        """The operator deleted ``name`` (``answer``: the API's answer, when an object).

        With finalizers the answer is the object, now with a deletionTimestamp, and it is
        kept as such; otherwise the object is gone. When the answer says neither, the kind is
        read live until a list shows where things stand."""
        if kind not in self.kinds:
            return
        key = (namespace, name)
        with self._lock:
            since = self._mark(mark)
            if answer and answer.get("kind") == kind and ids(answer)[1]:
                if (answer.get("metadata") or {}).get("deletionTimestamp"):
                    self._answer(
                        kind, answer, since, self._since(kind, namespace, since).get(key, [])
                    )
                else:
                    self._bury(kind, key, ids(answer)[1], watch=False)
            else:
                self._invalid.add((kind, namespace))

    def absorb_get(self, kind: str, namespace: str, name: str, obj: Mapping[str, Any] | None,
                   mark: int | None = None) -> None:  # fmt: skip
        """A live GET's answer: the object, or None (not found: gone since what is held).
        Clears ``invalidate`` (the round that reads live after a conflict re-reads what it
        wrote; kinds read by name, as Deployments, are never listed)."""
        if kind not in self.kinds:
            return
        key = (namespace, name)
        with self._lock:
            since = self._mark(mark)
            self._invalid.discard((kind, namespace))
            if obj is not None:
                self._answer(kind, obj, since, self._since(kind, namespace, since).get(key, []))
                return
            held = self._entry(kind, key)
            if held is not None and held.seq <= since:
                self._bury(kind, key, held.uid, watch=False)

    def absorb_list(self, kind: str, namespace: str, labels: Mapping[str, str] | None,
                    items: list[dict[str, Any]], mark: int | None = None) -> None:  # fmt: skip
        """A live LIST's answer to a request sent at ``mark``: its objects, and the held
        objects of that selection it no longer contains (gone by then, unless they changed
        while it was in flight). Clears ``invalidate``."""
        if kind not in self.kinds:
            return
        with self._lock:
            since = self._mark(mark)
            changes = self._since(kind, namespace, since)
            for obj in items:
                if kind not in CHILD_KINDS or is_child(obj):
                    self._answer(kind, obj, since, changes.get(ids(obj)[0], []))
            listed = {str((o.get("metadata") or {}).get("name")) for o in items}
            for name, held in list(self._objects[kind].get(namespace, {}).items()):
                if (
                    name not in listed
                    and held.seq <= since
                    and held.obj is not None
                    and labels_match(held.obj, labels)
                ):
                    self._bury(kind, (namespace, name), held.uid, watch=False)
            self._invalid.discard((kind, namespace))
            if not labels:
                self._relisted.discard((kind, namespace))
            self._prune()

    def _prune(self) -> None:
        cutoff = time.monotonic() - TOMBSTONE_SECONDS
        for uid, at in list(self._gone.items()):
            if at < cutoff:
                del self._gone[uid]

    # --- reading ---------------------------------------------------------------------------
    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        with self._lock:
            held = self._entry(kind, (namespace, name))
            return held.obj if held is not None else None

    def find(self, kind: str, namespace: str, field: str, value: str) -> list[dict[str, Any]]:
        """The objects of ``kind`` in ``namespace`` whose ``field`` (:mod:`rtrl.kube.index`)
        is ``value``: an index look-up, not a pass over the namespace."""
        with self._lock:
            names = self._index.get((kind, namespace, field, value)) or {}
            held = self._objects[kind].get(namespace) or {}
            return [e.obj for e in (held.get(n) for n in names) if e is not None and e.obj]

    def list(  # namespace None: every namespace (the metrics' scrape)
        self, kind: str, namespace: str | None, labels: Mapping[str, str] | None = None
    ) -> list[dict[str, Any]]:
        labels = labels or {}
        rlcycle = labels.get(LABEL_RLCYCLE)
        if namespace is not None and rlcycle is not None:  # a round's children: its own
            found = self.find(kind, namespace, LABEL, rlcycle)
            return [o for o in found if labels_match(o, labels)] if len(labels) > 1 else found
        with self._lock:
            spaces = (
                list(self._objects[kind].values())
                if namespace is None
                else [self._objects[kind].get(namespace) or {}]
            )
            return [
                e.obj
                for held in spaces
                for e in held.values()
                if e.obj is not None and labels_match(e.obj, labels)
            ]


__all__ = ["CACHED_KINDS", "CHILD_KINDS", "CHILD_LABEL", "ObjectCache", "copy_json"]
