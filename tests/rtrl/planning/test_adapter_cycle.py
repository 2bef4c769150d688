"""An adapter RLCycle (``spec.adapter``) through the planning core: one organisation's LoRA
adapter trained, canaried, promoted and rolled back as writes of its own key of the routing
ConfigMap, the target Deployment never touched; the key of another organisation never
written; a base promotion making the adapter stale (docs/adapters.md)."""

from __future__ import annotations

import copy
import json
from datetime import timedelta
from typing import Any

from rtrl.core.api.adapter import AdapterRouting
from rtrl.planning import Create, Observed, Patch
from tests.rtrl.planning.test_capture import CAPTURE, CaptureWorld, _lora_ready
from tests.rtrl.planning.test_plan import (
    EVAL_PASS,
    STAGE_OK,
    TRAIN_OK,
    _doc,
    analyse,
    analysis,
    run_cycle,
    to_canary,
)

TABLE = "composer-adapters"
KEY = "composer.yaml"  # the RLCycle's own key
OTHER = json.dumps(  # what the RLCycle of another organisation wrote
    {"orgs": {"globex": {"stable": {"name": "globex-3", "checkpoint": "globex-3",
                                    "uri": "s3://rtrl-artifacts/globex/globex-3/"}}}}
)  # fmt: skip


class AdapterWorld(CaptureWorld):
    """The CaptureWorld with the routing ConfigMap as the API server would keep it."""

    def __init__(self, **spec_changes: Any) -> None:
        spec_changes.setdefault("capture", {**CAPTURE, "adapters": {"configMap": TABLE}})
        spec_changes.setdefault("adapter", {"rank": 16, "alpha": 32})
        super().__init__(**spec_changes)
        self.rlcycle["spec"]["data"]["population"] = {"orgs": ["acme"]}
        self.deployments["composer-vllm"] = base_target()
        self.routing: dict[str, Any] | None = {
            "metadata": {"name": TABLE, "labels": {"rtrl.io/adapter-routes": "true"}},
            "data": {"globex.yaml": OTHER},
        }
        self.table_writes: list[Any] = []

    def observed(self) -> Observed:
        obs = super().observed()
        return Observed(**{**obs.__dict__, "routing": copy.deepcopy(self.routing)})

    def apply(self, actions: list[Any]) -> None:
        rest = []
        for action in actions:
            if getattr(action, "kind", None) != "ConfigMap" or action.name != TABLE:
                rest.append(action)
                continue
            self.table_writes.append(action)
            if isinstance(action, Create) and self.routing is None:
                self.routing = copy.deepcopy(action.manifest)
            elif isinstance(action, Patch):  # a JSON merge patch of data
                assert self.routing is not None
                self.routing["data"].update(action.patch["data"])
        super().apply(rest)

    def route(self) -> dict[str, Any]:
        assert self.routing is not None
        table = AdapterRouting.model_validate(json.loads(self.routing["data"][KEY]))
        return table.orgs["acme"].model_dump(by_alias=True, exclude_none=True)


def base_target(adapters: dict[str, Any] | None = None) -> dict[str, Any]:
    """The target as the RLCycle of the base leaves it: LoRA on, and the sidecar it
    injected following the routing table (an adapter RLCycle injects none)."""
    base = CaptureWorld(capture={**CAPTURE, "adapters": adapters or {"configMap": TABLE}})
    base.rlcycle["metadata"]["name"] = "composer-base"
    _lora_ready(base)
    base.reconcile()
    assert base.sidecar() is not None
    base.settle()
    return base.deployments["composer-vllm"]


def ref(name: str, cycle: int) -> dict[str, Any]:
    uri = f"s3://rtrl-artifacts/composer/checkpoints/composer-{cycle}/"
    return {"name": name, "checkpoint": name, "uri": uri, "rlcycle": "composer"}


def _uri(world: AdapterWorld, name: str) -> dict[str, Any]:
    found = ref(name, 0)
    found["uri"] = world.checkpoint(name)["spec"]["uri"]
    return found


