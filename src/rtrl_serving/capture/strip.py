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


def parse(raw: bytes) -> Any:
    """``raw`` parsed as JSON by pydantic-core's parser (twice as fast as ``json.loads`` on
    a chunk: it runs for every chunk of every stream), the same values; ``json.loads`` where
    it refuses (a lone surrogate escape); ValueError when neither can."""
    try:
        return pydantic_core.from_json(raw)
    except ValueError:
        return json.loads(raw)


def strip_response(doc: dict[str, Any], rw: Rewrite, raw: bytes) -> bytes:
    """A whole (non-streamed) response without the added fields, as vLLM writes it; ``raw``
    itself when there was nothing to take out."""
    changed = False
    if rw.added_token_ids and rw.endpoint == CHAT:
        changed = _set_null(doc, "prompt_token_ids")
    for choice in doc.get("choices") or []:
        changed = _strip_choice(choice, rw) or changed
    if not changed:
        return raw
    return json.dumps(
        doc, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")
    ).encode("utf-8")


def strip_chunk(chunk: dict[str, Any], rw: Rewrite, raw: bytes) -> bytes | None:
    """A streamed chunk's JSON without the added fields (``raw`` itself when there was
    nothing to take out), or None when the client would not have received it at all."""
    changed = False
    if rw.added_token_ids and rw.endpoint == CHAT:
        changed = _set_null(chunk, "prompt_token_ids")
    choices = chunk.get("choices") or []
    for choice in choices:
        changed = _strip_choice(choice, rw) or changed
    if (
        rw.endpoint == CHAT
        and rw.added_logprobs
        and rw.added_token_ids
        and len(choices) == 1
        and choices[0].get("delta") == {}
        and choices[0].get("finish_reason") is None
    ):
        return None
    return pydantic_core.to_json(chunk) if changed else raw


def _set_null(doc: dict[str, Any], key: str) -> bool:
    """Set ``doc[key]`` to None where it holds something; whether it did."""
    if doc.get(key) is None:
        return False
    doc[key] = None
    return True


def _strip_choice(choice: dict[str, Any], rw: Rewrite) -> bool:
    changed = False
    if rw.added_logprobs:
        changed = _set_null(choice, "logprobs")
    if rw.added_token_ids:
        changed = _set_null(choice, "token_ids") or changed
        if rw.endpoint != CHAT:
            changed = _set_null(choice, "prompt_token_ids") or changed
    return changed
