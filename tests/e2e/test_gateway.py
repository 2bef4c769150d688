"""The Gateway API router on the real control plane: the standard-channel CRDs validate the
HTTPRoute the operator writes, and every backendRef resolves, through a Service port that
exists, to ready endpoints of the right pods (the real EndpointSlice controller's view)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.api import KubeAPI
from tests.cluster.kubelet import Kubelet
from tests.cluster.tools import OperatorProcess
from tests.e2e.world import set_up
from tests.integration.cycle_world import RTRL

pytestmark = pytest.mark.timeout(300)

GATEWAY = "gateway.networking.k8s.io/v1"


def resolve(kube: KubeAPI, ref: dict[str, Any]) -> list[str]:
    """The ready endpoint addresses a backendRef reaches: its Service must have the port,
    and that port's EndpointSlices must list ready endpoints for it."""
    service = kube.get("v1", "Service", ref["name"])
    assert service is not None, f"backendRef {ref}: no Service"
    ports = [p for p in service["spec"]["ports"] if p["port"] == ref["port"]]
    assert ports, f"backendRef {ref}: Service {ref['name']} has ports {service['spec']['ports']}"
    slices = kube.list(
        "discovery.k8s.io/v1", "EndpointSlice", labels={"kubernetes.io/service-name": ref["name"]}
    )
    addresses = []
    for endpoints in slices:
        names = {p.get("name", "") for p in endpoints.get("ports") or []}
        if ports[0].get("name", "") not in names:
            continue
        for endpoint in endpoints.get("endpoints") or []:
            if (endpoint.get("conditions") or {}).get("ready"):
                addresses.append(endpoint["targetRef"]["name"])
    return addresses


def test_canary_route_backends_resolve(
    kube: KubeAPI,
    node: Kubelet,
    rtrl_operator: Callable[..., OperatorProcess],
    tmp_path: Path,
) -> None:
    # The vLLM example: pods serve on containerPort 8000 ("http"); the Service maps 8000 to it.
    kube.create({
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": "composer"},
        "spec": {"selector": {"app": "composer"},
                 "ports": [{"name": "http", "port": 8000, "targetPort": "http"}]},
    })  # fmt: skip
    kube.create({
        "apiVersion": GATEWAY, "kind": "HTTPRoute", "metadata": {"name": "composer"},
        "spec": {"parentRefs": [{"name": "inference"}],
                 "rules": [{"backendRefs": [{"name": "composer", "port": 8000}]}]},
    })  # fmt: skip
    rollout = {
        "router": "gatewayapi", "httpRoute": "composer", "service": "composer",
        "steps": [{"weight": 10, "minDuration": "1h"}], "readyTimeout": "2m",
        "analysis": {"maxDuration": "2h", "interval": "1m"},
    }  # fmt: skip
    set_up(kube, tmp_path / "store", tmp_path, rollout=rollout)
    operator = rtrl_operator()

    def weighted() -> list[dict[str, Any]] | None:
        route = kube.get(GATEWAY, "HTTPRoute", "composer") or {}
        refs = route["spec"]["rules"][0]["backendRefs"]
        return refs if len(refs) == 2 else None

    refs = kube.wait_for(weighted, timeout=240, interval=0.5, message=operator.output)
    assert [(r["name"], r["port"], r["weight"]) for r in refs] == [
        ("composer", 8000, 90), ("composer-canary", 8000, 10)
    ]  # fmt: skip

    def canary_ready() -> bool:
        ck = kube.get(RTRL, "Checkpoint", "composer-1") or {}
        message = (ck.get("status") or {}).get("message") or ""
        return "waiting for the canary" not in message and bool(resolve(kube, refs[1]))

    def state() -> str:
        slices = kube.list("discovery.k8s.io/v1", "EndpointSlice")
        return f"{operator.output()[-3000:]}\nEndpointSlices: {slices}"

    kube.wait_for(canary_ready, timeout=90, interval=0.5, message=state)
    canary_pods = resolve(kube, refs[1])
    stable_pods = resolve(kube, refs[0])
    assert all(name.startswith("composer-vllm-canary-") for name in canary_pods), canary_pods
    assert stable_pods and not set(stable_pods) & set(canary_pods), (stable_pods, canary_pods)

    # Deleted mid-canary: the canary Service goes with the garbage collector, and the route
    # gives its weight back to the stable Service.
    kube.delete(RTRL, "RLCycle", "composer")

    def released() -> bool:
        route = kube.get(GATEWAY, "HTTPRoute", "composer") or {}
        refs = route["spec"]["rules"][0]["backendRefs"]
        return [(r["name"], r.get("weight")) for r in refs] == [("composer", 100)]

    kube.wait_for(released, timeout=30, message=operator.output)
    kube.wait_for(lambda: kube.get("v1", "Service", "composer-canary") is None, timeout=30)
