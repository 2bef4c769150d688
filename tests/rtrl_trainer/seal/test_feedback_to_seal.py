"""From a client's POST to a sealed shard: what rtrl-feedback stores is what the seal reads."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from aiohttp import ClientSession
from aiohttp.test_utils import TestServer

from rtrl.core.events import hour_of
from rtrl.core.store.local import LocalStore
from rtrl_serving.feedback.app import build_app
from rtrl_serving.feedback.commit import GroupCommitter
from rtrl_serving.feedback.tokens import Tokens
from rtrl_trainer.cli import main
from tests.rtrl_trainer.seal.events import generation, write_events
from tests.rtrl_trainer.seal.test_seal import sealed_rows


@pytest.mark.asyncio
async def test_posted_feedback_reaches_the_sealed_shard(tmp_path: Path) -> None:
    events, shards = LocalStore(tmp_path / "events"), LocalStore(tmp_path / "shards")
    hour = hour_of(datetime.now(UTC) - timedelta(hours=4))
    served = [generation(hour + timedelta(minutes=5 + i)) for i in range(3)]
    write_events(events, "generations", hour, served)
    (tmp_path / "tokens").write_text("t0ken\n")
    app = build_app(GroupCommitter(events, "feedback-e2e"), Tokens(tmp_path / "tokens"))
    server = TestServer(app)
    await server.start_server()
    a, b, c = (g["interaction_id"] for g in served)
    at = (hour + timedelta(minutes=20)).isoformat()
    body = {"events": [
        {"event_id": "1", "interaction_id": a, "signal": "edit_persisted", "value": 0.3,
         "observed_at": at},
        {"event_id": "2", "interaction_id": a.upper(), "signal": "dissatisfied_followup",
         "value": True, "observed_at": at},
        {"event_id": "3", "interaction_id": b, "signal": "invalid_tool_calls", "value": 4,
         "observed_at": at},
    ]}  # fmt: skip
    try:
        url, auth = server.make_url("/v1/feedback"), {"Authorization": "Bearer t0ken"}
        async with ClientSession() as session:
            for _ in range(2):  # the second time: a retry, acknowledged, not counted twice
                async with session.post(url, json=body, headers=auth) as answer:
                    assert answer.status == 202
    finally:
        await server.close()
    assert main(["seal", "--events", events.uri, "--shards", shards.uri]) == 0
    rows = sealed_rows(shards)
    assert (rows[a]["edit_persisted"], rows[a]["dissatisfied_followup"]) == (0.3, True)
    assert rows[b]["invalid_tool_calls"] == 4
    assert (rows[c]["edit_persisted"], rows[c]["invalid_tool_calls"]) == (None, 0)
