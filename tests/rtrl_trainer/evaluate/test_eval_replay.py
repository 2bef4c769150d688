"""The replay suite scores held-out rows the way the trainer does
(rtrl_trainer.evaluate.replay): under each row's sampling distribution, and not at all when
the row's logged log-probs cannot be matched."""

from __future__ import annotations

import math
from pathlib import Path

import pyarrow as pa
import pytest
import torch

from rtrl_trainer.evaluate import replay
from rtrl_trainer.evaluate.model import EvalModel
from rtrl_trainer.logprobs import Sampling
from tests.rtrl_trainer.trainset import tiny_gpt2

P, R = "processed_logprobs", "raw_logprobs"


def _table(n: int, **sampling: list[object]) -> pa.Table:
    columns: dict[str, object] = {
        "prompt_ids": [[5, 6, 7]] * n,
        "completion_ids": [[8, 9, 10]] * n,
        "completion_mask": [[True, True, True]] * n,
        "edit_persisted": [1.0] * n,
    }
    table = pa.table(columns)
    types = {"temperature": pa.float32(), "top_p": pa.float32(), "top_k": pa.int32(),
             "logprobs_mode": pa.string()}  # fmt: skip
    for name, values in sampling.items():
        table = table.append_column(name, pa.array(values, types[name]))
    return table


def test_unmatched_rows_are_not_replayed_but_counted() -> None:
    table = _table(
        5,
        temperature=[None, 0.7, 0.7, 0.0, 1.0],
        top_p=[None, 0.9, None, None, 0.8],
        logprobs_mode=[None, P, R, P, None],
    )
    refused = replay.Refused()
    rows = replay.rows_from_table(table, refused=refused)
    assert [r.sampling for r in rows] == [
        Sampling(),
        Sampling(temperature=pytest.approx(0.7), top_p=pytest.approx(0.9)),
    ]
    assert refused.by_reason == {
        "raw_logprobs_tempered": 1,
        "greedy": 1,
        "raw_logprobs_truncated": 1,
    }
    # A held-out set staged before the columns existed: every row at the defaults.
    assert [r.sampling.is_default for r in replay.rows_from_table(_table(2))] == [True, True]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> EvalModel:
    directory = tmp_path_factory.mktemp("eval-model")
    net = tiny_gpt2(seed=3)
    with torch.no_grad():
        net.lm_head.weight.mul_(4.0)  # far from uniform: temperature matters
    net.save_pretrained(directory)
    return EvalModel(directory, label="parent")


def _by_hand(model: EvalModel, temperature: float) -> float:
    with torch.no_grad():
        logits = model.model(input_ids=torch.tensor([[5, 6, 7, 8, 9, 10]])).logits[0, 2:5]
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return float(logp.gather(1, torch.tensor([[8], [9], [10]]))[:, 0].mean())


def test_log_likelihood_is_under_the_rows_temperature(model: EvalModel) -> None:
    rows = replay.rows_from_table(_table(2, temperature=[None, 0.5], logprobs_mode=[None, P]))
    plain, tempered = replay.loglik_values(model, rows)
    assert plain == pytest.approx(_by_hand(model, 1.0), abs=1e-5)
    assert tempered == pytest.approx(_by_hand(model, 0.5), abs=1e-5)
    assert abs(plain - tempered) > 0.05  # the test can fail: temperature matters here


def test_a_token_outside_the_rows_top_k_scores_the_floor(model: EvalModel) -> None:
    (row,) = replay.rows_from_table(_table(1, top_k=[1], logprobs_mode=[P]))
    with torch.no_grad():
        logits = model.model(input_ids=torch.tensor([[5, 6, 7, 8, 9, 10]])).logits[0, 2:5]
    top = logits.argmax(-1).tolist()
    expected = [0.0 if top[j] == t else replay.LOGLIK_FLOOR for j, t in enumerate([8, 9, 10])]
    (value,) = replay.loglik_values(model, [row])
    assert value == pytest.approx(sum(expected) / 3)
    assert math.isfinite(value)


def test_kl_is_between_the_tempered_distributions(model: EvalModel, tmp_path: Path) -> None:
    other = tiny_gpt2(seed=4)
    other.save_pretrained(tmp_path / "candidate")
    candidate = EvalModel(tmp_path / "candidate", label="candidate")
    rows = replay.rows_from_table(_table(2, temperature=[None, 0.5], logprobs_mode=[None, P]))
    plain, tempered = replay.kl_values(candidate, model, rows)
    with torch.no_grad():
        ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
        c = candidate.model(input_ids=ids).logits[0, 2:5].float() / 0.5
        p = model.model(input_ids=ids).logits[0, 2:5].float() / 0.5
    c, p = torch.log_softmax(c, -1), torch.log_softmax(p, -1)
    assert tempered == pytest.approx(float((c.exp() * (c - p)).sum(-1).mean()), rel=1e-4)
    assert plain != pytest.approx(tempered, rel=0.01)
