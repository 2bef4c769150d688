"""Taking out of the engine's response exactly what the proxy added to the request, so that
the client gets the bytes vLLM would have sent it directly.

vLLM 0.32 writes a whole response with Starlette's ``JSONResponse`` (``json.dumps`` with
``ensure_ascii=False``, compact separators) and each streamed chunk with pydantic's
``model_dump_json(exclude_unset=True)``. A field the client did not ask for is present as
``null`` either way (the handlers pass it explicitly), so stripping sets it back to
``null``, and the document is written again by the same serializer that wrote it; a chunk
with nothing to strip goes out as the engine's own bytes.

One thing more than values: for a chat stream, vLLM skips a chunk that carries no text
(a tool parser holding back its control tokens) unless log-probs or token ids were asked
for. When the proxy asked for both on the client's behalf, such a chunk (empty delta, no
finish reason) is dropped here, after its tokens were collected.
"""

from __future__ import annotations

import json
from typing import Any

import pydantic_core

from rtrl_serving.capture.rewrite import CHAT, Rewrite


def strip_response(doc: dict[str, Any], rw: Rewrite) -> bytes:
    """A whole (non-streamed) response without the added fields, as vLLM writes it."""
    if rw.added_token_ids and rw.endpoint == CHAT and "prompt_token_ids" in doc:
        doc["prompt_token_ids"] = None
    for choice in doc.get("choices") or []:
        _strip_choice(choice, rw)
    return json.dumps(
        doc, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")
    ).encode("utf-8")


def strip_chunk(chunk: dict[str, Any], rw: Rewrite) -> bytes | None:
    """A streamed chunk's JSON without the added fields, or None when the client would not
    have received the chunk at all."""
    if rw.added_token_ids and rw.endpoint == CHAT and "prompt_token_ids" in chunk:
        chunk["prompt_token_ids"] = None
    choices = chunk.get("choices") or []
    for choice in choices:
        _strip_choice(choice, rw)
    if (
        rw.endpoint == CHAT
        and rw.added_logprobs
        and rw.added_token_ids
        and len(choices) == 1
        and choices[0].get("delta") == {}
        and choices[0].get("finish_reason") is None
    ):
        return None
    return pydantic_core.to_json(chunk)


def _strip_choice(choice: dict[str, Any], rw: Rewrite) -> None:
    if rw.added_logprobs and "logprobs" in choice:
        choice["logprobs"] = None
    if rw.added_token_ids:
        if "token_ids" in choice:
            choice["token_ids"] = None
        if rw.endpoint != CHAT and "prompt_token_ids" in choice:
            choice["prompt_token_ids"] = None
