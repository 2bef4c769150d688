"""The finalizer ``rtrl.io/restore-traffic`` (rtrl.planning.traffic): an HTTPRoute the
operator weighted to a canary never names a Service the garbage collector removed, whether
or not an operator runs when the RLCycle is deleted, and a deletion with nothing to give
back never waits.

The plans are applied to :class:`Cluster`, the planning tests' World plus what the API
server does on deletion: an RLCycle with finalizers is only marked (``deletionTimestamp``),
one without is gone, and then the garbage collector removes what it owns (its Checkpoints,
their canary Deployment and Service). Every write is checked against the invariant as it
is applied, one action at a time."""

from __future__ import annotations

import contextlib
import copy
from datetime import timedelta
from typing import Any

import pytest

from rtrl.core.api.names import FINALIZER_RESTORE_TRAFFIC
from rtrl.planning import Emit, Patch, plan
from rtrl.planning.manifests.canary import routes_to_canary
from tests.rtrl.planning.test_plan import World, analysis, to_canary

REQUEST = {
    "router": "gatewayapi", "httpRoute": "composer", "service": "composer",
    "steps": [{"weight": 10, "minDuration": "10m"}, {"weight": 50, "minDuration": "10m"}],
    "analysis": {"maxDuration": "3h"},
}  # fmt: skip
STICKY = {**REQUEST, "unit": "user", "bucketHeader": "x-rtrl-bucket"}
STABLE_REF = {"name": "composer", "port": 8000, "group": "", "kind": "Service", "weight": 1}
USERS_RULE = {"matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
              "backendRefs": [STABLE_REF]}  # fmt: skip
RESTORED = [{**USERS_RULE, "backendRefs": [{**STABLE_REF, "weight": 100}]}]


class UnsafeRouteError(AssertionError):
    pass


class KilledError(Exception):
    """The operator was killed (Cluster.limit)."""


class Cluster(World):
    """The World with an HTTPRoute (kept, as the World keeps patchable objects, by name
    among its Deployments), the API server's deletion and its garbage collector."""

    def __init__(self, rollout: dict[str, Any] | None = None) -> None:
        super().__init__(rollout=copy.deepcopy(rollout or REQUEST))
        self.rlcycle["metadata"]["resourceVersion"] = "1"
        self.deployments["composer"] = {
            "apiVersion": "gateway.networking.k8s.io/v1",
            "kind": "HTTPRoute",
            "metadata": {"name": "composer", "generation": 1},
            "spec": {"rules": [copy.deepcopy(USERS_RULE)]},
        }
        self.stable_service = {"metadata": {"name": "composer"},
                               "spec": {"ports": [{"name": "http", "port": 8000}]}}  # fmt: skip
        self.gone = False
        self.checking = True
        # With a limit: the operator is killed once that many actions were applied.
        self.limit: int | None = None
        self.applied = 0

    # --- what is checked after every single write -------------------------------------
    def route(self) -> dict[str, Any] | None:
        return self.deployments.get("composer")

    def rules(self) -> list[dict[str, Any]]:
        return list(((self.route() or {}).get("spec") or {}).get("rules") or [])

    def held(self) -> bool:
        return FINALIZER_RESTORE_TRAFFIC in (self.rlcycle["metadata"].get("finalizers") or [])

    def check(self) -> None:
        """While the route sends anything to the canary Service, the RLCycle holds it (and
        so the canary Service exists: nothing can collect it)."""
        if self.checking and routes_to_canary(self.route(), "composer"):
            if not self.held():
                raise UnsafeRouteError(f"route names the canary, no finalizer: {self.rules()}")
            assert "composer-canary" in self.services and not self.gone

    def apply(self, actions: list[Any]) -> None:
        for action in actions:
            if self.limit is not None and self.applied >= self.limit:
                raise KilledError
            super().apply([action])
            self.applied += 1
            self.check()

    # --- the API server's deletion and garbage collection ------------------------------
    def patch_rlcycle(self, patch: Any) -> None:
        super().patch_rlcycle(patch)
        self.collect()

    def delete(self) -> None:
        """``kubectl delete rlcycle composer`` (background propagation)."""
        self.rlcycle["metadata"]["deletionTimestamp"] = "2026-11-29T12:00:00Z"
        self.collect()

    def collect(self) -> None:
        meta = self.rlcycle["metadata"]
        if not meta.get("deletionTimestamp") or meta.get("finalizers"):
            return
        self.gone = True
        self.checkpoints = {k: c for k, c in self.checkpoints.items() if k == "composer-0"}
        self.deployments.pop("composer-vllm-canary", None)
        self.services.discard("composer-canary")
        self.jobs.clear()

    def until_gone(self, rounds: int = 5) -> None:
        """An operator runs: rounds until the RLCycle is gone."""
        for _ in range(rounds):
            if self.gone:
                return
            decided = plan(self.observed(), self.now)
            assert decided.status == {}  # nothing written to an RLCycle being deleted
            self.apply(decided.actions)
        assert self.gone, self.rlcycle["metadata"]


