"""The canary's workload and what the target serves: the canary Deployment created or
resized to a step's weight, its Service and the HTTPRoute's weights (gatewayapi router),
all removed when the canary ends; and the target Deployment pointed at a checkpoint (a
promotion, a rollback, a pin). :mod:`.rollout` decides when. An adapter RLCycle has no
canary workload: each of these is a write of its organisation's route in the engine
(:mod:`.adapter_routes`)."""

from __future__ import annotations

from typing import Any

from rtrl.core.api.rlcycle import Router

from . import adapter_routes as routes
from .actions import Create, Delete, Patch
from .capture import canary_service, canary_template, sidecar_env_ops
from .manifests import canary as cn
from .manifests.names import canary_service_name
from .reading import meta
from .round import Round
from .traffic import route_patch


def ensure_canary(r: Round, ck: dict[str, Any], weight: int) -> float:
    """Create or resize the canary workload and route ``weight``; the share reached."""
    if r.spec.adapter is not None:
        routes.canary(r, ck, weight)
        return float(weight)  # of the organisation's units, bucketed by the sidecars
    spec, target = r.spec, dict(r.obs.target or {})
    service = spec.rollout.service if spec.rollout.router == Router.GATEWAY_API else None
    if service and canary_service_name(service) not in r.obs.services:
        if r.obs.stable_service is None:
            raise StableServiceMissingError(service)
        manifest = cn.canary_service(spec, r.rlc, ck, dict(r.obs.stable_service))
        r.act(Create(canary_service(r, manifest)))
    replicas, share = cn.canary_weight(r.spec, r.obs.target, weight)
    canary = r.obs.canary
    if canary is None:
        manifest = cn.canary_deployment(spec, target, r.rlc, ck, replicas)
        r.act(Create(canary_template(r, ck, manifest)))
    elif int((canary.get("spec") or {}).get("replicas", 0)) != replicas:
        r.act(
            Patch("apps/v1", "Deployment", meta(canary)["name"], {"spec": {"replicas": replicas}})
        )
    parent = (ck.get("spec") or {}).get("parent")
    container = spec.target.container
    if parent and cn.env_value(target, container, cn.CHECKPOINT_ID_ENV) != parent:
        ops = cn.set_env_patch(target, container, {cn.CHECKPOINT_ID_ENV: parent})
        r.act(Patch("apps/v1", "Deployment", spec.target.deployment, ops))
    if spec.rollout.router == Router.GATEWAY_API and spec.rollout.service:
        route_to(r, weight)
    return share


def canary_ready(r: Round, ck: dict[str, Any], weight: int) -> bool:
    """The canary can serve: its Deployment ready, or its route in the table."""
    if r.spec.adapter is not None:
        return routes.canary_shown(r, ck, weight)
    return cn.deployment_ready(dict(r.obs.canary) if r.obs.canary else None)


def canary_at_weight(r: Round, ck: dict[str, Any], weight: int) -> bool:
    """The canary serves its step's weight: scaled to it, or routed at it."""
    if r.spec.adapter is not None:
        return routes.canary_shown(r, ck, weight)
    scaled = int(((r.obs.canary or {}).get("spec") or {}).get("replicas", -1))
    return scaled == cn.canary_weight(r.spec, r.obs.target, weight)[0]


def serves(r: Round) -> str:
    """What a promotion changes, in words: the Deployment, or the organisation's route."""
    org = r.spec.adapter_org()
    if org is not None:
        return f"organisation {org} on {r.spec.target.deployment}"
    return r.spec.target.deployment


def route_to(r: Round, weight: int) -> None:
    """With the gatewayapi router: the HTTPRoute's weights, when they differ."""
    route = r.obs.http_route
    rules = cn.route_rules(r.spec, dict(route), weight) if route is not None else None
    if rules is not None:
        r.act(route_patch(r.spec.rollout.http_route or "", rules))


class StableServiceMissingError(Exception):
    """The gatewayapi router's ``rollout.service`` does not exist: no canary can be routed."""


def remove_canary(r: Round, ck: dict[str, Any]) -> None:
    """The canary workload, its Service and route weight, and any analysis still running."""
    spec = r.spec
    for job in r.obs.jobs:
        running = job.checkpoint == meta(ck)["name"] and not job.finished and not job.deleting
        if running and (job.step or "").startswith("analyze"):
            r.act(Delete("batch/v1", "Job", job.name))
    if spec.adapter is not None:
        return  # the route's canary goes with the stable route :func:`serve` writes
    if r.obs.canary is not None:
        r.act(Delete("apps/v1", "Deployment", meta(r.obs.canary)["name"]))
    if spec.rollout.router == Router.GATEWAY_API and spec.rollout.service:
        route_to(r, 0)
        if canary_service_name(spec.rollout.service) in r.obs.services:
            r.act(Delete("v1", "Service", canary_service_name(spec.rollout.service)))


def serve(r: Round, uri: str, checkpoint: str) -> bool:
    """Point the target at ``uri``; True when it already serves it. An adapter RLCycle
    routes its organisation to ``checkpoint``: its adapter, or the base (none, also for
    an adapter of another base)."""
    if r.spec.adapter is not None:
        return routes.want(r, routes.route_for(r, r.checkpoint(checkpoint)))
    spec, target = r.spec, dict(r.obs.target or {})
    if cn.env_value(target, spec.target.container, spec.target.checkpoint_env) == uri:
        return True
    ops = cn.set_env_patch(
        target,
        spec.target.container,
        {spec.target.checkpoint_env: uri, cn.CHECKPOINT_ID_ENV: checkpoint},
    )
    ops += sidecar_env_ops(r, uri, checkpoint)  # one patch: engine and sidecar roll together
    r.act(Patch("apps/v1", "Deployment", spec.target.deployment, ops))
    return False
