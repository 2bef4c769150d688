"""An adapter RLCycle (``spec.adapter``): one organisation's LoRA adapter, served inside the
running engine, and what that organisation is served written as a route, never as a pod
restart (docs/adapters.md).

What the organisation is served is this RLCycle's entry in the routing table, the key
``<rlcycle>.yaml`` of ``spec.capture.adapters.configMap``: each RLCycle writes its own key
(a JSON merge patch of that key alone), so the RLCycles of different organisations never
overwrite each other, and the sidecars read every key (``rtrl-capture --adapters DIR``).
The canary is the entry's candidate at the step's weight; a promotion makes the candidate
the entry's stable adapter; a rollback puts the parent back (the base: no adapter). The
entry is both what the engine serves and what the operator reads back each round: the
serving Checkpoint of an adapter RLCycle is the entry's stable adapter.

An adapter is served only on the base it was trained on (``Checkpoint.spec.base``). When
the target's base changes (a full-model RLCycle promoted a new one) the organisation's
adapter is stale: the sidecars already route the org to the base (they check each
adapter's base digest), the entry is set back to the base, the adapter's Checkpoint reads
``Superseded`` (reason ``BaseChanged``), and the next cycle trains a new adapter from the
new base.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import yaml
from pydantic import ValidationError

from rtrl.core.api.adapter import AdapterRef, AdapterRouting, OrgRoute
from rtrl.core.api.checkpoint import CheckpointPhase
from rtrl.core.api.names import LABEL_ADAPTER_ROUTES, MANAGED_BY
from rtrl.core.api.reasons import Reason
from rtrl.core.api.rlcycle import RLCycleSpec
from rtrl.core.api.yamlfile import load

from .actions import Create, Patch
from .manifests import capture as cap
from .manifests.adapters import ADAPTERS_TABLE_VOLUME, adapters_conflict
from .manifests.names import same_uri
from .reading import meta, phase
from .round import Round


def entry_key(r: Round) -> str:
    """The routing table's key this RLCycle writes (a ConfigMap key: its name fits)."""
    return f"{r.name}.yaml"


def is_adapter(ck: dict[str, Any] | None) -> bool:
    """A Checkpoint of a LoRA adapter: it names the base it was trained on."""
    return bool(((ck or {}).get("spec") or {}).get("base"))


def own_route(r: Round) -> OrgRoute | None:
    """This RLCycle's org's route as the table holds it; None when it holds none (or a
    route that does not parse: the next write replaces it)."""
    data = (r.obs.routing or {}).get("data") or {}
    return _route_in(data, entry_key(r), r.spec.adapter_org() or "")


def ref(ck: dict[str, Any]) -> AdapterRef:
    """A Checkpoint of an adapter as the table names it (loaded under its own name)."""
    name, spec = meta(ck)["name"], ck.get("spec") or {}
    return AdapterRef(name=name, checkpoint=name, uri=spec["uri"], rlcycle=spec.get("rlCycle"))


def route_for(r: Round, ck: dict[str, Any] | None) -> OrgRoute:
    """The route serving ``ck`` alone: its adapter, or the base (no adapter): also when it
    is an adapter of another base, which is never served on this one."""
    served = ck is not None and is_adapter(ck) and on_base(r, ck)
    return OrgRoute(stable=ref(ck) if ck is not None and served else None)


def want(r: Round, route: OrgRoute) -> bool:
    """Write ``route`` as the org's entry unless the table holds it already; True when it
    does (what the sidecars follow: through the API in milliseconds, or at the kubelet's
    next refresh of their mounted copy)."""
    if own_route(r) == route:
        return True
    text = _entry(r.spec.adapter_org() or "", route)
    adapters = r.spec.capture.adapters if r.spec.capture else None
    assert adapters is not None  # the spec's validation: spec.adapter needs it
    if r.obs.routing is None:
        r.act(
            Create(
                {
                    "apiVersion": "v1",
                    "kind": "ConfigMap",
                    "metadata": {
                        "name": adapters.config_map,
                        "namespace": r.meta.get("namespace"),
                        "labels": {**MANAGED_BY, LABEL_ADAPTER_ROUTES: "true"},
                    },
                    "data": {entry_key(r): text + "\n"},
                }
            )
        )
    else:
        r.act(Patch("v1", "ConfigMap", adapters.config_map, {"data": {entry_key(r): text + "\n"}}))
    return False


def _entry(org: str, route: OrgRoute) -> str:
    """The key's text: the org's route as one table (JSON, which YAML reads)."""
    table = AdapterRouting(orgs={org: route})
    doc = table.model_dump(mode="json", by_alias=True, exclude_none=True)
    return json.dumps(doc, indent=2, sort_keys=True)


def canary(r: Round, ck: dict[str, Any], weight: int) -> bool:
    """The candidate ``ck`` on ``weight``% of the org's units, the rest on its parent;
    True when the table holds that."""
    parent_name = (ck.get("spec") or {}).get("parent")
    parent = r.checkpoint(parent_name) if parent_name else None
    stable = route_for(r, parent).stable
    return want(r, OrgRoute(stable=stable, canary=ref(ck), weight=weight))


