"""The Gateway API router on the real control plane: the standard-channel CRDs validate the
HTTPRoute the operator writes, and every backendRef resolves, through a Service port that
exists, to ready endpoints of the right pods (the real EndpointSlice controller's view).
With ``unit: user``, the route as the server stored it keeps every user in one arm when
routed by the Gateway API's matching rules (``src/rtrl_localkube/gateway.py``)."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from rtrl.core.api.names import API_VERSION, FINALIZER_RESTORE_TRAFFIC
from rtrl.core.api.rlcycle import RLCycleSpec
from rtrl.kube.apply import apply, write_status
from rtrl.kube.client import KubeClient, KubeError
from rtrl.planning import Patch
from rtrl.planning.manifests.canary import CANARY_RULE, bucket_regex, route_rules
from rtrl_localkube import gateway
from rtrl_localkube.api import KubeAPI
from rtrl_localkube.cycle_world import RTRL, rlcycle
from rtrl_localkube.kubelet import Kubelet
from rtrl_localkube.tools import OperatorProcess
from tests.e2e.world import set_up

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


def stable_service_and_route(kube: KubeAPI) -> None:
    """The vLLM example: pods serve on containerPort 8000 ("http"), the Service maps 8000
    to it, and one HTTPRoute rule sends everything to that Service."""
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


def test_canary_route_backends_resolve(
    kube: KubeAPI,
    node: Kubelet,
    rtrl_operator: Callable[..., OperatorProcess],
    tmp_path: Path,
) -> None:
    stable_service_and_route(kube)
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


def test_deleted_mid_canary_with_no_operator_keeps_routing_to_a_live_service(
    kube: KubeAPI,
    node: Kubelet,
    rtrl_operator: Callable[..., OperatorProcess],
    tmp_path: Path,
) -> None:
    """The operator stopped mid-canary, the RLCycle deleted: it stays Terminating (the
    finalizer rtrl.io/restore-traffic), so the garbage collector leaves the canary Service
    the route names, and its pods, serving. An operator started again gives the route back,
    lets the RLCycle go, and the garbage collector then removes the canary."""
    stable_service_and_route(kube)
    rollout = {
        "router": "gatewayapi", "httpRoute": "composer", "service": "composer",
        "steps": [{"weight": 10, "minDuration": "1h"}], "readyTimeout": "2m",
        "analysis": {"maxDuration": "2h", "interval": "1m"},
    }  # fmt: skip
    set_up(kube, tmp_path / "store", tmp_path, rollout=rollout)
    operator = rtrl_operator()

    def canary_ref() -> dict[str, Any] | None:
        route = kube.get(GATEWAY, "HTTPRoute", "composer") or {}
        refs = route["spec"]["rules"][0]["backendRefs"]
        return next((r for r in refs if r["name"] == "composer-canary"), None)

    ref = kube.wait_for(canary_ref, timeout=240, interval=0.5, message=operator.output)
    kube.wait_for(lambda: resolve(kube, ref), timeout=90, interval=0.5, message=operator.output)
    held = kube.get(RTRL, "RLCycle", "composer") or {}
    assert FINALIZER_RESTORE_TRAFFIC in held["metadata"]["finalizers"]
    operator.stop()

    kube.delete(RTRL, "RLCycle", "composer")
    time.sleep(5)  # the garbage collector has had time to act on anything it may take
    assert canary_ref() == ref
    assert resolve(kube, ref), "the canary Service the route names serves no more"
    terminating = kube.get(RTRL, "RLCycle", "composer") or {}
    assert terminating["metadata"].get("deletionTimestamp"), terminating
    assert kube.get(RTRL, "Checkpoint", "composer-1") is not None

    operator = rtrl_operator()
    kube.wait_for(lambda: kube.get(RTRL, "RLCycle", "composer") is None, timeout=60,
                  interval=0.2, message=operator.output)  # fmt: skip
    route = kube.get(GATEWAY, "HTTPRoute", "composer") or {}
    refs = route["spec"]["rules"][0]["backendRefs"]
    assert [(r["name"], r.get("weight")) for r in refs] == [("composer", 100)]
    kube.wait_for(lambda: kube.get("v1", "Service", "composer-canary") is None, timeout=60)
    kube.wait_for(lambda: kube.get("apps/v1", "Deployment", "composer-vllm-canary") is None,
                  timeout=60)  # fmt: skip

    def restored_event() -> list[dict[str, Any]]:
        return [e for e in kube.list("v1", "Event") if e.get("reason") == "TrafficRestored"]

    events = kube.wait_for(restored_event, timeout=10, message=operator.output)
    assert "HTTPRoute composer sends all its traffic to Service composer" in events[0]["message"]


def test_the_status_write_after_the_finalizer_write_is_conditional_on_it(
    kube: KubeAPI, release: str, tmp_path: Path
) -> None:
    """A round adds the finalizer (conditional on the RLCycle it saw), then writes the
    status: that write is conditional on what the finalizer write answered, not refused as
    someone else's change; and a finalizer write from a stale view is refused (409)."""
    kube.create(rlcycle(tmp_path))
    client = KubeClient(kube.api_client)
    seen = client.get("RLCycle", kube.namespace, "composer") or {}
    version = seen["metadata"]["resourceVersion"]
    meta = {"finalizers": [FINALIZER_RESTORE_TRAFFIC], "resourceVersion": version}
    held = Patch(API_VERSION, "RLCycle", "composer", {"metadata": meta})
    try:
        apply(client, seen, [held])
        assert write_status(client, seen, {"message": "held"})
        with pytest.raises(KubeError) as refused:
            apply(KubeClient(kube.api_client), seen, [held])
        assert refused.value.status == 409
        now = kube.get(RTRL, "RLCycle", "composer") or {}
        assert now["metadata"]["finalizers"] == [FINALIZER_RESTORE_TRAFFIC]
        assert now["status"]["message"] == "held"
    finally:
        kube.patch(RTRL, "RLCycle", "composer", {"metadata": {"finalizers": None}})


def users_arms(route: dict[str, Any], users: list[str], rng: random.Random) -> dict[str, str]:
    """Where each user's requests land (several each, with the bucket the edge gives it);
    asserts that they all land in one arm."""
    arms = {}
    for user in users:
        headers = {"x-rtrl-bucket": str(gateway.bucket(user))}
        seen = {gateway.backend(route, gateway.Request("/v1/chat/completions", "POST", headers),
                                rng) for _ in range(3)}  # fmt: skip
        assert len(seen) == 1, f"{user} (bucket {headers}) reached {seen}"
        arms[user] = str(seen.pop())
    return arms


def test_unit_user_keeps_each_user_in_one_arm(
    kube: KubeAPI,
    node: Kubelet,
    rtrl_operator: Callable[..., OperatorProcess],
    tmp_path: Path,
) -> None:
    stable_service_and_route(kube)
    # The first analysis (no interactions yet: continue, and minSamples is 0) moves the
    # canary from 10% to 30%.
    rollout = {
        "router": "gatewayapi", "httpRoute": "composer", "service": "composer",
        "unit": "user", "bucketHeader": "x-rtrl-bucket",
        "steps": [{"weight": 10, "minDuration": "3s"}, {"weight": 30, "minDuration": "1h"}],
        "readyTimeout": "2m", "analysis": {"maxDuration": "2h", "interval": "1m"},
    }  # fmt: skip
    rlc = set_up(kube, tmp_path / "store", tmp_path, rollout=rollout)
    spec = RLCycleSpec.model_validate(rlc["spec"])
    operator = rtrl_operator()

    def route_at(weight: int) -> dict[str, Any] | None:
        route = kube.get(GATEWAY, "HTTPRoute", "composer") or {}
        rules = route["spec"]["rules"]
        canary = [r for r in rules if r.get("name") == CANARY_RULE]
        regex = canary[0]["matches"][0]["headers"][-1]["value"] if canary else None
        return route if regex == bucket_regex(weight) else None

    # Written by the operator, and accepted (validated, defaulted) by the real API server.
    route = kube.wait_for(lambda: route_at(10), timeout=240, interval=0.2,
                          message=operator.output)  # fmt: skip
    stable_rule, canary_rule = route["spec"]["rules"]
    assert [(r["name"], r["weight"]) for r in stable_rule["backendRefs"]] == [("composer", 100)]
    assert canary_rule["matches"] == [{
        "path": {"type": "PathPrefix", "value": "/"},
        "headers": [{"type": "RegularExpression", "name": "x-rtrl-bucket", "value": "^[0-9]$"}],
    }]  # fmt: skip
    assert [r["name"] for r in canary_rule["backendRefs"]] == ["composer-canary"]
    # what the server stored, defaults included, is what the operator plans: no re-patching
    assert route_rules(spec, route, 10) is None

    def canary_ready() -> bool:
        ck = kube.get(RTRL, "Checkpoint", "composer-1") or {}
        message = (ck.get("status") or {}).get("message") or ""
        ref = canary_rule["backendRefs"][0]
        return "waiting for the canary" not in message and bool(resolve(kube, ref))

    kube.wait_for(canary_ready, timeout=90, interval=0.5, message=operator.output)
    canary_pods = resolve(kube, canary_rule["backendRefs"][0])
    assert all(name.startswith("composer-vllm-canary-") for name in canary_pods), canary_pods

    users = [f"user-{i}" for i in range(2000)]
    rng = random.Random(11)

    def canary_share(arms: dict[str, str], weight: int) -> float:
        share = sum(arm == "composer-canary" for arm in arms.values()) / len(arms)
        p = weight / 100
        assert abs(share - p) < 4 * (p * (1 - p) / len(arms)) ** 0.5, (share, weight)
        return share

    at_10 = users_arms(route, users, rng)
    canary_share(at_10, 10)
    # requests without the header are not in the experiment
    no_header = {gateway.backend(route, gateway.Request("/v1/chat/completions"), rng)
                 for _ in range(300)}  # fmt: skip
    assert no_header == {"composer"}

    route = kube.wait_for(lambda: route_at(30), timeout=90, interval=0.5,
                          message=operator.output)  # fmt: skip
    assert len(route["spec"]["rules"]) == 2 and route_rules(spec, route, 30) is None
    records = (kube.get(RTRL, "Checkpoint", "composer-1") or {})["status"]["rollout"]
    assert [(r["weight"], r.get("decision")) for r in records][:1] == [(10, "continue")]
    at_30 = users_arms(route, users, rng)
    canary_share(at_30, 30)
    moved_back = [u for u in users if at_10[u] == "composer-canary" and at_30[u] == "composer"]
    assert not moved_back, moved_back[:10]

    # Deleted mid-canary: the canary rule goes, the stable Service keeps all the traffic.
    kube.delete(RTRL, "RLCycle", "composer")

    def released() -> bool:
        rules = (kube.get(GATEWAY, "HTTPRoute", "composer") or {})["spec"]["rules"]
        return [[(r["name"], r.get("weight")) for r in rule["backendRefs"]] for rule in rules] == [
            [("composer", 100)]
        ]

    kube.wait_for(released, timeout=30, message=operator.output)
