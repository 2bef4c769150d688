"""``rtrl-job train`` end to end, as a Job pod runs it: the real CLI in a subprocess (one
process, and two under torchrun), real DeepSpeed ZeRO-2 on CPU, the parent checkpoint and
the staged set in S3 (moto over HTTP).

One uninterrupted run (module fixture) is the reference several tests read: what it
published, that the model reloads and computes exactly the engine's logits, that it
learned from the feedback, that its TensorBoard events hold its history, and that a
killed-and-resumed run ends bit for bit where it did, its events without a repeated step.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import uuid
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import pytest
import torch

from rtrl.core.api.checkpoint import TrainingSummary
from rtrl.core.store import ObjectStore, open_store
from rtrl.core.store.base import sha256_file
from rtrl_trainer.train.events import LEARNING_RATE, TAGS, TOKENS_PER_SECOND
from tests.conftest import REPO, console_script
from tests.rtrl_trainer.trainset import (
    P,
    Q,
    Row,
    mean_logprob,
    pattern_rows,
    save_parent,
    tiny_gpt2,
    write_trainset,
)

# Settings of the reference run: 48 rows of ~6 loss tokens, 3 steps an epoch, stopped at 4.
LEARNING = [
    "--precision", "fp32", "--learning-rate", "3e-3", "--batch-tokens", "96",
    "--micro-batch-size", "4", "--epochs", "2", "--max-steps", "4", "--save-every-steps", "1",
]  # fmt: skip
MARGIN = 0.5  # nats of mean per-token log-prob: P must rise, Q fall, by at least this


@dataclass
class World:
    bucket: str
    store: ObjectStore  # the bucket's root
    parent: str
    data: str
    rows: list[Row]
    model: Any
    tmp: Path
    env: dict[str, str]

    def uri(self, key: str) -> str:
        return f"s3://{self.bucket}/{key.strip('/')}/"


@pytest.fixture(scope="module")
def world(moto_endpoint: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    """A bucket with the parent (a tiny GPT-2 with a tokenizer) and a staged set in which
    completion P earned advantage +1 and Q -1, in two rank files."""
    tmp = tmp_path_factory.mktemp("train-e2e")
    with pytest.MonkeyPatch.context() as mp:
        empty = tmp / "no-aws-config"
        for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL_S3", "AWS_ROLE_ARN", "AWS_SESSION_TOKEN"):
            mp.delenv(name, raising=False)
        for name, value in {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": moto_endpoint,
            "AWS_CONFIG_FILE": str(empty),
            "AWS_SHARED_CREDENTIALS_FILE": str(empty),
            "AWS_EC2_METADATA_DISABLED": "true",
        }.items():
            mp.setenv(name, value)
        bucket = f"train-{uuid.uuid4().hex[:12]}"
        client = boto3.session.Session().client("s3", endpoint_url=moto_endpoint)
        client.create_bucket(Bucket=bucket)
        client.close()
        store = open_store(f"s3://{bucket}/")
        model = tiny_gpt2(seed=0)
        save_parent(store, "models/parent", model, tmp, tokenizer_size=250)
        rows = pattern_rows(model, 48)
        write_trainset(store, "runs/c1/stage", [rows[0::2], rows[1::2]], tmp)
        env = dict(os.environ, RTRL_SCRATCH=str(tmp / "scratch"), PYTHONUNBUFFERED="1")
        yield World(
            bucket=bucket,
            store=store,
            parent=f"s3://{bucket}/models/parent/",
            data=f"s3://{bucket}/runs/c1/stage/",
            rows=rows,
            model=model,
            tmp=tmp,
            env=env,
        )


def rtrl_job(
    world: World,
    *args: str,
    torchrun: int = 0,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    command = [console_script("rtrl-job"), "train", *args]
    if torchrun:
        command = [
            console_script("torchrun"),
            "--nproc_per_node",
            str(torchrun),
            "--no-python",
            *command,
        ]
    return subprocess.run(
        command,
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**world.env, **(env or {})},
        timeout=300,
    )


def _ok(out: subprocess.CompletedProcess[str]) -> None:
    assert out.returncode == 0, f"exit {out.returncode}\n{out.stdout}\n{out.stderr[-4000:]}"


def _train_json(world: World, out: str) -> dict[str, Any]:
    return json.loads(open_store(out).get_bytes("train.json"))  # type: ignore[no-any-return]


def _download(out: str, dest: Path) -> Path:
    store = open_store(out)
    manifest = store.committed("")
    assert manifest is not None
    for name in manifest.files:
        store.get_file(name, dest / name)
    return dest


def _reload(directory: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory).eval()


def _probe_matches(model: Any, probe: dict[str, Any]) -> bool:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([probe["input_ids"]])).logits.float().contiguous()
    assert list(logits.shape) == probe["logits_shape"]
    return hashlib.sha256(logits.numpy().tobytes()).hexdigest() == probe["logits_sha256"]


@pytest.fixture(scope="module")
def reference(world: World) -> str:
    """The uninterrupted one-process ZeRO-2 run; its output URI."""
    out = world.uri("runs/c1/ckpt-a")
    result = rtrl_job(
        world, "--parent", world.parent, "--data", world.data, "--out", out, *LEARNING
    )
    _ok(result)
    # one line per step at most (every RTRL_PROGRESS_SECONDS) with rate and ETA; the last
    assert "step 4/4" in result.stdout and "tok/s, ETA " in result.stdout
    return out


def test_one_process_publishes_a_checkpoint_that_reproduces_the_engine(
    world: World, reference: str
) -> None:
    store = open_store(reference)
    manifest = store.committed("")
    assert manifest is not None
    assert {"config.json", "model.safetensors", "train.json", "tokenizer.json"} <= set(
        manifest.files
    )
    local = _download(reference, world.tmp / "ckpt-a")
    for name, entry in manifest.files.items():
        assert sha256_file(local / name) == entry["sha256"], name
        assert (local / name).stat().st_size == entry["size"]
    # Optimizer state exists only to resume; it is gone once the checkpoint is committed.
    assert [o.key for o in store.list("_deepspeed/")] == []

    doc = json.loads((local / "train.json").read_text())
    summary = TrainingSummary.model_validate(doc["summary"])
    assert summary.steps == 4 and summary.tokens > 0
    assert summary.kl is not None and summary.kl > 0  # the policy moved away from the parent
    assert summary.grad_norm is not None and summary.grad_norm > 0
    assert summary.tokens_per_second and summary.wall_seconds
    assert doc["run"]["world_size"] == 1 and doc["parent"]["manifest"] == "verified"
    assert doc["history"][0]["clip_fraction"] == 0.0  # step 1: the policy is the parent
    assert [h["step"] for h in doc["history"]] == [1, 2, 3, 4]

    model = _reload(local)
    assert _probe_matches(model, doc["probe"])
    assert not _probe_matches(world.model, doc["probe"])  # and it is not the parent's
    config = json.loads((local / "config.json").read_text())
    assert config["resid_pdrop"] == 0.1  # the parent's dropout, not training's 0
    _assert_tied_and_trained(local, world.model)


def test_the_policy_learned_from_the_feedback(world: World, reference: str) -> None:
    model = _reload(_download(reference, world.tmp / "ckpt-a-learn"))
    p_rows = [r for r in world.rows if r.completion[:3] == P[:3]]
    q_rows = [r for r in world.rows if r.completion[:3] == Q[:3]]
    before = mean_logprob(world.model, p_rows), mean_logprob(world.model, q_rows)
    after = mean_logprob(model, p_rows), mean_logprob(model, q_rows)
    assert after[0] > before[0] + MARGIN, (before, after)
    assert after[1] < before[1] - MARGIN, (before, after)


def test_a_rerun_of_a_committed_output_is_a_no_op(world: World, reference: str) -> None:
    before = open_store(reference).get_bytes("_MANIFEST.json")
    result = rtrl_job(world, "--parent", world.parent, "--data", world.data, "--out", reference)
    _ok(result)
    assert "already committed: nothing to do" in result.stdout
    assert open_store(reference).get_bytes("_MANIFEST.json") == before


def test_resume_after_a_kill_ends_with_the_same_weights(world: World, reference: str) -> None:
    out = world.uri("runs/c1/ckpt-b")
    args = ["--parent", world.parent, "--data", world.data, "--out", out, *LEARNING]
    killed = rtrl_job(world, *args, env={"RTRL_TEST_EXIT_AFTER_STEP": "2"})
    assert killed.returncode == 137, killed.stderr[-2000:]
    store = open_store(out)
    assert store.committed("") is None  # nothing published
    assert store.committed("_deepspeed/step-2") is not None
    assert store.committed("_deepspeed/step-1") is None  # superseded state is deleted
    # A run's TensorBoard events are in the store while it runs, not only once it is done.
    assert _event_steps(out, world.tmp / "ckpt-b-killed") == {tag: [1, 2] for tag in CONTRACT_TAGS}

    resumed = rtrl_job(world, *args)
    _ok(resumed)
    assert "resumed from the state saved at step 2" in resumed.stdout
    assert "step 1/4" not in resumed.stdout and "step 3/4" in resumed.stdout
    assert store.get_bytes("model.safetensors") == open_store(reference).get_bytes(
        "model.safetensors"
    )
    doc = _train_json(world, out)
    assert doc["run"]["resumed_from_step"] == 2
    assert [h["step"] for h in doc["history"]] == [1, 2, 3, 4]
    assert doc["history"] == [
        {**h, "seconds": doc["history"][i]["seconds"]}
        for i, h in enumerate(_train_json(world, reference)["history"])
    ]
    _assert_events_match_history(out, doc["history"], world.tmp / "ckpt-b-events")


# --- TensorBoard events ---------------------------------------------------------------------

# The tags the demo report reads back: a contract (rtrl_trainer/train/events.py).
CONTRACT_TAGS = (*TAGS.values(), TOKENS_PER_SECOND, LEARNING_RATE)


def _sync_events(out: str, dest: Path) -> Path:
    """``<out>/tensorboard/`` copied to ``dest``, as `aws s3 sync` would for TensorBoard."""
    store = open_store(out)
    keys = [o.key for o in store.list("tensorboard/")]
    assert keys, f"no event files under {out}tensorboard/"
    for key in keys:
        store.get_file(key, dest / key.rsplit("/", 1)[-1])
    return dest


def _raw_events(directory: Path) -> list[tuple[str, int, float]]:
    """(tag, step, value) of every scalar of every event file, as written (TensorBoard's
    EventAccumulator would hide a repeated step by purging the older one)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.util import tensor_util

    out = []
    for path in sorted(directory.iterdir()):
        for event in EventFileLoader(str(path)).Load():
            for value in event.summary.value:
                number = (
                    value.simple_value
                    if value.HasField("simple_value")
                    else float(tensor_util.make_ndarray(value.tensor))
                )
                out.append((value.tag, event.step, number))
    return out