def canary_shown(r: Round, ck: dict[str, Any], weight: int) -> bool:
    """The table holds the candidate at ``weight``% (the canary's readiness)."""
    route = own_route(r)
    return route is not None and route.canary == ref(ck) and route.weight == weight


def follow_serving(r: Round) -> None:
    """Once the target's base is known (``r.serving``): the org's stable adapter, when the
    table names one trained on that base, is what this RLCycle serves; one trained on
    another base is stale (:func:`retire_stale`)."""
    r.base = r.serving
    r.stale = None
    if r.spec.adapter is None:
        return
    route = own_route(r)
    if route is None or route.stable is None:
        return
    adapter = r.checkpoint(route.stable.checkpoint)
    if adapter is None:  # deleted by hand: the next cycle starts from the base again
        return
    if on_base(r, adapter):
        r.serving = adapter
        r.status["serving"] = meta(adapter)["name"]
    else:
        r.stale = adapter


def on_base(r: Round, adapter: dict[str, Any]) -> bool:
    """``adapter`` was trained on the base the target serves now."""
    base_name = (adapter.get("spec") or {}).get("base")
    if base_name == meta(r.base)["name"]:
        return True
    base = r.checkpoint(str(base_name)) if base_name else None
    return base is not None and same_uri(
        (base.get("spec") or {}).get("uri"), (r.base.get("spec") or {}).get("uri")
    )


def stale_candidate(r: Round, ck: dict[str, Any]) -> str:
    """Why the candidate adapter ``ck`` can no longer be served ("" when it can)."""
    if r.spec.adapter is None or not is_adapter(ck) or on_base(r, ck):
        return ""
    return (
        f"the target's base changed to {meta(r.base)['name']}: {meta(ck)['name']} was "
        f"trained on {(ck.get('spec') or {}).get('base')} and is never served on another base"
    )


def retire_stale(r: Round) -> None:
    """A stale stable adapter: the org back on the base in the table, its Checkpoint
    ``Superseded`` (reason ``BaseChanged``), once."""
    stale = r.stale
    if stale is None:
        return
    name, org = meta(stale)["name"], r.spec.adapter_org()
    want(r, OrgRoute())
    if phase(stale) == CheckpointPhase.SUPERSEDED:
        return
    why = (
        f"trained on base {(stale.get('spec') or {}).get('base')}; the target serves "
        f"{meta(r.base)['name']} now: organisation {org} is served by the base until the "
        "next cycle trains an adapter on it"
    )
    r.patch_checkpoint(stale, phase=CheckpointPhase.SUPERSEDED, reason=Reason.BASE_CHANGED,
                       message=why)  # fmt: skip
    r.event(Reason.BASE_CHANGED, f"{name}: {why}", warning=True, kind="Checkpoint", name=name)


def taken_route(r: Round) -> tuple[str, str]:
    """``(reason, message)`` when the routing table is not one rtrl may write (a ConfigMap
    without the label :data:`LABEL_ADAPTER_ROUTES`), or another of its keys routes this
    RLCycle's organisation too (two writers of one org's route would undo each other's
    canaries); ``("", "")`` otherwise. A key that does not parse is the sidecars' to refuse."""
    org = r.spec.adapter_org()
    if org is None or r.obs.routing is None:
        return "", ""
    adapters = r.spec.capture.adapters if r.spec.capture else None
    where = adapters.config_map if adapters else ""
    labels = (r.obs.routing.get("metadata") or {}).get("labels") or {}
    if labels.get(LABEL_ADAPTER_ROUTES) != "true":
        return (
            Reason.ADAPTER_ROUTES_UNLABELLED,
            f"spec.capture.adapters.configMap: ConfigMap {where} is not labelled "
            f"{LABEL_ADAPTER_ROUTES}=true, so the operator writes no route into it (a spec "
            "must not make it write into any ConfigMap); label it, or name a ConfigMap that "
            "does not exist yet (the operator creates it, labelled)",
        )
    for key, orgs in _orgs_by_key(r).items():
        if key != entry_key(r) and org in orgs:
            return (
                Reason.ADAPTER_ROUTE_TAKEN,
                f"data.population.orgs: organisation {org} is routed by key {key} of "
                f"ConfigMap {where}, not by this RLCycle's key {entry_key(r)}: one RLCycle "
                "per organisation; remove that entry or route another organisation",
            )
    return "", ""


