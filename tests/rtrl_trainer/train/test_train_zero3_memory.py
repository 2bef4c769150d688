"""ZeRO-3 loads the parent straight into partitions: each rank's host memory for loading
falls with the number of ranks, and the run computes what it computes on one rank.

The real ``rtrl-job train`` under torchrun, once with one rank and once with two, on a GPT-2
of ~50M parameters stored in bf16 as served models are (200 MB in fp32, the precision it
trains in here: large enough that the model, not the interpreter, decides what loading
costs), the stores on the local file system. The figures are the ones the step reports in
train.json (``run.host_memory``), per rank: how far building the policy and DeepSpeed's
partitions raised the resident set, and how far loading the weights alone did. Loading the
whole model on every rank first, as ``from_pretrained`` does, puts a whole fp32 copy in
every rank's weights phase whatever the number of ranks.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from rtrl.core.store import open_store
from tests.conftest import REPO, console_script
from tests.rtrl_trainer.trainset import pattern_rows, save_parent, tiny_gpt2, write_trainset

LEARNING_RATE = 1e-5


def _train(tmp: Path, parent: str, data: str, ranks: int) -> tuple[dict[str, Any], str, str]:
    out = f"file://{tmp}/out-{ranks}/"
    command = [
        console_script("torchrun"), "--nproc_per_node", str(ranks), "--no-python",
        console_script("rtrl-job"), "train", "--parent", parent, "--data", data, "--out", out,
        "--zero-stage", "3", "--precision", "fp32", "--learning-rate", str(LEARNING_RATE),
        "--batch-tokens", "1000000", "--micro-batch-size", "4", "--epochs", "2",
        "--save-every-steps", "0",
    ]  # fmt: skip
    env = dict(os.environ, RTRL_SCRATCH=str(tmp / f"scratch-{ranks}"), PYTHONUNBUFFERED="1")
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr[-4000:]}"
    doc = json.loads(open_store(out).get_bytes("train.json"))
    return doc, out, result.stdout


def _weights(out: str, tmp: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tmp.mkdir(parents=True, exist_ok=True)
    path = tmp / "weights.safetensors"
    open_store(out).get_file("model.safetensors", path)
    return load_file(str(path))


def test_zero3_host_memory_per_rank_falls_with_ranks_and_the_result_is_the_same(
    tmp_path: Path,
) -> None:
    model = tiny_gpt2(seed=0, layers=16, width=512)
    assert sum(p.numel() for p in model.parameters()) > 45_000_000
    store = open_store(f"file://{tmp_path}/bucket/")
    save_parent(store, "parent", model.to(torch.bfloat16), tmp_path)
    small = tiny_gpt2(seed=0)  # the logged log-probs need not be this model's
    write_trainset(store, "stage", [pattern_rows(small, 16)], tmp_path)
    del model
    parent, data = f"file://{tmp_path}/bucket/parent/", f"file://{tmp_path}/bucket/stage/"

    one, out_one, log = _train(tmp_path, parent, data, 1)
    two, out_two, _ = _train(tmp_path, parent, data, 2)

    assert "partitioned at construction" in log and "MiB for the weights" in log
    fp32_bytes = 4 * sum(p.numel() for p in tiny_gpt2(seed=0, layers=16, width=512).parameters())
    (alone,) = one["run"]["host_memory"]["per_rank"]
    reports = two["run"]["host_memory"]["per_rank"]
    assert len(reports) == 2 and all(r["peak_is_phase"] for r in [alone, *reports])

    def growth(r: dict[str, Any]) -> int:
        return max(r["load_peak"], r["initialize_peak"]) - int(r["before_load"])

    assert growth(alone) > fp32_bytes  # at least the weights and their fp32 master copy
    ratio = max(growth(r) for r in reports) / growth(alone)
    assert ratio < 0.7, ([growth(r) for r in [alone, *reports]], fp32_bytes)
    # No rank held the whole model while loading its weights: about its half, one tensor
    # at a time beyond it.
    assert max(r["load_growth"] for r in reports) < 0.7 * fp32_bytes, (reports, fp32_bytes)

    # The same run: the same losses and gradient norms, and the same weights up to the
    # order of float sums (Adam's first steps move a weight by about the learning rate).
    for a, b in zip(one["history"], two["history"], strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-7)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
    w1, w2 = _weights(out_one, tmp_path / "w1"), _weights(out_two, tmp_path / "w2")
    assert w1.keys() == w2.keys()
    parent_wte = tiny_gpt2(seed=0, layers=16, width=512).transformer.wte.weight
    assert not torch.equal(w1["transformer.wte.weight"], parent_wte)  # it trained
    for key in w1:
        assert torch.allclose(w1[key], w2[key], rtol=0, atol=2 * LEARNING_RATE), key
