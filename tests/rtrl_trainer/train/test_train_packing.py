"""Micro-batches by token budget, packed sequences, and activation checkpointing
(rtrl_trainer.train.batches, .forward, .engine.set_training_mode) on real models.

Packing must not change what is learned: a packed micro-batch gives the loss, the stats
and the gradients of the same rows unpacked. The budget must keep every micro-batch within
it and keep every rank's schedule the same length.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch

from rtrl_trainer.train.batches import (
    collate,
    epoch_micro_batches,
    make_schedule,
    most_micro_batches,
    pack_lines,
    row_lengths,
    step_micro_batches,
)
from rtrl_trainer.train.engine import set_training_mode
from rtrl_trainer.train.examples import Example
from rtrl_trainer.train.forward import micro_batch_loss, packing_keeps_rows_apart, token_logprobs
from rtrl_trainer.train.loss import STEP_STAT_NAMES, LossSettings
from tests.rtrl_trainer.trainset import VOCAB, tiny_gpt2

SETTINGS = LossSettings(clip_ratio=0.2, is_truncation=2.0, kl_coef=0.05)
CPU = torch.device("cpu")


def tiny_llama(seed: int = 0) -> Any:
    """A Llama (rotary positions: packing must restart them per row) from a config."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256,
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def _no_dropout(model: Any) -> Any:
    """Training mode without dropout, as the trainer trains (engine.disable_dropout)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model.train()


def _examples(n: int, seed: int = 0) -> list[Example]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        prompt, completion = int(rng.integers(1, 12)), int(rng.integers(2, 10))
        mask = rng.random(completion) > 0.2
        mask[0] = True
        out.append(
            Example(
                input_ids=rng.integers(3, VOCAB, prompt + completion).astype(np.int64),
                completion_start=prompt,
                logprobs=rng.normal(-5.5, 0.3, completion).astype(np.float32),
                mask=mask,
                advantage=float(rng.normal()),
                sample_weight=float(rng.uniform(0.5, 1.5)),
                source=f"row {i}",
                reward=i / 4,
            )
        )
    return out


def _start_logprobs(model: Any, examples: Sequence[Example]) -> list[np.ndarray]:
    """Each row's log-probs under ``model``, moved a little: ratios differ from 1, so the
    clipped, truncated and KL terms of the loss all take part."""
    rng = np.random.default_rng(9)
    out = []
    with torch.no_grad():
        for i in range(len(examples)):
            mb = collate(examples, [i], device=CPU)
            values = mb.gather(token_logprobs(model, mb, True))[0]
            out.append(values + rng.normal(0, 0.2, len(values)).astype(np.float32))
    return out


def _loss_and_grads(
    model: Any, examples: Sequence[Example], start: Sequence[np.ndarray],
    batches: Sequence[Sequence[int]], *, packed: int | None,
) -> tuple[float, torch.Tensor, list[torch.Tensor]]:  # fmt: skip
    model.zero_grad(set_to_none=True)
    normalizer = sum(examples[i].tokens for b in batches for i in b)
    total, stats = 0.0, torch.zeros(len(STEP_STAT_NAMES), dtype=torch.float64)
    for rows in batches:
        loss, micro_stats, _ = micro_batch_loss(
            model, examples, start, rows, normalizer=normalizer, settings=SETTINGS,
            device=CPU, keep_logits=True, packed=packed,
        )  # fmt: skip
        loss.backward()  # type: ignore[no-untyped-call]
        total += float(loss.detach())
        stats += micro_stats
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    return total, stats, grads


@pytest.mark.parametrize("build", [tiny_gpt2, tiny_llama], ids=["gpt2", "llama"])
def test_packed_and_unpacked_micro_batches_give_the_same_loss_and_gradients(build: Any) -> None:
    model = _no_dropout(build(seed=4))
    examples = _examples(9)
    start = _start_logprobs(model, examples)
    unpacked = [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    packed = [[0, 1, 2, 3, 4], [5, 6, 7, 8]]
    loss_a, stats_a, grads_a = _loss_and_grads(model, examples, start, unpacked, packed=None)
    # Lines of up to 24 tokens: several rows per line, several lines per micro-batch.
    loss_b, stats_b, grads_b = _loss_and_grads(model, examples, start, packed, packed=24)
    assert loss_a == pytest.approx(loss_b, rel=1e-5, abs=1e-7)
    torch.testing.assert_close(stats_a, stats_b, rtol=1e-5, atol=1e-6)
    assert stats_a[3] > 0 and stats_a[2] > 0  # some tokens clipped; KL away from zero
    rows = dict(zip(STEP_STAT_NAMES, stats_b.tolist(), strict=True))
    # each row once, however its tokens fall on lines
    assert (rows["rows"], rows["rewarded_rows"]) == (9, 9)
    assert rows["reward"] == pytest.approx(sum(i / 4 for i in range(9)))
    assert len(grads_a) == len(grads_b)
    for a, b in zip(grads_a, grads_b, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)

    # The test can fail: the same packed rows with positions running on (no restart), so
    # that each row sees the rows before it, give another loss.
    mb = collate(examples, packed[0], device=CPU, packed=1000)
    mb.position_ids = None
    with torch.no_grad():
        leaked = mb.gather(token_logprobs(model, mb, True))
        alone = collate(examples, packed[0], device=CPU)
        right = alone.gather(token_logprobs(model, alone, True))
    leaked_by_row = dict(zip(mb.rows, leaked, strict=True))
    right_by_row = dict(zip(alone.rows, right, strict=True))
    # The first row of the line sees nothing before it; every later one sees its neighbours.
    assert np.allclose(leaked_by_row[mb.rows[0]], right_by_row[mb.rows[0]], atol=1e-5)
    assert all(not np.allclose(leaked_by_row[r], right_by_row[r], atol=1e-4) for r in mb.rows[1:])


def test_a_model_that_ignores_packed_positions_is_told_apart() -> None:
    # The check the trainer runs before training packed: the models it supports pass, a
    # model that drops the position ids (its rows would see each other) does not.
    for build in (tiny_gpt2, tiny_llama):
        model = _no_dropout(build(seed=2)).eval()
        assert packing_keeps_rows_apart(model, VOCAB, CPU)

        def blind(model: Any = model, **kwargs: Any) -> Any:
            kwargs.pop("position_ids", None)
            return model(**kwargs)

        assert not packing_keeps_rows_apart(blind, VOCAB, CPU)


def test_a_packed_batch_lines_each_row_up_with_its_own_tokens() -> None:
    examples = _examples(8, seed=2)
    lengths = row_lengths(examples)
    rows = [2, 0, 3, 5, 7, 6]
    width = max(lengths) + 4
    mb = collate(examples, rows, device=CPU, packed=width)
    lines = pack_lines(rows, lengths, width)
    assert 1 < len(lines) < len(rows)  # several rows per line, several lines
    assert mb.input_ids.shape == (len(lines), max(sum(lengths[i] for i in ln) for ln in lines))
    assert mb.position_ids is not None and mb.lines is not None
    assert sorted(mb.rows) == sorted(rows) and mb.tokens == sum(examples[i].tokens for i in rows)
    for n, line in enumerate(lines):
        # Positions restart at each row of the line; padding after the last is 0.
        expected = np.concatenate([np.arange(lengths[i]) for i in line])
        positions = mb.position_ids[n].numpy()
        np.testing.assert_array_equal(positions[: len(expected)], expected)
        assert not positions[len(expected) :].any()
    for row, line, cols in zip(mb.rows, mb.lines, mb.columns, strict=True):
        e = examples[row]
        np.testing.assert_array_equal(
            mb.targets[line, cols].numpy(), e.input_ids[e.completion_start :]
        )
        assert mb.mask[line, cols].numpy().tolist() == e.mask.tolist()
        n = e.completion_length
        assert mb.advantages[line, cols].tolist() == pytest.approx([e.advantage] * n)
        assert mb.sample_weight[line, cols].tolist() == pytest.approx([e.sample_weight] * n)


@pytest.mark.parametrize("packed", [None, 24])
def test_token_budget_bounds_every_micro_batch_and_every_rank_runs_the_same_count(
    packed: int | None,
) -> None:
    lengths = {0: row_lengths(_examples(40, seed=5)), 1: row_lengths(_examples(23, seed=6))}
    budget = 48
    schedule = make_schedule(
        [40, 23], 400, batch_tokens=100, micro_batch_size=1, epochs=2, max_steps=None, seed=3
    )
    from dataclasses import replace

    schedule = replace(schedule, micro_batch_tokens=budget, packed=packed)
    gas = max(most_micro_batches(lengths[r], schedule, rank=r) for r in (0, 1))
    schedule = replace(schedule, gradient_accumulation_steps=gas)
    for rank, sizes in lengths.items():
        for epoch in (0, 1):
            batches = epoch_micro_batches(sizes, schedule, epoch=epoch, rank=rank)
            assert len(batches) == schedule.micro_batches_per_epoch
            assert sorted(i for b in batches for i in b) == list(range(len(sizes)))
            for b in batches:
                if len(b) > 1:
                    # What goes through the model, padding included, as collate builds it.
                    examples = _examples(len(sizes), seed=5 + rank)
                    assert (
                        collate(examples, b, device=CPU, packed=packed).input_ids.numel() <= budget
                    )
        # Deterministic: a resumed run recomputes the same micro-batches.
        assert step_micro_batches(sizes, schedule, step=3, rank=rank) == step_micro_batches(
            tuple(sizes), schedule, step=3, rank=rank
        )
    # Packing fills the budget: fewer forward passes than padded rows need.
    if packed:
        padded = replace(schedule, packed=None, gradient_accumulation_steps=100)

        def passes(schedule: Any) -> int:
            return sum(1 for b in epoch_micro_batches(lengths[0], schedule, epoch=0, rank=0) if b)

        assert passes(schedule) < passes(padded)
    with pytest.raises(TypeError, match="row_lengths"):
        epoch_micro_batches(40, schedule, epoch=0, rank=0)


def test_activation_checkpointing_takes_effect_and_changes_no_gradient() -> None:
    examples = _examples(6, seed=8)
    saved: dict[bool, int] = {}
    results = {}
    for checkpointing in (False, True):
        model = tiny_llama(seed=1)
        set_training_mode(model, activation_checkpointing=checkpointing)
        assert model.is_activation_checkpointing is checkpointing
        start = _start_logprobs(model, examples)
        count = 0

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            nonlocal count
            count += tensor.numel()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            results[checkpointing] = _loss_and_grads(
                model, examples, start, [[0, 1, 2, 3, 4, 5]], packed=False
            )
        saved[checkpointing] = count
    # Recomputed in backward, not kept from forward: fewer saved activations.
    assert saved[True] < 0.8 * saved[False], saved
    assert results[True][0] == pytest.approx(results[False][0], rel=1e-6)
    for a, b in zip(results[True][2], results[False][2], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
