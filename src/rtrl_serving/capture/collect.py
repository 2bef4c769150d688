"""What the engine returned, gathered per choice: token ids, the sampled tokens' log-probs,
the finish reason, the content and the tool calls, from a whole response or from the chunks
of a stream (vLLM 0.32's shapes, chat and completions).

Where token ids or log-probs are missing or do not line up (a reasoning parser that hides
them, an engine that ignores ``return_token_ids``), the choice's tokens are marked missing
with a reason code: its event then carries no tokens rather than wrong ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rtrl_serving.capture.rewrite import CHAT
from rtrl_serving.capture.toolcheck import ToolCall

# Why a choice's event carries no tokens (the label of rtrl_capture_uncaptured_total).
NO_PROMPT_IDS = "no_prompt_ids"  # the engine returned no prompt token ids
NO_TOKEN_IDS = "no_token_ids"  # ... no completion token ids (a parser hiding them)
NO_LOGPROBS = "no_logprobs"  # ... no log-probs
MISALIGNED = "misaligned"  # log-probs and token ids of different lengths


@dataclass
class _PartialCall:
    name: str | None = None
    arguments: list[str] = field(default_factory=list)


@dataclass
class ChoiceCapture:
    index: int
    prompt_ids: list[int] | None = None
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    content: list[str] = field(default_factory=list)
    calls: dict[int, _PartialCall] = field(default_factory=dict)
    missing: str | None = None  # why the tokens cannot be trusted (a reason code)

    def tool_calls(self) -> list[ToolCall]:
        return [
            ToolCall(call.name, "".join(call.arguments)) for _, call in sorted(self.calls.items())
        ]

    def text(self) -> str:
        return "".join(self.content)

    def finish(self) -> None:
        """Check that ids and log-probs line up, once the choice is complete."""
        if self.missing is None and self.prompt_ids is None:
            self.missing = NO_PROMPT_IDS
        if self.missing is None and len(self.logprobs) != len(self.completion_ids):
            self.missing = MISALIGNED


class Collector:
    """Per-choice captures of one response (``endpoint`` is ``CHAT`` or ``COMPLETIONS``)."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.choices: dict[int, ChoiceCapture] = {}
        self._chat_prompt: list[int] | None = None
        self.error: dict[str, Any] | None = None  # an error object the engine streamed

    def _choice(self, index: object) -> ChoiceCapture:
        key = index if isinstance(index, int) else len(self.choices)
        if key not in self.choices:
            self.choices[key] = ChoiceCapture(key, prompt_ids=self._chat_prompt)
        return self.choices[key]

    # --- whole responses -----------------------------------------------------------------

    def add_response(self, doc: dict[str, Any]) -> None:
        if self.endpoint == CHAT:
            self._chat_prompt = _ids(doc.get("prompt_token_ids"))
        for raw in doc.get("choices") or []:
            choice = self._choice(raw.get("index"))
            self._tokens(choice, raw)
            choice.finish_reason = raw.get("finish_reason")
            if self.endpoint == CHAT:
                message = raw.get("message") or {}
                if isinstance(message.get("content"), str):
                    choice.content.append(message["content"])
                for position, call in enumerate(message.get("tool_calls") or []):
                    function = call.get("function") or {}
                    partial = choice.calls.setdefault(position, _PartialCall())
                    partial.name = function.get("name")
                    partial.arguments = [str(function.get("arguments") or "")]
            elif isinstance(raw.get("text"), str):
                choice.content.append(raw["text"])

    # --- streams -------------------------------------------------------------------------

    def add_chunk(self, chunk: dict[str, Any]) -> None:
        if isinstance(chunk.get("error"), dict):
            self.error = chunk["error"]
            return
        if self.endpoint == CHAT and "prompt_token_ids" in chunk:
            self._chat_prompt = _ids(chunk.get("prompt_token_ids"))
            for choice in self.choices.values():
                choice.prompt_ids = self._chat_prompt
        for raw in chunk.get("choices") or []:
            choice = self._choice(raw.get("index"))
            if self.endpoint == CHAT:
                delta = raw.get("delta") or {}
                has_tokens = "token_ids" in raw
                if isinstance(delta.get("content"), str):
                    choice.content.append(delta["content"])
                for call in delta.get("tool_calls") or []:
                    partial = choice.calls.setdefault(int(call.get("index", 0)), _PartialCall())
                    function = call.get("function") or {}
                    if function.get("name"):
                        partial.name = function["name"]
                    if function.get("arguments"):
                        partial.arguments.append(str(function["arguments"]))
                # The role chunk and an echo chunk carry no token ids (the key is unset);
                # every generated chunk has the key, null where the engine hides them.
                if has_tokens:
                    self._tokens(choice, raw)
            else:
                if "prompt_token_ids" in raw and raw["prompt_token_ids"] is not None:
                    choice.prompt_ids = _ids(raw["prompt_token_ids"])
                if isinstance(raw.get("text"), str):
                    choice.content.append(raw["text"])
                self._tokens(choice, raw)
            if raw.get("finish_reason") is not None:
                choice.finish_reason = raw["finish_reason"]

    # --- both ----------------------------------------------------------------------------

    def _tokens(self, choice: ChoiceCapture, raw: dict[str, Any]) -> None:
        if self.endpoint != CHAT and "prompt_token_ids" in raw and raw["prompt_token_ids"]:
            choice.prompt_ids = _ids(raw["prompt_token_ids"])
        ids = _ids(raw.get("token_ids"))
        if ids is None:
            choice.missing = choice.missing or NO_TOKEN_IDS
            return
        choice.completion_ids.extend(ids)
        logprobs = raw.get("logprobs")
        values = _logprobs(self.endpoint, logprobs)
        if values is None:
            choice.missing = choice.missing or NO_LOGPROBS
            return
        choice.logprobs.extend(values)

    def finish(self) -> list[ChoiceCapture]:
        """The choices in index order, checked."""
        for choice in self.choices.values():
            choice.finish()
        return [self.choices[k] for k in sorted(self.choices)]


def _ids(value: object) -> list[int] | None:
    if isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        return value
    return None


def _logprobs(endpoint: str, logprobs: object) -> list[float] | None:
    if not isinstance(logprobs, dict):
        return None
    values: list[object]
    if endpoint == CHAT:
        content = logprobs.get("content")
        if content is None:
            return []  # a chunk with no tokens (the role chunk)
        if not isinstance(content, list):
            return None
        values = [entry.get("logprob") if isinstance(entry, dict) else None for entry in content]
    else:
        found = logprobs.get("token_logprobs")
        if not isinstance(found, list):
            return None
        values = found
    floats = [float(v) for v in values if isinstance(v, int | float) and not isinstance(v, bool)]
    return floats if len(floats) == len(values) else None