def _event_steps(out: str, dest: Path) -> dict[str, list[int]]:
    steps: dict[str, list[int]] = {}
    for tag, step, _ in _raw_events(_sync_events(out, dest)):
        steps.setdefault(tag, []).append(step)
    return {tag: sorted(s) for tag, s in steps.items()}


def _assert_events_match_history(out: str, history: list[dict[str, Any]], dest: Path) -> None:
    """Every contract tag holds exactly one value per optimizer step, and the values are
    train.json's history (read as TensorBoard reads them)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    directory = _sync_events(out, dest)
    counts = Counter((tag, step) for tag, step, _ in _raw_events(directory))
    assert [k for k, n in counts.items() if n > 1] == []  # no step written twice
    board = EventAccumulator(str(directory))
    board.Reload()
    assert set(CONTRACT_TAGS) <= set(board.Tags()["scalars"])
    steps = [h["step"] for h in history]
    for key, tag in TAGS.items():
        events = board.Scalars(tag)
        assert [e.step for e in events] == steps, tag
        expected = [h[key] for h in history]
        assert [e.value for e in events] == pytest.approx(expected, rel=1e-6), tag
    rates = [e.value for e in board.Scalars(TOKENS_PER_SECOND)]
    assert rates == pytest.approx([h["tokens"] / h["seconds"] for h in history], rel=1e-6)
    assert [e.value for e in board.Scalars(LEARNING_RATE)] == pytest.approx([3e-3] * len(steps))


def test_the_events_hold_the_history_and_the_lines_show_rate_and_eta(
    world: World, reference: str
) -> None:
    _assert_events_match_history(
        reference, _train_json(world, reference)["history"], world.tmp / "ckpt-a-events"
    )
    # The checkpoint is what the manifest lists: the events are next to it, not in it.
    manifest = open_store(reference).committed("")
    assert manifest is not None and not [n for n in manifest.files if "tensorboard" in n]


def test_a_resume_rewinds_the_events_to_the_saved_state(world: World) -> None:
    # Saved at step 2, killed after step 3 whose events were uploaded: the resumed run
    # repeats step 3, and the store must not hold it twice.
    out = world.uri("runs/c1/ckpt-rewind")
    args = [
        "--parent", world.parent, "--data", world.data, "--out", out, *LEARNING,
        "--save-every-steps", "2", "--log-format", "json",
    ]  # fmt: skip
    every_step = {"RTRL_TENSORBOARD_SECONDS": "0", "RTRL_PROGRESS_SECONDS": "0"}
    killed = rtrl_job(world, *args, env={**every_step, "RTRL_TEST_EXIT_AFTER_STEP": "3"})
    assert killed.returncode == 137, killed.stderr[-2000:]
    assert _event_steps(out, world.tmp / "rewind-killed") == {
        tag: [1, 2, 3] for tag in CONTRACT_TAGS
    }
    resumed = rtrl_job(world, *args, env=every_step)
    _ok(resumed)
    # --log-format json: every line of stdout is one JSON object
    lines = [json.loads(line) for line in resumed.stdout.splitlines()]
    steps = [d for d in lines if d["event"] == "progress" and d["what"] == "training"]
    assert [d["done"] for d in steps] == [3, 4]
    assert steps[0]["eta_seconds"] > 0 and steps[0]["rate"] > 0 and steps[0]["total"] == 4
    assert "tok/s" in steps[0]["message"]
    assert any(d["event"] == "note" and "resumed" in d["message"] for d in lines)
    _assert_events_match_history(
        out, _train_json(world, out)["history"], world.tmp / "rewind-events"
    )


def test_a_set_without_rewards_trains_and_logs_no_reward(world: World) -> None:
    # Written by hand (or by another tool) without the reward column: the run trains as
    # ever, and no reward appears anywhere rather than an invented one.
    write_trainset(
        world.store, "runs/no-reward/stage", [world.rows[:8]], world.tmp / "no-reward",
        rewards=False,
    )  # fmt: skip
    out = world.uri("runs/no-reward/ckpt")
    result = rtrl_job(
        world, "--parent", world.parent, "--data", world.uri("runs/no-reward/stage"),
        "--out", out, "--precision", "fp32", "--max-steps", "1",
    )  # fmt: skip
    _ok(result)
    assert "step 1/1" in result.stdout and " reward " not in result.stdout
    (step,) = _train_json(world, out)["history"]
    assert step["tokens"] > 0 and "mean_reward" not in step
    tags = {tag for tag, _, _ in _raw_events(_sync_events(out, world.tmp / "no-reward-events"))}
    assert TAGS["loss"] in tags and TAGS["mean_reward"] not in tags


def test_packed_micro_batches_train_as_the_unpacked_ones(world: World, reference: str) -> None:
    # The same rows in every step, packed into sequences of up to 64 tokens instead of 4
    # padded rows: the same losses and gradient norms, step after step.
    out = world.uri("runs/c1/ckpt-packed")
    args = ["--parent", world.parent, "--data", world.data, "--out", out, *LEARNING]
    result = rtrl_job(world, *args, "--pack-sequences", "--micro-batch-tokens", "64")
    _ok(result)
    assert "micro-batch(es) of up to 64 tokens packed in rows of up to 64 per rank" in result.stdout
    packed, unpacked = _train_json(world, out), _train_json(world, reference)
    assert packed["config"]["training"]["pack_sequences"] is True
    for a, b in zip(packed["history"], unpacked["history"], strict=True):
        assert a["tokens"] == b["tokens"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-3)
    # The same real tokens went through the model (padding is never counted).
    assert packed["run"]["input_tokens"] == unpacked["run"]["input_tokens"]


def _reinforce_grad_norm(model: Any, rows: Sequence[Row]) -> float:
    """The gradient norm of -sum(A * log pi) / N over all rows: what the first step of a
    one-step epoch must compute when the logged log-probs are the parent's own."""
    import copy

    policy = copy.deepcopy(model).train()
    for module in policy.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    tokens = sum(sum(r.mask or []) for r in rows)
    total = torch.zeros(())
    for r in rows:
        ids = torch.tensor([r.prompt + r.completion])
        logits = policy(input_ids=ids).logits[0, len(r.prompt) - 1 : -1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(r.completion)[:, None])[:, 0]
        mask = torch.tensor(r.mask or [True] * len(r.completion))
        total = total - r.advantage * r.sample_weight * (logp * mask).sum() / tokens
    grads = torch.autograd.grad(total, [p for p in policy.parameters() if p.requires_grad])
    return float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))


