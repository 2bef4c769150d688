"""An in-memory Kubernetes API server for integration tests: kmock, plus what a real one does.

No kube-apiserver can be installed here (see shared/TOOLCHAIN.md), so the operator's tests run
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
import base64
import contextlib
import copy
import datetime
import functools
import itertools
import json
import re
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp.web
import attrs
import jsonpatch
import jsonpointer
import kmock
import yaml
from kmock._internal import apps, enums, rendering

REPO = Path(__file__).resolve().parents[2]
PROJECT_CRDS = sorted((REPO / "crds").glob("*.yaml"))
KOPF_PEERING_CRDS = REPO / "charts" / "rtrl-operator" / "files" / "kopf-peering-crds.yaml"


@dataclass(frozen=True)
class Kind:
    """What the emulator knows of one resource: enough for discovery and for write rules."""

    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool
    status_subresource: bool
    singular: str = ""
    shortnames: tuple[str, ...] = ()
    categories: tuple[str, ...] = ()

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def resource(self) -> kmock.resource:
        return kmock.resource(group=self.group, version=self.version, plural=self.plural)


BUILTIN_KINDS: tuple[Kind, ...] = (
    Kind("", "v1", "pods", "Pod", True, True, "pod", ("po",)),
    Kind("", "v1", "services", "Service", True, True, "service", ("svc",)),
    Kind("", "v1", "configmaps", "ConfigMap", True, False, "configmap", ("cm",)),
    Kind("", "v1", "secrets", "Secret", True, False, "secret"),
    Kind("", "v1", "events", "Event", True, False, "event", ("ev",)),
    Kind("batch", "v1", "jobs", "Job", True, True, "job"),
    Kind("events.k8s.io", "v1", "events", "Event", True, False, "event", ("ev",)),
    Kind("apps", "v1", "deployments", "Deployment", True, True, "deployment", ("deploy",)),
    Kind("coordination.k8s.io", "v1", "leases", "Lease", True, False, "lease"),
    Kind(
        "apiextensions.k8s.io",
        "v1",
        "customresourcedefinitions",
        "CustomResourceDefinition",
        False,
        True,
        "customresourcedefinition",
        ("crd", "crds"),
    ),
)
VERBS = ("create", "delete", "get", "list", "patch", "update", "watch")


def kinds_from_crd(crd: Mapping[str, Any]) -> list[Kind]:
    """The served versions of a CustomResourceDefinition document."""
    spec = crd["spec"]
    names = spec["names"]
    return [
        Kind(
            group=spec["group"],
            version=version["name"],
            plural=names["plural"],
            kind=names["kind"],
            namespaced=spec.get("scope", "Namespaced") == "Namespaced",
            status_subresource="status" in (version.get("subresources") or {}),
            singular=names.get("singular", names["kind"].lower()),
            shortnames=tuple(names.get("shortNames", ())),
            categories=tuple(names.get("categories", ())),
        )
        for version in spec["versions"]
        if version.get("served", True)
    ]


def load_crds(paths: Iterable[Path]) -> list[dict[str, Any]]:
    """The CRD documents in these files (parsed once per process: emulators start per test)."""
    return [copy.deepcopy(doc) for path in paths for doc in _parse_yaml(Path(path))]


@functools.cache
def _parse_yaml(path: Path) -> tuple[dict[str, Any], ...]:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    return tuple(doc for doc in yaml.load_all(path.read_text(), Loader=loader) if doc)


def now_rfc3339() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def api_error(status: int, reason: str, message: str) -> kmock.KubernetesError:
    """An error rendered as a Kubernetes ``Status`` with a real reason (``NotFound``, ...)."""
    return kmock.KubernetesError(
        status=status, reason=reason, message=message, details={"causes": []}
    )


# --- selectors ---------------------------------------------------------------------------------

_NAME = r"[A-Za-z0-9][-A-Za-z0-9_./]*"
_TERM = re.compile(
    rf"""^\s*(?:
        !\s*(?P<absent>{_NAME})
      | (?P<skey>{_NAME})\s+(?P<setop>in|notin)\s*\((?P<values>[^()]*)\)
      | (?P<ekey>{_NAME})\s*(?P<op>==|=|!=)\s*(?P<value>[-A-Za-z0-9_.]*)
      | (?P<present>{_NAME})
    )\s*$""",
    re.VERBOSE,
)


def _split_terms(selector: str) -> list[str]:
    """Split on the commas that are not inside ``(...)``."""
    terms, depth, current = [], 0, []
    for char in selector:
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        if char == "," and depth == 0:
            terms.append("".join(current))
            current = []
        else:
            current.append(char)
    terms.append("".join(current))
    return [term for term in terms if term.strip()]


def label_matcher(selector: str | None) -> Any:
    """A predicate on a labels dict for a Kubernetes label selector (set-based included)."""
    if not selector:
        return lambda labels: True
    checks = []
    for term in _split_terms(selector):
        match = _TERM.match(term)
        if match is None:
            raise api_error(400, "BadRequest", f"unable to parse requirement: {term!r}")
        if match["absent"]:
            checks.append(lambda labels, k=match["absent"]: k not in labels)
        elif match["present"]:
            checks.append(lambda labels, k=match["present"]: k in labels)
        elif match["setop"]:
            values = {v.strip() for v in match["values"].split(",") if v.strip()}
            if match["setop"] == "in":
                checks.append(lambda labels, k=match["skey"], vs=values: labels.get(k) in vs)
            else:
                checks.append(lambda labels, k=match["skey"], vs=values: labels.get(k) not in vs)
        elif match["op"] == "!=":
            checks.append(lambda labels, k=match["ekey"], v=match["value"]: labels.get(k) != v)
        else:
            checks.append(lambda labels, k=match["ekey"], v=match["value"]: labels.get(k) == v)
    return lambda labels: all(check(labels) for check in checks)


def field_matcher(selector: str | None) -> Any:
    """A predicate on an object for ``path=value``/``path!=value`` field selectors."""
    if not selector:
        return lambda obj: True
    checks = []
    for term in _split_terms(selector):
        match = re.match(r"^\s*([A-Za-z0-9_.]+)\s*(==|=|!=)\s*(\S*)\s*$", term)
        if match is None:
            raise api_error(400, "BadRequest", f"invalid field selector: {term!r}")
        path, op, value = match.groups()

        def check(obj: Mapping[str, Any], path: str = path, op: str = op, value: str = value):
            current: Any = obj
            for part in path.split("."):
                current = current.get(part) if isinstance(current, Mapping) else None
            actual = "" if current is None else str(current)
            return (actual != value) if op == "!=" else (actual == value)

        checks.append(check)
    return lambda obj: all(check(obj) for check in checks)


def object_matcher(params: Mapping[str, str]) -> Any:
    labels = label_matcher(params.get("labelSelector"))
    fields = field_matcher(params.get("fieldSelector"))
    return lambda obj: labels((obj.get("metadata") or {}).get("labels") or {}) and fields(obj)


# --- patching ----------------------------------------------------------------------------------


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch: dicts merge, ``None`` deletes, everything else replaces."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


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


# --- the emulator ------------------------------------------------------------------------------

_ObjectKey = tuple[kmock.resource, str | None, str]


@attrs.define(kw_only=True)
class KubeEmulator(kmock.KubernetesEmulator):
    """kmock's emulator with the API server's write semantics (see the module docstring).

    All state changes happen in :meth:`_handle` under kmock's lock; reads go through kmock's
    own fallbacks (``_serve_fetch``) or the overridden ``_serve_list``/``_serve_watch``.
    kmock's DSL still works on top (``emulator['patch', ...] << 500`` to inject a failure):
    as in kmock, a write is applied to the stored state even when a reaction intercepts it.
    """

    crd_documents: list[dict[str, Any]] = attrs.field(factory=list)
    namespaces: set[str] = attrs.field(factory=lambda: {"default"})
    # Called after a write (create, patch, delete, replace) is applied and before it is
    # answered, with (HTTP method, path, request body, resulting object): lets a test act at
    # an exact point, e.g. kill the client that wrote (test_operator_crash.py). It runs in the
    # server's thread and loop, so keep it short; if it raises, the client gets a 500 for a
    # write that was applied. Failed writes (404, 409...) do not call it.
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

    async def _watch_events(self, request: rendering.Request) -> AsyncIterator[rendering.Payload]:
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

    # State changes (called under the lock) ------------------------------------------------

    def _stored(self, kind: Kind, namespace: str | None, name: str) -> Any:
        key = (kind.resource, namespace if kind.namespaced else None, name)
        if key not in self.objects or self.objects[key].deleted:
            raise api_error(404, "NotFound", f'{kind.plural}.{kind.group} "{name}" not found')
        return self.objects[key]

    async def _emit(self, kind: Kind, event_type: str, obj: Mapping[str, Any]) -> None:
        event = {"type": event_type, "object": copy.deepcopy(obj)}
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
                return jsonpatch.apply_patch(old, request.data, in_place=False)
            except jsonpatch.JsonPatchTestFailed as exc:
                raise api_error(422, "Invalid", f"the JSON patch test failed: {exc}") from exc
            except (jsonpatch.JsonPatchException, jsonpointer.JsonPointerException) as exc:
                raise api_error(422, "Invalid", f"the JSON patch is invalid: {exc}") from exc
        if not isinstance(request.data, Mapping):
            raise api_error(400, "BadRequest", "a merge patch must be a JSON object")
        wanted_rv = (request.data.get("metadata") or {}).get("resourceVersion")
        if wanted_rv is not None and wanted_rv != old["metadata"]["resourceVersion"]:
            raise api_error(409, "Conflict", "the object has been modified; please apply again")
        return merge_patch(old, request.data)

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
            return obj
        meta["resourceVersion"] = self._next_rv()
        stored.history.append(obj)
        stored.delete()
        await self._emit(kind, "DELETED", obj)
        if options.get("propagationPolicy") != "Orphan":
            await self._collect_dependents(meta["uid"])
        return obj

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
