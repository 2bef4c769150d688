"""The feedback service's Prometheus metrics (``GET /metrics``), in a registry of its own.

Rejections are counted by reason: for a request refused whole (401, 409, 413, 503) the
reason is the request's, and its events are counted under it when they were read; for a
400, each problem counts under the field it names (``value``, ``observed_at``...), so a
client sending, say, unknown signals shows up as such.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

COMMIT_BUCKETS = (0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
EVENT_BUCKETS = (1, 10, 100, 1_000, 10_000, 100_000)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "rtrl_feedback_requests", "POST /v1/feedback requests by response code", ["code"],
            registry=r,
        )  # fmt: skip
        self.accepted = Counter(
            "rtrl_feedback_events_accepted",
            "events acknowledged (202) after they were durable, duplicates included",
            registry=r,
        )
        self.duplicates = Counter(
            "rtrl_feedback_events_duplicate",
            "events acknowledged without a write: this process had committed their id already",
            registry=r,
        )
        self.rejected = Counter(
            "rtrl_feedback_events_rejected",
            "events refused, by reason (a 400's field, or unauthorized, conflict, too_large, "
            "store_failed)",
            ["reason"],
            registry=r,
        )
        self.writes = Counter(
            "rtrl_feedback_writes", "event files written to the events store", registry=r
        )
        self.write_failures = Counter(
            "rtrl_feedback_write_failures",
            "group writes that failed after the store's retries (their requests got 503)",
            registry=r,
        )
        self.commit_seconds = Histogram(
            "rtrl_feedback_commit_seconds",
            "time to write one group's files to the events store",
            buckets=COMMIT_BUCKETS,
            registry=r,
        )
        self.commit_events = Histogram(
            "rtrl_feedback_commit_events",
            "events per group commit",
            buckets=EVENT_BUCKETS,
            registry=r,
        )
        self.ready = Gauge(
            "rtrl_feedback_ready", "1 when the service accepts feedback (tokens loaded)",
            registry=r,
        )  # fmt: skip

    def committed(self, events: int, seconds: float, ok: bool) -> None:
        self.commit_seconds.observe(seconds)
        self.commit_events.observe(events)
        if ok:
            self.writes.inc()
        else:
            self.write_failures.inc()