def test_an_adapter_cycle_trains_canaries_and_promotes_as_routes_not_restarts() -> None:
    world = AdapterWorld()
    injected = copy.deepcopy(world.deployments["composer-vllm"]["spec"])
    world.reconcile()
    ck = world.checkpoint("composer-1")
    assert ck["spec"]["parent"] == "composer-0" and ck["spec"]["base"] == "composer-0"
    world.finish("stage", result=STAGE_OK)
    world.reconcile()
    train = world.manifests["composer-1-train-0"]["spec"]["template"]["spec"]["containers"][0]
    assert "--parent=s3://rtrl-artifacts/composer/checkpoints/composer-0/" in train["args"]
    world.finish("train", result=TRAIN_OK)
    world.reconcile()
    world.finish("eval", result=EVAL_PASS)
    world.reconcile()
    # the canary is a route: 5% of acme's units to the candidate, the rest to the base
    assert world.route() == {"canary": _uri(world, "composer-1"), "weight": 5}
    assert world.routing is not None and world.routing["data"]["globex.yaml"] == OTHER
    assert all(isinstance(a, Patch) for a in world.table_writes)  # its own key alone
    assert "composer-vllm-canary" not in world.deployments
    world.reconcile()
    assert world.checkpoint("composer-1")["status"]["rollout"][0].get("readyAt")
    world.now += timedelta(hours=1)
    world.reconcile()
    analyze = world.manifests["composer-1-analyze-0-0"]["spec"]["template"]["spec"]
    assert "--org=acme" in analyze["containers"][0]["args"]
    assert "--baseline=composer-0" in analyze["containers"][0]["args"]
    world.finish("analyze-0", result=analysis("promote"))
    world.reconcile(3)  # decided; the route written; read back: promoted
    assert world.route() == {"stable": _uri(world, "composer-1"), "weight": 0}
    assert world.checkpoint("composer-1")["status"]["phase"] == "Promoted"
    # the base goes on serving every other organisation: never Superseded by an adapter
    assert world.checkpoint("composer-0").get("status", {}).get("phase") != "Superseded"
    status = world.rlcycle["status"]
    assert status["serving"] == "composer-1" and status["phase"] == "Idle"
    assert world.deployments["composer-vllm"]["spec"] == injected  # never restarted
    assert any("now serves organisation acme" in e.message for e in world.events)


def test_the_next_cycle_continues_the_adapter_and_a_rollback_swaps_back() -> None:
    world = AdapterWorld()
    run_cycle(world)
    assert world.rlcycle["status"]["serving"] == "composer-1"
    world.now += timedelta(hours=5)
    to_canary(world)
    ck = world.checkpoint("composer-2")
    assert ck["spec"]["parent"] == "composer-1" and ck["spec"]["base"] == "composer-0"
    train = world.manifests["composer-2-train-0"]["spec"]["template"]["spec"]["containers"][0]
    assert f"--parent={world.checkpoint('composer-1')['spec']['uri']}" in train["args"]
    assert world.route() == {
        "stable": _uri(world, "composer-1"),
        "canary": _uri(world, "composer-2"),
        "weight": 5,
    }
    world.analyses = []
    analyse(world, "rollback")
    assert world.checkpoint("composer-2")["status"]["phase"] == "RolledBack"
    assert world.route() == {"stable": _uri(world, "composer-1"), "weight": 0}
    assert world.checkpoint("composer-1")["status"]["phase"] == "Promoted"
    assert world.rlcycle["status"]["serving"] == "composer-1"


def test_a_manual_rollback_of_the_first_adapter_routes_the_org_to_the_base() -> None:
    world = AdapterWorld()
    run_cycle(world)
    world.rlcycle["metadata"]["annotations"] = {"rtrl.io/rollback": "t1"}
    world.reconcile(2)
    assert world.route() == {"weight": 0}
    assert world.rlcycle["status"]["serving"] == "composer-0"
    assert world.checkpoint("composer-1")["status"]["phase"] == "RolledBack"


def test_another_key_routing_the_same_org_is_a_condition_and_nothing_is_written() -> None:
    world = AdapterWorld()
    assert world.routing is not None
    world.routing["data"]["by-hand.yaml"] = "orgs:\n  acme: {}\n"
    world.reconcile()
    invalid = world.condition("InvalidSpec")
    assert invalid["reason"] == "AdapterRouteTaken", invalid
    assert "organisation acme is routed by key by-hand.yaml" in invalid["message"]
    assert world.table_writes == [] and "Checkpoint/composer-1" not in world.created


