"""Generation and feedback event files as the capture proxy and the feedback service
write them (GENERATION_SCHEMA, FEEDBACK_SCHEMA, event_file_key names), for the seal's
tests."""

from __future__ import annotations

import io
from datetime import datetime, timedelta
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from rtrl.core.events import (
    FEEDBACK_SCHEMA,
    GENERATION_SCHEMA,
    event_file_key,
    new_interaction_id,
)
from rtrl.core.store import ObjectStore


def generation(created_at: datetime, **fields: Any) -> dict[str, Any]:
    """One served completion (verified, status 200, three completion tokens)."""
    row: dict[str, Any] = {name: None for name in GENERATION_SCHEMA.names}
    row.update(
        interaction_id=new_interaction_id(created_at),
        created_at=created_at,
        checkpoint_id="ckpt-1",
        model_uri="s3://models/ckpt-1/",
        engine_model="s3://models/ckpt-1/",
        checkpoint_verified=True,
        arm="stable",
        rlcycle="composer",
        pod="composer-0",
        user_id="u-1",
        session_id="s-1",
        org="acme",
        endpoint="chat.completions",
        stream=False,
        status=200,
        choice_index=0,
        finish_reason="stop",
        latency_ms=250.0,
        prompt_ids=[1, 2, 3],
        completion_ids=[4, 5, 6],
        completion_logprobs=[-0.5, -0.25, -1.0],
        completion_mask=[True, True, True],
        temperature=0.7,
        top_p=0.95,
        top_k=None,
        logprobs_mode="processed_logprobs",
        serving_dtype="float32",
        tool_calls=1,
        invalid_tool_calls=0,
        tool_call_errors=[],
    )
    row.update(fields)
    return row


def feedback(
    interaction_id: str, signal: str, value: float, observed_at: datetime, *,
    event_id: str | None = None, received_at: datetime | None = None,
) -> dict[str, Any]:  # fmt: skip
    return {
        "event_id": event_id or f"{interaction_id[-12:]}-{signal}-{observed_at.timestamp()}",
        "interaction_id": interaction_id,
        "signal": signal,
        "value": float(value),
        "observed_at": observed_at,
        "received_at": received_at or observed_at + timedelta(seconds=1),
    }


def write_events(
    store: ObjectStore, kind: str, hour: datetime, rows: list[dict[str, Any]],
    *, writer: str = "writer-a", seq: int = 0,
) -> str:  # fmt: skip
    """One event file of ``kind`` (generations or feedback) for ``hour``; its key."""
    schema = GENERATION_SCHEMA if kind == "generations" else FEEDBACK_SCHEMA
    table = pa.Table.from_pylist(rows, schema=schema)
    sink = io.BytesIO()
    pq.write_table(table, sink)
    key = event_file_key(kind, hour, writer, seq)
    store.put_bytes(key, sink.getvalue())
    return key
