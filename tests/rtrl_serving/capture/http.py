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
