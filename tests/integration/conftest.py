"""Fixtures for the operator's integration tests: a Kubernetes API per test, and helpers.

``kube_api`` starts a fresh :class:`~tests.integration.kube_emulator.KubeEmulator` for each test
(about 5 ms), writes a kubeconfig for it, points ``KUBECONFIG`` at it and yields a
:class:`KubeAPI`. See ``kube_emulator.py`` for what the emulator does and does not emulate.

Running kopf against it (see ``test_harness.py::test_kopf_operator_end_to_end``):

- Run the operator with ``kopf.testing.KopfRunner(['run', '--standalone', '--namespace',
  kube_api.namespace, path_or_module])`` inside the test, never in the test's own event loop,
  and leave the ``with`` block (which stops kopf) before the fixture ends: the emulator stops
  at fixture teardown and kopf must be gone by then (kopf first, then the API).
- ``--standalone`` skips peering; without it kopf uses the peering CRDs served here (checked
  by hand: the end-to-end test passes either way).
- No kopf setting is *required*: discovery (``/api``, ``/apis``), CRD scanning (the CRDs are
  served as ``apiextensions.k8s.io/v1`` objects) and listing/watching ``/api/v1/namespaces``
  all work (checked by hand with scanning on). The test operator still sets
  ``settings.scanning.disabled = True``: fewer watch streams, less to tear down, and the
  resources are discovered once at start. Events kopf posts are stored like any object.
- kopf logs in with the ``kubernetes`` client when it is installed; that client reads the
  default kubeconfig path from ``KUBECONFIG`` at *import* time, so this fixture also patches
  ``kubernetes.config.kube_config.KUBE_CONFIG_DEFAULT_LOCATION``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import kopf.testing
import kubernetes
import pytest
import yaml
from kubernetes.dynamic import DynamicClient
from kubernetes.dynamic.exceptions import NotFoundError
from tests.integration.job_runner import JobRunner
from tests.integration.kube_emulator import EmulatorServer, KubeEmulator, default_emulator

from rtrl import handlers

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
    emulator: KubeEmulator
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
        return resource.create(body=obj, namespace=ns).to_dict()

    def get(
        self, api_version: str, kind: str, name: str, namespace: str | None = None
    ) -> dict[str, Any] | None:
        """The object, or None if it does not exist (handy in ``wait_for`` predicates)."""
        resource = self.resource(api_version, kind)
        try:
            return resource.get(name=name, namespace=self._ns(resource, namespace)).to_dict()
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
        patch: dict[str, Any] | list[dict[str, Any]],
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
        return resource.patch(
            body=patch,
            name=name,
            namespace=self._ns(resource, namespace),
            content_type=content_type,
        ).to_dict()

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
        return result.to_dict() if hasattr(result, "to_dict") else result

    @staticmethod
    def wait_for(
        predicate: Callable[[], T],
        timeout: float = 10.0,
        interval: float = 0.02,
        message: str | Callable[[], str] = "",
    ) -> T:
        """Poll until ``predicate()`` is truthy and return that value; fail after ``timeout``.

        ``message`` (or a callable that builds it, e.g. dumping the state) explains a timeout.
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


def write_kubeconfig(path: Path, url: str, namespace: str) -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "emulator", "cluster": {"server": url}}],
                "users": [{"name": "tester", "user": {"token": "test-token"}}],
                "contexts": [
                    {
                        "name": "emulator",
                        "context": {
                            "cluster": "emulator",
                            "user": "tester",
                            "namespace": namespace,
                        },
                    }
                ],
                "current-context": "emulator",
            }
        )
    )
    return path


@pytest.fixture
def kube_emulator() -> KubeEmulator:
    """The emulator ``kube_api`` serves; override to pre-register kinds or namespaces."""
    return default_emulator()


@pytest.fixture
def kube_api(
    kube_emulator: KubeEmulator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[KubeAPI]:
    """A fresh Kubernetes API per test, with KUBECONFIG pointing at it."""
    namespace = "default"
    with EmulatorServer(kube_emulator) as server:
        kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", server.url, namespace)
        monkeypatch.setenv("KUBECONFIG", os.fspath(kubeconfig))
        monkeypatch.setattr(
            kubernetes.config.kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", os.fspath(kubeconfig)
        )
        api_client = kubernetes.config.new_client_from_config(config_file=os.fspath(kubeconfig))
        try:
            dynamic = DynamicClient(api_client, cache_file=os.fspath(tmp_path / "discovery.json"))
            yield KubeAPI(
                url=server.url,
                kubeconfig=kubeconfig,
                namespace=namespace,
                api_client=api_client,
                dynamic=dynamic,
                emulator=kube_emulator,
            )
        finally:
            api_client.close()


@pytest.fixture
def job_runner(kube_api: KubeAPI, tmp_path: Path) -> Iterator[JobRunner]:
    """A started :class:`JobRunner` on ``kube_api``'s namespace; stopped (processes killed)
    before the API goes away. Set ``job_runner.extra_env`` / ``.script(...)`` in the test."""
    with JobRunner(kube_api, tmp_path / "jobs") as runner:
        yield runner


@pytest.fixture
def deployment_controller(kube_api: KubeAPI) -> Iterator[Any]:
    """Deployments of ``kube_api``'s namespace reported ready as soon as they change;
    ``.never_ready`` lists name patterns that stay unready."""
    from tests.integration.deployment_controller import DeploymentController

    with DeploymentController(kube_api) as controller:
        yield controller


@pytest.fixture
def operator(
    kube_api: KubeAPI, deployment_controller: Any, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Any]:
    """``rtrl.handlers`` run by kopf in a thread, watching the test namespace, with its
    Deployments reported ready (so a canary comes up)."""
    monkeypatch.setenv("RTRL_RESYNC_SECONDS", "1")
    monkeypatch.setenv("RTRL_ERROR_BACKOFF_SECONDS", "0.5")
    args = ["run", "--standalone", "--namespace", kube_api.namespace]
    with kopf.testing.KopfRunner(args, timeout=60, registry=handlers.registry) as runner:
        yield runner
    assert runner.exception is None, runner.output
    assert runner.exit_code == 0, runner.output
