"""Fixtures for the operator's integration tests: a Kubernetes API per test, and helpers.

``kube_api`` starts a fresh :class:`~rtrl_localkube.emulator.KubeEmulator` for each test
(about 5 ms), writes a kubeconfig for it, points ``KUBECONFIG`` at it and yields a
:class:`KubeAPI`. See ``rtrl_localkube/emulator.py`` for what the emulator does and does
not emulate.

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
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

import kopf.testing
import kubernetes
import pytest
from kubernetes.dynamic import DynamicClient

from rtrl import handlers
from rtrl_localkube.api import KubeAPI, write_kubeconfig
from rtrl_localkube.emulator import EmulatorServer, KubeEmulator, default_emulator
from rtrl_localkube.job_runner import JobRunner

T = TypeVar("T")


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
    from rtrl_localkube.deployment_controller import DeploymentController

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
