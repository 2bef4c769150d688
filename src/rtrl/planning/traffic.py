"""Traffic given back before an RLCycle goes: the finalizer ``rtrl.io/restore-traffic``.

With the gatewayapi router the operator writes into someone else's object, the user's
HTTPRoute: backendRef weights, or sticky rules, that send a share of the requests to the
canary Service ``<service>-canary``. That Service is owned (through its Checkpoint) by the
RLCycle, so deleting the RLCycle lets the garbage collector remove it, and a route still
naming it answers errors for that share (Gateway API: 500 for a backendRef whose Service is
missing). Kubernetes deletes an object only once its finalizers are gone, whether or not an
operator runs, so:

- While the route, as a round leaves it, sends traffic to the canary, the RLCycle carries
  the finalizer (:func:`keep_finalizer`): added in the round's actions before its first
  write of the route, removed after its last one once nothing is routed to the canary any
  more (promotion, rollback). An RLCycle that routes nothing never carries it, so a
  deletion waits for nothing there is to give back.
- A deleted RLCycle that carries it (``deletionTimestamp`` set) gets a round of its own
  (:func:`finalize`): the route given back to the stable Service (canary backendRefs and
  rules removed, the stable one at weight 100), an Event, then the finalizer removed; the
  garbage collector then removes the canary. Until an operator runs that round, the
  RLCycle stays Terminating and its canary keeps serving the share the route sends it: the
  route never names a Service that is gone.

An adapter RLCycle's canary is a share of its organisation's users in its key of the
routing ConfigMap: it holds the finalizer while that key gives a candidate a share, and a
deleted one gets that share given back to the org's stable route (the candidate's files stay
in the store, so nothing fails meanwhile; what goes is an unjudged candidate's share).

Which route and Service are read from the raw spec, not the validated one: an RLCycle whose
spec no longer validates is given back all the same, and one whose route is gone (deleted
by the user) or never routed has nothing to give back and loses the finalizer at once.
Every write is idempotent and each is planned from what was observed, so an operator
killed between two of them carries on from the state it finds.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rtrl.core.api.names import API_VERSION, FINALIZER_RESTORE_TRAFFIC
from rtrl.core.api.reasons import Reason
from rtrl.core.api.rlcycle import Router

from .actions import Patch
from .adapter_routes import canary_routed_after, give_back
from .manifests.canary import restored_rules, routes_to_canary
from .round import Plan, Round

GATEWAY_API_VERSION = "gateway.networking.k8s.io/v1"


def route_patch(name: str, rules: list[dict[str, Any]]) -> Patch:
    """The one write rtrl makes to an HTTPRoute: its rules."""
    return Patch(GATEWAY_API_VERSION, "HTTPRoute", name, {"spec": {"rules": rules}})


def routed(rlcycle: Mapping[str, Any]) -> tuple[str, str] | None:
    """``(httpRoute, service)`` when the RLCycle's spec routes its canary through an
    HTTPRoute (router ``gatewayapi``); None otherwise. From the raw spec (see above)."""
    rollout = (rlcycle.get("spec") or {}).get("rollout") or {}
    route, service = rollout.get("httpRoute"), rollout.get("service")
    if rollout.get("router") != Router.GATEWAY_API.value:
        return None
    if not isinstance(route, str) or not route or not isinstance(service, str) or not service:
        return None
    return route, service


def holds(rlcycle: Mapping[str, Any]) -> bool:
    """Whether the RLCycle carries the finalizer."""
    return FINALIZER_RESTORE_TRAFFIC in ((rlcycle.get("metadata") or {}).get("finalizers") or [])


def deleting(rlcycle: Mapping[str, Any]) -> bool:
    return bool((rlcycle.get("metadata") or {}).get("deletionTimestamp"))


def _finalizers(r: Round, *, held: bool) -> Patch:
    """A merge patch setting the RLCycle's finalizers with or without rtrl's, others kept,
    conditional on the version the round saw (409 if anyone changed the RLCycle since: the
    round fails before the writes that follow it, and the next one reads afresh)."""
    others = [str(f) for f in r.meta.get("finalizers") or [] if f != FINALIZER_RESTORE_TRAFFIC]
    wanted = [*others, FINALIZER_RESTORE_TRAFFIC] if held else others
    meta: dict[str, Any] = {"finalizers": wanted or None}
    if r.meta.get("resourceVersion"):
        meta["resourceVersion"] = str(r.meta["resourceVersion"])
    return Patch(API_VERSION, "RLCycle", r.name, {"metadata": meta})


def _route_after(r: Round, name: str) -> tuple[Mapping[str, Any] | None, int | None]:
    """The route as the round's actions leave it, and the index of the round's first
    write to it (None: it writes none)."""
    route, first = r.obs.http_route, None
    for index, action in enumerate(r.out.actions):
        if isinstance(action, Patch) and action.kind == "HTTPRoute" and action.name == name:
            first = index if first is None else first
            patch = action.patch if isinstance(action.patch, dict) else {}
            route = {**(route or {}), "spec": {**((route or {}).get("spec") or {}),
                                               **(patch.get("spec") or {})}}  # fmt: skip
    return route, first


def _first_table_write(r: Round) -> int | None:
    """The index of the round's first write of a ConfigMap (an adapter route's)."""
    kinds = [getattr(a, "kind", None) for a in r.out.actions]
    return kinds.index("ConfigMap") if "ConfigMap" in kinds else None


def keep_finalizer(r: Round) -> None:
    """At the end of a live round: the finalizer on while the route, as the round leaves
    it, sends traffic to the canary (added before the round's first write to the route);
    off once it sends none (removed after the round's writes)."""
    where = routed(r.rlc)
    route, first = _route_after(r, where[0]) if where is not None else (None, None)
    wanted = where is not None and route is not None and routes_to_canary(route, where[1])
    if not wanted and canary_routed_after(r):  # an adapter's canary, in its org's route
        wanted, first = True, _first_table_write(r)
    if wanted and not holds(r.rlc):
        at = first if first is not None else len(r.out.actions)
        r.out.actions.insert(at, _finalizers(r, held=True))
    elif holds(r.rlc) and not wanted:
        r.act(_finalizers(r, held=False))


def finalize(r: Round) -> Plan:
    """The round of a deleted RLCycle that carries the finalizer: the route given back to
    the stable Service if it still sends anything to the canary, then the finalizer
    removed. No other decision is made for an RLCycle being deleted, and no status is
    written."""
    if not holds(r.rlc):
        return r.out
    where = routed(r.rlc)
    route = r.obs.http_route
    if where is not None and route is not None:
        name, stable = where
        rules = restored_rules(dict(route), stable)
        if rules is not None:
            r.act(route_patch(name, rules))
            r.event(
                Reason.TRAFFIC_RESTORED,
                f"HTTPRoute {name} sends all its traffic to Service {stable} again: the "
                "RLCycle is being deleted, its canary goes with it",
            )
    give_back(r)
    r.act(_finalizers(r, held=False))
    return r.out
