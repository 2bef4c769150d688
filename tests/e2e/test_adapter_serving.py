"""An adapter ``rtrl-job train`` published, served by the session's real vLLM without a
restart: loaded into the running engine (``POST /v1/load_lora_adapter``), sampled through
the official ``openai`` client, its log-probs the trainer's own.

The base is the engine's tiny model (tests/vllm_engine.py, which starts the engine with LoRA
on); the adapter is trained on it by the real train step, as tests/rtrl_trainer/train/
test_train_adapter.py trains one. In float32 every sampled token's log-prob under the
adapter agrees with PEFT's forward of base + adapter within 1e-4 (the importance weight of
a row the adapter served is within 1e-4 of 1), requests that name the base are untouched
by it, and unloading it leaves the engine as it was.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from rtrl.core.store import open_store
from tests.conftest import console_script
from tests.rtrl_trainer.train.test_train_adapter import LEARNING, SHAPE
from tests.rtrl_trainer.trainset import pattern_rows, write_trainset
from tests.vllm_engine import VllmEngine

FLOAT32_TOLERANCE = 1e-4


@dataclass(frozen=True)
class Adapter:
    name: str  # as loaded into the engine
    directory: Path  # the published adapter's files
    base: Any  # the engine's checkpoint in a plain forward (float32)


def _post(engine: VllmEngine, path: str, doc: dict[str, Any]) -> tuple[int, str]:
    request = urllib.request.Request(
        engine.root_url + path,
        data=json.dumps(doc).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.fixture(scope="module")
def adapter(vllm_engine: VllmEngine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Adapter]:
    """An adapter of the engine's model trained by ``rtrl-job train`` (rank 4, q and v),
    loaded into the running engine, and unloaded after."""
    from transformers import AutoModelForCausalLM

    tmp = tmp_path_factory.mktemp("adapter-serving")
    root = tmp / "bucket"
    store = open_store(root.as_uri() + "/")
    model_dir = vllm_engine.model_dir
    files = {p.relative_to(model_dir).as_posix(): p for p in model_dir.rglob("*") if p.is_file()}
    store.commit("models/served", files, {"kind": "checkpoint"})
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    write_trainset(store, "runs/c1/stage", [pattern_rows(base, 48)], tmp)
    done = subprocess.run(
        [console_script("rtrl-job"), "train", "--parent", (root / "models/served").as_uri() + "/",
         "--data", (root / "runs/c1/stage").as_uri() + "/",
         "--out", (root / "adapters/org-a").as_uri() + "/", *LEARNING, *SHAPE],
        env=dict(os.environ, RTRL_SCRATCH=str(tmp / "scratch")),
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    name = f"org-a-{uuid.uuid4().hex[:8]}"
    directory = root / "adapters/org-a"
    status, text = _post(
        vllm_engine, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(directory)}
    )
    assert status == 200, text
    yield Adapter(name, directory, base)
    status, text = _post(vllm_engine, "/v1/unload_lora_adapter", {"lora_name": name})
    assert status == 200, text


def _sample(
    engine: VllmEngine, model: str, prompt: list[int], seed: int
) -> tuple[list[int], list[float]]:
    answer = engine.client().completions.create(
        model=model,
        prompt=prompt,
        max_tokens=16,
        temperature=1.0,
        seed=seed,
        logprobs=0,
        extra_body={"return_token_ids": True},
    )
    choice = answer.choices[0]
    assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
    return list((choice.model_extra or {})["token_ids"]), list(choice.logprobs.token_logprobs)


def _forward(model: Any, prompt: list[int], tokens: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0]
    logprobs = logits[len(prompt) - 1 : -1].float().log_softmax(-1)
    return [float(logprobs[i, t]) for i, t in enumerate(tokens)]


def test_the_engine_serves_the_adapter_with_the_trainers_logprobs(
    vllm_engine: VllmEngine, adapter: Adapter
) -> None:
    import copy

    from peft import PeftModel

    listed = vllm_engine.client().models.list()
    assert adapter.name in {m.id for m in listed.data}
    adapted = PeftModel.from_pretrained(copy.deepcopy(adapter.base), adapter.directory).eval()
    generator = torch.Generator().manual_seed(5)
    worst, apart, count = 0.0, 0.0, 0
    for seed in range(6):
        prompt = [256, *torch.randint(32, 127, (10,), generator=generator).tolist()]
        tokens, served = _sample(vllm_engine, adapter.name, prompt, seed)
        trainer = _forward(adapted, prompt, tokens)
        plain = _forward(adapter.base, prompt, tokens)
        for t, e, b in zip(trainer, served, plain, strict=True):
            assert abs(math.exp(t - e) - 1) <= FLOAT32_TOLERANCE
            worst, apart = max(worst, abs(t - e)), max(apart, abs(b - e))
            count += 1
        # the same prompt and seed on the base: the base's own log-probs, no adapter in them
        base_tokens, base_served = _sample(vllm_engine, vllm_engine.served_model_name, prompt, seed)
        for t, e in zip(_forward(adapter.base, prompt, base_tokens), base_served, strict=True):
            assert abs(t - e) <= FLOAT32_TOLERANCE
    assert count >= 48
    assert apart > 100 * FLOAT32_TOLERANCE  # the adapter changes what is served
    print(f"max |trainer - engine| under the adapter over {count} tokens: {worst:.2e}")


def test_an_adapter_of_a_rank_above_the_engines_is_refused_and_nothing_changes(
    vllm_engine: VllmEngine, adapter: Adapter, tmp_path: Path
) -> None:
    """What an operator must see before routing traffic: the engine refuses an adapter it
    cannot serve (rank above --max-lora-rank) with an error, and keeps serving."""
    config = json.loads((adapter.directory / "adapter_config.json").read_text())
    too_big = tmp_path / "too-big"
    too_big.mkdir()
    (too_big / "adapter_config.json").write_text(json.dumps({**config, "r": 64}))
    (too_big / "adapter_model.safetensors").write_bytes(
        (adapter.directory / "adapter_model.safetensors").read_bytes()
    )
    status, text = _post(vllm_engine, "/v1/load_lora_adapter",
                         {"lora_name": "too-big", "lora_path": str(too_big)})  # fmt: skip
    assert status >= 400, text
    tokens, _ = _sample(vllm_engine, adapter.name, [256, 65, 66, 67], 0)
    assert tokens