def test_an_adapter_without_one_org_or_a_routing_table_is_invalid() -> None:
    world = AdapterWorld()
    world.rlcycle["spec"]["data"]["population"] = {"orgs": ["acme", "globex"]}
    world.reconcile()
    invalid = world.condition("InvalidSpec")
    assert "data.population.orgs must name exactly one organisation" in invalid["message"]
    world = AdapterWorld(capture=copy.deepcopy(CAPTURE))
    world.reconcile()
    assert "capture.adapters.configMap must name" in world.condition("InvalidSpec")["message"]


def _promote_new_base(world: AdapterWorld) -> None:
    """A full-model RLCycle promoted a new base: the target's engine serves it."""
    base = copy.deepcopy(world.checkpoint("composer-0"))
    base["metadata"].update(name="composer-base-2", uid="base-2-uid")
    base["spec"]["uri"] = "s3://rtrl-artifacts/composer/checkpoints/composer-base-2/"
    world.checkpoints["composer-base-2"] = base
    for container in world.deployments["composer-vllm"]["spec"]["template"]["spec"]["containers"]:
        for env in container.get("env", []):
            if env["name"] == "MODEL_URI":
                env["value"] = base["spec"]["uri"]


def test_a_new_base_makes_the_adapter_stale_and_the_next_cycle_trains_on_it() -> None:
    world = AdapterWorld()
    run_cycle(world)
    _promote_new_base(world)
    world.reconcile()
    assert world.route() == {"weight": 0}  # the org back on the (new) base
    stale = world.checkpoint("composer-1")["status"]
    assert stale["phase"] == "Superseded" and stale["reason"] == "BaseChanged"
    assert "the target serves composer-base-2 now" in stale["message"]
    assert world.rlcycle["status"]["serving"] == "composer-base-2"
    world.now += timedelta(hours=5)
    world.reconcile()
    ck = world.checkpoint("composer-2")
    assert ck["spec"]["parent"] == "composer-base-2" and ck["spec"]["base"] == "composer-base-2"
    assert world.reasons().count("BaseChanged") == 1


def test_a_new_base_mid_canary_rolls_the_stale_candidate_back() -> None:
    world = AdapterWorld()
    to_canary(world)
    _promote_new_base(world)
    world.reconcile(2)
    ck = world.checkpoint("composer-1")["status"]
    assert ck["phase"] == "RolledBack"
    assert "the target's base changed to composer-base-2" in ck["message"]
    assert world.route() == {"weight": 0}


def test_the_operator_writes_only_into_a_routing_table_labelled_as_one() -> None:
    world = AdapterWorld()
    assert world.routing is not None
    world.routing["metadata"]["labels"] = {}  # some application's ConfigMap
    world.reconcile()
    invalid = world.condition("InvalidSpec")
    assert invalid["reason"] == "AdapterRoutesUnlabelled", invalid
    assert world.table_writes == []
    world.routing = None  # absent: the operator creates it, labelled
    to_canary(world)
    assert world.routing is not None
    assert world.routing["metadata"]["labels"]["rtrl.io/adapter-routes"] == "true"
    assert world.route()["weight"] == 5


def _staged(interactions: int) -> dict[str, Any]:
    """A stage that found ``interactions`` of the org's in the 24 h before T0."""
    doc = copy.deepcopy(STAGE_OK)
    doc.update(interactions_used=interactions, since="2026-11-28T00:00:00Z",
               next_since="2026-11-29T00:00:00Z")  # fmt: skip
    return doc


def test_an_org_too_small_for_its_canary_is_told_so_as_the_canary_starts() -> None:
    # examples/rlcycle.yaml: steps 5%/25%/50% needing 20k/50k/100k interactions per arm,
    # maxDuration 12h, 1h maturity: 100,000/h needs 1h + 4h + 2h + 2h
    for interactions, warned in ((2_400, True), (2_400_000, False)):
        world = AdapterWorld()
        world.reconcile()
        world.finish("stage", result=_staged(interactions))
        world.reconcile()
        world.finish("train", result=TRAIN_OK)
        world.reconcile()
        world.finish("eval", result=EVAL_PASS)
        world.reconcile()
        low = [e for e in world.events if e.reason == "TrafficTooLow"]
        assert bool(low) == warned, low
        if warned:
            assert low[0].warning and low[0].name == "composer-1"
            assert "organisation acme served 100 interactions/h" in low[0].message
            assert "more than rollout.analysis.maxDuration" in low[0].message
        assert world.route()["weight"] == 5  # told, not stopped: the policy decides