def test_two_processes_under_torchrun(world: World) -> None:
    # A base model registered by hand (no manifest), two ranks, one step per epoch.
    tmp = world.tmp / "torchrun"
    save_parent(world.store, "models/base", world.model, tmp, commit=False)
    parent = world.uri("models/base")
    out = world.uri("runs/c2/ckpt")
    result = rtrl_job(
        world,
        "--parent", parent, "--data", world.data, "--out", out,
        "--precision", "fp32", "--zero-stage", "2", "--epochs", "2", "--micro-batch-size", "4",
        torchrun=2,
    )  # fmt: skip
    _ok(result)
    doc = _train_json(world, out)
    assert doc["run"]["world_size"] == 2 and doc["run"]["total_steps"] == 2
    assert doc["parent"]["manifest"] == "first-use"
    assert open_store(parent).committed("") is not None  # checksummed on first use
    # Both ranks' micro-batches, normalised by the global token count, make the full-batch
    # REINFORCE gradient: DeepSpeed's averaging over ranks and micro-batches is undone.
    expected = _reinforce_grad_norm(world.model, world.rows)
    assert doc["history"][0]["grad_norm"] == pytest.approx(expected, rel=1e-4)
    assert _probe_matches(_reload(_download(out, tmp / "ckpt")), doc["probe"])


