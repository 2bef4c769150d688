"""Generation events (rtrl.core.events.GENERATION_SCHEMA) from one served request: one row per
choice, or one row without tokens for a request that failed (an engine error, a client that
left mid-stream), so the requests served per arm can be counted.

Rows are spooled as JSON objects (the spool turns them into Parquet): timestamps as ISO 8601
in UTC, log-probs as the engine's floats (float32 in the files).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from rtrl_serving.capture.collect import ChoiceCapture
from rtrl_serving.capture.sampling import Sampling
from rtrl_serving.capture.toolcheck import ToolVerdict

# the status of an event whose client went away before its response was complete (nginx's)
CLIENT_CLOSED = 499
HEADER_VALUE_MAX = 256


@dataclass(frozen=True)
class Served:
    """What is common to every event of one request."""

    created_at: datetime
    endpoint: str
    stream: bool
    status: int
    latency_ms: float
    sampling: Sampling | None
    user_id: str | None
    session_id: str | None
    org: str | None


@dataclass(frozen=True)
class Identity:
    """What is common to every event of this pod."""

    checkpoint_id: str | None
    model_uri: str | None
    arm: str | None
    rlcycle: str | None
    pod: str
    logprobs_mode: str
    serving_dtype: str | None


def header_value(headers: Mapping[str, str], name: str) -> str | None:
    value = headers.get(name)
    return value[:HEADER_VALUE_MAX] if value else None


def iso(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def event_row(
    interaction_id: str,
    served: Served,
    *,
    identity: Identity,
    engine_model: str | None,
    verified: bool,
    choice: ChoiceCapture | None = None,
    tools: ToolVerdict | None = None,
) -> dict[str, Any]:
    """One row; ``choice`` None (or its tokens missing) for an event without tokens."""
    tokens = choice is not None and choice.missing is None and served.status == 200
    sampling = served.sampling
    return {
        "interaction_id": interaction_id,
        "created_at": iso(served.created_at),
        "checkpoint_id": identity.checkpoint_id,
        "model_uri": identity.model_uri,
        "engine_model": engine_model,
        "checkpoint_verified": verified,
        "arm": identity.arm,
        "rlcycle": identity.rlcycle,
        "pod": identity.pod,
        "user_id": served.user_id,
        "session_id": served.session_id,
        "org": served.org,
        "endpoint": served.endpoint,
        "stream": served.stream,
        "status": served.status,
        "choice_index": choice.index if choice is not None else None,
        "finish_reason": choice.finish_reason if choice is not None else None,
        "latency_ms": round(served.latency_ms, 3),
        "prompt_ids": choice.prompt_ids if tokens and choice else None,
        "completion_ids": choice.completion_ids if tokens and choice else None,
        "completion_logprobs": choice.logprobs if tokens and choice else None,
        "completion_mask": [True] * len(choice.completion_ids) if tokens and choice else None,
        "temperature": sampling.temperature if sampling else None,
        "top_p": sampling.top_p if sampling else None,
        "top_k": sampling.top_k if sampling else None,
        "logprobs_mode": identity.logprobs_mode,
        "serving_dtype": identity.serving_dtype,
        "tool_calls": tools.calls if tools is not None else None,
        "invalid_tool_calls": tools.invalid if tools is not None else None,
        "tool_call_errors": tools.errors if tools is not None else None,
    }


def encode(row: Mapping[str, Any]) -> bytes:
    """The row as the spool's JSON record; ValueError for what JSON cannot hold (NaN)."""
    return json.dumps(row, allow_nan=False, separators=(",", ":"), ensure_ascii=False).encode()


def rows_ids(ids: Sequence[str], count: int, mint: Any) -> list[str]:
    """``ids`` extended with fresh ones (``mint()``) to ``count``: a response with more
    choices than the request announced still gets one id per choice."""
    out = list(ids)
    while len(out) < count:
        out.append(mint())
    return out
