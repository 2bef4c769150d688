"""The ``behaviour`` eval suite: how the candidate behaves on held-out prompts.

A policy trained on implicit feedback can learn to game it (ask instead of edit, stop
calling tools, emit broken tool calls); these metrics catch that before users see it. Each
model generates one completion per held-out prompt (the same prompts, same decoding, same
seed for both), and per completion:

- ``behaviour.tool_call_rate``: it contains a tool call (reported; direction: higher);
- ``behaviour.invalid_tool_call_rate``: it contains a tool call that breaks the grammar
  below (lower is better);
- ``behaviour.tool_call_validity``: valid tool calls / tool calls over all completions
  (higher is better; undefined, so not judged, when neither model called a tool);
- ``behaviour.clarification_rate``: it asks instead of acting: no tool call, no code
  block, and its last non-empty line ends with ``?`` (lower is better);
- ``behaviour.edit_rate``: it proposes an edit: an ``edit_file`` tool call or a fenced
  code block (higher is better);
- ``behaviour.completion_tokens``: its length in tokens (lower is better: cost and
  latency; gate it with ``relative`` mode).

Tool-call grammar: a tool call is the text between ``<tool>`` and ``</tool>``; its body
must be a JSON object ``{"name": NAME, "arguments": {...}}`` with NAME one of
:data:`TOOLS` and ``arguments`` an object whose keys are strings. Anything else between
the tags, or a ``<tool>`` without its closing tag, is an invalid call.
"""

from __future__ import annotations

import json
import re

from rtrl_trainer.evaluate.gates import Metric

TOOLS = frozenset({"read_file", "edit_file", "run_command", "search", "list_files"})
_CALL = re.compile(r"<tool>(.*?)</tool>", re.DOTALL)


def tool_calls(text: str) -> list[tuple[str | None, bool]]:
    """(tool name or None, valid) of each call in ``text``, unclosed ones included."""
    calls: list[tuple[str | None, bool]] = []
    for match in _CALL.finditer(text):
        try:
            doc = json.loads(match.group(1))
        except json.JSONDecodeError:
            calls.append((None, False))
            continue
        ok = (
            isinstance(doc, dict)
            and set(doc) == {"name", "arguments"}
            and doc["name"] in TOOLS
            and isinstance(doc["arguments"], dict)
        )
        calls.append((doc.get("name") if isinstance(doc, dict) else None, ok))
    unclosed = text.count("<tool>") - len(calls)
    calls.extend((None, False) for _ in range(max(0, unclosed)))
    return calls


def classify(text: str) -> dict[str, bool]:
    calls = tool_calls(text)
    code = "```" in text
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    asks = not calls and not code and bool(lines) and lines[-1].endswith("?")
    return {
        "tool_call": bool(calls),
        "invalid_tool_call": any(not ok for _, ok in calls),
        "clarification": asks,
        "edit": code or any(name == "edit_file" and ok for name, ok in calls),
    }


def metrics(texts: list[str], lengths: list[int]) -> list[Metric]:
    flags = [classify(t) for t in texts]
    calls = [tool_calls(t) for t in texts]

    def rate(key: str) -> tuple[float, ...]:
        return tuple(float(f[key]) for f in flags)

    return [
        Metric("behaviour.tool_call_rate", rate("tool_call"), 1),
        Metric("behaviour.invalid_tool_call_rate", rate("invalid_tool_call"), -1),
        Metric(
            "behaviour.tool_call_validity",
            tuple(float(sum(ok for _, ok in c)) for c in calls),
            1,
            weights=tuple(float(len(c)) for c in calls),
        ),
        Metric("behaviour.clarification_rate", rate("clarification"), -1),
        Metric("behaviour.edit_rate", rate("edit"), 1),
        Metric("behaviour.completion_tokens", tuple(float(n) for n in lengths), -1),
    ]
