"""Raw HTTP for the capture tests: the exact bytes and status a client receives."""

from __future__ import annotations

import http.client
import json
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit


@dataclass(frozen=True)
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def ids(self) -> list[str]:
        return [i for i in self.headers.get("x-rtrl-interaction-id", "").split(",") if i]

    def chunks(self) -> list[dict[str, Any]]:
        """The JSON chunks of an SSE body."""
        out = []
        for event in self.body.split(b"\n\n"):
            if event.startswith(b"data: ") and event != b"data: [DONE]":
                out.append(json.loads(event[6:]))
        return out


def post(
    base: str, path: str, body: dict[str, Any] | bytes, headers: dict[str, str] | None = None
) -> Reply:
    parts = urlsplit(base)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=300)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    try:
        conn.request("POST", path, body=data,
                     headers={"Content-Type": "application/json", **(headers or {})})  # fmt: skip
        resp = conn.getresponse()
        payload = resp.read()
        return Reply(resp.status, {k.lower(): v for k, v in resp.getheaders()}, payload)
    finally:
        conn.close()


# id and created differ per request anyway (tool-call ids are "id" too)
_PER_REQUEST = re.compile(rb'"(id|created)":("[^"]*"|\d+)')


def normalise(body: bytes) -> bytes:
    return _PER_REQUEST.sub(rb'"\1":0', body)


def per_choice(body: bytes) -> dict[int, list[bytes]]:
    """A stream's events (normalised) by the choice they carry, in order; -1 for those with
    none (usage, [DONE]). The engine interleaves the chunks of several choices in whatever
    order its scheduler produced them, which no two runs share; each choice's own sequence
    is what must be byte-identical."""
    out: dict[int, list[bytes]] = {}
    for event in normalise(body).split(b"\n\n"):
        index = -1
        if event.startswith(b"data: {"):
            choices = json.loads(event[6:]).get("choices") or []
            if len(choices) == 1:
                index = int(choices[0]["index"])
        out.setdefault(index, []).append(event)
    return out


MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]

# A tool with a strict schema: the capture tests' requests offer it, and a call to it is
# judged valid or not against this schema.
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


# --- streams whose engine steps were merged ----------------------------------------------
# When vLLM's API server falls behind its engine it sends the tokens of several steps as one
# chunk (their texts joined, their token ids and log-probs lists joined), at random. Two runs
# of one seeded request then differ only in where their chunks were cut: a proxy that changes
# a byte differs in something else too, which these two helpers still see.

_TEXT = re.compile(rb'"(content|text|arguments)":"(?:[^"\\]|\\.)*"')
_LISTS = re.compile(rb'"(token_ids|logprobs)":(\[[^\]]*\]|\{.*?\]\}(?=,"finish_reason"))')
# the last step's tokens may ride in the finishing chunk, whose delta is otherwise empty
_LAST = re.compile(rb'"delta":\{"content":""\}(?=,"logprobs":(null|\[\]),"finish_reason":"\w+")')


def chunk_shape(event: bytes) -> bytes:
    """An event's bytes with its step's payload (the text, token ids, log-probs) blanked:
    what a chunk of one step and a chunk of several merged steps share, byte for byte."""
    blank = _LISTS.sub(rb'"\1":[]', _TEXT.sub(rb'"\1":""', normalise(event)))
    return _LAST.sub(rb'"delta":{}', blank)


def _one_step(choice: dict[str, Any]) -> bool:
    """Whether a chunk is one step's output that merging may join (text, content or a tool
    call's arguments), not a role, a new tool call or a usage chunk."""
    delta = choice.get("delta")
    if delta is None:
        return "text" in choice  # /v1/completions
    if set(delta) <= {"content"}:
        return True
    calls = delta.get("tool_calls") or []
    return set(delta) == {"tool_calls"} and len(calls) == 1 and set(calls[0]) == {
        "index", "function"} and set(calls[0]["function"]) == {"arguments"}  # fmt: skip


def _join(a: Any, b: Any) -> Any:
    if a is None or b is None:
        return b if a is None else a
    if isinstance(a, str) and isinstance(b, str):
        return a + b
    if isinstance(a, list) and isinstance(b, list):
        return a + b
    if isinstance(a, dict) and isinstance(b, dict):
        return {k: _join(a.get(k), b.get(k)) if k in a and k in b else b.get(k, a.get(k))
                for k in {**a, **b}}  # fmt: skip
    return b


def merged_steps(events: list[bytes]) -> list[Any]:
    """One choice's events (as :func:`per_choice` gives them), parsed, with every run of
    consecutive one-step chunks joined into one: texts and tool-call arguments concatenated,
    token ids and log-probs lists concatenated, the rest (finish_reason, ...) the last's."""
    out: list[Any] = []
    joinable = False
    for event in events:
        if not event.startswith(b"data: {"):
            out.append(event)
            joinable = False
            continue
        doc = json.loads(normalise(event)[6:])
        choice = doc["choices"][0] if len(doc.get("choices") or []) == 1 else None
        step = choice is not None and _one_step(choice)
        if step and joinable:
            previous = out[-1]["choices"][0]
            doc["choices"][0] = {
                key: _join(previous.get(key), choice.get(key)) if key != "finish_reason"
                else choice.get(key) for key in {**previous, **choice}
            }  # fmt: skip
            out[-1] = doc
        else:
            out.append(doc)
        joinable = step and choice.get("finish_reason") is None
    return out
