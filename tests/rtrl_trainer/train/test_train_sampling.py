"""Each staged row trains under the distribution it was sampled from
(rtrl_trainer.train.sampling, .batches, .forward): the rank file's sampling columns become
each row's Sampling, every position of a packed line or micro-batch gets its own row's
temperature and truncation, and rows whose log-probs cannot be matched are skipped and
counted."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from rtrl_trainer.logprobs import Sampling
from rtrl_trainer.train.batches import collate
from rtrl_trainer.train.examples import DataError, Example, read_rank
from rtrl_trainer.train.forward import micro_batch_loss, token_logprobs
from rtrl_trainer.train.loss import STEP_STAT_NAMES, LossSettings
from tests.rtrl_trainer.trainset import TRAINSET_SCHEMA, VOCAB, Row, tiny_gpt2

CPU = torch.device("cpu")
SETTINGS = LossSettings(clip_ratio=0.2, is_truncation=2.0, kl_coef=0.05)
SAMPLINGS = [
    Sampling(),
    Sampling(temperature=0.5),
    Sampling(temperature=1.3, top_p=0.6),
    Sampling(temperature=0.8, top_k=5),
    Sampling(temperature=0.7, top_p=0.9, top_k=12),
]


def _peaked(seed: int = 4) -> Any:
    """A tiny GPT-2 whose distributions are far from uniform (temperature matters)."""
    model = tiny_gpt2(seed=seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)  # tied to the embeddings
    return model.eval()


def _examples(model: Any, n: int, seed: int = 0) -> list[Example]:
    """Rows whose completions are the model's first or second most likely tokens (mostly
    inside each row's top-p/top-k), each row with one of SAMPLINGS."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        prompt = rng.integers(3, VOCAB, int(rng.integers(2, 10))).tolist()
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(int(rng.integers(3, 8))):
                logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
                ids.append(int(logits.argsort(descending=True)[int(rng.integers(0, 2))]))
        completion = len(ids) - len(prompt)
        out.append(
            Example(
                input_ids=np.asarray(ids, dtype=np.int64),
                completion_start=len(prompt),
                logprobs=np.full(completion, -0.7, np.float32),
                mask=np.ones(completion, dtype=np.bool_),
                advantage=float(rng.normal()),
                sample_weight=1.0,
                source=f"row {i}",
                sampling=SAMPLINGS[i % len(SAMPLINGS)],
            )
        )
    return out


def _by_hand(model: Any, e: Example) -> list[float]:
    """The row's completion log-probs computed alone, the plain way: log-softmax of the
    logits / T over the kept tokens (top-k by value, then top-p over the rest sorted)."""
    s = e.sampling
    with torch.no_grad():
        logits = model(input_ids=torch.from_numpy(e.input_ids)[None]).logits[0].float()
    out = []
    for j in range(e.completion_length):
        position = e.completion_start + j
        z = (logits[position - 1] / s.temperature).tolist()
        order = sorted(range(len(z)), key=lambda t: -z[t])  # descending
        kept = order[: s.top_k] if s.top_k >= 1 else order
        if s.top_p < 1:
            top = max(z[t] for t in kept)
            probs = [math.exp(z[t] - top) for t in kept]
            total = sum(probs)
            mass, nucleus = 0.0, []
            # keep from the largest while the mass above is below top_p (the complement of
            # vLLM's "cumulative from the smallest <= 1 - p")
            for t, prob in zip(kept, probs, strict=True):
                if mass >= s.top_p * total and nucleus:
                    break
                nucleus.append(t)
                mass += prob
            kept = nucleus
        target = int(e.input_ids[position])
        if target not in kept:
            out.append(-math.inf)
            continue
        top = max(z[t] for t in kept)
        lse = top + math.log(sum(math.exp(z[t] - top) for t in kept))
        out.append(z[target] - lse)
    return out


@pytest.mark.parametrize("packed", [None, 40], ids=["unpacked", "packed"])
def test_each_position_gets_its_own_rows_distribution(packed: int | None) -> None:
    model = _peaked()
    examples = _examples(model, 10)
    rows = list(range(10))
    mb = collate(examples, rows, device=CPU, packed=packed)
    if packed:
        assert mb.lines is not None and len(set(mb.lines)) < len(rows)  # rows share lines
    got = mb.gather(token_logprobs(model, mb, True))
    for row, values in zip(mb.rows, got, strict=True):
        expected = _by_hand(model, examples[row])
        assert values.tolist() == pytest.approx(expected, abs=2e-5), examples[row].sampling
    # The test can fail: the same rows at temperature 1 without truncation give other numbers.
    plain = [
        Example(**{**e.__dict__, "sampling": Sampling()}) for e in examples
    ]  # fmt: skip
    mb_plain = collate(plain, rows, device=CPU, packed=packed)
    assert mb_plain.sampling is None
    plain_values = mb_plain.gather(token_logprobs(model, mb_plain, True))
    moved = [
        float(np.max(np.abs(a - b)))
        for a, b, r in zip(got, plain_values, mb.rows, strict=True)
        if not examples[r].sampling.is_default
    ]
    assert len(moved) == 8 and min(moved) > 0.05, moved


