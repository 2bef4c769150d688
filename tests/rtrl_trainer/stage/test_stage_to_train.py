"""The contract between the steps: what ``rtrl-job stage`` commits is what ``rtrl-job
train`` reads. Synthetic shards served by a tiny parent go through the real stage command,
then the real train command, on a ``file://`` store, as the demo and a cycle run them."""

from __future__ import annotations

import json
import subprocess
from datetime import timedelta
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rtrl.core.shards import synthetic_interactions, write_shards
from rtrl.core.store import open_store
from rtrl_trainer.cli import main
from tests.conftest import REPO, console_script
from tests.rtrl_trainer.trainset import VOCAB, save_parent, tiny_gpt2


def _job(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [console_script("rtrl-job"), *args], capture_output=True, text=True, cwd=REPO, timeout=300
    )


def _store_with_shards(tmp_path: Path, rows: int, seed: int, tokens: int,
                       prompt_tokens: tuple[int, int]) -> tuple[Path, Path]:  # fmt: skip
    """A ``file://`` store holding ``rows`` synthetic interactions served by ckpt-1 and that
    tiny parent at ``models/ckpt-1``: (the store's root, the shard root)."""
    root = tmp_path / "store"
    shards = root / "interactions"
    write_shards(
        synthetic_interactions(
            rows, seed=seed, checkpoint_id="ckpt-1", tokens=tokens,
            prompt_tokens=prompt_tokens, vocab_size=VOCAB, duration=timedelta(minutes=30),
        ),
        shards,
    )  # fmt: skip
    save_parent(open_store(root.as_uri() + "/"), "models/ckpt-1", tiny_gpt2(), tmp_path)
    return root, shards


def test_train_consumes_what_stage_commits(tmp_path: Path) -> None:
    root, shards = _store_with_shards(tmp_path, 64, seed=3, tokens=12, prompt_tokens=(4, 12))

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


def test_the_train_step_logs_the_mean_reward_the_stage_computed(tmp_path: Path) -> None:
    """``train/reward`` (and ``mean_reward`` in train.json's history and the step line) is
    the mean combined reward of the step's rows as the stage computed it: each row once, so
    with one step over the whole set, the mean of the rank files' rewards."""
    root, shards = _store_with_shards(tmp_path, 24, seed=7, tokens=8, prompt_tokens=(4, 8))
    stage_out = root / "cycles" / "2" / "stage"
    assert main([
        "stage", "--shards", shards.as_uri() + "/", "--checkpoint", "ckpt-1",
        "--out", stage_out.as_uri() + "/", "--now", "2026-01-06T00:00:00Z",
        "--min-interactions", "8", "--heldout-fraction", "0", "--ranks", "2",
    ]) == 0  # fmt: skip
    rewards = [
        r
        for name in sorted((stage_out / "train").glob("rank-*-of-00002.parquet"))
        for r in pq.read_table(name, columns=["reward"]).column("reward").to_pylist()
    ]
    assert len(set(rewards)) > 1  # a mean that could come out wrong

    train_out = root / "models" / "ckpt-2"
    trained = _job(
        "train", "--parent", (root / "models" / "ckpt-1").as_uri() + "/",
        "--data", stage_out.as_uri() + "/", "--out", train_out.as_uri() + "/",
        "--precision", "fp32", "--batch-tokens", "4096", "--micro-batch-size", "8",
    )  # fmt: skip
    assert trained.returncode == 0, trained.stderr[-3000:]
    result = json.loads((train_out / "train.json").read_text())
    assert result["data"]["rows"] == len(rewards)  # every staged row, in one step
    (step,) = result["history"]
    expected = sum(rewards) / len(rewards)
    assert step["mean_reward"] == pytest.approx(expected, rel=1e-9)
    assert f"reward {expected:+.3f}" in trained.stdout
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(train_out / "tensorboard"))
    board.Reload()
    assert [(e.step, e.value) for e in board.Scalars("train/reward")] == [
        (1, pytest.approx(expected, rel=1e-6))
    ]


def test_a_row_an_older_stage_let_through_is_skipped_not_fatal(tmp_path: Path) -> None:
    """A set staged without the parent's vocabulary (by an older stage, or without
    ``--parent``) holding one row with a token id beyond it: the train step skips and
    counts it and trains on the rest, where it used to fail at every retry. Staged again
    with ``--parent``, the row is quarantined at the door instead."""
    root = tmp_path / "store"
    shards = root / "interactions"
    batches = list(synthetic_interactions(
        24, seed=5, checkpoint_id="ckpt-1", tokens=8, prompt_tokens=(4, 8),
        vocab_size=VOCAB, duration=timedelta(minutes=30),
    ))  # fmt: skip
    table = pa.Table.from_batches(batches)
    beyond = table.column("completion_ids").to_pylist()
    beyond[5] = [VOCAB + 1] * len(beyond[5])
    table = table.set_column(
        table.schema.get_field_index("completion_ids"),
        "completion_ids",
        pa.array(beyond, pa.list_(pa.int32())),
    )
    write_shards(table, shards)
    bad_id = table.column("interaction_id")[5].as_py()
    store = open_store(root.as_uri() + "/")
    save_parent(store, "models/ckpt-1", tiny_gpt2(), tmp_path)
    parent = (root / "models" / "ckpt-1").as_uri() + "/"
    stage = [
        "stage", "--shards", shards.as_uri() + "/", "--checkpoint", "ckpt-1",
        "--now", "2026-01-06T00:00:00Z", "--min-interactions", "8", "--heldout-fraction", "0",
    ]  # fmt: skip

    # With the parent, the stage quarantines the row (in-process: the subprocess is below).
    guarded = (root / "cycles" / "guarded" / "stage").as_uri() + "/"
    # (synthetic log-probs: the fidelity gate, tested on its own, would quarantine them all)
    no_gate = ["--fidelity-sample-rows", "0"]
    assert main([*stage, "--out", guarded, "--parent", parent, "--max-bad-fraction", "0.1",
                 *no_gate]) == 0  # fmt: skip
    summary = json.loads(open_store(guarded).get_bytes("stage.json"))
    assert summary["quarantined"] == {"token_out_of_range": 1}
    assert summary["vocab_size"] == VOCAB

    older = (root / "cycles" / "older" / "stage").as_uri() + "/"
    assert main([*stage, "--out", older]) == 0
    summary = json.loads(open_store(older).get_bytes("stage.json"))
    assert summary["quarantined"] == {} and summary["interactions_used"] > 16

    train_out = (root / "models" / "ckpt-2").as_uri() + "/"
    trained = _job(
        "train", "--parent", parent, "--data", older, "--out", train_out, "--precision", "fp32",
        "--batch-tokens", "512", "--micro-batch-size", "8", "--max-steps", "1",
    )  # fmt: skip
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert "skipped 1 row(s) that cannot be trained on: " in trained.stdout
    result = json.loads(open_store(train_out).get_bytes("train.json"))
    assert result["summary"]["steps"] == 1
    data = result["data"]
    assert data["rows_skipped"] == {"token_out_of_range": 1}
    (example,) = data["skipped_examples"]
    assert f"(interaction {bad_id}): completion_ids has token id {VOCAB + 1}" in example
    assert data["rows"] == summary["interactions_used"] - 1
