"""The client a reconcile round uses: reads from the watch cache where it can, and every
write's answer (and every live read) fed back into it (:mod:`rtrl.kube.cache`)."""

from __future__ import annotations

from typing import Any

from .cache import ObjectCache
from .client import KubeClient, KubeError
from .index import Finder, ListFinder


class CacheFinder:
    """A :class:`rtrl.kube.index.Finder` over the cache's index of one kind and namespace."""

    def __init__(self, cache: ObjectCache, kind: str, namespace: str) -> None:
        self.cache, self.kind, self.namespace = cache, kind, namespace

    def named(self, name: str) -> dict[str, Any] | None:
        return self.cache.get(self.kind, self.namespace, name)

    def find(self, field: str, value: str) -> list[dict[str, Any]]:
        return self.cache.find(self.kind, self.namespace, field, value)


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
            with self.cache.request() as mark:
                items, _ = self.list_with_version(kind, namespace)
                self.cache.absorb_list(kind, namespace, None, items, mark)

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        self._refresh(kind, namespace)
        if self._from_cache(kind, namespace):
            self.cached_reads += 1
            return self.cache.get(kind, namespace, name)
        with self.cache.request() as mark:
            found = super().get(kind, namespace, name)
            self.cache.absorb_get(kind, namespace, name, found, mark)
        return found

    def list(
        self, kind: str, namespace: str, labels: dict[str, str] | None = None
    ) -> list[dict[str, Any]]:
        self._refresh(kind, namespace)
        if self._from_cache(kind, namespace):
            self.cached_reads += 1
            return self.cache.list(kind, namespace, labels)
        with self.cache.request() as mark:
            items, _ = self.list_with_version(kind, namespace, labels)
            self.cache.absorb_list(kind, namespace, labels, items, mark)
        return items

    def finder(self, kind: str, namespace: str) -> Finder:
        """From the cache's index where it is usable; else one live list, indexed."""
        self._refresh(kind, namespace)
        if self._from_cache(kind, namespace):
            self.cached_reads += 1
            return CacheFinder(self.cache, kind, namespace)
        return ListFinder(kind, self.list(kind, namespace))

    def create(self, manifest: dict[str, Any]) -> dict[str, Any] | None:
        kind, namespace = str(manifest["kind"]), str(manifest["metadata"].get("namespace"))
        with self.cache.request() as mark:
            try:
                created = super().create(manifest)
            except KubeError:
                self._failed(kind, namespace)
                raise
            if created is None:  # it existed already: whatever it is, the cache may not know it
                self._failed(kind, namespace)
            self.cache.wrote(kind, created, mark)
        return created

    def delete(self, kind: str, namespace: str, name: str) -> bool:
        with self.cache.request() as mark:
            try:
                gone, answer = self.delete_with_answer(kind, namespace, name)
            except KubeError:
                self._failed(kind, namespace)
                raise
            self.cache.deleted(kind, namespace, name, answer if gone else None, mark)
        return gone

    def patch(
        self, kind: str, namespace: str, name: str, patch: Any, **options: Any
    ) -> dict[str, Any] | None:
        """:meth:`KubeClient.patch` (``options``: its ``sub`` and ``json_patch``)."""
        with self.cache.request() as mark:
            try:
                patched = super().patch(kind, namespace, name, patch, **options)
            except KubeError:
                self._failed(kind, namespace)  # e.g. a JSON patch whose test no longer holds
                raise
            if patched is None:
                self.cache.absorb_get(kind, namespace, name, None, mark)
            else:
                self.cache.wrote(kind, patched, mark)
        return patched

    def _failed(self, kind: str, namespace: str) -> None:
        if kind in self.cache.kinds:
            self.write_failed = True
            self.cache.invalidate(kind, namespace)


__all__ = ["CacheFinder", "CachingClient"]
