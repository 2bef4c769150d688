"""Behaviour log-probs that are right, end to end, with a real vLLM.

A real engine (float32, ``--logprobs-mode processed_logprobs``) samples completions at
temperature 0.7, some with top-p and top-k too; they become shards with their sampling
columns, the real stage step stages them (its fidelity gate recomputing them with the
serving checkpoint), and the real train step trains one step in float32. The importance
weights ``exp(logp_old - logp_logged)`` of the batch sit within 1e-4 of 1 with the
trainer's log-probs computed under each row's distribution; computed the old way (logits
at temperature 1, the full vocabulary) they are visibly off.

The engine is the session's (``vllm_engine``, tests/vllm_engine.py) when that fixture
exists; otherwise this module starts one of its own from ``.venv-vllm`` (or the Python
that ``RTRL_VLLM_PYTHON`` names) on a tiny GPT-2 whose distributions are far from uniform.
Without either the tests are skipped, and under ``CI=true`` they fail.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch

from rtrl.core.api.rlcycle import FidelitySpec
from rtrl.core.shards import write_shards
from rtrl.core.store import open_store
from rtrl_trainer.cli import main
from rtrl_trainer.train.batches import collate
from rtrl_trainer.train.examples import read_rank
from rtrl_trainer.train.forward import token_logprobs
from tests.conftest import REPO, console_script
from tests.rtrl_trainer.helpers import NOW_ISO, T0, rows

CPU = torch.device("cpu")
ROWS = 24
MAX_TOKENS = 16
# Half the rows at temperature 0.7 alone, half also truncated: (temperature, top_p, top_k)
SETTINGS = [(0.7, 1.0, -1), (0.7, 0.9, 40)]
ENGINE_START_SECONDS = 900


@dataclass(frozen=True)
class Served:
    """An engine to sample from, and the checkpoint it serves (a local directory)."""

    base_url: str
    model: str
    model_dir: Path


def _vllm_python() -> str | None:
    named = os.environ.get("RTRL_VLLM_PYTHON")
    candidate = Path(named) if named else REPO / ".venv-vllm" / "bin" / "python"
    return os.fspath(candidate) if candidate.exists() else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _peaked_gpt2(directory: Path) -> None:
    """A tiny GPT-2 with large weights (entropy ~3 nats of 5.6): temperature matters."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=260, n_positions=256,
                        bos_token_id=1, eos_token_id=2, initializer_range=0.3)  # fmt: skip
    GPT2LMHeadModel(config).eval().save_pretrained(directory)
    for path in directory.iterdir():
        path.chmod(0o644)


