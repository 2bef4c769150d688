"""The capture sidecar's adapter routing, without an engine: which route a request gets
(rtrl_serving.capture.adapters.choose), the table as a file (read_table), and the request
and response rewritten for an adapter (rewrite's ``model``). The real engine behind it:
tests/rtrl_serving/capture/test_adapter_routing.py."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import pytest

from rtrl.core.api.adapter import AdapterRef, AdapterRouting, OrgRoute
from rtrl_serving.capture.adapters import (
    CANARY,
    STABLE,
    AdapterRouter,
    TableError,
    bucket,
    choose,
    read_table,
)
from rtrl_serving.capture.rewrite import COMPLETIONS, rewrite

C1 = AdapterRef(name="org-a-c1", checkpoint="org-a-c1-id", uri="s3://models/org-a/c1/")
C2 = AdapterRef(name="org-a-c2", checkpoint="org-a-c2-id", uri="s3://models/org-a/c2/")
C3 = AdapterRef(name="org-a-c3", checkpoint="org-a-c3-id", uri="s3://models/org-a/c3/")


def _table(canary: AdapterRef | None = C2, weight: int = 30) -> AdapterRouting:
    return AdapterRouting(orgs={"org-a": OrgRoute(stable=C1, canary=canary, weight=weight)})


def test_a_unit_stays_in_its_arm_and_the_share_is_the_weight() -> None:
    table = _table(weight=30)
    users = [f"user-{i}" for i in range(4000)]
    arms = {u: choose(table, "org-a", u) for u in users}
    assert all(choose(table, "org-a", u) == arms[u] for u in users[:200])  # sticky
    canary = [u for u, r in arms.items() if r is not None and r.arm == CANARY]
    assert all(arms[u] is not None and arms[u].ref == C2 for u in canary)  # type: ignore[union-attr]
    assert all(r is not None and r.ref == C1 for u, r in arms.items() if u not in canary)
    assert abs(len(canary) / len(users) - 0.30) < 0.03


def test_each_canary_draws_its_units_afresh() -> None:
    """The bucket is salted with the canary's checkpoint: the next canary's 30% is not the
    same users again (they would carry the last canary's effect into the next)."""
    users = [f"user-{i}" for i in range(4000)]
    first = {u for u in users if choose(_table(C2), "org-a", u).arm == CANARY}  # type: ignore[union-attr]
    second = {u for u in users if choose(_table(C3), "org-a", u).arm == CANARY}  # type: ignore[union-attr]
    overlap = len(first & second) / len(first)
    assert 0.2 < overlap < 0.4  # independent draws: about the weight, not 1
    assert bucket("x", "u") == bucket("x", "u") and 0 <= bucket("x", "u") < 100


def test_what_the_table_does_not_route() -> None:
    table = AdapterRouting(orgs={"org-a": OrgRoute(canary=C2, weight=100)})
    assert choose(table, "org-b", "u") is None  # another org: the pod's own
    named = AdapterRouting(orgs={"org-b": OrgRoute()})  # named with nothing: the same
    assert choose(named, "org-b", "u") is None
    assert choose(table, None, "u") is None
    no_unit = choose(table, "org-a", None)  # no unit: never the canary, whatever the weight
    assert no_unit is not None and (no_unit.ref, no_unit.arm) == (None, STABLE)
    routed = choose(table, "org-a", "u")
    assert routed is not None and (routed.ref, routed.arm) == (C2, CANARY)


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"orgs": {"a": {"weight": 10}}}, "orgs.a: Value error, weight without a canary"),
        ({"orgs": {"a": {"canary": {**C2.to_k8s()}, "weight": 101}}}, "orgs.a.weight"),
        ({"orgs": {"a": {"stable": {**C1.to_k8s(), "name": "Org_A"}}}}, "orgs.a.stable.name"),
        ({"orgs": {"a": {"stable": {**C1.to_k8s(), "uri": "gs://x/"}}}}, "orgs.a.stable.uri"),
        ({"orgs": {"a": {"stabel": C1.to_k8s()}}}, "orgs.a.stabel: Extra inputs"),
        (
            {"orgs": {"a": {"stable": C1.to_k8s()}, "b": {"stable": {**C1.to_k8s(),
                                                                     "uri": "s3://other/"}}}},
            "adapter name 'org-a-c1' names two adapters",
        ),
        ("[1, 2", "not YAML or JSON"),
    ],
)  # fmt: skip
def test_a_bad_table_is_refused_naming_the_field(tmp_path: Path, doc: object, message: str) -> None:
    path = tmp_path / "adapters.yaml"
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    with pytest.raises(TableError, match=message.replace(".", r"\.").replace("(", r"\(")):
        read_table(path)


def test_an_empty_file_is_an_empty_table(tmp_path: Path) -> None:
    (tmp_path / "t.yaml").write_text("")
    assert read_table(tmp_path / "t.yaml").orgs == {}


def test_the_request_names_the_adapter_and_the_response_the_model_asked_for() -> None:
    raw = b'{"model": "tiny", "prompt": [1, 2], "max_tokens": 3}'
    rw = rewrite(COMPLETIONS, raw, model="org-a-c2", served="tiny")
    assert json.loads(rw.body)["model"] == "org-a-c2"
    engine = b'{"id":"c","object":"text_completion","model":"org-a-c2","choices":[]}'
    assert rw.restore_model(engine) == engine.replace(b"org-a-c2", b"tiny")
    # a request that names no model is given back the engine's served name
    bare = rewrite(COMPLETIONS, b'{"prompt": [1]}', model="org-a-c2", served="tiny")
    assert json.loads(bare.body)["model"] == "org-a-c2"
    assert bare.restore_model(engine) == engine.replace(b"org-a-c2", b"tiny")
    # echo passes unchanged but for the adapter; not JSON cannot be routed
    echo = rewrite(COMPLETIONS, b'{"model": "tiny", "prompt": "x", "echo": true}', model="a")
    assert json.loads(echo.body)["model"] == "a" and echo.uncapturable == "echo"
    assert rewrite(COMPLETIONS, b"not json", model="a").model_sent is None
    # without a route nothing changes
    plain = rewrite(COMPLETIONS, raw)
    assert plain.restore_model(engine) == engine and json.loads(plain.body)["model"] == "tiny"


def _refresh(router: AdapterRouter) -> bool:
    async def go() -> bool:
        async with aiohttp.ClientSession() as session:
            return await router.refresh(session)

    return asyncio.run(go())


def test_until_a_table_is_in_effect_the_router_says_why(tmp_path: Path) -> None:
    """What /readyz reports: no file yet; then a table naming an adapter that is not
    published (refused whole, nothing routed); then an empty table, in effect at once."""
    path = tmp_path / "adapters.yaml"
    router = AdapterRouter(path, tmp_path / "dir", engine="http://127.0.0.1:9", base_uri=None)
    assert _refresh(router) is False and not router.applied
    assert router.problem == f"{path}: no such file"
    missing = AdapterRef(name="gone", checkpoint="gone", uri=(tmp_path / "gone").as_uri() + "/")
    path.write_text(json.dumps({"orgs": {"acme": {"stable": missing.to_k8s()}}}))
    assert _refresh(router) is False and not router.applied
    assert router.problem is not None and "not committed" in router.problem
    assert router.tables["refused"] == 1 and router.route("acme", "u") is None
    path.write_text("orgs: {}\n")
    assert _refresh(router) is True and router.applied and router.problem is None
