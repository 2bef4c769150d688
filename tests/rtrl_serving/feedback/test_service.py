"""The feedback service over real HTTP, writing to a real store (file://, and moto's S3
over HTTP with a faulty proxy in front): durable before 202, idempotent, authenticated,
all-or-nothing per request, grouped writes."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from aiohttp import ClientSession
from aiohttp.test_utils import TestServer

from rtrl.core.events import event_file_key, hour_of
from rtrl.core.store import ObjectStore
from rtrl.core.store.local import LocalStore
from rtrl.core.store.s3 import S3Store
from rtrl_localkube.s3faults import serve_fault_proxy
from rtrl_serving.feedback import tokens as tokens_module
from rtrl_serving.feedback.app import build_app
from rtrl_serving.feedback.commit import GroupCommitter
from rtrl_serving.feedback.events import Limits
from rtrl_serving.feedback.tokens import Tokens
from tests.rtrl_serving.feedback.helpers import TOKEN, event, stored_feedback

AUTH = {"Authorization": f"Bearer {TOKEN}"}


class Service:
    def __init__(self, server: TestServer, store: ObjectStore, token_file: Path) -> None:
        self.server, self.store, self.token_file = server, store, token_file
        self.session = ClientSession()

    async def post(self, body: Any, headers: dict[str, str] | None = None) -> tuple[int, Any]:
        kwargs: dict[str, Any] = {"data": body} if isinstance(body, bytes) else {"json": body}
        url = self.server.make_url("/v1/feedback")
        async with self.session.post(url, headers=AUTH if headers is None else headers,
                                     **kwargs) as response:  # fmt: skip
            return response.status, await response.json(content_type=None)

    async def get(self, path: str) -> tuple[int, str]:
        async with self.session.get(self.server.make_url(path)) as response:
            return response.status, await response.text()


@pytest.fixture
def token_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(tokens_module, "RECHECK_S", 0.0)
    path = tmp_path / "tokens"
    path.write_text(f"old-token-retired-soon\n{TOKEN}\n")
    return path


@pytest_asyncio.fixture
async def serve(token_file: Path) -> AsyncIterator[Callable[..., Any]]:
    started: list[Service] = []

    async def start(store: ObjectStore, **limits: Any) -> Service:
        committer = GroupCommitter(store, "feedback-test-0a1b2c3d")
        app = build_app(committer, Tokens(token_file), limits=Limits(**limits),
                        max_body_bytes=64 * 1024)  # fmt: skip
        server = TestServer(app)
        await server.start_server()
        service = Service(server, store, token_file)
        started.append(service)
        return service

    yield start
    for service in started:
        await service.session.close()
        await service.server.close()


@pytest.fixture
def local_store(tmp_path: Path) -> LocalStore:
    return LocalStore(tmp_path / "events")


@pytest.mark.asyncio
async def test_accepted_events_are_in_the_store_under_their_interactions_hour(
    serve: Callable[..., Any], local_store: LocalStore
) -> None:
    service = await serve(local_store)
    earlier = datetime.now(UTC) - timedelta(hours=3)
    events = [event(), event(served=earlier), event(signal="latency_ms", value=1200)]
    status, doc = await service.post({"events": events})
    assert (status, doc) == (202, {"accepted": 3, "duplicates": 0})
    table = stored_feedback(local_store)
    assert sorted(table.column("event_id").to_pylist()) == sorted(e["event_id"] for e in events)
    # one file per partition, named by the writer and its sequence numbers
    keys = set(table.column("key").to_pylist())
    hours = sorted({hour_of(earlier), hour_of(datetime.now(UTC) - timedelta(minutes=1))})
    assert keys == {
        event_file_key("feedback", hour, "feedback-test-0a1b2c3d", seq)
        for seq, hour in enumerate(hours)
    }
    rows = {r["event_id"]: r for r in table.to_pylist()}
    latency = rows[events[2]["event_id"]]
    assert (latency["signal"], latency["value"]) == ("latency_ms", 1200.0)
    assert latency["interaction_id"] == events[2]["interaction_id"]
    assert latency["observed_at"] == datetime.fromisoformat(events[2]["observed_at"])
    received = table.column("received_at").to_pylist()
    assert all(datetime.now(UTC) - r < timedelta(minutes=1) for r in received)


@pytest.mark.asyncio
async def test_a_retry_is_acknowledged_once_and_a_reused_id_conflicts(
    serve: Callable[..., Any], local_store: LocalStore
) -> None:
    service = await serve(local_store)
    events = [event(), event()]
    assert await service.post({"events": events}) == (202, {"accepted": 2, "duplicates": 0})
    assert await service.post({"events": events}) == (202, {"accepted": 2, "duplicates": 2})
    assert await service.post({"events": [events[0], event()]}) == (
        202,
        {"accepted": 2, "duplicates": 1},
    )
    status, doc = await service.post({"events": [event(), {**events[1], "value": 0.99}]})
    assert status == 409
    assert doc["problems"] == [
        {"field": "events[1].event_id", "message": "already used for another event"}
    ]
    assert stored_feedback(local_store).num_rows == 3  # the 409's fresh event was not stored


@pytest.mark.asyncio
async def test_a_malformed_request_stores_nothing_and_names_the_field(
    serve: Callable[..., Any], local_store: LocalStore
) -> None:
    service = await serve(local_store)
    bad = event()
    bad["observed_at"] = (datetime.now(UTC) + timedelta(days=2)).isoformat()
    status, doc = await service.post({"events": [event(), event(), bad, event()]})
    assert status == 400
    assert doc["problems"][0]["field"] == "events[2].observed_at"
    assert "is in the future" in doc["problems"][0]["message"]
    assert doc["error"].startswith("no event of this request was stored: events[2].observed_at")
    assert list(local_store.list()) == []
    status, doc = await service.post(b"x" * 70_000)
    assert status == 413
    assert list(local_store.list()) == []
    _, metrics = await service.get("/metrics")
    assert 'rtrl_feedback_events_rejected_total{reason="observed_at"} 1.0' in metrics
    assert 'rtrl_feedback_events_rejected_total{reason="too_large"} 1.0' in metrics
    assert 'rtrl_feedback_requests_total{code="400"} 1.0' in metrics


@pytest.mark.asyncio
async def test_only_a_current_token_is_accepted_and_never_shown(
    serve: Callable[..., Any], local_store: LocalStore, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    service = await serve(local_store)
    for headers in (
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": f"Basic {TOKEN}"},
        {"Authorization": f"Bearer {TOKEN}x"},
        {"Authorization": "Bearer "},
    ):
        status, doc = await service.post({"events": [event()]}, headers=headers)
        assert status == 401, headers
        assert TOKEN not in str(doc)
    assert (await service.post({"events": [event()]}))[0] == 202
    old = {"Authorization": "Bearer old-token-retired-soon"}
    assert (await service.post({"events": [event()]}, headers=old))[0] == 202
    # rotation: the Secret's file now holds only the new token
    service.token_file.write_text(f"{TOKEN}\n")
    assert (await service.post({"events": [event()]}, headers=old))[0] == 401
    assert (await service.post({"events": [event()]}))[0] == 202
    _, metrics = await service.get("/metrics")
    assert 'rtrl_feedback_events_rejected_total{reason="unauthorized"} 6.0' in metrics
    assert TOKEN not in metrics and TOKEN not in caplog.text
    assert stored_feedback(local_store).num_rows == 3


@pytest.mark.asyncio
async def test_ready_only_with_a_token(serve: Callable[..., Any], local_store: LocalStore) -> None:
    service = await serve(local_store)
    assert (await service.get("/healthz"))[0] == 200
    assert (await service.get("/readyz"))[0] == 200
    service.token_file.write_text("\n")
    status, text = await service.get("/readyz")
    assert status == 503 and "holds no token" in text
    assert TOKEN not in text
    # fail closed: emptying the Secret revokes every token
    assert (await service.post({"events": [event()]}))[0] == 401


@pytest.mark.asyncio
async def test_concurrent_requests_share_writes_on_s3(
    serve: Callable[..., Any], s3_bucket: str
) -> None:
    store = S3Store(s3_bucket, "events")
    service = await serve(store)
    batches = [[event() for _ in range(5)] for _ in range(60)]
    answers = await asyncio.gather(*(service.post({"events": b}) for b in batches))
    assert all(a == (202, {"accepted": 5, "duplicates": 0}) for a in answers)
    table = stored_feedback(store)
    assert table.num_rows == 300
    assert len(set(table.column("event_id").to_pylist())) == 300
    files = len(set(table.column("key").to_pylist()))
    assert files < 30, f"{files} files for 60 concurrent requests: no group commit"


@pytest.mark.asyncio
async def test_a_failing_store_answers_503_and_the_retry_lands_once(
    serve: Callable[..., Any], s3_bucket: str, moto_endpoint: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    with serve_fault_proxy(moto_endpoint) as (proxy, endpoint):
        store = S3Store(s3_bucket, "events", endpoint_url=endpoint)
        service = await serve(store)
        proxy.fail(lambda method, path, headers: method == "PUT", times=-1)
        events = [event(), event()]
        status, doc = await service.post({"events": events})
        assert status == 503
        assert "retry with the same event ids" in doc["error"]
        proxy.faults.clear()
        # a transient 503 within the store's retries is not the client's concern
        proxy.fail(lambda method, path, headers: method == "PUT", times=1)
        assert await service.post({"events": events}) == (202, {"accepted": 2, "duplicates": 0})
        assert await service.post({"events": events}) == (202, {"accepted": 2, "duplicates": 2})
        assert stored_feedback(store).num_rows == 2
        _, metrics = await service.get("/metrics")
        assert "rtrl_feedback_write_failures_total 1.0" in metrics
        assert 'rtrl_feedback_events_rejected_total{reason="store_failed"} 2.0' in metrics
