"""The gatewayapi router's HTTPRoute rules (``rtrl.planning.manifests.canary.route_rules`` and
``route_weight``) in both units of assignment: weighted backendRefs per request, and the
header-matched rule that keeps each user (or session) in one arm; routed through the
Gateway API matching stand-in of ``src/rtrl_localkube/gateway.py``."""

from __future__ import annotations

import copy
import random
import re
from typing import Any

import pytest

from rtrl.core.api.rlcycle import RLCycleSpec
from rtrl.core.api.yamlfile import load
from rtrl.planning.manifests.canary import (
    CANARY_RULE,
    bucket_regex,
    bucket_weight,
    route_rules,
    route_weight,
)
from rtrl_localkube import gateway
from tests.conftest import REPO

HEADER = "x-rtrl-bucket"


def spec(**rollout: Any) -> RLCycleSpec:
    doc = load((REPO / "examples" / "rlcycle.yaml").read_text())["spec"]
    doc["rollout"].update(router="gatewayapi", httpRoute="composer", service="composer",
                          **rollout)  # fmt: skip
    return RLCycleSpec.model_validate(doc)


STICKY = {"unit": "user", "bucketHeader": HEADER}


def http_route(*rules: dict[str, Any]) -> dict[str, Any]:
    return {"metadata": {"name": "composer"}, "spec": {"rules": list(rules)}}


def stable_rule(**extra: Any) -> dict[str, Any]:
    return {"backendRefs": [{"name": "composer", "port": 8000}], **extra}


def stable_at_100(rule: dict[str, Any]) -> dict[str, Any]:
    """``rule`` with its stable backendRef (the first named composer) at weight 100, last."""
    refs = rule["backendRefs"]
    mine = next(r for r in refs if r["name"] == "composer")
    others = [r for r in refs if r["name"] != "composer"]
    return {**rule, "backendRefs": [*others, {**mine, "weight": 100}]}


def applied(route: dict[str, Any], rules: list[dict[str, Any]] | None) -> dict[str, Any]:
    out = copy.deepcopy(route)
    if rules is not None:
        out["spec"]["rules"] = rules
    return out


def server_defaults(route: dict[str, Any]) -> dict[str, Any]:
    """What the API server stores (the standard-channel CRD's defaults): a rule's matches
    default to a path prefix "/", a path's type to PathPrefix, a header match's type to
    Exact, a backendRef's group, kind and weight to "", Service and 1."""
    out = copy.deepcopy(route)
    for rule in out["spec"]["rules"]:
        rule.setdefault("matches", [{"path": {"type": "PathPrefix", "value": "/"}}])
        for match in rule["matches"]:
            match.setdefault("path", {"type": "PathPrefix", "value": "/"})
            for header in match.get("headers") or []:
                header.setdefault("type", "Exact")
        for ref in rule.get("backendRefs") or []:
            ref.setdefault("group", "")
            ref.setdefault("kind", "Service")
            ref.setdefault("weight", 1)
    return out


# --- the bucket regex -------------------------------------------------------------------
NOT_BUCKETS = ["100", "-1", "07", "00", "", "5a", "a5", " 5", "5 ", "+5", "1.0", "1e1", "٣"]


@pytest.mark.parametrize("weight", range(1, 101))
def test_bucket_regex_matches_exactly_the_buckets_below_the_weight(weight: int) -> None:
    regex = bucket_regex(weight)
    assert regex.startswith("^") and regex.endswith("$")
    # Matched whole (RE2 in Envoy) or searched (a proxy that finds a match anywhere): the
    # anchors make both the same.
    for matcher in (re.fullmatch, re.search):
        took = [b for b in range(100) if matcher(regex, str(b))]
        assert took == list(range(weight)), (regex, matcher)
        assert not [s for s in NOT_BUCKETS if matcher(regex, s)], regex
    assert bucket_weight(regex) == weight
    assert re.fullmatch(r"[\^$()?:|\[\]0-9-]+", regex), regex  # nothing dialect-specific


