"""Tool calls checked against the request's tools: the seed's first reward hack is an invalid
tool call, so every one must reach the reward as a negative and none may be dropped.

A call is invalid when its function is not among the request's ``tools``, when its
arguments are not JSON, or when they do not validate against the function's JSON schema
(``parameters``, checked with the jsonschema library under the schema's own draft). Text in
a reply's content that starts a tool call (``<tool_call>`` and the like: the engine's parser
could not parse it, so the client got text instead of a call) counts as one invalid call per
marker. A request whose own schema is broken does not make the model's call invalid: that
call counts as valid and the schema error is logged once per request.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jsonschema
import jsonschema.exceptions
import jsonschema.validators

log = logging.getLogger(__name__)

MAX_REASON = 300


@dataclass(frozen=True)
class ToolCall:
    name: str | None
    arguments: str | None


@dataclass
class ToolVerdict:
    calls: int = 0
    invalid: int = 0
    errors: list[str] = field(default_factory=list)

    def fail(self, reason: str) -> None:
        self.invalid += 1
        self.errors.append(reason[:MAX_REASON])


def request_tools(request: dict[str, Any] | None) -> dict[str, Any] | None:
    """Function name -> its parameters schema (``True``: any arguments), from a chat request's
    ``tools``; None when the request declares none."""
    tools = (request or {}).get("tools")
    if not isinstance(tools, list):
        return None
    found: dict[str, Any] = {}
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            parameters = function.get("parameters")
            found[function["name"]] = parameters if isinstance(parameters, dict) else True
    return found


def check_tool_calls(
    calls: Sequence[ToolCall],
    content: str | None,
    tools: dict[str, Any] | None,
    markers: Iterable[str],
) -> ToolVerdict:
    """The verdict on one reply's parsed ``calls`` and its ``content``."""
    verdict = ToolVerdict()
    for position, call in enumerate(calls):
        verdict.calls += 1
        label = f"tool call {position} ({call.name!r})"
        if tools is None or call.name not in tools:
            known = ", ".join(sorted(tools or {})) or "none"
            verdict.fail(f"{label}: no such function in the request's tools ({known})")
            continue
        try:
            arguments = json.loads(call.arguments or "")
        except ValueError as exc:
            verdict.fail(f"{label}: arguments are not JSON ({exc})")
            continue
        schema = tools[call.name]
        if schema is True:
            continue
        problem = _schema_problem(schema, arguments)
        if problem is not None:
            verdict.fail(f"{label}: arguments do not match its schema: {problem}")
    text = content or ""
    for marker in markers:
        for _ in range(text.count(marker)):
            verdict.calls += 1
            verdict.fail(f"unparsed tool call: {marker!r} in the reply's content")
    return verdict


@functools.lru_cache(maxsize=256)
def _validator(schema_text: str) -> Any:
    """A validator of the schema (checked once: agents send the same tools every request),
    or None when the schema itself is not valid JSON Schema."""
    schema = json.loads(schema_text)
    try:
        cls = jsonschema.validators.validator_for(schema)
        cls.check_schema(schema)
    except jsonschema.exceptions.SchemaError as exc:
        log.warning("a request's tool schema is not valid JSON Schema: %s", exc.message[:200])
        return None
    return cls(schema)


def _schema_problem(schema: dict[str, Any], instance: object) -> str | None:
    validator = _validator(json.dumps(schema, sort_keys=True))
    if validator is None:
        return None
    error = jsonschema.exceptions.best_match(validator.iter_errors(instance))
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path)
    return f"{error.message}" + (f" at {where}" if where else "")