def test_zero3_bf16_publishes_the_gathered_model(world: World) -> None:
    # ZeRO-3 partitions the weights over the ranks: publishing gathers them onto rank 0.
    out = world.uri("runs/c3/ckpt")
    result = rtrl_job(
        world,
        "--parent", world.parent, "--data", world.data, "--out", out,
        "--zero-stage", "3", "--precision", "bf16", "--learning-rate", "1e-3",
        "--batch-tokens", "96", "--micro-batch-size", "4", "--max-steps", "2",
        torchrun=2,
    )  # fmt: skip
    _ok(result)
    local = _download(out, world.tmp / "zero3")
    model = _reload(local)
    assert model.dtype == torch.bfloat16
    assert _probe_matches(model, _train_json(world, out)["probe"])
    _assert_tied_and_trained(local, world.model)


def _assert_tied_and_trained(local: Path, parent: Any) -> None:
    from safetensors import safe_open

    with safe_open(str(local / "model.safetensors"), "pt") as weights:
        keys = set(weights.keys())
        wte = weights.get_tensor("transformer.wte.weight").float()
    assert "lm_head.weight" not in keys  # tied to the embeddings: stored once
    assert "transformer.h.0.mlp.c_fc.weight" in keys
    assert not torch.equal(wte, parent.transformer.wte.weight.float())  # it trained


