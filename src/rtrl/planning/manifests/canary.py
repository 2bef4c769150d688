"""The canary rollout of a Checkpoint that passed eval, and its promotion or rollback.

Manifests and patches here are pure functions of the observed objects; the decisions live
in :mod:`rtrl.planning.rollout`. The rollout's own record is the Checkpoint's
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
  selects them. With ``rollout.unit: request`` the HTTPRoute's backendRefs get weights
  ``100 - w`` (stable Service) and ``w`` (canary Service). With ``user`` or ``session``
  the stable backendRef keeps all the weight, and each rule holding it gets a copy named
  ``rtrl-canary`` (``rtrl-canary-2``, ...) that sends to the canary Service the requests
  whose ``rollout.bucketHeader`` (``hash(unit id) mod 100``, set at the edge) is below
  ``w``: one more header match than the rule it copies, so Gateway API's precedence gives
  it those requests, and a unit stays in its arm while the weight rises.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from typing import Any

from rtrl.core.api import names
from rtrl.core.api.rlcycle import AssignmentUnit, RLCycleSpec, Router

from .names import canary_name, canary_service_name, labels, owner

CHECKPOINT_ID_ENV = "RTRL_CHECKPOINT_ID"


def canary_split(stable_replicas: int, weight: int) -> tuple[int, float]:
    """Canary replicas for a ``weight`` percent share next to ``stable_replicas``, and the
    share (percent) that this actually gives."""
    stable = max(0, stable_replicas)
    if stable == 0:
        return 1, 100.0
    replicas = max(1, round(stable * weight / max(1, 100 - weight)))
    return replicas, 100.0 * replicas / (stable + replicas)


def canary_weight(
    spec: RLCycleSpec, target: Mapping[str, Any] | None, weight: int
) -> tuple[int, float]:
    """Canary replicas for ``weight`` next to the target's replicas, and the share (percent)
    of traffic the canary gets: the replicas' share, or ``weight`` itself when the
    gatewayapi router's HTTPRoute weights it."""
    stable = int(((target or {}).get("spec") or {}).get("replicas", 1))
    replicas, share = canary_split(stable, weight)
    if spec.rollout.router == Router.GATEWAY_API:
        share = float(weight)
    return replicas, share


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
    return {
        names.LABEL_ARM: "canary",
        names.LABEL_RLCYCLE: rlcycle,
        names.LABEL_CHECKPOINT: checkpoint,
    }


def _canary_metadata(name: str, rlcycle: str, checkpoint: dict[str, Any]) -> dict[str, Any]:
    """Metadata of the canary Deployment and Service: the canary arm's labels, owned by the
    Checkpoint (garbage-collected with it)."""
    meta = checkpoint["metadata"]
    return {
        "name": name,
        "namespace": meta["namespace"],
        "labels": {**labels(rlcycle, meta["name"]), names.LABEL_ARM: "canary"},
        "ownerReferences": [owner("Checkpoint", meta["name"], meta["uid"])],
    }


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
        "metadata": _canary_metadata(canary_name(spec.target.deployment), rlc, checkpoint),
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
        "metadata": _canary_metadata(canary_service_name(spec.rollout.service), rlc, checkpoint),
        "spec": {
            "selector": canary_labels(rlc, meta["name"]),
            "ports": [
                {k: v for k, v in port.items() if k != "nodePort"}
                for port in (stable.get("spec") or {}).get("ports") or []
            ],
        },
    }


# The name of the HTTPRoute rule that sends the bucketed units to the canary (the second
# and later ones, for routes with several rules holding the stable Service: "-2", "-3", ...).
CANARY_RULE = "rtrl-canary"


def bucket_regex(weight: int) -> str:
    """An anchored regular expression that matches exactly the decimal integers
    ``0 .. weight - 1`` as the edge writes them (no sign, no leading zeros), for
    ``1 <= weight <= 100``. Only literals, character ranges, a non-capturing group and
    alternation: the same in RE2 (Envoy), PCRE, ECMAScript and Python."""
    if not 1 <= weight <= 100:
        raise ValueError(f"a bucket regex is for weights 1..100, not {weight}")
    last = weight - 1

    def span(low: int, high: int) -> str:
        return str(low) if low == high else f"[{low}-{high}]"

    if last < 10:
        return f"^{span(0, last)}$"
    tens, units = divmod(last, 10)
    parts = ["[0-9]"]
    full = tens if units == 9 else tens - 1  # tens digits whose every units digit is in
    if full >= 1:
        parts.append(f"{span(1, full)}[0-9]")
    if units < 9:
        parts.append(f"{tens}{span(0, units)}")
    return f"^(?:{'|'.join(parts)})$"


_BUCKET_WEIGHTS = {bucket_regex(w): w for w in range(1, 101)}


def bucket_weight(regex: str) -> int | None:
    """The weight whose :func:`bucket_regex` is ``regex``; for one written otherwise (by
    hand), how many of the buckets 0..99 it matches; None if it is no valid regex."""
    if regex in _BUCKET_WEIGHTS:
        return _BUCKET_WEIGHTS[regex]
    try:
        compiled = re.compile(regex)
    except re.error:
        return None
    return sum(1 for bucket in range(100) if compiled.fullmatch(str(bucket)))


def sticky(spec: RLCycleSpec) -> bool:
    """Whether the route assigns whole units (user or session) by the bucket header."""
    rollout = spec.rollout
    return rollout.unit != AssignmentUnit.REQUEST and bool(rollout.bucket_header)


