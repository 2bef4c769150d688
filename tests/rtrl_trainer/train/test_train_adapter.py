"""``rtrl-job train`` of a LoRA adapter instead of all the weights, end to end: the real CLI
in a subprocess, real DeepSpeed ZeRO-2 on CPU, PEFT, a tiny Llama base and a staged set in
a ``file://`` store.

One run (module fixture) trains a fresh adapter on the base; the tests read what it
published (the files vLLM loads, the lineage, only the adapter trained), load it on the
base and compare with the trainer's own logits, continue it in a second cycle, resume it
after a kill, and refuse what must not be trained: an adapter of another shape, or one
whose base changed. tests/rtrl_serving/capture/test_adapter_routing.py serves what the
step publishes from a real vLLM.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from rtrl.core.api.adapter import base_digest
from rtrl.core.store import MANIFEST_NAME, ObjectStore, open_store
from rtrl.core.store.base import sha256_file
from rtrl_trainer import checkpoint_io as cio
from rtrl_trainer.train.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from rtrl_trainer.train.config import build_config
from rtrl_trainer.train.state import fetch_inputs
from tests.conftest import console_script
from tests.rtrl_trainer.trainset import (
    P,
    Q,
    Row,
    mean_logprob,
    pattern_rows,
    save_parent,
    tiny_llama,
    write_trainset,
)

LEARNING = [
    "--precision", "fp32", "--learning-rate", "5e-2", "--batch-tokens", "96",
    "--micro-batch-size", "4", "--epochs", "2", "--max-steps", "4", "--save-every-steps", "1",
]  # fmt: skip
SHAPE = ["--adapter-rank", "4", "--adapter-alpha", "8", "--adapter-target-modules", "q_proj,v_proj"]
# nats of mean per-token log-prob: P must rise, Q fall, by at least this. PPO's clip of 0.2
# stops a token's gradient once its ratio passes 1.2 (0.8 for Q): a cycle moves P by at
# most about log 1.2 = 0.18; this run moves it by 0.13-0.22
MARGIN = 0.1


@dataclass
class World:
    root: Path
    store: ObjectStore
    base: str
    data: str
    rows: list[Row]
    model: Any
    env: dict[str, str]
    first: subprocess.CompletedProcess[str]

    def uri(self, key: str) -> str:
        return (self.root / key).as_uri() + "/"

    def files(self, key: str) -> dict[str, Path]:
        return {
            p.relative_to(self.root / key).as_posix(): p
            for p in (self.root / key).rglob("*")
            if p.is_file()
        }


def rtrl_job(world_env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [console_script("rtrl-job"), "train", *args],
        env=world_env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    """A base (a tiny Llama with a tokenizer), a staged set in which completion P earned
    +1 and Q -1, and the first cycle's adapter trained on them (adapters/a1)."""
    tmp = tmp_path_factory.mktemp("train-adapter")
    root = tmp / "bucket"
    root.mkdir()
    store = open_store(root.as_uri() + "/")
    model = tiny_llama(seed=0)
    save_parent(store, "models/base", model, tmp, tokenizer_size=250)
    rows = pattern_rows(model, 48)
    write_trainset(store, "runs/c1/stage", [rows], tmp)
    env = dict(os.environ, RTRL_SCRATCH=str(tmp / "scratch"), PYTHONUNBUFFERED="1")
    world = World(root, store, "", "", rows, model, env, subprocess.CompletedProcess([], 0))
    world.base, world.data = world.uri("models/base"), world.uri("runs/c1/stage")
    world.first = rtrl_job(
        env, "--parent", world.base, "--data", world.data, "--out", world.uri("adapters/a1"),
        *LEARNING, *SHAPE,
    )  # fmt: skip
    assert world.first.returncode == 0, world.first.stderr[-3000:]
    yield world