# --- abort cases: exit 1, one clear line, nothing published -------------------------------


def _bad_data(world: World, name: str, rows: list[Row], **kw: Any) -> str:
    write_trainset(world.store, f"runs/{name}/stage", [rows], world.tmp / name, **kw)
    return world.uri(f"runs/{name}/stage")


def _case(world: World, case: str) -> tuple[str, str, list[str], str]:
    """(parent, data, extra flags, expected message) of an abort case."""
    good = world.rows[:8]
    if case == "token-ids-beyond-vocab":
        # One such row is skipped (tests/rtrl_trainer/stage/test_stage_to_train.py); two of
        # ten are more than stage.json's max_bad_fraction (0.01 when it does not say).
        rows = [
            *good,
            Row(prompt=[3], completion=[4, 300], advantage=1.0, interaction_id="big"),
            Row(prompt=[-2], completion=[4, 5], advantage=1.0, interaction_id="neg"),
        ]
        data = _bad_data(world, case, rows)
        return (
            world.parent,
            data,
            [],
            (
                f"staged training set {data}: 2 of 10 rows cannot be trained on (0.2 of the "
                "set, limit 0.01: stage.json max_bad_fraction): token_out_of_range=2; first: "
                "train/rank-00000-of-00001.parquet row 8 (interaction big): completion_ids has "
                "token id 300, outside the model's vocabulary of 260"
            ),
        )
    if case == "insufficient":
        data = _bad_data(world, case, good, sufficient=False)
        return world.parent, data, [], "is marked insufficient"
    if case == "no-loss-tokens":
        rows = [Row(prompt=r.prompt, completion=r.completion, advantage=1.0) for r in good]
        for row in rows:
            row.mask = [False] * len(row.completion)
        return world.parent, _bad_data(world, case, rows), [], "no completion tokens to train on"
    if case == "uncommitted-data":
        data = _bad_data(world, case, good, commit=False)
        return world.parent, data, [], f"staged training set {data}: not committed"
    if case == "missing-parent":
        parent = world.uri("models/nothing-here")
        return parent, world.data, [], f"parent {parent}: no such checkpoint"
    if case == "tampered-parent":
        save_parent(world.store, "models/tampered", world.model, world.tmp / case)
        world.store.put_bytes("models/tampered/model.safetensors", b"not the weights")
        parent = world.uri("models/tampered")
        return parent, world.data, [], f"{parent}model.safetensors: size"
    if case == "tokenizer-mismatch":
        save_parent(world.store, "models/bigtok", world.model, world.tmp / case, tokenizer_size=300)
        return (
            world.uri("models/bigtok"),
            world.data,
            [],
            (
                "the tokenizer has 300 tokens but the model's vocabulary (config.json vocab_size) "
                "has 260: mismatched tokenizer"
            ),
        )
    if case == "non-finite-loss":
        rows = [*good, Row(prompt=[3], completion=[4, 5], advantage=3e38, sample_weight=1e10)]
        return (
            world.parent,
            _bad_data(world, case, rows),
            ["--precision", "fp32"],
            ("non-finite loss at step 1"),
        )
    raise AssertionError(case)


ABORTS = [
    "token-ids-beyond-vocab",
    "insufficient",
    "no-loss-tokens",
    "uncommitted-data",
    "missing-parent",
    "tampered-parent",
    "tokenizer-mismatch",
    "non-finite-loss",
]


@pytest.mark.parametrize("case", ABORTS)
def test_abort_cases_exit_1_and_publish_nothing(world: World, case: str) -> None:
    parent, data, flags, message = _case(world, case)
    out = world.uri(f"runs/{case}/ckpt")
    result = rtrl_job(world, "--parent", parent, "--data", data, "--out", out, *flags)
    assert result.returncode == 1, f"{result.stdout}\n{result.stderr[-3000:]}"
    lines = [line for line in result.stderr.splitlines() if line.startswith("rtrl-job train: ")]
    assert len(lines) == 1 and message in lines[0], result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert open_store(out).committed("") is None
