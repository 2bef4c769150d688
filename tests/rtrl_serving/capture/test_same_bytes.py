"""A client sees the status and the bytes vLLM itself would have sent it, errors included:
the same seeded request to the engine and through the proxy, compared byte for byte (only
``id`` and ``created``, which differ per request anyway, set aside; a stream's chunks per
choice, as vLLM interleaves choices and, under load, merges steps in its own order)."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.rtrl_serving.capture.http import (
    MESSAGES,
    WEATHER,
    chunk_shape,
    merged_steps,
    normalise,
    per_choice,
    post,
)
from tests.rtrl_serving.conftest import Capture, new_bucket, s3_env, start_capture
from tests.vllm_engine import VllmEngine

pytestmark = pytest.mark.timeout(1800)

CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
PROMPT = "def add(a, b):"

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"

CASES: dict[str, tuple[str, dict[str, Any] | bytes]] = {
    "completions": (COMPLETIONS, {"prompt": PROMPT, "max_tokens": 24, "seed": 11}),
    "completions, n=2": (COMPLETIONS, {"prompt": PROMPT, "max_tokens": 12, "seed": 3, "n": 2}),
    "completions, two prompts": (
        COMPLETIONS, {"prompt": [PROMPT, "x = "], "max_tokens": 10, "seed": 5}),
    "completions, token ids asked": (
        COMPLETIONS, {"prompt": [1, 2, 3], "max_tokens": 8, "seed": 1, "return_token_ids": True}),
    "completions, logprobs 2 asked": (
        COMPLETIONS, {"prompt": PROMPT, "max_tokens": 8, "seed": 2, "logprobs": 2}),
    "completions, echo": (
        COMPLETIONS, {"prompt": PROMPT, "max_tokens": 6, "seed": 2, "echo": True}),
    "chat": (CHAT, {"messages": MESSAGES, "max_tokens": 24, "seed": 7, "temperature": 0.7}),
    "chat, logprobs asked": (
        CHAT, {"messages": MESSAGES, "max_tokens": 12, "seed": 7, "logprobs": True,
               "top_logprobs": 2}),
    "chat, tools": (
        CHAT, {"messages": MESSAGES, "tools": [WEATHER], "tool_choice": "auto", "seed": 1,
               "max_tokens": 100, "structured_outputs": {"choice": [CALL]}}),
    "chat, n=2": (CHAT, {"messages": MESSAGES, "max_tokens": 10, "seed": 9, "n": 2}),
    # vLLM refuses these: the proxy must neither cure nor change the error
    "error: top_logprobs without logprobs": (
        CHAT, {"messages": MESSAGES, "max_tokens": 4, "top_logprobs": 2}),
    "error: temperature out of range": (
        COMPLETIONS, {"prompt": PROMPT, "max_tokens": 4, "temperature": 9}),
    "error: unknown model": (CHAT, {"model": "nope", "messages": MESSAGES, "max_tokens": 4}),
    "error: not JSON": (COMPLETIONS, b'{"prompt": "x", '),
}  # fmt: skip
STREAMABLE = [name for name, (_, body) in CASES.items()
              if isinstance(body, dict) and not name.startswith("error")]  # fmt: skip


@pytest.fixture(scope="module")
def capture(vllm_engine: VllmEngine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Capture]:
    moto_endpoint = vllm_engine.s3_endpoint  # the engine's S3: the model and the events
    bucket = new_bucket(moto_endpoint)
    spool: Path = tmp_path_factory.mktemp("bytes") / "spool"
    cap = start_capture(
        vllm_engine.root_url, f"s3://{bucket}/events/", spool, s3_env(moto_endpoint),
        model_uri=vllm_engine.model_uri,
    )  # fmt: skip
    yield cap
    assert cap.stop() == 0


def _compare(engine: VllmEngine, capture: Capture, path: str, body: dict[str, Any] | bytes) -> None:
    direct = post(engine.root_url, path, copy.deepcopy(body))
    proxied = post(capture.url, path, copy.deepcopy(body))
    assert proxied.status == direct.status, proxied.body[:500]
    assert proxied.headers["content-type"] == direct.headers["content-type"]
    assert normalise(proxied.body) == normalise(direct.body)
    assert proxied.ids, "no X-Rtrl-Interaction-Id"


# vLLM's chunks are not reproducible under load: when its API server falls behind the engine,
# the tokens of two steps go out in one chunk, at random; more often through the proxy, which
# asks for log-probs and token ids that slow the API server down for every chunk. A stream is
# compared up to this many times; one byte-identical pair shows the proxy changes nothing.
# If every try was cut differently (a loaded machine), the last pair must still be the same
# stream cut elsewhere: the same chunks once each run of one-step chunks is joined, and every
# chunk the proxy sent shaped byte for byte as one the engine sent directly
# (test_merged_steps.py shows what that still catches).
STREAM_TRIES = 4


def _compare_stream(engine: VllmEngine, capture: Capture, path: str, body: dict[str, Any]) -> None:
    shapes: set[bytes] = set()
    for _ in range(STREAM_TRIES):
        direct = post(engine.root_url, path, copy.deepcopy(body))
        proxied = post(capture.url, path, copy.deepcopy(body))
        assert proxied.status == direct.status == 200, proxied.body[:500]
        assert proxied.headers["content-type"] == direct.headers["content-type"]
        assert proxied.ids, "no X-Rtrl-Interaction-Id"
        ours, theirs = per_choice(proxied.body), per_choice(direct.body)
        if ours == theirs:
            return
        shapes |= {chunk_shape(e) for events in theirs.values() for e in events}
    assert {i: merged_steps(e) for i, e in ours.items()} == {
        i: merged_steps(e) for i, e in theirs.items()
    }
    assert {chunk_shape(e) for events in ours.values() for e in events} <= shapes


@pytest.mark.parametrize("case", list(CASES))
def test_a_whole_response_is_the_engines_bytes(
    vllm_engine: VllmEngine, capture: Capture, case: str
) -> None:
    path, body = CASES[case]
    _compare(vllm_engine, capture, path, body)


@pytest.mark.parametrize("case", STREAMABLE)
def test_a_stream_is_the_engines_bytes(
    vllm_engine: VllmEngine, capture: Capture, case: str
) -> None:
    path, body = CASES[case]
    assert isinstance(body, dict)
    _compare_stream(vllm_engine, capture, path, {**body, "stream": True})


def test_a_stream_with_usage_is_the_engines_bytes(
    vllm_engine: VllmEngine, capture: Capture
) -> None:
    body = {"messages": MESSAGES, "max_tokens": 16, "seed": 4, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    _compare_stream(vllm_engine, capture, CHAT, body)
