"""A small JSON client over the official ``kubernetes`` package's HTTP layer.

Objects stay plain dicts in the API's own camelCase (no generated model classes), and every
call names its path explicitly, so the permissions the operator needs are exactly the
(verb, resource) pairs listed in :data:`PERMISSIONS`.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlencode

import kubernetes
import urllib3
from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException
from kubernetes.watch.watch import iter_resp_lines

from ..core.api.names import GROUP, VERSION
from .index import Finder, ListFinder

# kind -> (API group, version, plural, namespaced)
KINDS: dict[str, tuple[str, str, str]] = {
    "RLCycle": (GROUP, VERSION, "rlcycles"),
    "Checkpoint": (GROUP, VERSION, "checkpoints"),
    "Job": ("batch", "v1", "jobs"),
    "CronJob": ("batch", "v1", "cronjobs"),
    "Pod": ("", "v1", "pods"),
    "Service": ("", "v1", "services"),
    "ConfigMap": ("", "v1", "configmaps"),
    "Secret": ("", "v1", "secrets"),
    "Event": ("", "v1", "events"),
    "Deployment": ("apps", "v1", "deployments"),
    "HTTPRoute": ("gateway.networking.k8s.io", "v1", "httproutes"),
}

# What the operator does to each resource: the Helm chart's RBAC grants exactly this.
PERMISSIONS: dict[tuple[str, str], tuple[str, ...]] = {
    (GROUP, "rlcycles"): ("get", "list", "watch", "patch"),
    (GROUP, "rlcycles/status"): ("get", "patch"),
    (GROUP, "checkpoints"): ("get", "list", "watch", "create", "delete", "patch"),
    (GROUP, "checkpoints/status"): ("get", "patch"),
    ("batch", "jobs"): ("get", "list", "watch", "create", "delete"),
    # the seal CronJob of an RLCycle with spec.capture (replaced when the spec changes it)
    ("batch", "cronjobs"): ("get", "list", "watch", "create", "delete", "patch"),
    ("", "pods"): ("get", "list"),
    ("", "services"): ("get", "list", "watch", "create", "delete"),
    # patch: an adapter RLCycle's key of the routing table (spec.capture.adapters)
    ("", "configmaps"): ("get", "list", "watch", "create", "delete", "patch"),
    ("", "secrets"): ("get",),
    ("", "events"): ("create", "patch"),
    ("apps", "deployments"): ("get", "list", "watch", "create", "delete", "patch"),
    ("gateway.networking.k8s.io", "httproutes"): ("get", "patch"),
    # Not a call: children carry ownerReferences with blockOwnerDeletion, which the API
    # server's OwnerReferencesPermissionEnforcement admission (on by default in OpenShift)
    # allows only to whom may update the owner's finalizers.
    (GROUP, "rlcycles/finalizers"): ("update",),
    (GROUP, "checkpoints/finalizers"): ("update",),
}


FIELD_MANAGER = "rtrl"
# (connect, read) seconds: a stalled API server fails a round, which is retried, instead of
# hanging the RLCycle's reconciler forever.
REQUEST_TIMEOUT = (10.0, 60.0)
# A watch's read timeout beyond the seconds the server was asked to keep it open.
WATCH_SLACK_SECONDS = 30


class KubeError(Exception):
    """An API call failed; ``status`` is the HTTP status (0 when there was no answer),
    ``reason`` the Status object's reason and ``detail`` its message."""

    def __init__(self, message: str, status: int = 0, reason: str = "", detail: str = ""):
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.detail = detail


def path(kind: str, namespace: str | None, name: str | None = None, sub: str = "") -> str:
    group, version, plural = KINDS[kind]
    base = f"/api/{version}" if not group else f"/apis/{group}/{version}"
    if namespace:
        base += f"/namespaces/{namespace}"
    base += f"/{plural}"
    if name:
        base += f"/{name}"
    if sub:
        base += f"/{sub}"
    return base


def api_version(kind: str) -> str:
    group, version, _ = KINDS[kind]
    return f"{group}/{version}" if group else version