def test_bucket_regex_is_short_and_refuses_weights_outside_1_to_100() -> None:
    assert bucket_regex(1) == "^0$"
    assert bucket_regex(10) == "^[0-9]$"
    assert bucket_regex(25) == "^(?:[0-9]|1[0-9]|2[0-4])$"
    assert bucket_regex(100) == "^(?:[0-9]|[1-9][0-9])$"
    for weight in (0, 101, -5):
        with pytest.raises(ValueError, match=r"1\.\.100"):
            bucket_regex(weight)
    # one written by hand: the buckets it takes; an invalid one: unknown
    assert bucket_weight("^([0-9]|1[0-4])$") == 15
    assert bucket_weight("^(0") is None


# --- unit request: weighted backendRefs, as before -----------------------------------------
def test_request_unit_weights_the_backend_refs() -> None:
    route = http_route(stable_rule())
    rules = route_rules(spec(), route, 10)
    assert rules == [{"backendRefs": [
        {"name": "composer", "port": 8000, "weight": 90},
        {"name": "composer-canary", "port": 8000, "weight": 10},
    ]}]  # fmt: skip
    stored = server_defaults(applied(route, rules))
    assert route_rules(spec(), stored, 10) is None
    assert route_weight(spec(), stored) == 10
    back = route_rules(spec(), stored, 0)
    assert back is not None and [r["backendRefs"] for r in back] == [
        [{"name": "composer", "port": 8000, "weight": 100, "group": "", "kind": "Service"}]
    ]
    assert route_weight(spec(), applied(stored, back)) is None


# --- unit user: the header-matched rule ---------------------------------------------------
def test_user_unit_adds_a_header_matched_rule_for_the_canary() -> None:
    route = http_route(stable_rule())
    rules = route_rules(spec(**STICKY), route, 10)
    assert rules == [
        {"backendRefs": [{"name": "composer", "port": 8000, "weight": 100}]},
        {
            "name": CANARY_RULE,
            "matches": [{
                "path": {"type": "PathPrefix", "value": "/"},
                "headers": [{"type": "RegularExpression", "name": HEADER, "value": "^[0-9]$"}],
            }],
            "backendRefs": [{"name": "composer-canary", "port": 8000, "weight": 100}],
        },
    ]  # fmt: skip
    assert route_weight(spec(**STICKY), applied(route, rules)) == 10
    # idempotent, also as the server stores it
    assert route_rules(spec(**STICKY), applied(route, rules), 10) is None
    stored = server_defaults(applied(route, rules))
    assert route_rules(spec(**STICKY), stored, 10) is None
    assert route_weight(spec(**STICKY), stored) == 10
    # a step: the same rule, more buckets
    up = route_rules(spec(**STICKY), stored, 25)
    assert up is not None and len(up) == 2 and up[0] == stored["spec"]["rules"][0]
    assert up[1]["matches"][0]["headers"][0]["value"] == bucket_regex(25)
    assert route_weight(spec(**STICKY), applied(stored, up)) == 25
    # at 0 the rule is gone, the stable Service keeps all the weight
    back = route_rules(spec(**STICKY), applied(stored, up), 0)
    assert back == [stable_at_100(server_defaults(route)["spec"]["rules"][0])]
    assert route_weight(spec(**STICKY), applied(stored, back)) is None
    assert route_rules(spec(**STICKY), applied(stored, back), 0) is None