def _manifest(world: World, key: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((world.root / key / MANIFEST_NAME).read_text())
    return doc


def _on_base(world: World, key: str) -> Any:
    from peft import PeftModel

    # PEFT puts its layers into the model it is given: a copy keeps the base the base
    return PeftModel.from_pretrained(copy.deepcopy(world.model), world.root / key).eval()


def test_the_adapter_is_published_as_vllm_loads_it_with_its_base_in_the_lineage(
    world: World,
) -> None:
    assert set(world.files("adapters/a1")) >= {ADAPTER_CONFIG, ADAPTER_WEIGHTS, "train.json"}
    published = set(_manifest(world, "adapters/a1")["files"])
    assert published == {ADAPTER_CONFIG, ADAPTER_WEIGHTS, "train.json"}  # nothing of the base
    config = json.loads((world.root / "adapters/a1" / ADAPTER_CONFIG).read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8)
    assert sorted(config["target_modules"]) == ["q_proj", "v_proj"]
    assert config["base_model_name_or_path"] == world.base
    metadata = _manifest(world, "adapters/a1")["metadata"]
    base_files = {n: e["sha256"] for n, e in _manifest(world, "models/base")["files"].items()}
    assert metadata["kind"] == "adapter"
    assert metadata["base"] == world.base
    assert metadata["baseDigest"] == base_digest(base_files)
    weights = load_file(world.root / "adapters/a1" / ADAPTER_WEIGHTS)
    # rank 4 on q_proj (64 -> 64) and v_proj (64 -> 32: one key-value head of 32) of 2 layers
    expected = 2 * (4 * 64 + 64 * 4) + 2 * (4 * 64 + 32 * 4)
    assert all(".lora_A." in k or ".lora_B." in k for k in weights)
    assert sum(t.numel() for t in weights.values()) == expected
    train = json.loads((world.root / "adapters/a1" / "train.json").read_text())
    assert train["adapter"]["trainable_parameters"] == expected
    assert train["adapter"]["base"]["uri"] == world.base
    assert train["adapter"]["continued"] is False
    assert "training a LoRA adapter of rank 4" in world.first.stdout + world.first.stderr


def test_the_adapter_on_its_base_computes_the_trainers_logits_and_learned(world: World) -> None:
    train = json.loads((world.root / "adapters/a1" / "train.json").read_text())
    adapted = _on_base(world, "adapters/a1")
    with torch.no_grad():
        probe = adapted(input_ids=torch.tensor([train["probe"]["input_ids"]])).logits
    digest = hashlib.sha256(probe.float().contiguous().numpy().tobytes()).hexdigest()
    assert digest == train["probe"]["logits_sha256"]
    liked = [r for r in world.rows if r.completion[:3] == P[:3]]
    disliked = [r for r in world.rows if r.completion[:3] == Q[:3]]
    assert mean_logprob(adapted, liked) > mean_logprob(world.model, liked) + MARGIN
    assert mean_logprob(adapted, disliked) < mean_logprob(world.model, disliked) - MARGIN
    # the base itself is untouched: its files are the ones it was committed with
    for name, entry in _manifest(world, "models/base")["files"].items():
        assert sha256_file(world.root / "models/base" / name) == entry["sha256"]


def test_a_second_cycle_continues_the_adapter_on_the_base_its_lineage_names(
    world: World,
) -> None:
    """From a1, with no shape given: the base is fetched by the lineage, and the adapter
    starts where a1 ended (a step with a learning rate of 1e-9 moves it by ~1e-9), not from
    a fresh one (whose lora_B would be zero)."""
    done = rtrl_job(
        world.env, "--parent", world.uri("adapters/a1"), "--data", world.data,
        "--out", world.uri("adapters/a2"), *LEARNING[:2], "--learning-rate", "1e-9",
        *LEARNING[4:-4], "--max-steps", "1",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    first = load_file(world.root / "adapters/a1" / ADAPTER_WEIGHTS)
    second = load_file(world.root / "adapters/a2" / ADAPTER_WEIGHTS)
    assert first.keys() == second.keys()
    b_norm = max(float(t.abs().max()) for k, t in first.items() if ".lora_B." in k)
    assert b_norm > 1e-3
    assert max(float((first[k] - second[k]).abs().max()) for k in first) < 1e-6
    metadata = _manifest(world, "adapters/a2")["metadata"]
    assert (metadata["kind"], metadata["base"]) == ("adapter", world.base)
    assert metadata["parent"] == world.uri("adapters/a1")
    train = json.loads((world.root / "adapters/a2" / "train.json").read_text())
    assert train["adapter"]["continued"] is True
    assert (train["adapter"]["rank"], train["adapter"]["alpha"]) == (4, 8)


def test_a_killed_adapter_run_resumes_to_the_same_adapter(world: World) -> None:
    out = world.uri("adapters/resumed")
    args = ["--parent", world.base, "--data", world.data, "--out", out, *LEARNING, *SHAPE]
    killed = rtrl_job({**world.env, "RTRL_TEST_EXIT_AFTER_STEP": "2"}, *args)
    assert killed.returncode == 137, killed.stderr[-3000:]
    assert not (world.root / "adapters/resumed" / MANIFEST_NAME).exists()
    resumed = rtrl_job(world.env, *args)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from the state saved at step 2" in resumed.stdout + resumed.stderr
    reference = sha256_file(world.root / "adapters/a1" / ADAPTER_WEIGHTS)
    assert sha256_file(world.root / "adapters/resumed" / ADAPTER_WEIGHTS) == reference


def _fetch(world: World, parent: str, tmp_path: Path, *shape: str) -> Any:
    flags = dict(zip(shape[::2], shape[1::2], strict=True))
    overrides = {"rank": int(flags["--adapter-rank"])} if "--adapter-rank" in flags else None
    config = build_config(
        parent=parent, data=world.data, out=world.uri("unused"), adapter_overrides=overrides
    )
    return fetch_inputs(config, tmp_path)


def test_an_adapter_of_another_shape_than_its_parent_is_refused(
    world: World, tmp_path: Path
) -> None:
    with pytest.raises(cio.InputError, match=r"adapter\.rank 8 \(the parent's is 4\)"):
        _fetch(world, world.uri("adapters/a1"), tmp_path, "--adapter-rank", "8")
    same = _fetch(world, world.uri("adapters/a1"), tmp_path / "same", "--adapter-rank", "4")
    assert same.adapter.rank == 4 and same.base.uri.rstrip("/") == world.base.rstrip("/")


def test_an_adapter_whose_base_changed_or_is_unnamed_is_refused(
    world: World, tmp_path: Path
) -> None:
    """An adapter on other base files computes what nobody measured: refused, naming the
    base; and one whose manifest names no base cannot be trained at all."""
    files = {n: world.root / "adapters/a1" / n for n in (ADAPTER_CONFIG, ADAPTER_WEIGHTS)}
    metadata = _manifest(world, "adapters/a1")["metadata"]
    world.store.commit("adapters/forged", files, {**metadata, "baseDigest": "0" * 64})
    with pytest.raises(cio.InputError, match="trained on other files than base"):
        _fetch(world, world.uri("adapters/forged"), tmp_path / "forged")
    world.store.commit("adapters/orphan", files, {"kind": "adapter"})
    with pytest.raises(cio.InputError, match=r"names no base \(metadata\.base\)"):
        _fetch(world, world.uri("adapters/orphan"), tmp_path / "orphan")
    shutil.rmtree(tmp_path, ignore_errors=True)
