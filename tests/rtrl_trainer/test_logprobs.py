"""Log-probs under the sampling distribution (rtrl_trainer.logprobs) against hand-computed
values on tiny vocabularies: temperature, top-k (ties kept), top-p (the largest token
always kept), both together, each position with its own settings, and the gradient
flowing through the kept tokens only."""

from __future__ import annotations

import math

import pytest
import torch

from rtrl.core.shards.sampling import PROCESSED_LOGPROBS, RAW_LOGPROBS
from rtrl_trainer.logprobs import Sampling, sampled_logprobs

INF = math.inf
# Probabilities 0.5, 0.3, 0.15, 0.05 at temperature 1.
PROBS = [0.5, 0.3, 0.15, 0.05]
LOGITS = [math.log(p) for p in PROBS]


def _one(logits: list[float], target: int, **params: float) -> float:
    kwargs = {name: torch.tensor([value]) for name, value in params.items()}
    out = sampled_logprobs(torch.tensor([logits]), torch.tensor([target]), **kwargs)
    return float(out[0])


def test_temperature_one_without_truncation_is_the_log_softmax() -> None:
    assert _one(LOGITS, 1) == pytest.approx(math.log(0.3), abs=1e-6)
    assert _one(LOGITS, 1, temperature=1.0, top_p=1.0, top_k=0) == pytest.approx(
        math.log(0.3), abs=1e-6
    )


def test_temperature_divides_the_logits() -> None:
    z = [0.0, 1.0, 2.0]
    # T = 0.5: logits 0, 2, 4
    expected = 4 - math.log(1 + math.exp(2) + math.exp(4))
    assert _one(z, 2, temperature=0.5) == pytest.approx(expected, abs=1e-6)
    # T = 2: probabilities flatten
    expected = 0 - math.log(1 + math.exp(0.5) + math.exp(1))
    assert _one(z, 0, temperature=2.0) == pytest.approx(expected, abs=1e-6)


def test_top_k_keeps_the_k_largest_and_renormalises() -> None:
    # k = 2 keeps 0.5 and 0.3: renormalised over 0.8
    assert _one(LOGITS, 0, top_k=2) == pytest.approx(math.log(0.5 / 0.8), abs=1e-6)
    assert _one(LOGITS, 1, top_k=2) == pytest.approx(math.log(0.3 / 0.8), abs=1e-6)
    assert _one(LOGITS, 2, top_k=2) == -INF  # outside: could not have been sampled
    # k at or beyond the vocabulary, 0 or -1: no truncation
    for k in (4, 9, 0, -1):
        assert _one(LOGITS, 3, top_k=k) == pytest.approx(math.log(0.05), abs=1e-6)


def test_top_k_keeps_ties_at_the_threshold() -> None:
    logits = [1.0, 2.0, 2.0, 0.0]
    # k = 1: the threshold is 2, both 2s are kept (vLLM compares values)
    assert _one(logits, 1, top_k=1) == pytest.approx(math.log(0.5), abs=1e-6)
    assert _one(logits, 2, top_k=1) == pytest.approx(math.log(0.5), abs=1e-6)
    assert _one(logits, 0, top_k=1) == -INF


def test_top_p_removes_the_tail_whose_mass_is_at_most_one_minus_p() -> None:
    # ascending: 0.05, 0.15, 0.3, 0.5; cumulative 0.05, 0.2, 0.5, 1.0
    # p = 0.75 removes cumulative <= 0.25: 0.05 and 0.15; kept mass 0.8
    assert _one(LOGITS, 0, top_p=0.75) == pytest.approx(math.log(0.5 / 0.8), abs=1e-6)
    assert _one(LOGITS, 2, top_p=0.75) == -INF
    # p = 0.9 removes cumulative <= 0.1: 0.05 only; kept mass 0.95
    assert _one(LOGITS, 2, top_p=0.9) == pytest.approx(math.log(0.15 / 0.95), abs=1e-6)
    # a tiny p keeps the largest token alone: log-prob 0
    assert _one(LOGITS, 0, top_p=0.01) == pytest.approx(0.0, abs=1e-6)
    assert _one(LOGITS, 1, top_p=0.01) == -INF


def test_top_k_then_top_p_on_what_top_k_kept() -> None:
    # k = 3 drops 0.05; renormalised 0.158, 0.316, 0.526 (cumulative 0.158, 0.474, 1);
    # p = 0.8 then removes cumulative <= 0.2: the 0.15 token; kept 0.5 + 0.3
    assert _one(LOGITS, 0, top_k=3, top_p=0.8) == pytest.approx(math.log(0.5 / 0.8), abs=1e-6)
    assert _one(LOGITS, 2, top_k=3, top_p=0.8) == -INF
    # without the top-k the 0.15 token has cumulative 0.2: p = 0.82 (removes cumulative
    # <= 0.18) keeps it
    assert _one(LOGITS, 2, top_p=0.82) == pytest.approx(math.log(0.15 / 0.95), abs=1e-6)


