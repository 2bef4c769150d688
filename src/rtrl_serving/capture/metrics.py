"""The sidecar's Prometheus metrics (``GET /metrics``), one registry per proxy.

Served requests by arm, endpoint and status (what the A/B analysis counts per arm); events
spooled, shipped and dropped by reason (``spool_full``, ``io_error``, ``corrupt``, ``torn``,
``encode``); checkpoint mismatches; spool bytes; upload failures; requests whose events carry
no tokens, by reason; tool calls and invalid ones; with adapter routing, the routing
tables applied and refused, the adapters loaded, and those skipped as stale.
"""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Callable, Iterator
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from rtrl_serving.spool import SpoolSnapshot


class _SpoolCollector(Collector):
    def __init__(self, snapshot: Callable[[], SpoolSnapshot], extra_dropped: Callable[[], int]):
        self._snapshot = snapshot
        self._extra_dropped = extra_dropped

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        yield CounterMetricFamily(
            "rtrl_capture_events_spooled", "Events taken by the spool", value=snap.appended
        )
        yield CounterMetricFamily(
            "rtrl_capture_events_durable", "Events fsynced to the spool", value=snap.durable
        )
        yield CounterMetricFamily(
            "rtrl_capture_events_shipped", "Events uploaded to the events store", value=snap.shipped
        )
        yield CounterMetricFamily(
            "rtrl_capture_event_files_shipped", "Event files uploaded", value=snap.shipped_files
        )
        dropped = CounterMetricFamily(
            "rtrl_capture_events_dropped", "Events lost, by reason", labels=["reason"]
        )
        dropped.add_metric(["spool_full"], snap.dropped_full)
        dropped.add_metric(["io_error"], snap.dropped_io)
        dropped.add_metric(["corrupt"], snap.corrupt)
        dropped.add_metric(["torn"], snap.torn)
        dropped.add_metric(["encode"], self._extra_dropped())
        yield dropped
        yield CounterMetricFamily(
            "rtrl_capture_upload_failures",
            "Failed uploads of event files (retried)",
            value=snap.upload_failures,
        )
        yield GaugeMetricFamily(
            "rtrl_capture_spool_bytes", "Bytes in the spool not yet shipped", value=snap.held_bytes
        )
        yield GaugeMetricFamily(
            "rtrl_capture_spool_segments",
            "Closed spool segments waiting to be shipped",
            value=snap.backlog_segments,
        )


class Routing(Protocol):
    """What the metrics read of the adapter router (adapters.py)."""

    @property
    def tables(self) -> Tally[str]: ...
    @property
    def loaded(self) -> set[str]: ...
    @property
    def reloads(self) -> int: ...
    @property
    def stale(self) -> frozenset[str]: ...


class _RouterCollector(Collector):
    def __init__(self, router: Routing) -> None:
        self._router = router

    def collect(self) -> Iterator[Metric]:
        tables = CounterMetricFamily(
            "rtrl_capture_adapter_tables",
            "Adapter routing tables applied, and refused (the previous one stayed)",
            labels=["result"],
        )
        router = self._router
        for result in ("applied", "refused"):
            tables.add_metric([result], router.tables[result])
        yield tables
        yield GaugeMetricFamily(
            "rtrl_capture_adapters_loaded",
            "Adapters loaded in the engine",
            value=len(router.loaded),
        )
        yield CounterMetricFamily(
            "rtrl_capture_adapter_reloads",
            "Adapters loaded again after the engine lost them (a restarted engine)",
            value=router.reloads,
        )
        yield GaugeMetricFamily(
            "rtrl_capture_adapters_stale",
            "Adapters the table in effect names that were skipped as stale (trained on another "
            "base than the engine's): their organisations get the base",
            value=len(router.stale),
        )


class CaptureMetrics:
    """The proxy's own counters, plus the spool's read at scrape time."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "rtrl_capture_requests",
            "Requests served, by arm, endpoint and status",
            ["arm", "endpoint", "status"],
            registry=r,
        )
        self.mismatches = Counter(
            "rtrl_capture_checkpoint_mismatches",
            "Events recorded while the engine's model did not match "
            "RTRL_MODEL_URI (checkpoint_verified false)",
            registry=r,
        )
        self.verified = Gauge(
            "rtrl_capture_checkpoint_verified",
            "1 when the engine serves RTRL_MODEL_URI",
            registry=r,
        )
        self.defaults_verified = Gauge(
            "rtrl_capture_sampling_defaults_verified",
            "1 when the engine samples with the defaults the proxy records, 0 when not, -1 unknown",
            registry=r,
        )
        self.defaults_verified.set(-1)
        self.uncaptured = Counter(
            "rtrl_capture_uncaptured",
            "Choices whose events carry no tokens, by reason",
            ["reason"],
            registry=r,
        )
        self.tool_calls = Counter("rtrl_capture_tool_calls", "Tool calls seen", registry=r)
        self.invalid_tool_calls = Counter(
            "rtrl_capture_invalid_tool_calls", "Tool calls that were invalid", registry=r
        )
        self.encode_dropped = 0

    def watch_spool(self, snapshot: Callable[[], SpoolSnapshot]) -> None:
        self.registry.register(_SpoolCollector(snapshot, lambda: self.encode_dropped))

    def watch_router(self, router: Routing) -> None:
        self.registry.register(_RouterCollector(router))