def test_the_sidecar_and_the_seal_are_the_base_rlcycles() -> None:
    world = AdapterWorld()
    run_cycle(world)
    assert world.cron_jobs == {}  # the base's RLCycle seals the events
    assert world.target_patches() == []  # its sidecar, untouched
    world = AdapterWorld()
    world.deployments["composer-vllm"] = base_target({"configMap": "other-table"})
    world.reconcile()
    invalid = world.condition("InvalidSpec")
    assert invalid["reason"] == "CaptureAdaptersUnservable", invalid
    assert "(injected by RLCycle composer-base) follows ConfigMap other-table" in invalid["message"]
    world = AdapterWorld()
    world.deployments["composer-vllm"] = _doc("inference-deployment.yaml")  # no sidecar
    world.reconcile()
    assert (
        "has no rtrl-capture sidecar to route organisation acme"
        in (world.condition("InvalidSpec")["message"])
    )


def test_deleted_mid_canary_the_orgs_users_go_back_to_its_stable_route() -> None:
    world = AdapterWorld()
    run_cycle(world)  # composer-1 promoted: acme's stable adapter
    assert "rtrl.io/restore-traffic" not in world.rlcycle["metadata"].get("finalizers", [])
    world.now += timedelta(hours=5)
    to_canary(world)
    assert world.route()["canary"]["checkpoint"] == "composer-2"
    # held while a canary has a share of acme's users (added before that write)
    assert "rtrl.io/restore-traffic" in world.rlcycle["metadata"]["finalizers"]
    world.rlcycle["metadata"]["deletionTimestamp"] = "2026-11-29T06:00:00Z"
    world.reconcile()
    assert world.route() == {"stable": _uri(world, "composer-1"), "weight": 0}
    assert "TrafficRestored" in world.reasons()
    assert "rtrl.io/restore-traffic" not in (world.rlcycle["metadata"].get("finalizers") or [])


def test_the_finalizer_goes_once_the_canary_is_decided() -> None:
    world = AdapterWorld()
    to_canary(world)
    assert "rtrl.io/restore-traffic" in world.rlcycle["metadata"]["finalizers"]
    world.analyses = []
    analyse(world, "promote")
    world.reconcile(2)
    assert world.route() == {"stable": _uri(world, "composer-1"), "weight": 0}
    assert "rtrl.io/restore-traffic" not in (world.rlcycle["metadata"].get("finalizers") or [])


def test_the_bases_canary_analysis_leaves_out_the_orgs_routed_to_adapters() -> None:
    """The base's RLCycle, whose pods' sidecars follow the table: acme and globex have
    adapters (any key), initech's entry routes nothing; the base's canary analysis leaves
    out exactly acme and globex, whom its two arms do not serve alike."""
    world = CaptureWorld(capture={**CAPTURE, "adapters": {"configMap": TABLE}})
    _lora_ready(world)
    routing = {
        "metadata": {"name": TABLE, "labels": {"rtrl.io/adapter-routes": "true"}},
        "data": {"globex.yaml": OTHER, "composer-acme.yaml": _route_doc("acme"),
                 "by-hand.yaml": "orgs:\n  initech: {}\n"},
    }  # fmt: skip
    observed = world.observed

    def with_routing() -> Observed:
        return Observed(**{**observed().__dict__, "routing": copy.deepcopy(routing)})

    world.observed = with_routing  # type: ignore[method-assign]
    run_cycle(world, canary="continue")
    analyze = world.manifests["composer-1-analyze-0-0"]["spec"]["template"]["spec"]
    args = analyze["containers"][0]["args"]
    assert [a for a in args if a.startswith("--exclude-org")] == [
        "--exclude-org=acme",
        "--exclude-org=globex",
    ]
    assert not any(a.startswith("--org") for a in args)


def _route_doc(org: str) -> str:
    adapter = {"name": "composer-acme-1", "checkpoint": "composer-acme-1",
               "uri": "s3://rtrl-artifacts/composer-acme/composer-acme-1/"}  # fmt: skip
    return json.dumps({"orgs": {org: {"stable": adapter}}})