@pytest.fixture(scope="module")
def served(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Served]:
    try:
        engine = request.getfixturevalue("vllm_engine")
    except pytest.FixtureLookupError:
        engine = None
    if engine is not None:
        assert (engine.dtype, engine.logprobs_mode) == ("float32", "processed_logprobs")
        yield Served(engine.base_url, engine.served_model_name, engine.model_dir)
        return
    python = _vllm_python()
    if python is None:
        message = "no vLLM environment (.venv-vllm, or RTRL_VLLM_PYTHON)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    root = tmp_path_factory.mktemp("vllm-own")
    model_dir = root / "model"
    _peaked_gpt2(model_dir)
    port = _free_port()
    log = (root / "engine.log").open("wb")
    process = subprocess.Popen(
        [python, "-m", "vllm.entrypoints.openai.api_server", "--model", os.fspath(model_dir),
         "--served-model-name", "tiny", "--dtype", "float32", "--logprobs-mode",
         "processed_logprobs", "--enforce-eager", "--max-model-len", "256",
         "--host", "127.0.0.1", "--port", str(port)],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    try:
        deadline = time.monotonic() + ENGINE_START_SECONDS
        while True:
            if process.poll() is not None:
                pytest.fail(f"vLLM exited with {process.returncode}: see {root / 'engine.log'}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"vLLM did not start in {ENGINE_START_SECONDS}s")
                time.sleep(2)
        yield Served(f"http://127.0.0.1:{port}/v1", "tiny", model_dir)
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        log.close()


def _complete(
    served: Served, prompt: list[int], seed: int, setting: tuple[float, float, int]
) -> dict[str, Any]:
    temperature, top_p, top_k = setting
    body = {
        "model": served.model, "prompt": prompt, "max_tokens": MAX_TOKENS,
        "temperature": temperature, "top_p": top_p, "top_k": top_k, "seed": seed,
        "logprobs": 0, "return_token_ids": True, "ignore_eos": True,
    }  # fmt: skip
    request = urllib.request.Request(
        f"{served.base_url}/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        choice = json.load(response)["choices"][0]
    return {
        "completion_ids": choice["token_ids"],
        "completion_logprobs": choice["logprobs"]["token_logprobs"],
    }


@pytest.fixture(scope="module")
def staged(served: Served, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Rows sampled by the engine, as shards with their sampling columns, the serving
    checkpoint committed beside them, and the stage's result."""
    root = tmp_path_factory.mktemp("served")
    store = open_store(root.as_uri() + "/")
    files = {p.name: p for p in served.model_dir.iterdir() if p.is_file()}
    store.commit("models/ckpt-1", files, {"kind": "checkpoint"})
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(32, 127, int(rng.integers(3, 12)))) for _ in range(ROWS)]
    samples = [
        _complete(served, [int(t) for t in p], seed=i, setting=SETTINGS[i % 2])
        for i, p in enumerate(prompts)
    ]
    table = rows(
        ROWS,
        prompt_ids=[[int(t) for t in p] for p in prompts],
        completion_ids=[s["completion_ids"] for s in samples],
        completion_logprobs=[s["completion_logprobs"] for s in samples],
        completion_mask=[[True] * len(s["completion_ids"]) for s in samples],
        created_at=[T0 + timedelta(minutes=i) for i in range(ROWS)],
    )
    columns = {
        "temperature": ([SETTINGS[i % 2][0] for i in range(ROWS)], pa.float32()),
        "top_p": ([SETTINGS[i % 2][1] for i in range(ROWS)], pa.float32()),
        "top_k": ([SETTINGS[i % 2][2] for i in range(ROWS)], pa.int32()),
        "logprobs_mode": (["processed_logprobs"] * ROWS, pa.string()),
        "serving_dtype": (["float32"] * ROWS, pa.string()),
    }
    for name, (values, kind) in columns.items():
        table = table.append_column(name, pa.array(values, kind))
    write_shards(table, root / "interactions")
    out = root / "stage"
    code = main([
        "stage", "--shards", (root / "interactions").as_uri() + "/", "--checkpoint", "ckpt-1",
        "--out", out.as_uri() + "/", "--now", NOW_ISO, "--min-interactions", "1",
        "--heldout-fraction", "0", "--parent", (root / "models" / "ckpt-1").as_uri() + "/",
    ])  # fmt: skip
    doc = json.loads((out / "stage.json").read_text())
    assert code == 0, doc
    return {"root": root, "out": out, "doc": doc, "model_dir": served.model_dir}


def test_the_fidelity_gate_finds_a_float32_engine_faithful(staged: dict[str, Any]) -> None:
    doc = staged["doc"]
    assert doc["interactions_used"] == ROWS and doc["refused"] == {}
    gate = doc["fidelity"]
    assert gate["checked"] and gate["partitions_quarantined"] == 0
    assert gate["overall"]["rows"] == FidelitySpec().sample_rows  # one partition
    assert gate["overall"]["mean_abs_delta"] < 1e-4
    assert gate["overall"]["unsupported"] == 0
    assert gate["overall"]["serving_dtype"] == {"float32": FidelitySpec().sample_rows}


def _weights(staged: dict[str, Any], *, old_way: bool) -> np.ndarray:
    """Every staged token's first-step importance weight exp(logp_old - logp_logged), the
    trainer's code computing logp_old (the old way: at temperature 1, untruncated)."""
    from transformers import AutoModelForCausalLM

    name = "train/rank-00000-of-00001.parquet"
    data = read_rank(
        [(name, staged["out"] / name)], rank=0, world_size=1, one_per_rank=True,
        vocab_size=10**6, max_sequence_length=256,
    )  # fmt: skip
    assert data.skipped.rows == 0 and len(data.examples) == ROWS
    model = AutoModelForCausalLM.from_pretrained(staged["model_dir"], dtype=torch.float32).eval()
    mb = collate(data.examples, list(range(ROWS)), device=CPU)
    assert mb.sampling is not None
    if old_way:
        mb.sampling = None
    with torch.no_grad():
        old = token_logprobs(model, mb, True)
    log_w = (old - mb.logp_serve)[mb.mask]
    weights: np.ndarray = torch.exp(log_w).numpy()
    return weights


def test_importance_weights_are_one_under_the_sampled_distribution(
    staged: dict[str, Any],
) -> None:
    right = _weights(staged, old_way=False)
    assert right.size == ROWS * MAX_TOKENS
    assert np.abs(right - 1).max() < 1e-4
    # The old computation (temperature 1, no truncation) weighs against the wrong policy.
    wrong = _weights(staged, old_way=True)
    assert np.abs(wrong - 1).max() > 0.1
    assert np.abs(np.log(wrong)).mean() > 0.02


def test_one_training_step_in_float32_sees_weights_of_one(staged: dict[str, Any]) -> None:
    root = staged["root"]
    out = (root / "models" / "ckpt-2").as_uri() + "/"
    trained = subprocess.run(
        [console_script("rtrl-job"), "train", "--parent",
         (root / "models" / "ckpt-1").as_uri() + "/", "--data", staged["out"].as_uri() + "/",
         "--out", out, "--precision", "fp32", "--batch-tokens", "100000",
         "--micro-batch-size", "8", "--max-steps", "1"],
        capture_output=True, text=True, cwd=REPO, timeout=600,
    )  # fmt: skip
    assert trained.returncode == 0, trained.stderr[-3000:]
    (step,) = json.loads(open_store(out).get_bytes("train.json"))["history"]
    assert step["tokens"] == ROWS * MAX_TOKENS
    assert step["mean_is_weight"] == pytest.approx(1.0, abs=1e-4)
    assert step["truncation_fraction"] == 0.0
    assert step["unsupported_fraction"] == 0.0
