"""The contract between the steps: what ``rtrl-job stage`` commits is what ``rtrl-job
train`` reads. Synthetic shards served by a tiny parent go through the real stage command,
then the real train command, on a ``file://`` store, as the demo and a cycle run them."""

from __future__ import annotations

import json
import subprocess
from datetime import timedelta
from pathlib import Path

from rtrl.core.shards import synthetic_interactions, write_shards
from rtrl.core.store import open_store
from tests.conftest import REPO, console_script
from tests.rtrl_trainer.trainset import VOCAB, save_parent, tiny_gpt2


def _job(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [console_script("rtrl-job"), *args], capture_output=True, text=True, cwd=REPO, timeout=300
    )


def test_train_consumes_what_stage_commits(tmp_path: Path) -> None:
    root = tmp_path / "store"
    shards = root / "interactions"
    write_shards(
        synthetic_interactions(
            64, seed=3, checkpoint_id="ckpt-1", tokens=12, prompt_tokens=(4, 12),
            vocab_size=VOCAB, duration=timedelta(minutes=30),
        ),
        shards,
    )  # fmt: skip
    store = open_store(root.as_uri() + "/")
    save_parent(store, "models/ckpt-1", tiny_gpt2(), tmp_path)

    stage_out = (root / "cycles" / "2" / "stage").as_uri() + "/"
    staged = _job(
        "stage", "--shards", shards.as_uri() + "/", "--checkpoint", "ckpt-1",
        "--out", stage_out, "--now", "2026-01-06T00:00:00Z", "--min-interactions", "16",
        "--ranks", "2",
    )  # fmt: skip
    assert staged.returncode == 0, staged.stderr
    summary = json.loads(open_store(stage_out).get_bytes("stage.json"))
    assert summary["sufficient"] and summary["interactions_used"] > 48  # a few lack feedback
    assert summary["token_ids"] == "uint16"  # a small vocabulary: the trainer reads narrow ids

    train_out = (root / "models" / "ckpt-2").as_uri() + "/"
    trained = _job(
        "train", "--parent", (root / "models" / "ckpt-1").as_uri() + "/", "--data", stage_out,
        "--out", train_out, "--precision", "fp32", "--batch-tokens", "256",
        "--micro-batch-size", "8", "--max-steps", "2",
    )  # fmt: skip
    assert trained.returncode == 0, trained.stderr[-3000:]
    published = open_store(train_out)
    manifest = published.committed("")
    assert manifest is not None and "model.safetensors" in manifest.files
    result = json.loads(published.get_bytes("train.json"))
    assert result["summary"]["tokens"] > 0
    assert result["summary"]["steps"] == 2