def test_temperature_applies_before_truncation() -> None:
    # T = 0.5 squares the probabilities: 0.25, 0.09, 0.0225, 0.0025 (/ 0.365)
    squared = [p * p for p in PROBS]
    total = sum(squared)
    tempered = [q / total for q in squared]  # 0.685, 0.247, 0.062, 0.007
    # p = 0.9: cumulative ascending 0.007, 0.068, 0.315, 1: removes the two smallest
    kept = tempered[0] + tempered[1]
    got = _one(LOGITS, 1, temperature=0.5, top_p=0.9)
    assert got == pytest.approx(math.log(tempered[1] / kept), abs=1e-5)


def test_each_position_gets_its_own_parameters() -> None:
    logits = torch.tensor([LOGITS] * 4)
    targets = torch.tensor([1, 1, 1, 1])
    out = sampled_logprobs(
        logits,
        targets,
        temperature=torch.tensor([1.0, 0.5, 1.0, 1.0]),
        top_p=torch.tensor([1.0, 1.0, 0.75, 1.0]),
        top_k=torch.tensor([0, 0, 0, 1]),
    )
    squared = [p * p for p in PROBS]
    assert out.tolist() == pytest.approx(
        [math.log(0.3), math.log(squared[1] / sum(squared)), math.log(0.3 / 0.8), -INF],
        abs=1e-5,
    )


def test_where_limits_truncation_to_the_loss_positions() -> None:
    logits = torch.tensor([[LOGITS, LOGITS]])  # (1, 2, V): a grid like the trainer's
    targets = torch.tensor([[2, 2]])
    out = sampled_logprobs(
        logits, targets, top_k=torch.tensor([[2, 2]]), where=torch.tensor([[False, True]])
    )
    # position 0 is not a loss position: untruncated (and never used)
    assert out[0, 0].item() == pytest.approx(math.log(0.15), abs=1e-6)
    assert out[0, 1].item() == -INF


def test_gradient_flows_through_the_kept_tokens_only() -> None:
    logits = torch.tensor([LOGITS], requires_grad=True)
    out = sampled_logprobs(logits, torch.tensor([0]), top_k=torch.tensor([2]))
    out.sum().backward()
    assert logits.grad is not None
    # d/dz (z_0 - logsumexp(z_0, z_1)) = (1 - q0, -q1, 0, 0) with q the kept distribution
    q0, q1 = 0.5 / 0.8, 0.3 / 0.8
    assert logits.grad[0].tolist() == pytest.approx([1 - q0, -q1, 0.0, 0.0], abs=1e-6)
    # with a temperature, scaled by 1/T
    logits.grad = None
    out = sampled_logprobs(logits, torch.tensor([0]), temperature=torch.tensor([2.0]))
    out.sum().backward()
    tempered = torch.softmax(torch.tensor(LOGITS) / 2, -1).tolist()
    expected = [((i == 0) - tempered[i]) / 2 for i in range(4)]
    assert logits.grad[0].tolist() == pytest.approx(expected, abs=1e-6)


def test_a_target_outside_the_kept_set_has_no_nan_gradient() -> None:
    logits = torch.tensor([LOGITS], requires_grad=True)
    out = sampled_logprobs(logits, torch.tensor([3]), top_k=torch.tensor([1]))
    assert out.item() == -INF
    torch.exp(out).sum().backward()  # a ratio of 0
    assert logits.grad is not None
    assert torch.isfinite(logits.grad).all()


def test_many_rows_are_cut_in_chunks_with_the_same_result(monkeypatch: pytest.MonkeyPatch) -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(37, 50, generator=generator) * 3
    targets = logits.argsort(dim=-1, descending=True)[:, 3]  # the 4th most likely
    params = {
        "temperature": torch.rand(37, generator=generator) + 0.5,
        "top_p": torch.rand(37, generator=generator) * 0.5 + 0.5,
        "top_k": torch.randint(0, 20, (37,), generator=generator),
    }
    whole = sampled_logprobs(logits, targets, **params)
    monkeypatch.setattr("rtrl_trainer.logprobs._CUT_CHUNK_ELEMENTS", 100)  # 2 rows a chunk
    chunked = sampled_logprobs(logits, targets, **params)
    assert torch.equal(whole, chunked)


@pytest.mark.parametrize(
    ("columns", "expected"),
    [
        ((None, None, None, None), Sampling()),
        ((0.7, None, None, RAW_LOGPROBS), Sampling(temperature=0.7)),
        # truncation only counts for processed log-probs
        ((1.0, 0.9, 40, RAW_LOGPROBS), Sampling()),
        ((0.7, 0.9, 40, PROCESSED_LOGPROBS), Sampling(0.7, 0.9, 40)),
        ((None, None, -1, PROCESSED_LOGPROBS), Sampling()),
    ],
)
def test_a_rows_sampling_from_its_columns(
    columns: tuple[float | None, float | None, int | None, str | None], expected: Sampling
) -> None:
    got = Sampling.of_row(*columns)
    assert got.temperature == pytest.approx(expected.temperature)
    assert got.top_p == pytest.approx(expected.top_p)
    assert got.top_k == expected.top_k
    assert got.is_default == expected.is_default