def mid_canary(rollout: dict[str, Any] | None = None) -> Cluster:
    cluster = Cluster(rollout)
    to_canary(cluster)
    assert routes_to_canary(cluster.route(), "composer") and cluster.held()
    return cluster


@pytest.mark.parametrize("rollout", [REQUEST, STICKY], ids=["request", "user"])
def test_the_finalizer_is_on_before_the_route_names_the_canary(rollout: dict) -> None:
    """Every write of a whole canary (start, next step, rollback) keeps the invariant; once
    the route is given back, the finalizer is off."""
    cluster = mid_canary(rollout)
    cluster.now += timedelta(minutes=30)
    cluster.reconcile()
    cluster.finish("analyze-0", result=analysis("continue"))
    cluster.reconcile()
    cluster.settle()
    cluster.reconcile()
    assert cluster.rlcycle["status"]["canaryWeight"] == 50 and cluster.held()
    cluster.rlcycle["metadata"]["annotations"] = {"rtrl.io/rollback": "r1"}
    cluster.reconcile()
    assert cluster.checkpoint("composer-1")["status"]["phase"] == "RolledBack"
    assert cluster.rules() == RESTORED
    assert not cluster.held() and "finalizers" not in cluster.rlcycle["metadata"]


def test_a_promotion_gives_the_route_back_and_drops_the_finalizer() -> None:
    cluster = mid_canary()
    cluster.rlcycle["metadata"]["annotations"] = {"rtrl.io/promote": "p1"}
    cluster.reconcile()
    cluster.settle()
    cluster.reconcile()
    assert cluster.checkpoint("composer-1")["status"]["phase"] == "Promoted"
    assert cluster.rules() == RESTORED and not cluster.held()


@pytest.mark.parametrize("rollout", [REQUEST, STICKY], ids=["request", "user"])
def test_deleted_mid_canary_with_no_operator_then_one(rollout: dict) -> None:
    """No operator: the RLCycle stays Terminating, the route names a canary Service that
    still serves. The operator back: the route is given back, an Event says so, the
    finalizer goes, and only then does the garbage collector remove the canary."""
    cluster = mid_canary(rollout)
    other = "example.com/other-finalizer"  # someone else's, kept
    cluster.rlcycle["metadata"]["finalizers"].insert(0, other)
    cluster.delete()
    assert not cluster.gone and routes_to_canary(cluster.route(), "composer")
    assert "composer-canary" in cluster.services and "composer-vllm-canary" in cluster.deployments
    decided = plan(cluster.observed(), cluster.now)
    kinds = [(a.kind, a.name) for a in decided.actions if isinstance(a, Patch)]
    assert kinds == [("HTTPRoute", "composer"), ("RLCycle", "composer")]
    finalizers = next(a for a in decided.actions if isinstance(a, Patch) and a.kind == "RLCycle")
    assert isinstance(finalizers.patch, dict)
    seen = cluster.rlcycle["metadata"]["resourceVersion"]  # conditional on what was seen
    assert finalizers.patch["metadata"] == {"finalizers": [other], "resourceVersion": seen}
    cluster.apply(decided.actions)
    assert cluster.rules() == RESTORED
    assert cluster.rlcycle["metadata"]["finalizers"] == [other] and not cluster.gone
    assert [e.reason for e in decided.actions if isinstance(e, Emit)] == ["TrafficRestored"]
    cluster.rlcycle["metadata"]["finalizers"] = []  # the other owner is done too
    cluster.collect()
    assert cluster.gone and "composer-canary" not in cluster.services


