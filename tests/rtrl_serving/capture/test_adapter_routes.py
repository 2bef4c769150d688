"""The capture sidecar's adapter routing, without a real engine: which route a request gets
(rtrl_serving.capture.adapters.choose), the table as a file or a directory of files
(rtrl_serving.capture.table), the request and response rewritten for an adapter (rewrite's
``model``), and adapters trained on another base skipped as stale (a stand-in engine that
only loads adapters). The real engine behind it:
tests/rtrl_serving/capture/test_adapter_routing.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from rtrl.core.api.adapter import AdapterRef, AdapterRouting, OrgRoute, base_digest
from rtrl.core.store import open_store
from rtrl_serving.capture.adapters import CANARY, STABLE, AdapterRouter, Route, bucket, choose
from rtrl_serving.capture.configmap import ConfigMapWatch
from rtrl_serving.capture.metrics import CaptureMetrics
from rtrl_serving.capture.rewrite import COMPLETIONS, rewrite
from rtrl_serving.capture.table import TableError, read_table

C1 = AdapterRef(name="org-a-c1", checkpoint="org-a-c1-id", uri="s3://models/org-a/c1/")
C2 = AdapterRef(name="org-a-c2", checkpoint="org-a-c2-id", uri="s3://models/org-a/c2/")
C3 = AdapterRef(name="org-a-c3", checkpoint="org-a-c3-id", uri="s3://models/org-a/c3/")
D1 = AdapterRef(name="org-b-c1", checkpoint="org-b-c1-id", uri="s3://models/org-b/c1/")


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


# --- the table as a directory: one file per writer (a ConfigMap of one key per RLCycle) ---


def _route(ref: AdapterRef, canary: AdapterRef | None = None, weight: int = 0) -> dict[str, Any]:
    return OrgRoute(stable=ref, canary=canary, weight=weight).to_k8s()


def test_a_directory_is_the_union_of_its_files(tmp_path: Path) -> None:
    (tmp_path / "org-a.yaml").write_text(json.dumps({"orgs": {"org-a": _route(C1, C2, 30)}}))
    (tmp_path / "org-b.json").write_text(json.dumps({"orgs": {"org-b": _route(D1)}}))
    (tmp_path / "org-c.yml").write_text("")  # a writer with nothing to route yet
    (tmp_path / "notes.txt").write_text("orgs: {x: {}}")  # neither YAML nor JSON by name
    (tmp_path / ".hidden.yaml").write_text("orgs: {y: {}}")  # the kubelet's entries
    (tmp_path / "sub.yaml").mkdir()
    table = read_table(tmp_path)
    assert table.orgs == _table().orgs | {"org-b": OrgRoute(stable=D1)}
    assert set(table.adapters()) == {C1.name, C2.name, D1.name}
    empty = tmp_path / "empty"
    empty.mkdir()
    assert read_table(empty).orgs == {}


@pytest.mark.parametrize(
    ("second", "message"),
    [
        ({"org-a": _route(C3)}, "orgs.org-a: the organisation is routed by both files"),
        (
            {"org-b": _route(C1.model_copy(update={"uri": "s3://models/other/"}))},
            "orgs.org-b: adapter name 'org-a-c1' names two adapters",
        ),
        ({"org-b": {"weight": 10}}, "orgs.org-b: Value error, weight without a canary"),
    ],
)
def test_a_directory_whose_files_disagree_is_refused_naming_them(
    tmp_path: Path, second: dict[str, Any], message: str
) -> None:
    (tmp_path / "a.yaml").write_text(json.dumps({"orgs": {"org-a": _route(C1)}}))
    (tmp_path / "b.yaml").write_text(json.dumps({"orgs": second}))
    with pytest.raises(TableError) as refused:
        read_table(tmp_path)
    text = str(refused.value)
    assert message in text and f"{tmp_path / 'b.yaml'}" in text
    both = "weight" not in message  # a bad file alone names only itself
    assert (f"{tmp_path / 'a.yaml'} and {tmp_path / 'b.yaml'}: " in text) is both


def test_a_change_to_any_file_of_the_directory_is_picked_up(tmp_path: Path) -> None:
    """Files rewritten in place (the directory's own mtime stays), added and removed."""
    tables = tmp_path / "tables"
    tables.mkdir()
    (tables / "a.yaml").write_text("orgs: {org-a: {}}\n")
    (tables / "b.yaml").write_text("orgs: {org-b: {}}\n")
    router = AdapterRouter(tables, tmp_path / "dir", engine="http://127.0.0.1:9", base_uri=None)
    assert _refresh(router) is True and set(router.table.orgs) == {"org-a", "org-b"}
    assert _refresh(router) is False  # nothing changed: nothing applied again
    with (tables / "b.yaml").open("r+") as same_file:  # same size, same inode
        same_file.write("orgs: {org-x: {}}\n")
    assert _refresh(router) is True and set(router.table.orgs) == {"org-a", "org-x"}
    (tables / "c.json").write_text('{"orgs": {"org-c": {}}}')
    assert _refresh(router) is True and set(router.table.orgs) == {"org-a", "org-x", "org-c"}
    (tables / "a.yaml").unlink()
    assert _refresh(router) is True and set(router.table.orgs) == {"org-x", "org-c"}
    (tables / "c.json").write_text('{"orgs": {"org-x": {}}}')  # two files route org-x
    assert _refresh(router) is False and set(router.table.orgs) == {"org-x", "org-c"}
    assert router.problem is not None and "c.json" in router.problem
    assert "b.yaml" in router.problem and router.tables["refused"] == 1


def test_the_configmap_through_the_api_goes_ahead_of_the_mounted_table(tmp_path: Path) -> None:
    """``--adapters-configmap``: once the watch has read the ConfigMap, its copy is the
    table (its table keys only); until then, the mounted directory."""
    tables = tmp_path / "tables"
    tables.mkdir()
    (tables / "a.yaml").write_text("orgs: {org-old: {}}\n")
    watch = ConfigMapWatch("composer-adapters", namespace="ns", api="https://127.0.0.1:9")
    router = AdapterRouter(tables, tmp_path / "dir", engine="http://127.0.0.1:9",
                           base_uri=None, watch=watch)  # fmt: skip
    assert _refresh(router) is True and set(router.table.orgs) == {"org-old"}
    watch.data = {"a.yaml": "orgs: {org-new: {}}\n", "b.yaml": "orgs: {org-b: {}}\n",
                  "notes.txt": "not a table"}  # fmt: skip
    assert _refresh(router) is True and set(router.table.orgs) == {"org-new", "org-b"}
    assert _refresh(router) is False  # the kubelet's older copy is not read meanwhile
    watch.data = {}
    assert _refresh(router) is True and router.table.orgs == {}


def _kubelet_write(mount: Path, version: str, files: dict[str, str]) -> None:
    """A ConfigMap volume as the kubelet updates it: the keys in a new timestamped
    directory, ``..data`` swapped to it atomically, then the visible links made (a key
    removed leaves its link dangling until the kubelet takes it away)."""
    data = mount / f"..{version}"
    data.mkdir()
    for key, text in files.items():
        (data / key).write_text(text)
    (mount / "..data_tmp").symlink_to(data.name)
    os.replace(mount / "..data_tmp", mount / "..data")
    for key in files:
        if not (mount / key).is_symlink():
            (mount / key).symlink_to(Path("..data") / key)


def test_a_configmap_volume_swapped_by_the_kubelet_is_picked_up(tmp_path: Path) -> None:
    mount = tmp_path / "adapters"
    mount.mkdir()
    _kubelet_write(mount, "2026_01_01_v1", {"org-a.yaml": "orgs: {org-a: {}}\n"})
    router = AdapterRouter(mount, tmp_path / "dir", engine="http://127.0.0.1:9", base_uri=None)
    assert _refresh(router) is True and set(router.table.orgs) == {"org-a"}
    files = {"org-a.yaml": "orgs: {org-a2: {}}\n", "org-b.yaml": "orgs: {org-b: {}}\n"}
    _kubelet_write(mount, "2026_01_01_v2", files)
    assert _refresh(router) is True and set(router.table.orgs) == {"org-a2", "org-b"}
    _kubelet_write(mount, "2026_01_01_v3", {"org-a.yaml": "orgs: {org-a2: {}}\n"})
    assert (mount / "org-b.yaml").is_symlink() and not (mount / "org-b.yaml").exists()
    assert _refresh(router) is True and set(router.table.orgs) == {"org-a2"}
    assert router.tables["refused"] == 0


# --- adapters trained on another base: stale, skipped, their orgs on the base -------------


@dataclass
class _Engine:
    """The engine's adapter API alone: what was loaded, and /v1/models."""

    url: str
    loaded: list[str]


@contextlib.asynccontextmanager
async def _engine() -> AsyncIterator[_Engine]:
    engine = _Engine("", [])

    async def load(request: web.Request) -> web.Response:
        engine.loaded.append((await request.json())["lora_name"])
        return web.Response(text="ok")

    async def models(_request: web.Request) -> web.Response:
        ids = ["tiny", *engine.loaded]
        return web.json_response({"data": [{"id": i} for i in ids]})

    app = web.Application()
    app.router.add_post("/v1/load_lora_adapter", load)
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    engine.url = f"http://127.0.0.1:{port}"
    try:
        yield engine
    finally:
        await runner.cleanup()


def _publish(tmp_path: Path) -> tuple[str, AdapterRef, AdapterRef]:
    """A base in a file:// store, an adapter trained on it and one trained on another."""
    root = tmp_path / "bucket"
    store = open_store(root.as_uri() + "/")
    src = tmp_path / "src"
    src.mkdir()
    for name, data in (("config.json", b"{}"), ("model.safetensors", b"base weights"),
                       ("adapter_config.json", b'{"r": 4}'),
                       ("adapter_model.safetensors", b"lora weights")):  # fmt: skip
        (src / name).write_bytes(data)
    base = store.commit("base", {n: src / n for n in ("config.json", "model.safetensors")})
    digest = base_digest({n: str(e["sha256"]) for n, e in base.files.items()})
    adapter = {n: src / n for n in ("adapter_config.json", "adapter_model.safetensors")}
    store.commit("good", adapter, {"kind": "adapter", "baseDigest": digest})
    old = {"kind": "adapter", "baseDigest": "0" * 64, "base": "s3://user:secret@h/old-base/"}
    store.commit("old", adapter, old)
    good = AdapterRef(name="org-a-new", checkpoint="org-a-new", uri=store.url("good") + "/")
    stale = AdapterRef(name="org-b-old", checkpoint="org-b-old", uri=store.url("old") + "/")
    return store.url("base") + "/", good, stale


def test_an_adapter_of_another_base_is_skipped_and_its_orgs_get_the_base(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The base was promoted: org-b's adapter is of the old base. The table is applied all
    the same: org-a's adapter is loaded and routed, org-b gets the base, org-c's stale
    canary gets no unit (all to its stable), counted, warned of once; /readyz would not wait."""
    base_uri, good, stale = _publish(tmp_path)
    path = tmp_path / "adapters.yaml"
    orgs = {"org-a": _route(good), "org-b": _route(stale),
            "org-c": _route(good, stale, 100)}  # fmt: skip
    path.write_text(json.dumps({"orgs": orgs}))
    metrics = CaptureMetrics()

    async def go() -> None:
        async with _engine() as engine, aiohttp.ClientSession() as session:
            router = AdapterRouter(path, tmp_path / "dir", engine=engine.url, base_uri=base_uri)
            metrics.watch_router(router)
            assert await router.refresh(session) is True
            assert router.applied and router.problem is None and router.missing == []
            assert engine.loaded == [good.name] and router.loaded == {good.name}
            assert router.stale == {stale.name}
            assert router.route("org-a", "u") == Route(good, STABLE)
            assert router.route("org-b", "u") == Route(None, STABLE)  # the base
            for user in ("u", "v", "w", None):  # weight 100, but the canary is stale
                assert router.route("org-c", user) == Route(good, STABLE)
            assert router.in_flight[stale.name] == 0
            await router.refresh(session)  # the engine's adapters checked: none missing
            assert router.missing == [] and engine.loaded == [good.name]

    with caplog.at_level(logging.WARNING, logger="rtrl_serving.capture.adapters"):
        asyncio.run(go())
    assert metrics.registry.get_sample_value("rtrl_capture_adapters_stale") == 1
    assert metrics.registry.get_sample_value("rtrl_capture_adapters_loaded") == 1
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert f"adapter {stale.name}" in warning and "trained on base s3://***@h/old-base/" in warning
    assert f"not on the engine's {base_uri}" in warning and "secret" not in warning
    # without the stale set, the same table routes org-b to its adapter: choose() decides
    table = AdapterRouting.model_validate({"orgs": orgs})
    assert choose(table, "org-b", "u") == Route(stale, STABLE)
    assert choose(table, "org-b", "u", frozenset({stale.name})) == Route(None, STABLE)
