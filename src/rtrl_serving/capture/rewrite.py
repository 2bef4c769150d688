"""What the proxy asks the engine for beyond the client's request, and what it must therefore
take out of the response again.

The event needs the prompt's and the completion's token ids (``return_token_ids``) and the
log-probs of the sampled tokens (``logprobs``: ``true`` for chat, ``0`` for completions: the
sampled token's alone). The proxy adds either only where adding it cannot change anything
the client sees except the fields it then strips, as vLLM 0.32 behaves
(vllm/entrypoints/openai/{chat_completion,completion}/{protocol,serving}.py):

- never over a value the client gave (``logprobs: 3`` stays 3; ``true`` stays);
- never where vLLM would refuse the client's request for want of it: chat ``top_logprobs``
  or ``logprob_token_ids`` without ``logprobs`` is a 400 that the proxy's ``logprobs`` would
  turn into a 200;
- not for a completion with ``echo`` (``return_token_ids`` blanks the echoed prompt text in
  vLLM) nor with beam search (not sampling: no behaviour policy to record). Those requests
  pass unchanged and their events carry no tokens, with the reason counted.

The fields are appended to the client's JSON text (``..., "logprobs": true}``): a JSON
parser keeps the last of duplicate keys (Python's, which vLLM's FastAPI uses), so a client's
``null``/``false`` is overridden and every other byte of the request reaches the engine as
the client wrote it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

CHAT = "chat.completions"
COMPLETIONS = "completions"
ENDPOINTS = {"/v1/chat/completions": CHAT, "/v1/completions": COMPLETIONS}


@dataclass(frozen=True)
class Rewrite:
    """One request as forwarded: its body, what was added, what its events can hold."""

    endpoint: str
    body: bytes  # what the engine receives
    request: dict[str, Any] | None  # the client's JSON object (None when it is not one)
    added_logprobs: bool
    added_token_ids: bool
    # why this request's events carry no tokens (a reason code: not_json, echo, beam_search,
    # cannot_request), or None
    uncapturable: str | None
    choices: int  # completions the request asks for (ids to mint)
    # routed to an adapter: the response's model field as the engine writes it, and as the
    # client is given it back (what it asked for)
    model_sent: bytes | None = None
    model_asked: bytes | None = None

    @property
    def strips(self) -> bool:
        return self.added_logprobs or self.added_token_ids

    def restore_model(self, data: bytes) -> bytes:
        """``data`` (a response body or SSE event) with the adapter's name in its ``model``
        field replaced by the name the client asked for (vLLM writes compact JSON)."""
        if self.model_sent is None or self.model_asked is None:
            return data
        return data.replace(self.model_sent, self.model_asked)


def _is_unset(value: object) -> bool:
    return value is None or value is False


def _count(value: object, default: int = 1) -> int:
    """An integer request field as vLLM's validation would take it, else ``default``."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    return default


def _prompts(request: dict[str, Any]) -> int:
    """How many prompts a completions request holds (vLLM: a list of strings or of token
    id lists is a batch; a string or one token id list is one prompt)."""
    prompt = request.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        return len(prompt)
    return 1


def _append_fields(raw: bytes, fields: dict[str, Any]) -> bytes:
    """``raw`` (a JSON object's text) with ``fields`` appended before its closing brace."""
    text = raw.rstrip()
    assert text.endswith(b"}")
    head = text[:-1].rstrip()
    extra = ",".join(f"{json.dumps(k)}:{json.dumps(v)}" for k, v in fields.items()).encode()
    joiner = b"" if head.endswith(b"{") else b","
    return head + joiner + extra + b"}"


def _model_field(name: str) -> bytes:
    return b'"model":' + json.dumps(name, ensure_ascii=False).encode()


def rewrite(
    endpoint: str, raw: bytes, *, model: str | None = None, served: str | None = None
) -> Rewrite:
    """The request to forward for the client's ``raw`` body on ``endpoint``; with
    ``model``, sent to that adapter instead of what it named (or, naming nothing, the
    engine's ``served`` model), which the response is given back."""
    try:
        request = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        request = None
    if not isinstance(request, dict):
        return Rewrite(endpoint, raw, None, False, False, "not_json", 1)
    choices = max(1, _count(request.get("n"), 1))
    asked = request.get("model") if isinstance(request.get("model"), str) else served
    route: dict[str, Any] = {"model": model} if model is not None and asked is not None else {}
    sent = _model_field(model) if route and model is not None else None
    back = _model_field(asked) if route and asked is not None else None
    unchanged = _append_fields(raw, route) if route else raw
    if endpoint == COMPLETIONS:
        choices *= _prompts(request)
        if request.get("echo"):
            return Rewrite(endpoint, unchanged, request, False, False, "echo", choices, sent, back)
    if request.get("use_beam_search"):
        return Rewrite(
            endpoint, unchanged, request, False, False, "beam_search", choices, sent, back
        )

    add: dict[str, Any] = {}
    logprobs = request.get("logprobs")
    if endpoint == CHAT:
        top = request.get("top_logprobs")
        refused_without = (top is not None and top != 0) or request.get("logprob_token_ids")
        if _is_unset(logprobs) and not refused_without:
            add["logprobs"] = True
    elif logprobs is None and not request.get("logprob_token_ids"):
        add["logprobs"] = 0
    if _is_unset(request.get("return_token_ids")):
        add["return_token_ids"] = True
    uncapturable = None
    if "logprobs" not in add and not _asks_logprobs(endpoint, logprobs):
        uncapturable = "cannot_request"
    if "return_token_ids" not in add and request.get("return_token_ids") is not True:
        uncapturable = "cannot_request"
    add.update(route)
    body = _append_fields(raw, add) if add else raw
    return Rewrite(
        endpoint,
        body,
        request,
        added_logprobs="logprobs" in add,
        added_token_ids="return_token_ids" in add,
        uncapturable=uncapturable,
        choices=choices,
        model_sent=sent,
        model_asked=back,
    )


def _asks_logprobs(endpoint: str, logprobs: object) -> bool:
    if endpoint == CHAT:
        return logprobs is True
    return isinstance(logprobs, int) and not isinstance(logprobs, bool) and logprobs >= -1