@pytest.mark.parametrize("crash_after", range(4))
def test_an_operator_killed_while_giving_back_finishes_the_next_time(crash_after: int) -> None:
    """The deletion's round, cut after each of its writes, then planned again from what
    is there: the same end, and the invariant at every step."""
    cluster = mid_canary(STICKY)
    cluster.delete()
    decided = plan(cluster.observed(), cluster.now)
    cluster.apply(decided.actions[:crash_after])
    cluster.until_gone()
    assert cluster.rules() == RESTORED
    assert "composer-canary" not in cluster.services


def test_an_operator_killed_as_the_canary_starts_leaves_no_unheld_route() -> None:
    """The rounds that start the canary, cut after each of their writes, then the RLCycle
    deleted: the route never names a canary that can be collected, and the operator, back,
    leaves nothing routed to it."""
    probe = Cluster()
    to_canary(probe)
    for crash_after in range(probe.applied + 1):
        cluster = Cluster()
        cluster.limit = crash_after
        with contextlib.suppress(KilledError):
            to_canary(cluster)
        cluster.limit = None
        cluster.delete()
        cluster.check()
        cluster.until_gone()
        assert not routes_to_canary(cluster.route(), "composer"), crash_after


def _invalid(cluster: Cluster) -> None:
    cluster.rlcycle["spec"]["rollout"]["steps"] = [{"weight": 250}]  # the CRD refuses it


def _route_deleted(cluster: Cluster) -> None:
    del cluster.deployments["composer"]


def _route_given_back_by_hand(cluster: Cluster) -> None:
    cluster.deployments["composer"]["spec"]["rules"] = copy.deepcopy(RESTORED)


def _router_changed(cluster: Cluster) -> None:
    cluster.rlcycle["spec"]["rollout"] = {"router": "replicas"}


@pytest.mark.parametrize(
    ("change", "restored"),
    [(_invalid, True), (_route_deleted, False), (_route_given_back_by_hand, False),
     (_router_changed, False)],
    ids=["rlcycle-invalid", "route-deleted", "route-given-back", "router-changed"],
)  # fmt: skip
def test_a_deletion_with_nothing_to_give_back_never_waits(change: Any, restored: bool) -> None:
    """An RLCycle whose spec no longer validates is still given back (from the raw spec);
    one whose route is gone, already given back, or no longer named loses the finalizer
    in its first round."""
    cluster = mid_canary()
    change(cluster)
    # A spec that names no route any more cannot say which one to give back (a limit,
    # docs/canary.md): the deletion does not wait for it.
    cluster.checking = change is not _router_changed
    if change is _invalid:
        cluster.reconcile()
        assert cluster.rlcycle["status"]["phase"] == "Invalid" and cluster.held()
    cluster.delete()
    decided = plan(cluster.observed(), cluster.now)
    cluster.apply(decided.actions)
    assert cluster.gone
    routed = [a for a in decided.actions if isinstance(a, Patch) and a.kind == "HTTPRoute"]
    assert bool(routed) == restored
    if cluster.route() is not None and cluster.checking:
        assert cluster.rules() == RESTORED


def test_an_rlcycle_that_never_routed_carries_no_finalizer() -> None:
    cluster = Cluster(rollout={"steps": [{"weight": 10, "minDuration": "10m"}]})  # replicas
    to_canary(cluster)
    assert "composer-vllm-canary" in cluster.deployments and not cluster.held()
    cluster.delete()
    assert cluster.gone
    assert plan(cluster.observed(), cluster.now).actions == []


def test_a_canary_an_older_rtrl_routed_gets_the_finalizer_in_the_next_round() -> None:
    cluster = mid_canary()
    del cluster.rlcycle["metadata"]["finalizers"]
    patches = len(cluster.patches)
    cluster.reconcile()
    assert cluster.held()
    assert len(cluster.patches) == patches  # the route, already weighted, is not written


def test_a_rule_someone_pointed_at_the_canary_alone_is_sent_to_the_stable_service() -> None:
    """A rule edited by hand to name only the canary Service (no stable backendRef to give
    the weight back to) is pointed at the stable Service, not left naming a Service that
    the garbage collector is about to remove."""
    cluster = mid_canary()
    by_hand = {"matches": [{"path": {"type": "PathPrefix", "value": "/try"}}],
               "backendRefs": [{**STABLE_REF, "name": "composer-canary", "weight": 3}]}  # fmt: skip
    cluster.deployments["composer"]["spec"]["rules"].append(by_hand)
    cluster.delete()
    cluster.until_gone()
    assert cluster.rules() == [*RESTORED, {**by_hand, "backendRefs": [{**STABLE_REF, "weight": 3}]}]
