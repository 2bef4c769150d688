"""What rtrl changes inside kopf (rtrl.kopf_fixes), each checked against kopf itself: the
pinned kopf's sources are the ones the fixes were written for, and kopf's own watch loop,
over HTTP, survives a stream that breaks mid-event."""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
from typing import Any

import kopf
import pytest
from aiohttp import web
from kopf._cogs.clients import auth
from kopf._cogs.clients import watching as kopf_watching
from kopf._cogs.structs import credentials, references

from rtrl import kopf_fixes

PATH = "/apis/rtrl.dev/v1/namespaces/ns/rlcycles"


def test_the_pinned_kopf_is_the_one_the_fixes_were_written_for() -> None:
    """On a kopf upgrade this fails, naming each function to read again before the pin moves
    (and FINGERPRINTS with it)."""
    assert importlib.metadata.version("kopf") == kopf_fixes.KOPF_VERSION
    assert kopf_fixes.drifted() == []


def event(kind: str, name: str, version: int) -> bytes:
    meta = {"name": name, "namespace": "ns", "uid": f"uid-{name}", "resourceVersion": str(version)}
    return json.dumps({"type": kind, "object": {"metadata": meta}}).encode() + b"\n"


@pytest.mark.parametrize(
    "broken",
    [
        pytest.param(b'{"type": "MODIFIED", "object": {"metadata": {"name": "\xec\x9c', id="bytes"),
        pytest.param(b'{"type": "MODIFIED", "object": {"metada', id="cut"),
    ],
)
def test_a_watch_stream_broken_mid_event_is_watched_again(
    broken: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A watch answer whose last line is not UTF-8 JSON (cut mid-event, or damaged on the way:
    once seen in CI through a proxy): kopf's watch loop raised out of the watcher, which then
    ended for good with the operator still up (kopf issue 1276). With the fix the loop watches
    again from the last resourceVersion it saw, and no event is lost or repeated."""
    asked: list[str | None] = []
    done = asyncio.Event()

    async def handle(request: web.Request) -> web.StreamResponse:
        if request.query.get("watch") != "true":
            return web.json_response({"items": [], "metadata": {"resourceVersion": "10"}})
        asked.append(request.query.get("resourceVersion"))
        response = web.StreamResponse()
        await response.prepare(request)
        if len(asked) == 1:
            await response.write(event("ADDED", "a", 11) + broken)
        else:
            await response.write(event("ADDED", "b", 12))
            await done.wait()  # held open, as a real watch, until the test ends
        return response

    async def scenario() -> list[Any]:
        app = web.Application()
        app.router.add_get(PATH, handle)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        vault = credentials.Vault()
        await vault.populate(
            {"test": credentials.ConnectionInfo(server=f"http://127.0.0.1:{port}")}
        )
        auth.vault_var.set(vault)
        resource = references.Resource("rtrl.dev", "v1", "rlcycles", namespaced=True)
        seen: list[Any] = []
        try:
            async with asyncio.timeout(20):
                async for item in kopf_watching.infinite_watch(
                    settings=kopf.OperatorSettings(), resource=resource, namespace="ns"
                ):
                    seen.append(item)
                    if isinstance(item, dict) and item["object"]["metadata"]["name"] == "b":
                        break
        finally:
            done.set()
            await vault.close()
            await runner.cleanup()
        return seen

    monkeypatch.setattr(kopf_fixes.kopf_api, "stream", kopf_fixes._ORIGINAL["kopf_api.stream"])
    kopf_fixes.install()
    seen = asyncio.run(scenario())
    names = [i["object"]["metadata"]["name"] for i in seen if isinstance(i, dict)]
    assert names == ["a", "b"]
    assert asked == ["10", "11"]  # from the listing, then from the last event seen