def test_each_rule_holding_the_stable_service_gets_its_copy_with_its_matches() -> None:
    chat = stable_rule(
        name="chat",
        matches=[
            {"path": {"type": "PathPrefix", "value": "/v1/chat"}, "method": "POST"},
            # the edge's header given by hand is replaced, never doubled
            {"path": {"type": "Exact", "value": "/v1/completions"},
             "headers": [{"name": "x-tenant", "value": "a"},
                         {"name": "X-RTRL-Bucket", "value": "1"}]},
        ],
        filters=[{"type": "RequestHeaderModifier",
                  "requestHeaderModifier": {"set": [{"name": "x-arm", "value": "any"}]}}],
    )  # fmt: skip
    docs = {"matches": [{"path": {"type": "PathPrefix", "value": "/docs"}}],
            "backendRefs": [{"name": "docs", "port": 80}]}  # fmt: skip
    mixed = stable_rule(matches=[{"path": {"type": "PathPrefix", "value": "/v2"}}])
    mixed["backendRefs"].append({"name": "legacy", "port": 8000, "weight": 10})
    route = server_defaults(http_route(chat, docs, mixed))
    rules = route_rules(spec(**STICKY), route, 30)
    assert rules is not None and len(rules) == 5
    original = route["spec"]["rules"]
    assert rules[:3] == [stable_at_100(original[0]), original[1], stable_at_100(original[2])]
    first, second = rules[3], rules[4]
    assert (first["name"], second["name"]) == (CANARY_RULE, f"{CANARY_RULE}-2")
    bucketed = {"type": "RegularExpression", "name": HEADER, "value": bucket_regex(30)}
    assert first["matches"] == [
        {"path": {"type": "PathPrefix", "value": "/v1/chat"}, "method": "POST",
         "headers": [bucketed]},
        {"path": {"type": "Exact", "value": "/v1/completions"},
         "headers": [{"name": "x-tenant", "value": "a", "type": "Exact"}, bucketed]},
    ]  # fmt: skip
    assert first["filters"] == chat["filters"]  # the canary gets the rule's treatment
    assert first["backendRefs"] == [{"name": "composer-canary", "port": 8000, "weight": 100,
                                     "group": "", "kind": "Service"}]  # fmt: skip
    # what the rule sends elsewhere stays; the stable share goes to the canary
    assert [(r["name"], r["weight"]) for r in second["backendRefs"]] == [
        ("legacy", 10), ("composer-canary", 100)
    ]  # fmt: skip
    assert route_rules(spec(**STICKY), applied(route, rules), 30) is None
    assert route_rules(spec(**STICKY), applied(route, rules), 0) == [
        rules[0], rules[1], rules[2]
    ]  # fmt: skip


def test_changing_the_unit_mid_canary_replaces_one_way_of_routing_with_the_other() -> None:
    route = server_defaults(http_route(stable_rule()))
    weighted = route_rules(spec(), route, 10)
    sticky = route_rules(spec(**STICKY), applied(route, weighted), 10)
    assert sticky is not None and [r["backendRefs"][-1]["name"] for r in sticky] == [
        "composer", "composer-canary"
    ]  # fmt: skip
    assert sticky == route_rules(spec(**STICKY), route, 10)
    assert route_rules(spec(), applied(route, sticky), 10) == weighted
    # an RLCycle deleted mid-canary releases the route with its spec as it was
    assert route_rules(spec(), applied(route, sticky), 0) == [
        stable_at_100(route["spec"]["rules"][0])
    ]


# --- routed: the sticky split ---------------------------------------------------------------
def users_arms(route: dict[str, Any], users: list[str], requests: int = 4) -> dict[str, str]:
    """Each user's arm; asserts that all of a user's requests land in the same one."""
    rng = random.Random(5)
    arms: dict[str, str] = {}
    for user in users:
        headers = {"X-Rtrl-Bucket": str(gateway.bucket(user))}  # header names: any case
        seen = {gateway.backend(route, gateway.Request("/v1/chat", headers=headers), rng)
                for _ in range(requests)}  # fmt: skip
        assert len(seen) == 1, (user, seen)
        arms[user] = seen.pop() or ""
    return arms


