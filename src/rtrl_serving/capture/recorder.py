"""From one captured exchange to its events in the spool: one per choice (tool calls checked),
or one without tokens for a request that failed, counted in the metrics either way.

:meth:`Recorder.record` is synchronous on purpose: the proxy calls it right after the
client's last byte was handed to the socket, with no await in between, so the window in
which a killed process has answered a client but not queued its event is as small as it can
be (docs/writing-shards.md, "Capture").
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, replace
from datetime import datetime

from aiohttp import web

from rtrl.core.events import new_interaction_id
from rtrl_serving.capture.adapters import Route
from rtrl_serving.capture.collect import Collector
from rtrl_serving.capture.config import CaptureConfig
from rtrl_serving.capture.engine import EngineState
from rtrl_serving.capture.events import Identity, Served, encode, event_row, header_value, rows_ids
from rtrl_serving.capture.metrics import CaptureMetrics
from rtrl_serving.capture.rewrite import CHAT, Rewrite
from rtrl_serving.capture.toolcheck import check_tool_calls, request_tools
from rtrl_serving.spool import Spool, SpoolClosed, SpoolFull

log = logging.getLogger(__name__)


@dataclass
class Exchange:
    """One captured request on its way through the proxy."""

    request: web.Request
    rw: Rewrite
    ids: list[str]  # the interaction ids announced to the client
    created: datetime  # its serving time
    started: float  # monotonic, at arrival
    recorded: bool = False
    route: Route | None = None  # its org's adapter and arm (adapters.py), if routed


class Recorder:
    """Turns exchanges into spooled events for one pod (``identity``)."""

    def __init__(
        self, config: CaptureConfig, spool: Spool, metrics: CaptureMetrics, identity: Identity
    ) -> None:
        self.config = config
        self.spool = spool
        self.metrics = metrics
        self.identity = identity
        self.engine = EngineState()  # replaced by the proxy's watch at start

    def record(
        self, ex: Exchange, status: int, *, stream: bool, collector: Collector | None
    ) -> None:
        """Queue the exchange's events, once."""
        if ex.recorded:
            return
        ex.recorded = True
        config, state, rw = self.config, self.engine, ex.rw
        sampling = state.defaults.resolve(rw.request) if state.defaults is not None else None
        headers = ex.request.headers
        served = Served(
            created_at=ex.created,
            endpoint=rw.endpoint,
            stream=stream,
            status=status,
            latency_ms=(time.monotonic() - ex.started) * 1000.0,
            sampling=sampling,
            user_id=header_value(headers, config.user_header),
            session_id=header_value(headers, config.session_header),
            org=header_value(headers, config.org_header),
        )
        identity, engine_model = self.identity, state.engine_model
        if ex.route is not None:
            # the org's arm; its adapter's checkpoint (the base's where it has none), which
            # the engine serves under the adapter's name on the verified base
            ref = ex.route.ref
            identity = replace(identity, arm=ex.route.arm)
            if ref is not None:
                identity = replace(identity, checkpoint_id=ref.checkpoint, model_uri=ref.uri,
                                   rlcycle=ref.rlcycle or identity.rlcycle)  # fmt: skip
                engine_model = ref.name
        make_row = functools.partial(
            event_row,
            served=served,
            identity=identity,
            engine_model=engine_model,
            verified=state.verified,
        )
        rows = []
        choices = collector.finish() if collector is not None and status == 200 else []
        if not choices:
            rows.append(make_row(ex.ids[0]))
            if status == 200:
                self.metrics.uncaptured.labels(rw.uncapturable or "no_choices").inc()
        else:
            ids = rows_ids(ex.ids, len(choices), lambda: new_interaction_id(ex.created))
            declared = request_tools(rw.request) if rw.endpoint == CHAT else None
            for interaction_id, choice in zip(ids, choices, strict=False):
                if rw.uncapturable:
                    choice.missing = rw.uncapturable
                verdict = None
                if rw.endpoint == CHAT:
                    verdict = check_tool_calls(
                        choice.tool_calls(), choice.text(), declared, config.tool_call_markers
                    )
                    self.metrics.tool_calls.inc(verdict.calls)
                    self.metrics.invalid_tool_calls.inc(verdict.invalid)
                if choice.missing:
                    self.metrics.uncaptured.labels(choice.missing).inc()
                rows.append(make_row(interaction_id, choice=choice, tools=verdict))
        self.metrics.requests.labels(identity.arm or "", rw.endpoint, str(status)).inc()
        if not state.verified:
            self.metrics.mismatches.inc(len(rows))
        for row in rows:
            try:
                self.spool.append(encode(row))
            except ValueError as exc:
                self.metrics.encode_dropped += 1
                log.error("an event could not be encoded: %s", exc)
            except SpoolFull:
                pass  # counted by the spool (rtrl_capture_events_dropped{reason="spool_full"})
            except SpoolClosed:
                self.metrics.encode_dropped += 1
                log.error("an event arrived after the spool closed")
