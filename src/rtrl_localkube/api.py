"""A thin, generic client for tests: objects as plain dicts over the official client's
dynamic API, the same against the emulated API server and the real one."""

from __future__ import annotations

import builtins
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, cast

import kubernetes
import yaml
from kubernetes.dynamic import DynamicClient
from kubernetes.dynamic.exceptions import NotFoundError

from rtrl.core.api.reasons import JobCondition

T = TypeVar("T")


@dataclass
class KubeAPI:
    """A running emulated Kubernetes API and thin, generic helpers around the official client.

    Objects come and go as plain dicts (what the API returns), so assertions read like
    manifests. ``emulator`` is the kmock object itself: its state lives in another thread, so
    read it only for post-mortems, and go through the HTTP helpers otherwise.
    """

    url: str
    kubeconfig: Path
    namespace: str
    api_client: kubernetes.client.ApiClient
    dynamic: DynamicClient
    # the kmock emulator object when the API is the emulated one (None on the real server)
    emulator: Any = None
    _resources: dict[tuple[str, str], Any] = field(default_factory=dict, repr=False)

    def resource(self, api_version: str, kind: str) -> Any:
        """The discovered ``kubernetes.dynamic`` resource for an apiVersion and kind."""
        key = (api_version, kind)
        if key not in self._resources:
            self._resources[key] = self.dynamic.resources.get(api_version=api_version, kind=kind)
        return self._resources[key]

    def _ns(self, resource: Any, namespace: str | None) -> str | None:
        return (namespace or self.namespace) if resource.namespaced else None

    def create(self, obj: dict[str, Any], namespace: str | None = None) -> dict[str, Any]:
        resource = self.resource(obj["apiVersion"], obj["kind"])
        ns = self._ns(resource, namespace or obj.get("metadata", {}).get("namespace"))
        return cast(dict[str, Any], resource.create(body=obj, namespace=ns).to_dict())

    def get(
        self, api_version: str, kind: str, name: str, namespace: str | None = None
    ) -> dict[str, Any] | None:
        """The object, or None if it does not exist (handy in ``wait_for`` predicates)."""
        resource = self.resource(api_version, kind)
        try:
            found = resource.get(name=name, namespace=self._ns(resource, namespace))
            return cast(dict[str, Any], found.to_dict())
        except NotFoundError:
            return None

    def list(
        self,
        api_version: str,
        kind: str,
        labels: dict[str, str] | str | None = None,
        namespace: str | None = None,
    ) -> list[dict[str, Any]]:
        """Objects of a kind; ``labels`` is a dict (equality) or a label-selector string."""
        resource = self.resource(api_version, kind)
        if isinstance(labels, dict):
            labels = ",".join(f"{key}={value}" for key, value in labels.items())
        result = resource.get(namespace=self._ns(resource, namespace), label_selector=labels)
        return [item.to_dict() for item in result.items]

    def patch(
        self,
        api_version: str,
        kind: str,
        name: str,
        patch: dict[str, Any] | builtins.list[dict[str, Any]],
        *,
        namespace: str | None = None,
        subresource: str | None = None,
        content_type: str | None = None,
    ) -> dict[str, Any]:
        """A merge patch (dict) or JSON patch (list); ``subresource="status"`` for status."""
        resource = self.resource(api_version, kind)
        if subresource:
            resource = resource.subresources[subresource]
        if content_type is None:
            content_type = (
                "application/json-patch+json"
                if isinstance(patch, list)
                else "application/merge-patch+json"
            )
        patched = resource.patch(
            body=patch,
            name=name,
            namespace=self._ns(resource, namespace),
            content_type=content_type,
        )
        return cast(dict[str, Any], patched.to_dict())

    def delete(
        self,
        api_version: str,
        kind: str,
        name: str,
        namespace: str | None = None,
        propagation_policy: str = "Background",
    ) -> dict[str, Any] | None:
        """Delete; returns what the API answered, or None if it did not exist."""
        resource = self.resource(api_version, kind)
        try:
            result = resource.delete(
                name=name,
                namespace=self._ns(resource, namespace),
                body={"propagationPolicy": propagation_policy},
            )
        except NotFoundError:
            return None
        return cast(dict[str, Any], result.to_dict() if hasattr(result, "to_dict") else result)

    @staticmethod
    def wait_for(
        predicate: Callable[[], T],
        timeout: float = 30.0,
        interval: float = 0.05,
        message: str | Callable[[], str] = "",
    ) -> T:
        """Poll until ``predicate()`` is truthy and return that value; fail after ``timeout``.

        ``message`` (or a callable that builds it, e.g. dumping the state) explains a timeout.
        The default is generous for a real server on a loaded 2-core machine (a cycle of
        scripted steps once took 10 s there); only a failing wait ever takes that long.
        """
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if value:
                return value
            if time.monotonic() >= deadline:
                text = message() if callable(message) else message
                raise AssertionError(f"timed out after {timeout}s waiting for: {text or predicate}")
            time.sleep(interval)

    def wait_for_job(
        self, name: str, timeout: float = 60.0, message: str | Callable[[], str] = ""
    ) -> dict[str, Any]:
        """The Job's Complete or Failed condition (whichever it gets), once it has one."""

        def finished() -> dict[str, Any] | None:
            job = self.get("batch/v1", "Job", name) or {}
            for cond in (job.get("status") or {}).get("conditions") or []:
                if (
                    cond["type"] in (JobCondition.COMPLETE, JobCondition.FAILED)
                    and cond["status"] == "True"
                ):
                    return dict(cond)
            return None

        return cast(dict[str, Any], self.wait_for(finished, timeout=timeout, message=message))


def write_kubeconfig(
    path: Path,
    url: str,
    namespace: str,
    *,
    token: str = "test-token",
    name: str = "emulator",
    user: str = "tester",
    ca_file: Path | None = None,
) -> Path:
    """A kubeconfig (mode 0600: it holds a token) for the server at ``url``, as ``user``."""
    cluster = {"server": url}
    if ca_file is not None:
        cluster["certificate-authority"] = os.fspath(ca_file)
    context = {"cluster": name, "user": user, "namespace": namespace}
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": name, "cluster": cluster}],
                "users": [{"name": user, "user": {"token": token}}],
                "contexts": [{"name": name, "context": context}],
                "current-context": name,
            }
        )
    )
    path.chmod(0o600)
    return path
