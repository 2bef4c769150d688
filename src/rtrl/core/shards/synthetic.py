"""Synthetic interaction rows with the shape and statistics of real ones.

Tests, the shard benchmark and the local demo need millions of plausible interactions without
a serving fleet: unique ids, a skewed population of users and orgs, prompts of 100-300
tokens, completions whose mask has tool-output spans, negative per-token log-probs, and
feedback signals that are consistent with each other (invalid tool calls never exceed tool
calls; edit persistence is null until it matures). Rows are built column-wise with numpy and
assembled from buffers, so a million rows take seconds, not minutes.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from rtrl.core.shards.schema import INTERACTION_SCHEMA, TIMESTAMP

DEFAULT_START = datetime(2026, 1, 5, 8, 0, tzinfo=UTC)

_ORGS = ("acme", "globex", "initech", "umbrella", "hooli", "stark", "wayne", "wonka")
# Zipf-like: a few large customers produce most of the traffic.
_ORG_WEIGHTS = np.array([0.35, 0.2, 0.12, 0.1, 0.08, 0.06, 0.05, 0.04])
_USERS_PER_ORG = 500
_USER_POOL = pa.array([f"u{i:05d}" for i in range(len(_ORGS) * _USERS_PER_ORG)])
_HEX = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)


def _uuid_strings(rng: np.random.Generator, n: int) -> pa.Array:
    """``n`` random UUID4-formatted strings, built as one Arrow buffer (no Python strings)."""
    raw = rng.integers(0, 256, size=(n, 16), dtype=np.uint8)
    raw[:, 6] = (raw[:, 6] & 0x0F) | 0x40
    raw[:, 8] = (raw[:, 8] & 0x3F) | 0x80
    hexed = np.empty((n, 32), dtype=np.uint8)
    hexed[:, 0::2] = _HEX[raw >> 4]
    hexed[:, 1::2] = _HEX[raw & 0x0F]
    dash = np.full((n, 1), ord("-"), dtype=np.uint8)
    groups = [hexed[:, :8], hexed[:, 8:12], hexed[:, 12:16], hexed[:, 16:20], hexed[:, 20:]]
    text = np.hstack([part for group in groups for part in (group, dash)][:-1])
    offsets = np.arange(0, 36 * (n + 1), 36, dtype=np.int32)
    return pa.StringArray.from_buffers(n, pa.py_buffer(offsets), pa.py_buffer(text.tobytes()))


def _list_array(
    lengths: npt.NDArray[np.int64], values: pa.Array, list_type: pa.DataType
) -> pa.Array:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), values, type=list_type)


def _completion_mask(
    rng: np.random.Generator, lengths: npt.NDArray[np.int64]
) -> npt.NDArray[np.bool_]:
    """Per-token mask: a third of completions contain one span of tool output (False)."""
    n, total = len(lengths), int(lengths.sum())
    rows = np.repeat(np.arange(n), lengths)
    starts = np.cumsum(lengths) - lengths
    position = np.arange(total) - starts[rows]
    has_tool = rng.random(n) < 1 / 3
    span_start = (rng.random(n) * lengths * 0.8).astype(np.int64)
    span_len = np.where(has_tool, (rng.random(n) * lengths * 0.3).astype(np.int64), 0)
    in_span = (position >= span_start[rows]) & (position < (span_start + span_len)[rows])
    mask: npt.NDArray[np.bool_] = ~in_span
    return mask


def synthetic_interactions(
    n: int,
    *,
    seed: int,
    checkpoint_id: str,
    tokens: int = 100,
    prompt_tokens: tuple[int, int] = (100, 300),
    vocab_size: int = 32_000,
    start: datetime = DEFAULT_START,
    duration: timedelta = timedelta(hours=3),
    batch_size: int = 65_536,
) -> Iterator[pa.RecordBatch]:
    """``n`` interactions served by ``checkpoint_id``, as canonical record batches.

    Completions have ``tokens`` tokens on average (uniform in [tokens/2, 3*tokens/2]),
    prompts a uniform length in ``prompt_tokens``; ``created_at`` increases through
    ``[start, start + duration)``. The same arguments always give the same rows.
    """
    if n < 0 or tokens < 1 or batch_size < 1:
        raise ValueError("n must be >= 0, tokens and batch_size >= 1")
    if start.tzinfo is None:
        raise ValueError("start must be timezone-aware (interaction times are UTC)")
    rng = np.random.default_rng(seed)
    start_us = int(start.timestamp() * 1_000_000)
    span_us = duration.total_seconds() * 1_000_000
    orgs = pa.array(_ORGS)
    for first in range(0, n, batch_size):
        size = min(batch_size, n - first)
        yield _batch(
            rng,
            size,
            first=first,
            n=n,
            checkpoint_id=checkpoint_id,
            tokens=tokens,
            prompt_tokens=prompt_tokens,
            vocab_size=vocab_size,
            start_us=start_us,
            span_us=span_us,
            orgs=orgs,
        )


def _batch(
    rng: np.random.Generator,
    size: int,
    *,
    first: int,
    n: int,
    checkpoint_id: str,
    tokens: int,
    prompt_tokens: tuple[int, int],
    vocab_size: int,
    start_us: int,
    span_us: float,
    orgs: pa.Array,
) -> pa.RecordBatch:
    # Row i lands in its own slot of the time range, so times increase across batches too.
    slots = np.arange(first, first + size) + rng.random(size)
    created = start_us + (slots / max(n, 1) * span_us).astype(np.int64)
    latency = rng.lognormal(mean=7.5, sigma=0.6, size=size)
    feedback_delay = rng.exponential(20 * 60 * 1e6, size=size).astype(np.int64)
    feedback = created + latency.astype(np.int64) * 1000 + feedback_delay
    has_feedback = rng.random(size) < 0.9

    org_index = rng.choice(len(_ORGS), size=size, p=_ORG_WEIGHTS)
    user_number = org_index * _USERS_PER_ORG + rng.zipf(1.5, size=size) % _USERS_PER_ORG

    prompt_len = rng.integers(prompt_tokens[0], prompt_tokens[1] + 1, size=size)
    completion_len = rng.integers(max(1, tokens // 2), tokens * 3 // 2 + 1, size=size)
    total = int(completion_len.sum())
    prompt_values = rng.integers(0, vocab_size, size=int(prompt_len.sum()), dtype=np.int32)
    completion_values = rng.integers(0, vocab_size, size=total, dtype=np.int32)
    logprobs = -rng.exponential(0.4, size=total).astype(np.float32)

    tool_calls = rng.poisson(2.0, size=size)
    invalid_tool_calls = rng.binomial(tool_calls, 0.05)
    asked = rng.random(size) < 0.06
    edits = np.where(asked, 0, rng.poisson(1.5, size=size) + 1)
    # Edits persist more often than not; clarifications propose no edit, so nothing persists.
    persisted = np.where(asked, 0.0, rng.beta(1.2, 0.8, size=size))
    matured = rng.random(size) < 0.8
    dissatisfied = rng.random(size) < np.where(persisted < 0.3, 0.35, 0.08)

    columns = {
        "interaction_id": _uuid_strings(rng, size),
        "checkpoint_id": pa.repeat(pa.scalar(checkpoint_id, pa.string()), size),
        "user_id": _USER_POOL.take(pa.array(user_number)),
        "org": orgs.take(pa.array(org_index)),
        "created_at": pa.array(created, TIMESTAMP),
        "feedback_at": pa.array(feedback, TIMESTAMP, mask=~has_feedback),
        "prompt_ids": _list_array(
            prompt_len, pa.array(prompt_values), INTERACTION_SCHEMA.field("prompt_ids").type
        ),
        "completion_ids": _list_array(
            completion_len,
            pa.array(completion_values),
            INTERACTION_SCHEMA.field("completion_ids").type,
        ),
        "completion_logprobs": _list_array(
            completion_len,
            pa.array(logprobs),
            INTERACTION_SCHEMA.field("completion_logprobs").type,
        ),
        "completion_mask": _list_array(
            completion_len,
            pa.array(_completion_mask(rng, completion_len)),
            INTERACTION_SCHEMA.field("completion_mask").type,
        ),
        "edit_persisted": pa.array(persisted, pa.float64(), mask=~matured),
        "dissatisfied_followup": pa.array(dissatisfied),
        "latency_ms": pa.array(latency, pa.float64()),
        "tool_calls": pa.array(tool_calls, pa.int32()),
        "invalid_tool_calls": pa.array(invalid_tool_calls, pa.int32()),
        "asked_clarification": pa.array(asked),
        "edits_proposed": pa.array(edits, pa.int32()),
    }
    return pa.RecordBatch.from_arrays(list(columns.values()), schema=INTERACTION_SCHEMA)
