"""The session's real vLLM engine (tests/vllm_engine.py), through the official ``openai``
client: completions with token-id prompts, chat with tools (streaming and not), and the
engine's per-token log-probs against a plain Hugging Face forward of the same checkpoint.

What ``--logprobs-mode processed_logprobs`` returns in vLLM 0.32 (read in
``vllm/v1/sample/sampler.py`` and ``ops/topk_topp_sampler.py``, and checked below): the
log-probability of each token under the distribution it was sampled from, i.e.
``log_softmax(truncate(logits / T))`` in float32, where

- the logits first get the request's logits processors (``logit_bias``,
  ``allowed_token_ids``, bad words, min-tokens, repetition/frequency/presence penalties),
- then are divided by the temperature ``T``,
- then ``min_p`` masks, then ``top_k`` keeps the k largest (ties with the k-th kept), then
  ``top_p`` keeps the smallest set of largest tokens whose probability, renormalised after
  top-k, reaches ``top_p`` (at least one); every other token gets ``-inf``,
- and the log-softmax renormalises over what is left.

At temperature 0 (greedy; vLLM resets ``top_p``/``top_k``/``min_p`` of such a request) the
log-probs are ``log_softmax(logits)`` after the processors, with no temperature. The
default ``raw_logprobs`` is ``log_softmax(logits)`` before all of it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
import torch

from rtrl_localkube import tinymodel
from tests.vllm_engine import VllmEngine

FLOAT32_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def hf_model(vllm_engine: VllmEngine) -> Any:
    """The engine's checkpoint in a plain Hugging Face forward, float32: the trainer's view."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(vllm_engine.model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(vllm_engine: VllmEngine) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(vllm_engine.model_dir)