def test_packed_and_unpacked_give_the_same_loss_and_gradients_under_mixed_sampling() -> None:
    model = _peaked(seed=5).train()
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    examples = _examples(model, 10, seed=1)
    with torch.no_grad():
        start = []
        for i in range(len(examples)):
            mb = collate(examples, [i], device=CPU)
            start.append(mb.gather(token_logprobs(model, mb, True))[0])
    # Most tokens lie inside their row's truncation; the others (weight 0) take part too.
    flat = np.concatenate(start)
    assert len(flat) / 2 < np.isfinite(flat).sum() < len(flat)

    def run(batches: list[list[int]], packed: int | None) -> tuple[float, list[torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        total = 0.0
        stats = torch.zeros(len(STEP_STAT_NAMES), dtype=torch.float64)
        for rows in batches:
            loss, micro, _ = micro_batch_loss(
                model, examples, start, rows, normalizer=sum(e.tokens for e in examples),
                settings=SETTINGS, device=CPU, keep_logits=True, packed=packed,
            )  # fmt: skip
            loss.backward()  # type: ignore[no-untyped-call]
            total += float(loss.detach())
            stats += micro
        assert stats[STEP_STAT_NAMES.index("is_weight")] > 0
        return total, [p.grad.clone() for p in model.parameters() if p.grad is not None]

    loss_a, grads_a = run([[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]], None)
    loss_b, grads_b = run([[0, 1, 2, 3, 4, 5, 6], [7, 8, 9]], 30)
    assert loss_a == pytest.approx(loss_b, rel=1e-5, abs=1e-7)
    for a, b in zip(grads_a, grads_b, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


# --- reading the rank file's columns --------------------------------------------------------


def _rank_file(tmp_path: Path, sampling: dict[str, list[Any]]) -> list[tuple[str, Path]]:
    n = len(next(iter(sampling.values())))
    rows = [Row(prompt=[5, 6, 7], completion=[8, 9], advantage=1.0) for _ in range(n)]
    table = pa.Table.from_pylist([r.record() for r in rows], schema=TRAINSET_SCHEMA)
    types = {"temperature": pa.float32(), "top_p": pa.float32(), "top_k": pa.int32(),
             "logprobs_mode": pa.string()}  # fmt: skip
    for name, values in sampling.items():
        table = table.append_column(name, pa.array(values, types[name]))
    name = "train/rank-00000-of-00001.parquet"
    path = tmp_path / "rank.parquet"
    pq.write_table(table, path)
    return [(name, path)]


def _read(paths: list[tuple[str, Path]]) -> Any:
    return read_rank(
        paths, rank=0, world_size=1, one_per_rank=True, vocab_size=VOCAB, max_sequence_length=64
    )


def test_the_rank_files_sampling_columns_become_each_rows_sampling(tmp_path: Path) -> None:
    p, r = "processed_logprobs", "raw_logprobs"
    data = _read(
        _rank_file(
            tmp_path,
            {
                "temperature": [None, 0.7, 0.7, 1.0, 0.5, 0.0],
                "top_p": [None, 0.9, None, 0.9, None, None],
                "top_k": [None, 20, None, None, None, None],
                "logprobs_mode": [None, p, r, r, None, p],
            },
        )
    )
    assert [e.sampling for e in data.examples] == [
        Sampling(),
        Sampling(temperature=pytest.approx(0.7), top_p=pytest.approx(0.9), top_k=20),
    ]
    # raw at 0.7, raw truncated, raw (null) at 0.5, greedy: skipped and counted
    assert data.skipped.by_reason == {
        "raw_logprobs_tempered": 2,
        "raw_logprobs_truncated": 1,
        "greedy": 1,
    }
    assert data.skipped.rows_read == 6
    assert "row 2 " in data.skipped.examples[0]


def test_a_set_without_sampling_columns_trains_at_the_defaults(tmp_path: Path) -> None:
    paths = _rank_file(tmp_path, {"temperature": [None, None]})
    table = pq.read_table(paths[0][1]).drop_columns(["temperature"])
    pq.write_table(table, paths[0][1])
    data = _read(paths)
    assert [e.sampling.is_default for e in data.examples] == [True, True]
    assert data.skipped.rows == 0


def test_an_impossible_sampling_value_stops_the_run_naming_the_row(tmp_path: Path) -> None:
    paths = _rank_file(tmp_path, {"temperature": [1.0, -0.5], "top_p": [1.0, 1.0]})
    with pytest.raises(DataError, match=r"row 1 \(interaction .*temperature=-0.5"):
        _read(paths)
