"""The Arrow schemas of the two event files, and the sampling columns a shard may carry.

Generation events are written by the capture proxy, one row per completion served; feedback
events by the feedback service, one row per signal reported. Both are Parquet files in the
events store (:mod:`~rtrl.core.events.layout`), read only by the seal step.
"""

from __future__ import annotations

import pyarrow as pa

from rtrl.core.shards.schema import SAMPLING_COLUMNS, TIMESTAMP

__all__ = ["FEEDBACK_SCHEMA", "GENERATION_SCHEMA", "SAMPLING_COLUMNS"]

GENERATION_SCHEMA = pa.schema(
    [
        pa.field("interaction_id", pa.string()),  # UUIDv7 minted by the proxy
        pa.field("created_at", TIMESTAMP),  # when the request reached the proxy
        pa.field("checkpoint_id", pa.string()),  # RTRL_CHECKPOINT_ID of the pod
        pa.field("model_uri", pa.string()),  # the checkpoint URI the pod was given
        pa.field("engine_model", pa.string()),  # what the engine reported it loaded
        pa.field("checkpoint_verified", pa.bool_()),  # engine_model agrees with model_uri
        pa.field("arm", pa.string()),  # stable | canary
        pa.field("rlcycle", pa.string()),
        pa.field("pod", pa.string()),
        pa.field("user_id", pa.string()),
        pa.field("session_id", pa.string()),
        pa.field("org", pa.string()),
        pa.field("endpoint", pa.string()),  # chat.completions | completions
        pa.field("stream", pa.bool_()),
        pa.field("status", pa.int32()),  # the engine's HTTP status
        pa.field("choice_index", pa.int32()),  # n > 1: one event per choice
        pa.field("finish_reason", pa.string()),
        pa.field("latency_ms", pa.float64()),  # request in to last byte out
        pa.field("prompt_ids", pa.list_(pa.int32())),
        pa.field("completion_ids", pa.list_(pa.int32())),
        pa.field("completion_logprobs", pa.list_(pa.float32())),
        pa.field("completion_mask", pa.list_(pa.bool_())),
        *SAMPLING_COLUMNS,
        pa.field("tool_calls", pa.int32()),
        pa.field("invalid_tool_calls", pa.int32()),
        pa.field("tool_call_errors", pa.list_(pa.string())),  # why each invalid call is
    ]
)

FEEDBACK_SCHEMA = pa.schema(
    [
        pa.field("event_id", pa.string()),  # the client's idempotency key
        pa.field("interaction_id", pa.string()),
        pa.field("signal", pa.string()),  # a name of signals.SIGNALS
        pa.field("value", pa.float64()),  # bools as 1.0 / 0.0
        pa.field("observed_at", TIMESTAMP),  # when the client observed it
        pa.field("received_at", TIMESTAMP),  # when the service made it durable
    ]
)
