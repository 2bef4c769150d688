"""The sidecar follows the routing ConfigMap through the real API server
(``rtrl-capture --adapters-configmap``): with a ServiceAccount that may get, list and watch
that one ConfigMap (a Role with ``resourceNames``), a route written into it reaches the
sidecar's table in well under a second (the kubelet's volume would bring it at its next
sync of the pod, a minute or more); without that right, the sidecar keeps following the
mounted table and says why, never showing the token."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from pathlib import Path
from typing import Any

import pytest

from rtrl.core.api.adapter import AdapterRouting
from rtrl_localkube.api import KubeAPI
from rtrl_localkube.controlplane import ControlPlane
from rtrl_serving.capture.configmap import ConfigMapWatch
from rtrl_serving.capture.table import parse

pytestmark = pytest.mark.timeout(120)
TABLE = "composer-adapters"


def _route(checkpoint: str, weight: int) -> str:
    ref = {
        "name": checkpoint,
        "checkpoint": checkpoint,
        "uri": f"s3://rtrl-artifacts/{checkpoint}/",
    }
    return json.dumps({"orgs": {"acme": {"canary": ref, "weight": weight}}})


def _service_account(
    kube: KubeAPI, controlplane: ControlPlane, root: Path, *, allowed: bool
) -> Path:
    """A ServiceAccount's mount as a pod gets it (token, CA, namespace), allowed to get,
    list and watch the one ConfigMap (or nothing)."""
    ns = kube.namespace
    kube.create({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "vllm"}})
    if allowed:
        kube.create({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            "metadata": {"name": "rtrl-adapter-routes"},
            "rules": [{"apiGroups": [""], "resources": ["configmaps"],
                       "resourceNames": [TABLE], "verbs": ["get", "list", "watch"]}],
        })  # fmt: skip
        kube.create({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
            "metadata": {"name": "rtrl-adapter-routes"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                        "name": "rtrl-adapter-routes"},
            "subjects": [{"kind": "ServiceAccount", "name": "vllm", "namespace": ns}],
        })  # fmt: skip
    mount = root / "serviceaccount"
    mount.mkdir()
    (mount / "token").write_text(controlplane.service_account_token(ns, "vllm"))
    (mount / "ca.crt").write_bytes(Path(controlplane.ca_file).read_bytes())
    (mount / "namespace").write_text(ns)
    return mount


async def _stopped(task: asyncio.Task[None]) -> None:
    """The watch cancelled and its TLS connections closed before the test's loop ends (a
    socket left to the garbage collector warns in whichever test runs next)."""
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await asyncio.sleep(0.25)  # aiohttp: TLS transports close a few loop turns later


async def _until(check: Any, timeout: float = 10.0) -> float:
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout:
            raise AssertionError("not within the timeout")
        await asyncio.sleep(0.01)
    return time.monotonic() - start


def test_a_route_written_reaches_the_sidecar_through_the_api_in_under_a_second(
    kube: KubeAPI, controlplane: ControlPlane, tmp_path: Path
) -> None:
    mount = _service_account(kube, controlplane, tmp_path, allowed=True)
    kube.create({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": TABLE, "labels": {"rtrl.io/adapter-routes": "true"}},
        "data": {"globex.yaml": "orgs: {}\n"},
    })  # fmt: skip
    # another ConfigMap of the namespace the ServiceAccount may not read: never asked for
    kube.create({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "other"}})
    watch = ConfigMapWatch(TABLE, api=controlplane.url, service_account=mount)

    async def story() -> list[float]:
        task = asyncio.create_task(watch.run())
        try:
            await _until(lambda: watch.data is not None)
            assert watch.problem is None, watch.problem
            latencies = []
            for step, weight in enumerate((5, 25, 50, 0)):
                key = "composer-acme.yaml"
                kube.patch("v1", "ConfigMap", TABLE, {"data": {key: _route(f"c{step}", weight)}})
                written = time.monotonic()
                await _until(lambda w=weight: _weight(watch) == w)
                latencies.append(time.monotonic() - written)
            kube.patch("v1", "ConfigMap", TABLE, {"data": {"composer-acme.yaml": None}})
            await _until(lambda: "composer-acme.yaml" not in (watch.data or {}))
            return latencies
        finally:
            await _stopped(task)

    latencies = asyncio.run(story())
    print(f"route written -> sidecar's table: {', '.join(f'{s * 1000:.0f} ms' for s in latencies)}")
    assert max(latencies) < 1.0, latencies
    snapshot = watch.snapshot()
    assert snapshot is not None
    assert [p.name for p, _ in snapshot] == ["globex.yaml"]


def _weight(watch: ConfigMapWatch) -> int | None:
    files = watch.snapshot()
    if not files:
        return None
    route = parse(files).orgs.get("acme")
    return route.weight if route is not None else None


def test_without_the_right_to_read_it_the_mounted_table_stays_and_the_token_is_never_shown(
    kube: KubeAPI, controlplane: ControlPlane, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    mount = _service_account(kube, controlplane, tmp_path, allowed=False)
    kube.create({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": TABLE},
                 "data": {"a.yaml": _route("c1", 5)}})  # fmt: skip
    watch = ConfigMapWatch(TABLE, api=controlplane.url, service_account=mount)

    async def story() -> None:
        task = asyncio.create_task(watch.run())
        try:
            await _until(lambda: watch.problem is not None)
        finally:
            await _stopped(task)

    with caplog.at_level(logging.WARNING):
        asyncio.run(story())
    assert watch.data is None and watch.snapshot() is None  # the mounted table is followed
    assert watch.problem is not None and "HTTP 403" in watch.problem
    assert "following the mounted table" in caplog.text
    assert (mount / "token").read_text() not in caplog.text
    assert AdapterRouting() == parse(())  # an empty ConfigMap routes nothing