def routes_followed(spec: RLCycleSpec, template: Mapping[str, Any]) -> tuple[str, str]:
    """An adapter RLCycle injects no sidecar (one per pod, the RLCycle serving the base
    injects it): ``(reason, message)`` when the target's sidecar is missing or does not
    follow ``capture.adapters.configMap``, or the engine cannot serve adapters."""
    assert spec.capture is not None and spec.capture.adapters is not None
    table = spec.capture.adapters.config_map
    where = f"Deployment {spec.target.deployment}"
    if cap.container(template, cap.SIDECAR) is None:
        return (
            Reason.CAPTURE_ADAPTERS_UNSERVABLE,
            f"spec.capture.adapters: {where} has no {cap.SIDECAR} sidecar to route organisation "
            f"{spec.adapter_org()}: the RLCycle serving its base injects it (its spec.capture, "
            f"with capture.adapters.configMap: {table})",
        )
    volumes = (template.get("spec") or {}).get("volumes") or []
    followed = next(
        (
            v.get("configMap", {}).get("name")
            for v in volumes
            if v.get("name") == ADAPTERS_TABLE_VOLUME
        ),
        None,
    )
    if followed != table:
        now = f"ConfigMap {followed}" if followed else "no routing table"
        return (
            Reason.CAPTURE_ADAPTERS_UNSERVABLE,
            f"spec.capture.adapters.configMap: the {cap.SIDECAR} sidecar of {where} (injected by "
            f"RLCycle {cap.injected_by(template) or '?'}) follows {now}, not {table}: set "
            f"capture.adapters.configMap: {table} in that RLCycle's spec, or this one's to its",
        )
    return adapters_conflict(spec, template, cap.container(template, spec.target.container) or {})


# --- an RLCycle deleted mid-canary: the canary's share given back (rtrl.planning.traffic) --


def _raw_table(rlcycle: Mapping[str, Any]) -> tuple[str, str] | None:
    """``(configMap, org)`` of an adapter RLCycle, from the raw spec (a deleted RLCycle's
    spec may no longer validate); None for any other."""
    spec = rlcycle.get("spec") or {}
    table = ((spec.get("capture") or {}).get("adapters") or {}).get("configMap")
    orgs = ((spec.get("data") or {}).get("population") or {}).get("orgs") or []
    if not spec.get("adapter") or not isinstance(table, str) or len(orgs) != 1:
        return None
    return table, str(orgs[0])


def _route_in(data: Mapping[str, Any], key: str, org: str) -> OrgRoute | None:
    try:
        table = AdapterRouting.model_validate(json.loads(str(data.get(key) or "")))
    except (ValueError, ValidationError):
        return None
    return table.orgs.get(org)


def canary_routed_after(r: Round) -> bool:
    """Whether the org's route, as the round's writes leave it, sends users to a canary."""
    where = _raw_table(r.rlc)
    if where is None:
        return False
    table, org = where
    data = dict((r.obs.routing or {}).get("data") or {})
    for action in r.out.actions:
        written: Any = None
        if isinstance(action, Patch) and action.kind == "ConfigMap" and action.name == table:
            written = action.patch
        elif isinstance(action, Create) and action.kind == "ConfigMap" and action.name == table:
            written = action.manifest
        if isinstance(written, dict):
            data.update(written.get("data") or {})
    route = _route_in(data, entry_key(r), org)
    return route is not None and route.canary is not None and route.weight > 0


def give_back(r: Round) -> None:
    """A deleted adapter RLCycle's canary: the org's route keeps its stable adapter and
    sends nobody to the candidate, which goes with the RLCycle (its files stay in the
    store, so nothing fails meanwhile: what goes is an unjudged candidate's share)."""
    where = _raw_table(r.rlc)
    if where is None or r.obs.routing is None:
        return
    table, org = where
    route = _route_in((r.obs.routing or {}).get("data") or {}, entry_key(r), org)
    if route is None or route.canary is None:
        return
    text = _entry(org, OrgRoute(stable=route.stable))
    r.act(Patch("v1", "ConfigMap", table, {"data": {entry_key(r): text + "\n"}}))
    r.event(
        Reason.TRAFFIC_RESTORED,
        f"organisation {org}'s users all go to its stable route again in ConfigMap {table}: "
        "the RLCycle is being deleted, its canary goes with it",
    )


def routed_orgs(r: Round) -> list[str]:
    """Organisations the routing table sends to an adapter (any key): the base's canary
    does not serve them alike in both arms, so its analysis leaves them out."""
    found = {
        org
        for orgs in _orgs_by_key(r).values()
        for org, route in orgs.items()
        if isinstance(route, dict) and (route.get("stable") or route.get("canary"))
    }
    return sorted(found)


def _orgs_by_key(r: Round) -> dict[str, dict[str, Any]]:
    """Each key of the routing table and the ``orgs`` it routes, as written (YAML or JSON,
    by rtrl or by hand); a key that does not parse routes nothing here (the sidecars refuse
    it, naming it)."""
    out: dict[str, dict[str, Any]] = {}
    for key, text in sorted(((r.obs.routing or {}).get("data") or {}).items()):
        try:
            doc = load(str(text)) or {}
        except (ValueError, yaml.YAMLError):
            continue
        orgs = doc.get("orgs") if isinstance(doc, dict) else None
        out[str(key)] = {str(k): v for k, v in orgs.items()} if isinstance(orgs, dict) else {}
    return out