def _canary_rule_name(index: int) -> str:
    return CANARY_RULE if index == 0 else f"{CANARY_RULE}-{index + 1}"


def is_canary_rule(rule: dict[str, Any]) -> bool:
    """A rule rtrl added for the sticky assignment (found again by its name)."""
    name = str(rule.get("name") or "")
    suffix = name.removeprefix(f"{CANARY_RULE}-")
    return name == CANARY_RULE or (suffix != name and suffix.isdigit())


def _bucketed(matches: list[dict[str, Any]], header: str, weight: int) -> list[dict[str, Any]]:
    """``matches`` (or the default match, a path prefix "/") each with one more header
    match: ``header`` holds a bucket below ``weight``."""
    bucket = {"type": "RegularExpression", "name": header, "value": bucket_regex(weight)}
    out = []
    for original in matches or [{"path": {"type": "PathPrefix", "value": "/"}}]:
        match = copy.deepcopy(original)
        headers = [h for h in match.get("headers") or []
                   if str(h.get("name", "")).lower() != header.lower()]  # fmt: skip
        match["headers"] = [*headers, bucket]
        out.append(match)
    return out


def route_rules(
    spec: RLCycleSpec, route: dict[str, Any], weight: int
) -> list[dict[str, Any]] | None:
    """The HTTPRoute's rules routing ``weight`` percent to the canary; None when nothing
    changes.

    Unit request: in each rule holding the stable Service, the stable and canary Services
    weighted ``100 - weight`` and ``weight``. Unit user or session: the stable Service at
    100 and no canary backendRef there; each such rule followed, at the end of the list, by
    a copy named :data:`CANARY_RULE` whose matches also require ``rollout.bucketHeader`` to
    be below ``weight``, sending to the canary Service what went to the stable one. At 0
    (in either mode) the canary backendRefs and rules are gone (:func:`restored_rules`).
    """
    assert spec.rollout.service is not None
    header = spec.rollout.bucket_header or ""
    return _weighted(route, spec.rollout.service, weight, header, sticky(spec))


def restored_rules(route: dict[str, Any], stable: str) -> list[dict[str, Any]] | None:
    """The HTTPRoute's rules with nothing left of a canary of the Service ``stable``: its
    :data:`CANARY_RULE` copies gone, the stable backendRef at weight 100, and a backendRef
    to the canary Service in a rule without the stable one (someone edited the route) sent
    to the stable Service instead. None when nothing changes. Needs no valid spec: what a
    deleted RLCycle whose spec no longer validates gives back."""
    return _weighted(route, stable, 0, "", False)


def routes_to_canary(route: Mapping[str, Any] | None, stable: str) -> bool:
    """Whether any rule of ``route`` sends requests to the canary Service of ``stable``."""
    canary = canary_service_name(stable)
    rules = ((route or {}).get("spec") or {}).get("rules") or []
    return any(ref.get("name") == canary for rule in rules for ref in rule.get("backendRefs") or [])


def _weighted(
    route: dict[str, Any], stable: str, weight: int, header: str, by_bucket: bool
) -> list[dict[str, Any]] | None:
    canary = canary_service_name(stable)
    current = (route.get("spec") or {}).get("rules") or []
    rules = [copy.deepcopy(rule) for rule in current if not is_canary_rule(rule)]
    added: list[dict[str, Any]] = []
    for rule in rules:
        refs = rule.get("backendRefs") or []
        mine = [r for r in refs if r.get("name") == stable]
        if not mine:
            if weight == 0 and any(r.get("name") == canary for r in refs):
                rule["backendRefs"] = [{**r, "name": stable} if r.get("name") == canary else r
                                       for r in refs]  # fmt: skip
            continue
        others = [r for r in refs if r.get("name") not in (stable, canary)]
        # copies of the stable ref's shape (port, and the group and kind the server
        # defaults), so that a route already at this weight compares equal
        new = [{**mine[0], "weight": 100 if by_bucket else 100 - weight}]
        if weight > 0 and not by_bucket:
            new.append({**mine[0], "name": canary, "weight": weight})
        rule["backendRefs"] = [*others, *new]
        if weight > 0 and by_bucket:
            copied = copy.deepcopy(rule)
            copied["name"] = _canary_rule_name(len(added))
            copied["matches"] = _bucketed(rule.get("matches") or [], header, weight)
            # what else the rule sends elsewhere stays; the stable share goes to the canary
            copied["backendRefs"] = [*others, {**mine[0], "name": canary, "weight": 100}]
            added.append(copied)
    rules += added
    return None if rules == current else rules


def route_weight(spec: RLCycleSpec, route: dict[str, Any] | None) -> int | None:
    """The canary weight an HTTPRoute currently gives: the share of buckets its
    :data:`CANARY_RULE` takes, or the canary backendRef's weight; None with neither."""
    if route is None or spec.rollout.service is None:
        return None
    canary = canary_service_name(spec.rollout.service)
    rules = (route.get("spec") or {}).get("rules") or []
    header = (spec.rollout.bucket_header or "").lower()
    for rule in rules:
        if not is_canary_rule(rule):
            continue
        for match in rule.get("matches") or []:
            for entry in match.get("headers") or []:
                name = str(entry.get("name", "")).lower()
                kind = entry.get("type", "Exact")
                if kind == "RegularExpression" and (name == header or not header):
                    return bucket_weight(str(entry.get("value", "")))
    for rule in rules:
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