def next_token_logits(model: Any, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """The logits that predicted each completion token (float32, one row per token)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + completion])).logits[0]
    return logits[len(prompt) - 1 : -1].float()


def processed(logits: torch.Tensor, temperature: float, top_p: float, top_k: int) -> torch.Tensor:
    """The reference of what processed_logprobs returns (module docstring), row-wise."""
    if temperature == 0:
        return logits.log_softmax(-1)
    logits = logits / temperature
    if top_k > 0:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if top_p < 1:
        ascending, index = logits.sort(dim=-1)
        cumulative = ascending.softmax(-1).cumsum(-1)
        drop = cumulative <= 1 - top_p
        drop[:, -1] = False
        logits = logits.scatter(-1, index, ascending.masked_fill(drop, -math.inf))
    return logits.log_softmax(-1)


def gather(logprobs: torch.Tensor, tokens: list[int]) -> list[float]:
    return [float(logprobs[i, t]) for i, t in enumerate(tokens)]


def byte_prompts(count: int, length: int, seed: int) -> Iterator[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(count):
        yield [256, *torch.randint(32, 127, (length,), generator=generator).tolist()]


# --- completions -------------------------------------------------------------------------------


def test_completions_with_token_id_prompts_return_ids_and_logprobs(
    vllm_engine: VllmEngine,
) -> None:
    client = vllm_engine.client()
    prompt = [256, *b"def add(a, b):"]
    answer = client.completions.create(
        model=vllm_engine.served_model_name,
        prompt=prompt,
        max_tokens=12,
        temperature=1.0,
        seed=7,
        logprobs=2,
        extra_body={"return_token_ids": True},
    )
    assert answer.model == vllm_engine.served_model_name
    choice = answer.choices[0]
    extra = choice.model_extra or {}
    assert extra["prompt_token_ids"] == prompt
    tokens = extra["token_ids"]
    assert len(tokens) == 12 and choice.finish_reason == "length"
    assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
    assert len(choice.logprobs.token_logprobs) == len(tokens)
    assert all(lp is not None and lp <= 0 for lp in choice.logprobs.token_logprobs)
    # the top alternatives come with the sampled token's own log-prob in them
    assert choice.logprobs.top_logprobs is not None
    assert all(len(top) >= 2 for top in choice.logprobs.top_logprobs)


def test_a_fixed_seed_samples_the_same_tokens(vllm_engine: VllmEngine) -> None:
    client = vllm_engine.client()

    def sample() -> list[int]:
        answer = client.completions.create(
            model=vllm_engine.served_model_name,
            prompt=[256, *b"x = "],
            max_tokens=8,
            temperature=1.0,
            seed=123,
            extra_body={"return_token_ids": True},
        )
        return list((answer.choices[0].model_extra or {})["token_ids"])

    assert sample() == sample()


# --- chat with tools -----------------------------------------------------------------------------


def chat(vllm_engine: VllmEngine, case: tinymodel.Case, *, stream: bool) -> dict[str, Any]:
    """One chat request at temperature 0, streamed or not, reassembled into
    ``{content, tool_calls: [(name, arguments)], finish_reason, token_ids, logprobs}``."""
    client = vllm_engine.client()
    request: dict[str, Any] = {
        "model": vllm_engine.served_model_name,
        "messages": list(case.messages),
        "temperature": 0,
        "max_tokens": 120,
        "logprobs": True,
        "extra_body": {"return_token_ids": True},
    }
    if case.tools:
        request["tools"] = tinymodel.TOOLS
    if not stream:
        answer = client.chat.completions.create(**request)
        choice = answer.choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        assert choice.logprobs is not None and choice.logprobs.content is not None
        return {
            "content": choice.message.content,
            "tool_calls": calls,
            "finish_reason": choice.finish_reason,
            "token_ids": (choice.model_extra or {})["token_ids"],
            "logprobs": [t.logprob for t in choice.logprobs.content],
            "prompt_token_ids": (answer.model_extra or {})["prompt_token_ids"],
        }
    content, finish, token_ids, logprobs = "", None, [], []
    prompt_ids = None
    calls: dict[int, list[str]] = {}
    for chunk in client.chat.completions.create(**request, stream=True):
        prompt_ids = prompt_ids or (chunk.model_extra or {}).get("prompt_token_ids")
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for call in delta.tool_calls or []:
                name, args = calls.setdefault(call.index, ["", ""])
                function = call.function
                calls[call.index] = [
                    name + ((function.name or "") if function else ""),
                    args + ((function.arguments or "") if function else ""),
                ]
            token_ids += (choice.model_extra or {}).get("token_ids") or []
            if choice.logprobs is not None and choice.logprobs.content:
                logprobs += [t.logprob for t in choice.logprobs.content]
            finish = choice.finish_reason or finish
    return {
        "content": content or None,
        "tool_calls": [tuple(calls[i]) for i in sorted(calls)],
        "finish_reason": finish,
        "token_ids": token_ids,
        "logprobs": logprobs,
        "prompt_token_ids": prompt_ids,
    }


SCHEMA = tinymodel.RUN_TESTS_TOOL["function"]["parameters"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_plain_text(vllm_engine: VllmEngine, tokenizer: Any, stream: bool) -> None:
    case = tinymodel.CASE["text"]
    got = chat(vllm_engine, case, stream=stream)
    assert got["content"] == case.answer
    assert got["tool_calls"] == [] and got["finish_reason"] == "stop"
    # the prompt is the chat template's, token for token
    assert got["prompt_token_ids"] == tinymodel.prompt_ids(tokenizer, case)
    assert got["token_ids"] == tinymodel.answer_ids(tokenizer, case)
    assert len(got["logprobs"]) == len(got["token_ids"])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_valid_tool_call(vllm_engine: VllmEngine, stream: bool) -> None:
    got = chat(vllm_engine, tinymodel.CASE["tool_call"], stream=stream)
    assert got["finish_reason"] == "tool_calls"
    assert not got["content"]
    [(name, arguments)] = got["tool_calls"]
    assert name == "run_tests"
    assert json.loads(arguments) == {"path": "tests/test_math.py"}
    jsonschema.validate(json.loads(arguments), SCHEMA)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_tool_call_that_violates_the_schema(vllm_engine: VllmEngine, stream: bool) -> None:
    got = chat(vllm_engine, tinymodel.CASE["tool_call_invalid_arguments"], stream=stream)
    [(name, arguments)] = got["tool_calls"]
    assert name == "run_tests" and json.loads(arguments) == {"path": 7}
    # vLLM passes it on as a tool call: only a check against the request's schema sees it
    with pytest.raises(jsonschema.ValidationError, match="is not of type 'string'"):
        jsonschema.validate(json.loads(arguments), SCHEMA)


def test_chat_malformed_tool_call_is_text_when_whole(vllm_engine: VllmEngine) -> None:
    case = tinymodel.CASE["tool_call_malformed"]
    got = chat(vllm_engine, case, stream=False)
    # the hermes parser cannot read a call: the client gets the raw text, no tool call
    assert got["tool_calls"] == [] and got["finish_reason"] == "stop"
    assert got["content"] == case.answer


def test_chat_malformed_tool_call_when_streamed(vllm_engine: VllmEngine) -> None:
    """Streamed, the same completion reaches the client as a tool call whose arguments are
    not JSON: the parser sends the call's name and argument text as they arrive. A capture
    that judges tool calls must judge the arguments' text, not trust that a call parses."""
    case = tinymodel.CASE["tool_call_malformed"]
    got = chat(vllm_engine, case, stream=True)
    [(name, arguments)] = got["tool_calls"]
    assert name == "run_tests"
    with pytest.raises(json.JSONDecodeError):
        json.loads(arguments)


# --- log-probs -----------------------------------------------------------------------------------


def sample(
    vllm_engine: VllmEngine,
    prompt: list[int],
    *,
    temperature: float,
    top_p: float = 1.0,
    top_k: int = -1,
    max_tokens: int = 24,
    seed: int = 0,
) -> tuple[list[int], list[float]]:
    answer = vllm_engine.client().completions.create(
        model=vllm_engine.served_model_name,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        logprobs=0,
        extra_body={"return_token_ids": True, "top_k": top_k},
    )
    choice = answer.choices[0]
    assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
    tokens = list((choice.model_extra or {})["token_ids"])
    return tokens, [float(lp) for lp in choice.logprobs.token_logprobs]


def test_float32_logprobs_agree_with_the_trainers_forward(
    vllm_engine: VllmEngine, hf_model: Any, tokenizer: Any
) -> None:
    """At temperature 1, float32: every sampled token's log-prob within 1e-4 of the plain
    forward's, so the importance weight exp(trainer - engine) is within 1e-4 of 1."""
    assert vllm_engine.dtype == "float32"
    prompts = [tinymodel.prompt_ids(tokenizer, case) for case in tinymodel.CASES]
    prompts += list(byte_prompts(4, 12, seed=1))
    worst, count = 0.0, 0
    for i, prompt in enumerate(prompts):
        tokens, engine = sample(vllm_engine, prompt, temperature=1.0, seed=i)
        trainer = gather(next_token_logits(hf_model, prompt, tokens).log_softmax(-1), tokens)
        for t, e in zip(trainer, engine, strict=True):
            assert abs(math.exp(t - e) - 1) <= FLOAT32_TOLERANCE
            worst = max(worst, abs(t - e))
            count += 1
    assert count >= 100
    print(f"max |trainer - engine| over {count} tokens: {worst:.2e}")


SAMPLING = [
    pytest.param(0.7, 1.0, -1, id="temperature"),
    pytest.param(1.0, 0.9, -1, id="top_p"),
    pytest.param(1.0, 1.0, 5, id="top_k"),
    pytest.param(0.5, 0.8, 10, id="all"),
]


@pytest.mark.parametrize(("temperature", "top_p", "top_k"), SAMPLING)
def test_processed_logprobs_are_the_sampled_distribution(
    vllm_engine: VllmEngine, hf_model: Any, temperature: float, top_p: float, top_k: int
) -> None:
    """The engine's log-probs are log_softmax(truncate(logits / T)) (module docstring), and
    neither the raw ones nor temperature alone without the truncation's renormalisation."""
    assert vllm_engine.logprobs_mode == "processed_logprobs"
    naive_gap = 0.0
    for seed, prompt in enumerate(byte_prompts(4, 10, seed=2)):
        tokens, engine = sample(
            vllm_engine, prompt, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed
        )
        logits = next_token_logits(hf_model, prompt, tokens)
        expected = gather(processed(logits, temperature, top_p, top_k), tokens)
        naive = gather((logits / temperature).log_softmax(-1), tokens)
        for e, x, n in zip(engine, expected, naive, strict=True):
            assert abs(e - x) <= FLOAT32_TOLERANCE
            naive_gap = max(naive_gap, abs(e - n))
    # the rule is not vacuous here: ignoring the truncation (or T) would be off by far more
    assert naive_gap > 100 * FLOAT32_TOLERANCE or (top_p == 1.0 and top_k < 0)


def test_greedy_logprobs_ignore_temperature_and_truncation(
    vllm_engine: VllmEngine, hf_model: Any
) -> None:
    """Temperature 0: log_softmax of the logits themselves, whatever top_k says."""
    prompt = next(byte_prompts(1, 10, seed=3))
    tokens, engine = sample(vllm_engine, prompt, temperature=0.0, top_k=3)
    logits = next_token_logits(hf_model, prompt, tokens)
    assert tokens == logits.argmax(-1).tolist()
    expected = gather(logits.log_softmax(-1), tokens)
    assert max(abs(e - x) for e, x in zip(engine, expected, strict=True)) <= FLOAT32_TOLERANCE
    # with top_k=3 applied, each log-prob would be larger (renormalised over 3 tokens)
    truncated = gather(processed(logits, 1.0, 1.0, 3), tokens)
    assert max(t - e for t, e in zip(truncated, engine, strict=True)) > 100 * FLOAT32_TOLERANCE