def test_routed_users_stay_in_their_arm_and_only_move_to_the_canary() -> None:
    users = [f"user-{i}" for i in range(2000)]
    route = server_defaults(http_route(stable_rule()))
    at = {}
    for weight in (5, 25, 50):
        rules = route_rules(spec(**STICKY), route, weight)
        route = applied(route, rules)
        at[weight] = users_arms(route, users)
        share = sum(arm == "composer-canary" for arm in at[weight].values()) / len(users)
        # binomial: 4 standard deviations of the share of 2000 users
        assert abs(share - weight / 100) < 4 * (weight / 100 * (1 - weight / 100) / 2000) ** 0.5
        assert set(at[weight].values()) == {"composer", "composer-canary"}
    for low, high in ((5, 25), (25, 50)):
        moved_back = [u for u in users
                      if at[low][u] == "composer-canary" and at[high][u] == "composer"]  # fmt: skip
        assert not moved_back
    # no header: not in the experiment
    rng = random.Random(1)
    assert {gateway.backend(route, gateway.Request("/v1/chat"), rng) for _ in range(500)} == {
        "composer"
    }
    # the same split per request with the weighted route: users see both arms
    weighted = applied(route, route_rules(spec(), route, 50))
    rng = random.Random(2)
    both = sum(
        len({gateway.backend(weighted, gateway.Request(headers={HEADER: str(gateway.bucket(u))}),
                             rng) for _ in range(6)}) == 2
        for u in users[:200]
    )  # fmt: skip
    assert both > 150


# --- the stand-in itself, on the spec's precedence ------------------------------------------
def test_the_gateway_stand_in_follows_the_spec_precedence() -> None:
    def rule(name: str, **match: Any) -> dict[str, Any]:
        return {"matches": [match], "backendRefs": [{"name": name}]}

    route = http_route(
        rule("root"),
        rule("prefix", path={"type": "PathPrefix", "value": "/v1/chat"}),
        rule("exact", path={"type": "Exact", "value": "/v1/chat/x"}),
        rule("method", path={"type": "PathPrefix", "value": "/v1/chat"}, method="POST"),
        rule("header", path={"type": "PathPrefix", "value": "/v1/chat"},
             headers=[{"name": "a", "value": "1"}]),
        rule("two-headers", path={"type": "PathPrefix", "value": "/v1/chat"},
             headers=[{"name": "a", "value": "1"},
                      {"name": "b", "type": "RegularExpression", "value": "[0-9]+"}]),
        rule("query", path={"type": "PathPrefix", "value": "/v1/chat"},
             headers=[{"name": "a", "value": "1"}], queryParams=[{"name": "q", "value": "z"}]),
        rule("header-later", path={"type": "PathPrefix", "value": "/v1/chat"},
             headers=[{"name": "c", "value": "1"}]),
    )  # fmt: skip
    rng = random.Random(0)

    def to(path: str, method: str = "GET", **headers: str) -> str | None:
        query = {"q": headers.pop("q")} if "q" in headers else {}
        return gateway.backend(route, gateway.Request(path, method, headers, query), rng)

    assert to("/v1/chatty") == "root"  # prefixes match whole path elements
    assert to("/v1/chat/") == "prefix" and to("/v1/chat/y") == "prefix"
    assert to("/v1/chat/x", "POST", a="1", b="2") == "exact"
    assert to("/v1/chat", "POST", a="1", b="2") == "method"
    assert to("/v1/chat", A="1") == "header"
    assert to("/v1/chat", a="1", b="22") == "two-headers"
    assert to("/v1/chat", a="1", b="2x") == "header"  # a regex matches the whole value
    assert to("/v1/chat", a="1", q="z") == "query"
    assert to("/v1/chat", a="1", c="1") == "header"  # a tie: the first rule in list order
    assert gateway.pick([{"name": "a", "weight": 0}], rng) is None
    assert gateway.backend(http_route(rule("x", path={"type": "Exact", "value": "/"})),
                           gateway.Request("/a"), rng) is None  # fmt: skip
    # the edge's hash: FNV-1a, 32 bits (its published test vectors)
    assert gateway.fnv1a_32(b"") == 0x811C9DC5 and gateway.fnv1a_32(b"a") == 0xE40C292C
