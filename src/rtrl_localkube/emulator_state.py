"""What the emulated API server stores and how a write changes it (see
:mod:`rtrl_localkube.emulator` for the rules it follows and those it does not)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import itertools
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import Any, cast

import attrs
import jsonpatch
import jsonpointer
import kmock
from kmock._internal import rendering

from .kinds import BUILTIN_KINDS, VERBS, Kind, api_error, kinds_from_crd, now_rfc3339
from .patch import merge_patch


def _spec_part(obj: Mapping[str, Any]) -> dict[str, Any]:
    """What ``generation`` tracks: everything but ``metadata`` and ``status``."""
    return {k: v for k, v in obj.items() if k not in ("metadata", "status")}


def _fold_string_data(obj: dict[str, Any]) -> None:
    string_data = obj.pop("stringData", None) or {}
    if string_data:
        data = dict(obj.get("data") or {})
        for key, value in string_data.items():
            data[key] = base64.b64encode(str(value).encode()).decode()
        obj["data"] = data


_ObjectKey = tuple[kmock.resource, str | None, str]


@attrs.define(kw_only=True)
class EmulatorState(kmock.KubernetesEmulator):
    """The emulator's registry of kinds and its state changes (create, patch, replace,
    delete, garbage collection), each called under kmock's lock by
    :class:`~rtrl_localkube.emulator.KubeEmulator`, which routes the requests to them."""

    crd_documents: list[dict[str, Any]] = attrs.field(factory=list)
    namespaces: set[str] = attrs.field(factory=lambda: {"default"})
    # Called after a write (create, patch, delete, replace) is applied and before it is
    # answered, with (HTTP method, path, request body, resulting object): lets a test act at
    # an exact point (tests/integration/test_kubectl_plugin.py records the plugin's writes).
    # It runs in the server's thread and loop, so keep it short; if it raises, the client
    # gets a 500 for a write that was applied. Failed writes (404, 409...) do not call it.
    after_write: Callable[[str, str, Any, dict[str, Any] | None], None] | None = None
    # Seconds every watch event takes to reach the watchers (0: at once): a lagging watch,
    # as under load, for the tests of the operator's watch cache.
    watch_delay: float = 0.0

    # (method, path) of every request served, oldest first. kmock's own list of requests is
    # emptied as they are answered: kmock scans it to route each new request, which made
    # long tests slower and slower (quadratic; 90% of the emulator's CPU in a profile).
    request_log: list[tuple[str, str]] = attrs.field(factory=list, init=False)
    _kinds: dict[kmock.resource, Kind] = attrs.field(factory=dict, init=False)
    _counter: Iterator[int] = attrs.field(factory=lambda: itertools.count(1), init=False)
    _last_rv: int = attrs.field(default=0, init=False)
    _results: dict[Any, dict[str, Any]] = attrs.field(factory=dict, init=False)
    _closing: asyncio.Event | None = attrs.field(default=None, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        for kind in BUILTIN_KINDS:
            self.register(kind)
        for crd in self.crd_documents:
            for kind in kinds_from_crd(crd):
                self.register(kind)
            self._store_initial(
                self._kind_of("apiextensions.k8s.io", "customresourcedefinitions"), crd
            )

    # Registry -----------------------------------------------------------------------------

    def register(self, kind: Kind) -> None:
        """Make a resource known: discoverable, listable, writable."""
        self._kinds[kind.resource] = kind
        self.resources[kind.resource] = kmock.ResourceInfo(
            kind=kind.kind,
            namespaced=kind.namespaced,
            singular=kind.singular or kind.kind.lower(),
            verbs=set(VERBS),
            shortnames=set(kind.shortnames),
            categories=set(kind.categories),
            subresources={"status"} if kind.status_subresource else set(),
        )

    def kind_for(self, api_version: str, kind: str) -> Kind:
        for known in self._kinds.values():
            if known.api_version == api_version and known.kind == kind:
                return known
        raise KeyError(f"unknown kind {api_version} {kind}")

    def _kind_of(self, group: str, plural: str) -> Kind:
        return next(k for k in self._kinds.values() if k.group == group and k.plural == plural)

    def _known(self, resource: kmock.resource | None) -> Kind:
        kind = self._kinds.get(resource) if resource is not None else None
        if kind is None:
            raise api_error(404, "NotFound", f"the server could not find the resource {resource}")
        return kind

    def _next_rv(self) -> str:
        self._last_rv = next(self._counter)
        return str(self._last_rv)

    def _store_initial(self, kind: Kind, body: Mapping[str, Any]) -> None:
        obj = self._stamp_new(kind, copy.deepcopy(dict(body)), None)
        self.objects[kind.resource, None, obj["metadata"]["name"]] = obj

    def _stamp_new(self, kind: Kind, obj: dict[str, Any], namespace: str | None) -> dict[str, Any]:
        meta = obj.setdefault("metadata", {})
        if not meta.get("name"):
            if not meta.get("generateName"):
                raise api_error(422, "Invalid", "metadata.name or generateName is required")
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        if kind.namespaced:
            meta["namespace"] = namespace or meta.get("namespace") or "default"
        else:
            meta.pop("namespace", None)
        for key in ("deletionTimestamp", "deletionGracePeriodSeconds"):
            meta.pop(key, None)
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = now_rfc3339()
        meta["generation"] = 1
        meta["resourceVersion"] = self._next_rv()
        obj["apiVersion"] = kind.api_version
        obj["kind"] = kind.kind
        if kind.status_subresource:
            obj.pop("status", None)
        if kind.kind == "Secret":
            _fold_string_data(obj)
        return obj

    # State changes (called under the lock) ------------------------------------------------

    def _stored(self, kind: Kind, namespace: str | None, name: str) -> Any:
        key = (kind.resource, namespace if kind.namespaced else None, name)
        if key not in self.objects or self.objects[key].deleted:
            raise api_error(404, "NotFound", f'{kind.plural}.{kind.group} "{name}" not found')
        return self.objects[key]

    async def _emit(self, kind: Kind, event_type: str, obj: Mapping[str, Any]) -> None:
        event: dict[str, Any] = {"type": event_type, "object": copy.deepcopy(obj)}
        if self.watch_delay:
            event["_at"] = asyncio.get_running_loop().time()
        await self._buses[kind.resource].put(event)

    async def _create(self, kind: Kind, request: rendering.Request) -> dict[str, Any]:
        if not isinstance(request.data, Mapping):
            raise api_error(400, "BadRequest", "the body of a create must be a JSON object")
        obj = self._stamp_new(kind, copy.deepcopy(dict(request.data)), request.namespace)
        name, namespace = obj["metadata"]["name"], obj["metadata"].get("namespace")
        key: _ObjectKey = (kind.resource, namespace, name)
        if key in self.objects and not self.objects[key].deleted:
            raise api_error(409, "AlreadyExists", f'{kind.plural} "{name}" already exists')
        if key in self.objects:
            self.objects[key].create(obj)
        else:
            self.objects[key] = obj
        await self._emit(kind, "ADDED", obj)
        return obj

    def _apply_patch(self, old: dict[str, Any], request: rendering.Request) -> dict[str, Any]:
        content_type = request.headers.get("Content-Type", "")
        if "apply-patch" in content_type:
            raise api_error(415, "UnsupportedMediaType", "server-side apply is not emulated")
        if isinstance(request.data, list) or "json-patch" in content_type:
            try:
                patched: dict[str, Any] = jsonpatch.apply_patch(old, request.data, in_place=False)
                return patched
            except jsonpatch.JsonPatchTestFailed as exc:
                raise api_error(422, "Invalid", f"the JSON patch test failed: {exc}") from exc
            except (jsonpatch.JsonPatchException, jsonpointer.JsonPointerException) as exc:
                raise api_error(422, "Invalid", f"the JSON patch is invalid: {exc}") from exc
        if not isinstance(request.data, Mapping):
            raise api_error(400, "BadRequest", "a merge patch must be a JSON object")
        wanted_rv = (request.data.get("metadata") or {}).get("resourceVersion")
        if wanted_rv is not None and wanted_rv != old["metadata"]["resourceVersion"]:
            raise api_error(409, "Conflict", "the object has been modified; please apply again")
        merged: dict[str, Any] = merge_patch(old, request.data)
        return merged

    async def _patch(self, kind: Kind, request: rendering.Request) -> dict[str, Any]:
        stored = self._stored(kind, request.namespace, request.name or "")
        old = copy.deepcopy(stored.raw)
        new = self._apply_patch(copy.deepcopy(old), request)
        return await self._write(kind, stored, old, new, subresource=request.subresource)

    async def _replace(self, kind: Kind, request: rendering.Request) -> dict[str, Any]:
        stored = self._stored(kind, request.namespace, request.name or "")
        old = copy.deepcopy(stored.raw)
        new = copy.deepcopy(dict(request.data or {}))
        wanted_rv = (new.get("metadata") or {}).get("resourceVersion")
        if wanted_rv and wanted_rv != old["metadata"]["resourceVersion"]:
            raise api_error(409, "Conflict", "the object has been modified; please apply again")
        return await self._write(kind, stored, old, new, subresource=request.subresource)

    async def _write(
        self,
        kind: Kind,
        stored: Any,
        old: dict[str, Any],
        new: dict[str, Any],
        *,
        subresource: str | None,
    ) -> dict[str, Any]:
        if subresource == "status":
            status = new.get("status")
            new = copy.deepcopy(old)
            if status is None:
                new.pop("status", None)
            else:
                new["status"] = status
        elif subresource:
            raise api_error(404, "NotFound", f"subresource {subresource} is not emulated")
        elif kind.status_subresource:
            if "status" in old:
                new["status"] = copy.deepcopy(old["status"])
            else:
                new.pop("status", None)
        # What the server owns cannot be changed by a client.
        meta = new.setdefault("metadata", {})
        for key in ("uid", "creationTimestamp", "name", "namespace", "generation"):
            if key in old["metadata"]:
                meta[key] = old["metadata"][key]
            else:
                meta.pop(key, None)
        for key in ("deletionTimestamp", "deletionGracePeriodSeconds"):
            if key in old["metadata"]:
                meta[key] = old["metadata"][key]
            else:
                meta.pop(key, None)
        meta["resourceVersion"] = old["metadata"]["resourceVersion"]
        new["apiVersion"], new["kind"] = kind.api_version, kind.kind
        if kind.kind == "Secret":
            _fold_string_data(new)
        if new == old:
            return old  # a no-op write: no new resourceVersion, no watch event
        if _spec_part(new) != _spec_part(old):
            meta["generation"] = int(old["metadata"].get("generation", 1)) + 1
        meta["resourceVersion"] = self._next_rv()
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            stored.history.append(new)
            stored.delete()
            await self._emit(kind, "DELETED", new)
            await self._collect_dependents(meta["uid"])
            return new
        stored.history.append(new)
        await self._emit(kind, "MODIFIED", new)
        return new

    async def _delete(
        self, kind: Kind, namespace: str | None, name: str, options: Mapping[str, Any]
    ) -> dict[str, Any]:
        stored = self._stored(kind, namespace, name)
        obj = copy.deepcopy(stored.raw)
        meta = obj["metadata"]
        preconditions = options.get("preconditions") or {}
        for field in ("uid", "resourceVersion"):
            if preconditions.get(field) and preconditions[field] != meta.get(field):
                raise api_error(409, "Conflict", f"precondition failed: {field} mismatch")
        if meta.get("finalizers"):
            if not meta.get("deletionTimestamp"):
                meta["deletionTimestamp"] = now_rfc3339()
                meta["deletionGracePeriodSeconds"] = 0
                meta["resourceVersion"] = self._next_rv()
                stored.history.append(obj)
                await self._emit(kind, "MODIFIED", obj)
            return cast(dict[str, Any], obj)
        meta["resourceVersion"] = self._next_rv()
        stored.history.append(obj)
        stored.delete()
        await self._emit(kind, "DELETED", obj)
        if options.get("propagationPolicy") != "Orphan":
            await self._collect_dependents(meta["uid"])
        return cast(dict[str, Any], obj)

    async def _collect_dependents(self, owner_uid: str) -> None:
        """Background cascading deletion: dependents whose owners are all gone are deleted."""
        live_uids = {
            obj.raw["metadata"].get("uid") for obj in self.objects.values() if not obj.deleted
        }
        for (resource, namespace, name), obj in list(self.objects.items()):
            if obj.deleted:
                continue
            refs = obj.raw.get("metadata", {}).get("ownerReferences") or []
            uids = {ref.get("uid") for ref in refs}
            if owner_uid in uids and not (uids - {owner_uid}) & live_uids:
                kind = self._kinds[resource]
                with contextlib.suppress(kmock.KubernetesError):
                    await self._delete(kind, namespace, name, {})
