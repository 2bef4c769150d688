"""An in-memory Kubernetes API server for integration tests: kmock, plus what a real one does.

The operator's tests run against the real control plane (:mod:`rtrl_localkube.controlplane`)
wherever they can; the faults a real one cannot be made to show on demand are tested
against :class:`KubeEmulator`, a subclass of ``kmock.KubernetesEmulator`` served over real HTTP
on 127.0.0.1. kopf and the official ``kubernetes`` client talk to it unmodified.

kmock keeps objects and serves list/watch/fetch; this module fills the gaps that matter to an
operator (each one is a behaviour of the real API server that operator code relies on):

- Metadata stamping: ``uid``, ``creationTimestamp``, ``generation`` (bumped only when something
  outside ``metadata``/``status`` changes) and a cluster-wide increasing ``resourceVersion`` on
  every write. A write that changes nothing is a no-op (same resourceVersion, no watch event).
- Optimistic concurrency: a JSON-patch ``test`` on ``/metadata/resourceVersion`` that fails
  answers 422 (kopf's finalizer patches rely on it); a merge patch carrying a stale
  ``metadata.resourceVersion`` answers 409.
- Status subresource: for kinds that have one, writes to the main endpoint ignore ``status``
  and writes to ``/status`` change only ``status``; ``status`` is dropped on create.
- Deletion: with finalizers, DELETE sets ``deletionTimestamp`` and the object lives until a
  patch removes the last finalizer; without, it is gone at once. ``propagationPolicy`` is
  accepted; ``Orphan`` keeps dependents, anything else deletes them (background cascading
  garbage collection along ``ownerReferences``, done synchronously here, transitively).
- Label selectors (``a=b``, ``a==b``, ``a!=b``, ``a in (x,y)``, ``a notin (x)``, ``a``,
  ``!a``) and simple field selectors (``metadata.name=x``, any dotted path, ``=``/``!=``) on
  list and watch; ``timeoutSeconds`` on watch; a watch with ``resourceVersion`` skips the
  states up to it (kmock replays all objects on every new watch).
- Secrets: ``stringData`` is folded into base64 ``data`` on write, as the API server does.
- ``generateName``; list responses carry ``kind``/``apiVersion`` and the current
  resourceVersion; errors carry Kubernetes reasons (``NotFound``, ``AlreadyExists``, ...).
- Discovery of the project's CRDs (``crds/*.yaml``), kopf's peering CRDs and the built-in kinds
  the operator uses; CRD objects themselves are served under ``apiextensions.k8s.io/v1``.
- ``GET /api/v1/namespaces[/<name>]`` and a watch of them (kmock's URL parser cannot route
  them): a read-only list of known namespaces (``default`` plus what a test adds to
  ``namespaces``).
- PUT (replace) of a named object, which kmock does not route at all.
- Watch without lost events: kmock snapshots before subscribing, so a write in between was lost.
- ``watch_delay``: every watch event can be made to arrive that many seconds late (a lagging
  watch), to test that a client's watch cache never decides on a stale view.

Still not emulated (tests must not rely on them): schema validation and defaulting, CEL,
admission, strategic-merge semantics (a strategic merge patch is applied as a JSON merge
patch, so lists are replaced), server-side apply, watch bookmarks, exact watch resumption (a
watch from resourceVersion N replays the objects changed after N as ADDED, and misses objects
deleted between N and the watch's start), objects that stop
matching a watch's selector (no synthetic DELETED), namespace lifecycle, deletecollection.

The emulator pins kmock 0.8's internals: it hooks ``_handle`` and the ``_serve_*`` fallbacks.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import re
import threading
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from typing import Any

import aiohttp.web
import attrs
import kmock
from kmock._internal import apps, enums, rendering

from .emulator_state import EmulatorState
from .kinds import KOPF_PEERING_CRDS, PROJECT_CRDS, load_crds
from .selectors import object_matcher


@attrs.define(kw_only=True)
class KubeEmulator(EmulatorState):
    """kmock's emulator with the API server's write semantics (see the module docstring).

    All state changes happen in :meth:`_handle` under kmock's lock; reads go through kmock's
    own fallbacks (``_serve_fetch``) or the overridden ``_serve_list``/``_serve_watch``.
    kmock's DSL still works on top (``emulator['patch', ...] << 500`` to inject a failure):
    as in kmock, a write is applied to the stored state even when a reaction intercepts it.
    """

    # Request handling ---------------------------------------------------------------------

    async def __aenter__(self) -> KubeEmulator:
        self._closing = asyncio.Event()
        await super().__aenter__()
        return self

    def close_streams(self) -> None:
        """End all open watch streams (call in the server's loop before it stops)."""
        if self._closing is not None:
            self._closing.set()

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        # kmock's URL parser fails on /api/v1/namespaces (it takes "namespaces" as a prefix).
        match = re.fullmatch(r"/api/v1/namespaces(?:/([^/]+))?/?", raw_request.path)
        if match is not None and raw_request.method == "GET":
            if raw_request.query.get("watch") == "true" and match.group(1) is None:
                return await self._watch_namespaces(raw_request)
            return self._serve_namespaces(match.group(1))
        try:
            return await super().__call__(raw_request)
        except ConnectionResetError:
            # A watcher went away (kopf stopping, a client timeout): kmock then fails to write
            # its error into the closed stream. Nobody is left to answer, so answer quietly.
            return aiohttp.web.Response(status=499)

    async def _watch_namespaces(
        self, raw_request: aiohttp.web.BaseRequest
    ) -> aiohttp.web.StreamResponse:
        """The namespaces as ADDED events, then silence until the timeout or shutdown."""
        response = aiohttp.web.StreamResponse()
        response.content_type = "application/json"
        await response.prepare(raw_request)
        listing = json.loads(self._serve_namespaces(None).text or "{}")
        for item in listing["items"]:
            await response.write(json.dumps({"type": "ADDED", "object": item}).encode() + b"\n")
        timeout = raw_request.query.get("timeoutSeconds")
        assert self._closing is not None, "the emulator must be entered (async with)"
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._closing.wait(), float(timeout) if timeout else None)
        await response.write_eof()
        return response

    def _serve_namespaces(self, name: str | None) -> aiohttp.web.Response:
        def namespace(ns: str) -> dict[str, Any]:
            return {
                "apiVersion": "v1",
                "kind": "Namespace",
                "metadata": {"name": ns, "uid": str(uuid.uuid5(uuid.NAMESPACE_DNS, ns))},
                "status": {"phase": "Active"},
            }

        if name is None:
            return aiohttp.web.json_response(
                {
                    "apiVersion": "v1",
                    "kind": "NamespaceList",
                    "metadata": {"resourceVersion": str(self._last_rv)},
                    "items": [namespace(ns) for ns in sorted(self.namespaces)],
                }
            )
        if name in self.namespaces:
            return aiohttp.web.json_response(namespace(name))
        body = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 404}
        body |= {"reason": "NotFound", "message": f'namespaces "{name}" not found'}
        return aiohttp.web.json_response(body, status=404)

    async def _handle(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        method = getattr(request.method, "value", request.method)
        self.request_log.append((str(method).upper(), request.url.path))
        try:
            return await self._handle_request(request)
        finally:
            for index, known in enumerate(self._requests):
                if known is request:
                    del self._requests[index]
                    break

    async def _handle_request(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        resource = request.resource
        if resource is not None and resource.plural is not None:
            action, method = request.action, request.method
            if action == enums.action.CREATE:
                kind = self._known(resource)
                async with self._lock:
                    self._results[request] = await self._create(kind, request)
                self._written(request, self._results[request])
            elif action == enums.action.UPDATE and request.name:
                kind = self._known(resource)
                async with self._lock:
                    self._results[request] = await self._patch(kind, request)
                self._written(request, self._results[request])
            elif action == enums.action.DELETE and request.name:
                kind = self._known(resource)
                async with self._lock:
                    self._results[request] = await self._delete(
                        kind, request.namespace, request.name, request.data or {}
                    )
                self._written(request, self._results[request])
            elif method == enums.method.PUT and request.name:
                kind = self._known(resource)
                async with self._lock:
                    result = await self._replace(kind, request)
                self._written(request, result)
                return aiohttp.web.json_response(result)
        # Skip KubernetesEmulator._handle (its own, metadata-less state changes); serve via DSL.
        return await apps.RawHandler._handle(self, request)

    def _written(self, request: rendering.Request, result: dict[str, Any] | None) -> None:
        if self.after_write is not None:
            method = getattr(request.method, "value", str(request.method))
            self.after_write(method, request.url.path, request.data, result)

    async def _serve_version(self, request: rendering.Request) -> rendering.Payload:
        result: dict[str, Any] = await super()._serve_version(request)  # type: ignore[assignment]
        if request.resource is not None and request.resource.group == "":
            result["groupVersion"] = "v1"  # kmock says "/v1"
            result["resources"].append(
                {
                    "name": "namespaces",
                    "kind": "Namespace",
                    "singularName": "namespace",
                    "shortNames": ["ns"],
                    "categories": [],
                    "verbs": ["get", "list"],
                    "namespaced": False,
                }
            )
        return result

    async def _serve_create(self, request: rendering.Request) -> rendering.Payload:
        return self._results.pop(request)

    async def _serve_update(self, request: rendering.Request) -> rendering.Payload:
        return self._results.pop(request)

    async def _serve_delete(self, request: rendering.Request) -> rendering.Payload:
        return self._results.pop(request)

    async def _serve_list(self, request: rendering.Request) -> rendering.Payload:
        kind = self._known(request.resource)
        matches = object_matcher(request.params)
        async with self._lock:
            items = [
                copy.deepcopy(obj.raw)
                for (res, ns, _), obj in self.objects.items()
                if res == kind.resource and not obj.deleted
                if request.namespace is None or ns == request.namespace
            ]
        return {
            "apiVersion": kind.api_version,
            "kind": f"{kind.kind}List",
            "metadata": {"resourceVersion": str(self._last_rv)},
            "items": [item for item in items if matches(item)],
        }

    async def _serve_watch(self, request: rendering.Request) -> AsyncIterator[rendering.Payload]:
        self._known(request.resource)
        matches = object_matcher(request.params)
        # kmock replays every current object on a new watch; a watch that resumes from a
        # list's resourceVersion must not see the listed states again (kopf would process each
        # object twice and its second, stale JSON patch would fail).
        since = request.params.get("resourceVersion", "")
        since_rv = int(since) if since.isdigit() else 0

        def newer(obj: Mapping[str, Any]) -> bool:
            rv = str((obj.get("metadata") or {}).get("resourceVersion", ""))
            return not rv.isdigit() or int(rv) > since_rv

        timeout = request.params.get("timeoutSeconds")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + float(timeout) if timeout else None
        assert self._closing is not None, "the emulator must be entered (async with)"
        closing = asyncio.ensure_future(self._closing.wait())
        events = self._watch_events(request)
        try:
            while True:
                step = asyncio.ensure_future(anext(events))
                remaining = None if deadline is None else max(0.0, deadline - loop.time())
                done, _ = await asyncio.wait(
                    {step, closing}, timeout=remaining, return_when=asyncio.FIRST_COMPLETED
                )
                if step not in done:
                    step.cancel()
                    with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                        await step
                    return
                try:
                    event = step.result()
                except StopAsyncIteration:
                    return
                if isinstance(event, Mapping) and "object" in event:
                    if not matches(event["object"]) or not newer(event["object"]):
                        continue
                    if "_at" in event:  # a lagging watch: each event arrives watch_delay late
                        await asyncio.sleep(max(0.0, event["_at"] + self.watch_delay - loop.time()))
                    event = {"type": event["type"], "object": copy.deepcopy(event["object"])}
                yield event
        finally:
            closing.cancel()
            await events.aclose()

    async def _watch_events(
        self, request: rendering.Request
    ) -> AsyncGenerator[rendering.Payload, None]:
        """Current objects as ADDED, then live events, with nothing lost in between.

        kmock's own watch snapshots the objects and only then subscribes to the event bus, so a
        write in between is lost (kopf then waits forever for its own patch to come back).
        Here the bus position is marked under the same lock as the snapshot.
        """
        yield b""  # send the headers now: a quiet watch is still a started watch
        assert request.resource is not None
        bus = self._buses[request.resource]

        def wanted(namespace: str | None, name: str) -> bool:
            return (request.namespace is None or namespace == request.namespace) and (
                request.name is None or name == request.name
            )

        async with self._lock:
            marker = await bus.mark()
            current = [
                copy.deepcopy(obj.raw)
                for (res, ns, name), obj in self.objects.items()
                if res == request.resource and not obj.deleted and wanted(ns, name)
            ]
        try:
            for obj in current:
                yield {"type": "ADDED", "object": obj}
            async for event in bus.stream(since=marker):
                meta = event.get("object", {}).get("metadata", {})
                if wanted(meta.get("namespace"), meta.get("name", "")):
                    yield event
        finally:
            await bus.unmark(marker)


# --- serving over HTTP from a background thread ------------------------------------------------


class EmulatorServer:
    """Runs a :class:`KubeEmulator` on a free port of 127.0.0.1 in its own thread and loop.

    Tests are synchronous and kopf runs in a thread of its own (``KopfRunner``), so the
    server cannot share the test's event loop; a dedicated thread serves every client alike.
    ``stop()`` ends open watch streams first, then closes the server and joins the thread.
    """

    def __init__(self, emulator: KubeEmulator) -> None:
        self.emulator = emulator
        self.url = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kube-emulator", daemon=True)

    def start(self, timeout: float = 10.0) -> EmulatorServer:
        self._thread.start()
        if not self._ready.wait(timeout):
            raise RuntimeError("the Kubernetes emulator did not start")
        if self._error is not None:
            raise RuntimeError("the Kubernetes emulator failed to start") from self._error
        return self

    def stop(self, timeout: float = 10.0) -> None:
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise RuntimeError("the Kubernetes emulator did not stop")

    def __enter__(self) -> EmulatorServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # reported to start(); the thread must not die silently
            self._error = exc
            self._ready.set()

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        async with self.emulator, kmock.Server(self.emulator, host="127.0.0.1") as server:
            self.url = f"http://{server.host}:{server.port}"
            self._ready.set()
            await self._stop.wait()
            self.emulator.close_streams()
            await asyncio.sleep(0)  # let the watch streams see it and finish


def default_emulator() -> KubeEmulator:
    """An emulator that knows the project's CRDs and kopf's peering CRDs."""
    return KubeEmulator(crd_documents=load_crds([*PROJECT_CRDS, KOPF_PEERING_CRDS]))


def dump_json(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=True)
