"""A relay in front of the real engine that holds each stream's end back: everything passes
through as the engine sent it, but the chunked body's terminator of a stream follows its
``data: [DONE]`` only ``hold`` seconds later: what the capture proxy's client waits for
after its last event shows whether the proxy ends a response with its last event or with
the engine's end."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator

import aiohttp
from aiohttp import web

from rtrl_localkube.processes import free_port
from rtrl_serving.capture.headers import forward_headers


@contextlib.contextmanager
def engine_that_ends_late(engine: str, hold: float) -> Iterator[str]:
    """The relay's base URL while the block runs (its own loop, on a thread)."""
    loop = asyncio.new_event_loop()
    port = free_port()
    sessions: list[aiohttp.ClientSession] = []

    async def relay(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = forward_headers(request.headers, plain=False)
        async with sessions[0].request(
            request.method, engine + request.path_qs, data=body or None, headers=headers
        ) as up:
            kind = up.headers.get("Content-Type", "application/octet-stream")
            if not kind.startswith("text/event-stream"):
                return web.Response(
                    status=up.status, body=await up.read(), headers={"Content-Type": kind}
                )
            resp = web.StreamResponse(status=up.status, headers={"Content-Type": kind})
            await resp.prepare(request)
            async for data in up.content.iter_any():
                await resp.write(data)
                if b"data: [DONE]" in data:
                    await asyncio.sleep(hold)
            await resp.write_eof()
            return resp

    async def start() -> web.AppRunner:
        sessions.append(aiohttp.ClientSession())
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", relay)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        return runner

    thread = threading.Thread(target=loop.run_forever, name="late-end-relay", daemon=True)
    thread.start()
    runner = asyncio.run_coroutine_threadsafe(start(), loop).result(30)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
        asyncio.run_coroutine_threadsafe(sessions[0].close(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()
