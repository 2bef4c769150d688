"""The proxy: aiohttp in front of the engine's OpenAI API, recording each generation.

``POST /v1/chat/completions`` and ``POST /v1/completions`` are captured: the request is
forwarded with token ids and log-probs asked for (:mod:`.rewrite`), the response goes back
with them taken out again (:mod:`.strip`), its tokens are gathered as it passes
(:mod:`.collect`) and, once the client has its last byte, one event per choice is handed to
the spool (:mod:`.events`), which never makes the response wait for the disk. Every other
path passes to the engine unchanged; ``/healthz``, ``/readyz`` and ``/metrics`` are the
proxy's own.

Order of the last steps, for the loss bounds of docs/writing-shards.md: the last bytes are
written to the client (a stream's last event with the response's end, before the engine's
own end is read), then the event is queued in the same tick (no await between), and the
spool's writer puts it in the page cache within milliseconds; so a SIGKILL loses the events
of responses completed in those milliseconds, a power loss those of the commit window.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from rtrl.core.events import GENERATION_SCHEMA, GENERATIONS_DIR, new_interaction_id
from rtrl.core.store import ObjectStore, open_store, redact
from rtrl_serving.capture.adapters import AdapterRouter, Route
from rtrl_serving.capture.collect import Collector
from rtrl_serving.capture.config import CaptureConfig
from rtrl_serving.capture.configmap import ConfigMapWatch
from rtrl_serving.capture.engine import EngineWatch
from rtrl_serving.capture.events import CLIENT_CLOSED, Identity, header_value, rows_ids
from rtrl_serving.capture.headers import forward_headers, response_headers, served_at
from rtrl_serving.capture.metrics import CaptureMetrics
from rtrl_serving.capture.recorder import Exchange, Recorder
from rtrl_serving.capture.rewrite import ENDPOINTS, Rewrite, rewrite
from rtrl_serving.capture.strip import parse, strip_chunk, strip_response
from rtrl_serving.spool import EventKind, Spool, by_hour_of

log = logging.getLogger(__name__)

INTERACTION_HEADER = "X-Rtrl-Interaction-Id"
GENERATIONS = EventKind(GENERATIONS_DIR, GENERATION_SCHEMA, by_hour_of("created_at"))
_CLIENT_GONE = (ConnectionResetError, aiohttp.ClientConnectionResetError)
IDLE_KEEPALIVE_S = 2.0
ENGINE_END_S = 30.0  # how long a stream's end may follow its [DONE]


class CaptureProxy:
    """One sidecar: its engine, its spool, its metrics. :meth:`app` builds the aiohttp app."""

    def __init__(self, config: CaptureConfig, store: ObjectStore | None = None) -> None:
        self.config = config
        self.metrics = CaptureMetrics()
        self.spool = Spool(
            Path(config.spool),
            store if store is not None else open_store(config.events),
            GENERATIONS,
            writer_name=config.pod,
            commit_ms=config.commit_ms,
            segment_bytes=config.segment_bytes,
            segment_age_s=config.segment_age_s,
            max_bytes=config.max_spool_bytes,
        )
        self.metrics.watch_spool(self.spool.snapshot)
        identity = Identity(
            checkpoint_id=config.checkpoint_id,
            model_uri=config.model_uri,
            arm=config.arm,
            rlcycle=config.rlcycle,
            pod=config.pod,
            logprobs_mode=config.logprobs_mode,
            serving_dtype=config.serving_dtype,
        )
        self.recorder = Recorder(config, self.spool, self.metrics, identity)
        self.router: AdapterRouter | None = None
        if config.adapters:
            self.router = router = AdapterRouter(
                Path(config.adapters), Path(config.adapter_dir),
                engine=config.engine, base_uri=config.model_uri,
                watch=ConfigMapWatch(name) if (name := config.adapters_configmap) else None,
            )  # fmt: skip
            self.metrics.watch_router(router)
        self._routing: asyncio.Task[None] | None = None
        self.session: aiohttp.ClientSession | None = None
        self.watch: EngineWatch | None = None
        self.shipped_all: bool | None = None  # after shutdown: whether the spool emptied
        self._watcher: asyncio.Task[None] | None = None

    # --- lifecycle -----------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/metrics", self._metrics)
        for path in ENDPOINTS:
            app.router.add_post(path, self._capture)
        app.router.add_route("*", "/{tail:.*}", self._passthrough)
        app.on_startup.append(self._startup)
        app.on_cleanup.append(self._cleanup)
        return app

    async def _startup(self, _app: web.Application) -> None:
        self.session = aiohttp.ClientSession(
            # idle connections are dropped before the engine drops them (uvicorn: after 5 s),
            # so a request is rarely sent on a connection the engine has just closed
            connector=aiohttp.TCPConnector(limit=1024, keepalive_timeout=IDLE_KEEPALIVE_S),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
        )
        self.watch = EngineWatch(
            self.session,
            self.config.engine,
            self.config.model_uri,
            self.config.generation_config,
            dict(self.config.override_generation_config),
        )
        self.recorder.engine = self.watch.state
        self.spool.start()
        log.info("capturing for %s as writer %s", redact(self.config.engine), self.spool.writer_id)
        self._watcher = asyncio.create_task(self._watch_engine())
        if self.router is not None:
            self._routing = asyncio.create_task(self.router.run(self.session))

    async def _watch_engine(self) -> None:
        assert self.watch is not None
        while True:
            if await self.watch.health():
                await self.watch.refresh()
            state = self.watch.state
            self.metrics.verified.set(1 if state.verified else 0)
            if state.defaults_verified is not None:
                self.metrics.defaults_verified.set(1 if state.defaults_verified else 0)
            known = state.checked_at > 0
            await asyncio.sleep(self.config.verify_interval_s if known else 1.0)

    async def _cleanup(self, _app: web.Application) -> None:
        """After the last in-flight request: flush and ship everything, then close."""
        for task in (self._watcher, self._routing):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self.session is not None:
            await self.session.close()
        self.shipped_all = await asyncio.to_thread(self.spool.close, self.config.drain_timeout_s)
        snap = self.spool.snapshot()
        log.info("spool closed: %d events spooled, %d shipped, %d left, all shipped: %s",
                 snap.appended, snap.shipped, snap.backlog_segments, self.shipped_all)  # fmt: skip

    # --- the proxy's own endpoints -------------------------------------------------------

    async def _healthz(self, _request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def _readyz(self, _request: web.Request) -> web.Response:
        problems = []
        if self.watch is None or not await self.watch.health():
            problems.append("the engine's /health is not OK")
        elif self.watch.state.defaults is None:
            # until then an event could not say which temperature, top_p and top_k sampled
            problems.append("the engine's sampling defaults are not read yet")
        spool = self.spool.writable()
        if spool is not None:
            problems.append(spool)
        if self.router is not None and not self.router.applied:
            # its orgs' adapters are not in the engine yet: their requests would get the base
            why = f": {self.router.problem}" if self.router.problem else ""
            problems.append(f"the adapter routing table is not in effect yet{why}")
        elif self.router is not None and self.router.missing:
            problems.append(f"adapters not in the engine: {', '.join(self.router.missing)}")
        if problems:
            return web.Response(status=503, text="; ".join(problems) + "\n")
        return web.Response(text="ready\n")

    async def _metrics(self, _request: web.Request) -> web.Response:
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    # --- everything else -----------------------------------------------------------------

    async def _passthrough(self, request: web.Request) -> web.StreamResponse:
        assert self.session is not None
        body = await request.read()
        try:
            upstream = await self._send(
                request.method, request.path_qs, body or None,
                forward_headers(request.headers, plain=False),
            )  # fmt: skip
        except aiohttp.ClientError as exc:
            return self._unreachable(exc)
        async with upstream:
            resp = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for key, value in response_headers(upstream):
                resp.headers.add(key, value)
            length = upstream.headers.get("Content-Length")
            if length is not None:
                resp.content_length = int(length)
            await resp.prepare(request)
            async for data in upstream.content.iter_any():
                await resp.write(data)
            await resp.write_eof()
        return resp

    async def _send(
        self, method: str, path_qs: str, body: bytes | None, headers: CIMultiDict[str]
    ) -> aiohttp.ClientResponse:
        """The engine's response to one request. A pooled connection that the engine closed
        while idle fails before any response byte (ServerDisconnectedError): the engine
        never read the request, so it is sent once more on a fresh connection."""
        assert self.session is not None
        url = self.config.engine + path_qs
        for attempt in (1, 2):
            try:
                return await self.session.request(
                    method, url, data=body, headers=headers, allow_redirects=False
                )
            except aiohttp.ServerDisconnectedError:
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def _unreachable(self, exc: Exception) -> web.Response:
        engine = redact(self.config.engine)
        log.warning("the engine at %s is unreachable: %s", engine, redact(str(exc)))
        error = {
            "error": {
                "message": f"rtrl-capture: the engine at {engine} is unreachable",
                "type": "BadGateway",
                "param": None,
                "code": 502,
            }
        }
        return web.json_response(error, status=502)

    # --- capture -------------------------------------------------------------------------

    def _route(self, request: web.Request) -> Route | None:
        if self.router is None:
            return None
        config, headers = self.config, request.headers
        unit = header_value(headers, config.user_header) or header_value(
            headers, config.session_header
        )
        return self.router.route(header_value(headers, config.org_header), unit)

    async def _capture(self, request: web.Request) -> web.StreamResponse:
        route = self._route(request)
        try:
            return await self._captured(request, route)
        finally:
            if self.router is not None:
                self.router.release(route)

    async def _captured(self, request: web.Request, route: Route | None) -> web.StreamResponse:
        assert self.session is not None
        started = time.monotonic()
        created = served_at(request.headers, self.config.clock_header)
        adapter = route.ref.name if route is not None and route.ref is not None else None
        served = self.watch.state.served_name if self.watch is not None else None
        rw = rewrite(ENDPOINTS[request.path], await request.read(), model=adapter, served=served)
        if adapter is not None and rw.model_sent is None and route is not None:
            route = Route(None, route.arm)  # not JSON: the engine refuses it, as the base
        ids = [new_interaction_id(created) for _ in range(rw.choices)]
        ex = Exchange(request, rw, ids, created, started, route=route)
        try:
            upstream = await self._send(
                "POST", request.path_qs, rw.body, forward_headers(request.headers, plain=True)
            )
        except aiohttp.ClientError as exc:
            resp = self._unreachable(exc)
            resp.headers[INTERACTION_HEADER] = ids[0]
            self.recorder.record(ex, 502, stream=False, collector=None)
            return resp
        async with upstream:
            kind = upstream.headers.get("Content-Type", "")
            if upstream.status == 200 and kind.startswith("text/event-stream"):
                return await self._stream(ex, upstream)
            return await self._whole(ex, upstream)

    async def _whole(self, ex: Exchange, upstream: aiohttp.ClientResponse) -> web.StreamResponse:
        body = await upstream.read()
        collector = None
        rw = ex.rw
        if upstream.status == 200 and rw.request is not None:
            try:
                doc = parse(body)
            except (ValueError, UnicodeDecodeError):
                doc = None
            if isinstance(doc, dict):
                collector = Collector(rw.endpoint)
                collector.add_response(doc)
                ex.ids = rows_ids(
                    ex.ids, len(collector.choices), lambda: new_interaction_id(ex.created)
                )
                if rw.strips:
                    body = strip_response(doc, rw, body)
        body = rw.restore_model(body)
        resp = web.Response(status=upstream.status, reason=upstream.reason, body=body)
        for key, value in response_headers(upstream):
            resp.headers.add(key, value)
        resp.headers[INTERACTION_HEADER] = ",".join(ex.ids if collector else ex.ids[:1])
        status = upstream.status
        try:
            await resp.prepare(ex.request)
            await resp.write_eof()
        except _CLIENT_GONE:
            status = CLIENT_CLOSED
        self.recorder.record(ex, status, stream=False, collector=collector)
        return resp

    async def _stream(self, ex: Exchange, upstream: aiohttp.ClientResponse) -> web.StreamResponse:
        """Relay the engine's stream. Its last event goes to the client with the response's end
        in one write, the events are queued in the same tick, and the engine's end is read
        after that: a client sends its next request once it has the end, so waiting for the
        engine's, or building the events (for the streams an engine step ends, one after
        another), first would be latency."""
        resp = web.StreamResponse(status=upstream.status, reason=upstream.reason)
        for key, value in response_headers(upstream):
            resp.headers.add(key, value)
        resp.headers[INTERACTION_HEADER] = ",".join(ex.ids)
        collector = Collector(ex.rw.endpoint)
        buffer = b""
        try:
            await resp.prepare(ex.request)
            async for data in upstream.content.iter_any():
                buffer += data
                out: list[bytes] = []
                done = False
                while (cut := buffer.find(b"\n\n")) >= 0:
                    event, buffer = buffer[: cut + 2], buffer[cut + 2 :]
                    done = done or event == b"data: [DONE]\n\n"
                    out.append(self._relay(event, collector, ex.rw))
                if done:
                    await resp.write_eof(b"".join(out) + buffer)
                    self.recorder.record(
                        ex, _stream_status(collector), stream=True, collector=collector
                    )
                    # the engine's end (its chunked body's last bytes), read so that its
                    # connection goes back to the pool; one that never comes is closed
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(upstream.content.read(), ENGINE_END_S)
                    return resp
                if out:
                    await resp.write(b"".join(out))
            if buffer:
                await resp.write(buffer)
            await resp.write_eof()
        except _CLIENT_GONE:
            upstream.close()  # drop the engine's connection: vLLM aborts the generation
            self.recorder.record(ex, CLIENT_CLOSED, stream=True, collector=None)
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as exc:
            if not ex.recorded:  # not after its [DONE], while its end was read
                log.warning("the engine's stream broke off: %s", exc)
            self.recorder.record(ex, 502, stream=True, collector=None)  # a no-op if served
        except asyncio.CancelledError:
            self.recorder.record(ex, CLIENT_CLOSED, stream=True, collector=None)
            raise
        # an engine that ended its stream without [DONE]
        self.recorder.record(ex, _stream_status(collector), stream=True, collector=collector)
        return resp

    def _relay(self, event: bytes, collector: Collector, rw: Rewrite) -> bytes:
        """One SSE event as the client gets it, its tokens collected on the way."""
        if not event.startswith(b"data: ") or event == b"data: [DONE]\n\n":
            return event
        try:
            chunk = parse(event[6:-2])
        except (ValueError, UnicodeDecodeError):
            return event
        if not isinstance(chunk, dict):
            return event
        collector.add_chunk(chunk)
        if not rw.strips or "choices" not in chunk:
            return rw.restore_model(event)
        payload = event[6:-2]
        stripped = strip_chunk(chunk, rw, payload)
        if stripped is None:
            return b""
        return rw.restore_model(event if stripped is payload else b"data: " + stripped + b"\n\n")


def _stream_status(collector: Collector) -> int:
    """200, or the code of an error the engine sent inside the stream."""
    if collector.error is None:
        return 200
    code = collector.error.get("code")
    return code if isinstance(code, int) and 400 <= code < 600 else 500