# The kubernetes package runs its credentials' refresh hook before every request; the hook
# re-applies the whole kubeconfig each time (host included, which rescans the environment
# for proxies: a tenth of a millisecond per request). Tokens are re-read when they expire
# (in a pod, every minute), so a look at most this often is as good.
TOKEN_REFRESH_SECONDS = 1.0


class _ThrottledRefresh:
    """Stands in for a Configuration's ``refresh_api_key_hook``: runs the real hook at most
    once per ``period`` seconds, and keeps standing in when the hook replaces itself (the
    kubeconfig and in-cluster loaders both do, on every call)."""

    def __init__(self, hook: Any, period: float) -> None:
        self.hook = hook
        self.period = period
        self.due = 0.0

    def __call__(self, configuration: Any) -> None:
        now = time.monotonic()
        if now < self.due:
            return
        self.hook(configuration)
        replaced = configuration.refresh_api_key_hook
        if replaced is not self and replaced is not None:
            self.hook = replaced
        configuration.refresh_api_key_hook = self
        self.due = now + self.period


class KubeClient:
    """JSON requests with the credentials of a kubeconfig or the pod's service account."""

    def __init__(self, api_client: ApiClient | None = None):
        self.api = api_client or ApiClient()
        self.requests = 0  # counted for bench/operator_latency.py
        # The resourceVersion each conditional status write answered (rtrl.kube.apply
        # .patch_status): a later one of the same object in the same round is conditional
        # on it. A round has a client of its own (CachingClient).
        self.written: dict[tuple[str, str, str], str] = {}
        configuration: Any = getattr(self.api, "configuration", None)
        hook = getattr(configuration, "refresh_api_key_hook", None)
        if hook is not None and not isinstance(hook, _ThrottledRefresh):
            configuration.refresh_api_key_hook = _ThrottledRefresh(hook, TOKEN_REFRESH_SECONDS)

    @classmethod
    def from_environment(cls) -> KubeClient:
        """In a pod: its service account; elsewhere: $KUBECONFIG / ~/.kube/config."""
        try:
            kubernetes.config.load_incluster_config()  # type: ignore[no-untyped-call]
        except kubernetes.config.ConfigException:
            kubernetes.config.load_kube_config()  # type: ignore[no-untyped-call]
        return cls(ApiClient())

    def request(
        self,
        method: str,
        url_path: str,
        body: Any = None,
        *,
        query: dict[str, str] | None = None,
        content_type: str = "application/json",
    ) -> Any:
        response = self._send(
            method, url_path, body, query=query, content_type=content_type, timeout=REQUEST_TIMEOUT
        )
        data = response.data
        return json.loads(data) if data else None

    def watch(
        self, kind: str, namespace: str, resource_version: str, seconds: int
    ) -> Iterator[dict[str, Any]]:
        """The watch events of ``kind`` in ``namespace`` since ``resource_version``, with
        bookmarks, until the server ends the stream (after ``seconds``); each event as the
        API sends it (``type``, ``object``), an ERROR event's object a Status."""
        query = {
            "watch": "true",
            "resourceVersion": resource_version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(seconds),
        }
        timeout = (REQUEST_TIMEOUT[0], seconds + WATCH_SLACK_SECONDS)
        response = self._send(
            "GET", path(kind, namespace), None, query=query, content_type="", timeout=timeout,
            stream=True,
        )  # fmt: skip
        try:
            for line in iter_resp_lines(response.response):  # type: ignore[no-untyped-call]
                if line:
                    yield json.loads(line)
        except (OSError, urllib3.exceptions.HTTPError) as exc:
            raise KubeError(f"watch {path(kind, namespace)}: {exc}") from None
        finally:
            # closed, not drained: a watch left early must not go back to the pool unread
            response.response.close()
            response.response.release_conn()

    def _send(
        self,
        method: str,
        url_path: str,
        body: Any,
        *,
        query: dict[str, str] | None,
        content_type: str,
        timeout: tuple[float, float],
        stream: bool = False,
    ) -> Any:
        """The answer to one request, read unless ``stream``; a KubeError for an answer
        >= 400 or none."""
        if query:
            url_path = f"{url_path}?{urlencode(query)}"
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type
        params = self.api.param_serialize(
            method=method,
            resource_path=url_path,
            header_params=headers,
            body=body,
            auth_settings=["BearerToken"],
        )
        self.requests += 1
        where = f"{method} {url_path.split('?')[0]}"
        try:
            response = self.api.call_api(*params, _request_timeout=timeout)
            if not stream or response.status >= 400:
                response.read()  # type: ignore[no-untyped-call]
        except ApiException as exc:
            raise KubeError(f"{where}: HTTP {exc.status} {exc.reason}", exc.status or 0) from None
        except (OSError, urllib3.exceptions.HTTPError) as exc:  # unreachable, reset, timeout
            raise KubeError(f"{where}: {exc}") from None
        if response.status >= 400:
            # A Status object; its message names the object, never a Secret's contents.
            reason = message = ""
            with contextlib.suppress(ValueError, AttributeError):
                answer = json.loads(response.data or b"{}")
                reason, message = str(answer.get("reason") or ""), str(answer.get("message") or "")
            raise KubeError(
                f"{where}: HTTP {response.status} {reason}: {message[:300]}".rstrip(": "),
                response.status,
                reason,
                message[:1000],
            )
        return response

    def reads_remotely(self, kind: str, namespace: str) -> bool:
        """Whether a get or list of ``kind`` sends a request (a cache may answer instead)."""
        return True

    # typed conveniences ------------------------------------------------------------------
    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self.request("GET", path(kind, namespace, name))  # type: ignore[no-any-return]
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    def list_with_version(
        self, kind: str, namespace: str, labels: dict[str, str] | None = None
    ) -> tuple[list[dict[str, Any]], str]:
        """The objects, and the list's resourceVersion (opaque: for equality only)."""
        query = (
            {"labelSelector": ",".join(f"{k}={v}" for k, v in labels.items())} if labels else None
        )
        answer = self.request("GET", path(kind, namespace), query=query) or {}
        items = answer.get("items") or []
        rv = str((answer.get("metadata") or {}).get("resourceVersion") or "")
        # Filter here too: the selector is an optimisation, not something to rely on.
        return [
            item
            for item in items
            if all(
                ((item.get("metadata") or {}).get("labels") or {}).get(k) == v
                for k, v in (labels or {}).items()
            )
        ], rv

    def list(
        self, kind: str, namespace: str, labels: dict[str, str] | None = None
    ) -> list[dict[str, Any]]:
        return self.list_with_version(kind, namespace, labels)[0]

    def finder(self, kind: str, namespace: str) -> Finder:
        """The namespace's ``kind``, to find by name or field (:mod:`rtrl.kube.index`)."""
        return ListFinder(kind, self.list(kind, namespace))

    def create(self, manifest: dict[str, Any]) -> dict[str, Any] | None:
        """Create; None when it already exists (fixed names: that means done)."""
        meta = manifest["metadata"]
        try:
            return self.request("POST", path(manifest["kind"], meta.get("namespace")), manifest)  # type: ignore[no-any-return]
        except KubeError as exc:
            if exc.status == 409:
                return None
            raise

    def delete(self, kind: str, namespace: str, name: str) -> bool:
        """Delete with background propagation; False when it was already gone."""
        return self.delete_with_answer(kind, namespace, name)[0]

    def delete_with_answer(
        self, kind: str, namespace: str, name: str
    ) -> tuple[bool, dict[str, Any] | None]:
        """:meth:`delete`, and what the API answered (the object, or a Status)."""
        body = {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"}
        try:
            answer = self.request("DELETE", path(kind, namespace, name), body)
        except KubeError as exc:
            if exc.status == 404:
                return False, None
            raise
        return True, answer if isinstance(answer, dict) else None

    def patch(
        self,
        kind: str,
        namespace: str,
        name: str,
        patch: Any,
        *,
        sub: str = "",
        json_patch: bool = False,
    ) -> dict[str, Any] | None:
        kind_of_patch = (
            "application/json-patch+json" if json_patch else "application/merge-patch+json"
        )
        try:
            return self.request(  # type: ignore[no-any-return]
                "PATCH",
                path(kind, namespace, name, sub),
                patch,
                content_type=kind_of_patch,
                query={"fieldManager": FIELD_MANAGER},
            )
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise
