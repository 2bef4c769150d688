"""The canary rollout of a Checkpoint that passed eval, and its promotion or rollback.

Manifests and patches here are pure functions of the observed objects; the decisions live
in :mod:`rtrl.planning.plan`. The rollout's own record is the Checkpoint's
``status.rollout`` (one entry per step: weight, start, analyses judged, the last decision
and its A/B numbers), so a restarted operator knows which step it is in, how many analyses
it has judged, and whether a promotion or rollback was already decided.

Routers:

- ``replicas``: the canary Deployment ``<deployment>-canary`` carries the target's pod
  labels, so the target's Service sends it a share of traffic equal to its share of ready
  pods. The stable Deployment keeps its replicas; the canary gets
  ``round(stable * w / (100 - w))`` (at least 1), and the share actually reached is what
  the analysis checks the arms' sample ratio against.
- ``gatewayapi``: canary pods carry only rtrl's labels, a Service ``<service>-canary``
  selects them, and the HTTPRoute's backendRefs get weights ``100 - w`` (stable Service)
  and ``w`` (canary Service).
"""

from __future__ import annotations

import copy
from typing import Any

from rtrl.api.rlcycle import RLCycleSpec, Router

from . import children as ch

LABEL_ARM = f"{ch.GROUP_PREFIX}/arm"
CHECKPOINT_ID_ENV = "RTRL_CHECKPOINT_ID"


def canary_name(deployment: str) -> str:
    return f"{deployment}-canary"


def canary_service_name(service: str) -> str:
    return f"{service}-canary"


def canary_split(stable_replicas: int, weight: int) -> tuple[int, float]:
    """Canary replicas for a ``weight`` percent share next to ``stable_replicas``, and the
    share (percent) that this actually gives."""
    stable = max(0, stable_replicas)
    if stable == 0:
        return 1, 100.0
    replicas = max(1, round(stable * weight / max(1, 100 - weight)))
    return replicas, 100.0 * replicas / (stable + replicas)


def _container(deployment: dict[str, Any], name: str) -> tuple[int, dict[str, Any]] | None:
    containers = deployment["spec"]["template"]["spec"].get("containers") or []
    for index, container in enumerate(containers):
        if container.get("name") == name:
            return index, container
    return None


def env_value(deployment: dict[str, Any] | None, container: str, name: str) -> str | None:
    found = _container(deployment, container) if deployment else None
    if found is None:
        return None
    for env in found[1].get("env") or []:
        if env.get("name") == name:
            value = env.get("value")
            return str(value) if value is not None else None
    return None


def set_env_patch(
    deployment: dict[str, Any], container: str, values: dict[str, str]
) -> list[dict[str, Any]]:
    """A JSON patch that sets env ``values`` of ``container`` and touches nothing else; each
    replacement is guarded by ``test`` operations on the entry's name and current value, so
    it applies only to the state it was planned from."""
    found = _container(deployment, container)
    assert found is not None
    index, spec = found
    base = f"/spec/template/spec/containers/{index}/env"
    env = spec.get("env") or []
    ops: list[dict[str, Any]] = []
    if not env:
        ops.append({"op": "test", "path": f"/spec/template/spec/containers/{index}/name",
                    "value": container})  # fmt: skip
        ops.append({"op": "add", "path": base, "value": []})
    for name, value in values.items():
        at = next((i for i, e in enumerate(env) if e.get("name") == name), None)
        if at is None:
            ops.append({"op": "add", "path": f"{base}/-", "value": {"name": name, "value": value}})
        elif env[at].get("value") != value:
            ops += [
                {"op": "test", "path": f"{base}/{at}/name", "value": name},
                {"op": "test", "path": f"{base}/{at}/value", "value": env[at].get("value")},
                {"op": "replace", "path": f"{base}/{at}/value", "value": value},
            ]
    return ops


def canary_labels(rlcycle: str, checkpoint: str) -> dict[str, str]:
    return {LABEL_ARM: "canary", ch.LABEL_RLCYCLE: rlcycle, ch.LABEL_CHECKPOINT: checkpoint}


def canary_deployment(
    spec: RLCycleSpec,
    target: dict[str, Any],
    rlcycle: dict[str, Any],
    checkpoint: dict[str, Any],
    replicas: int,
) -> dict[str, Any]:
    """The target's pod template with the candidate injected, as ``<deployment>-canary``,
    owned by the Checkpoint (garbage-collected with it)."""
    meta = checkpoint["metadata"]
    rlc = rlcycle["metadata"]["name"]
    template = copy.deepcopy(target["spec"]["template"])
    arm = canary_labels(rlc, meta["name"])
    pod_labels = dict(template.get("metadata", {}).get("labels") or {})
    if spec.rollout.router == Router.GATEWAY_API:
        pod_labels = {}  # reached only through the canary Service, never the stable one
    template.setdefault("metadata", {})["labels"] = {**pod_labels, **arm}
    found = _container({"spec": {"template": template}}, spec.target.container)
    assert found is not None
    _, container = found
    env = [
        e
        for e in container.get("env") or []
        if e.get("name") not in (spec.target.checkpoint_env, CHECKPOINT_ID_ENV)
    ]
    container["env"] = [
        *env,
        {"name": spec.target.checkpoint_env, "value": checkpoint["spec"]["uri"]},
        {"name": CHECKPOINT_ID_ENV, "value": meta["name"]},
    ]
    body = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": canary_name(spec.target.deployment),
            "namespace": meta["namespace"],
            "labels": {**ch.labels(rlc, meta["name"]), LABEL_ARM: "canary"},
            "ownerReferences": [ch.owner("Checkpoint", meta["name"], meta["uid"])],
        },
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": arm},
            "template": template,
        },
    }
    return body


def canary_service(
    spec: RLCycleSpec, rlcycle: dict[str, Any], checkpoint: dict[str, Any], stable: dict[str, Any]
) -> dict[str, Any]:
    """For the gatewayapi router: the stable Service's ports (what the HTTPRoute's backendRef
    names and the pods serve on, since the canary's pod template is the target's),
    selecting the canary pods."""
    meta = checkpoint["metadata"]
    rlc = rlcycle["metadata"]["name"]
    assert spec.rollout.service is not None
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": canary_service_name(spec.rollout.service),
            "namespace": meta["namespace"],
            "labels": {**ch.labels(rlc, meta["name"]), LABEL_ARM: "canary"},
            "ownerReferences": [ch.owner("Checkpoint", meta["name"], meta["uid"])],
        },
        "spec": {
            "selector": canary_labels(rlc, meta["name"]),
            "ports": [
                {k: v for k, v in port.items() if k != "nodePort"}
                for port in (stable.get("spec") or {}).get("ports") or []
            ],
        },
    }


def route_rules(
    spec: RLCycleSpec, route: dict[str, Any], weight: int
) -> list[dict[str, Any]] | None:
    """The HTTPRoute's rules with the stable and canary Services weighted ``100 - weight``
    and ``weight`` (the canary backendRef removed at 0); None when nothing changes."""
    assert spec.rollout.service is not None
    stable = spec.rollout.service
    canary = canary_service_name(stable)
    rules = copy.deepcopy((route.get("spec") or {}).get("rules") or [])
    for rule in rules:
        refs = rule.get("backendRefs") or []
        mine = [r for r in refs if r.get("name") == stable]
        if not mine:
            continue
        others = [r for r in refs if r.get("name") not in (stable, canary)]
        new = [{**mine[0], "weight": 100 - weight}]
        if weight > 0:
            # the stable ref's shape (port, and the group and kind the server defaults), so
            # that a route already at this weight compares equal and is not patched again
            new.append({**mine[0], "name": canary, "weight": weight})
        rule["backendRefs"] = [*others, *new]
    return None if rules == ((route.get("spec") or {}).get("rules") or []) else rules


def route_weight(spec: RLCycleSpec, route: dict[str, Any] | None) -> int | None:
    """The canary weight an HTTPRoute currently gives (None without a canary backendRef)."""
    if route is None or spec.rollout.service is None:
        return None
    canary = canary_service_name(spec.rollout.service)
    for rule in (route.get("spec") or {}).get("rules") or []:
        for ref in rule.get("backendRefs") or []:
            if ref.get("name") == canary:
                return int(ref.get("weight", 1))
    return None


def deployment_ready(deployment: dict[str, Any] | None) -> bool:
    """All replicas of the current template updated and ready (the Deployment controller's
    view: observedGeneration caught up)."""
    if deployment is None:
        return False
    want = int((deployment.get("spec") or {}).get("replicas", 1))
    status = deployment.get("status") or {}
    meta = deployment.get("metadata") or {}
    return (
        int(status.get("observedGeneration") or 0) >= int(meta.get("generation") or 0)
        and int(status.get("updatedReplicas") or 0) >= want
        and int(status.get("readyReplicas") or 0) >= want
        and int(status.get("replicas") or want) <= want  # the old pods are gone
    )
