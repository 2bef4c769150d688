"""The learning rule (rtrl_trainer.train.loss) against hand-computed values on tiny tensors: the
first step is REINFORCE, clipping and truncation engage exactly at their boundaries, the
KL term is non-negative and zero at the parent, and the token mean does not depend on how
a batch is split into micro-batches."""

from __future__ import annotations

import math

import pytest
import torch

from rtrl_trainer.train.loss import (
    STAT_NAMES,
    LossSettings,
    policy_loss,
    row_stats,
    summarize,
)

SETTINGS = LossSettings(clip_ratio=0.2, is_truncation=2.0, kl_coef=0.1)


def _t(*values: float) -> torch.Tensor:
    return torch.tensor([list(values)], dtype=torch.float32)


def _stats(stats: torch.Tensor) -> dict[str, float]:
    return dict(zip(STAT_NAMES, stats.tolist(), strict=True))


def test_hand_computed_loss_and_stats() -> None:
    # token 1: on-policy, nothing moved:             w=1, r=1,       obj=+1,    kl=0
    # token 2: policy rose e^0.5 = 1.6487 > 1.2, A>0: clipped, obj=1.2, kl=e^-0.5+0.5-1
    # token 3: serving logged 1 nat lower, e^1 > 2:  truncated, w=2, obj=-1 (A=-1)
    # token 4: tool output (mask false) holding garbage: ignored entirely
    logp = _t(-1.0, -0.5, -1.0, float("nan"))
    old = _t(-1.0, -1.0, -1.0, float("inf"))
    serve = _t(-1.0, -1.0, -2.0, float("-inf"))
    advantages = _t(1.0, 1.0, -1.0, 5.0)
    mask = torch.tensor([[True, True, True, False]])
    out = policy_loss(
        logp, old, serve, advantages, mask, settings=SETTINGS, normalizer=3, logp_ref=old
    )
    kl2 = math.exp(-0.5) + 0.5 - 1  # 0.1065306597
    per_token = [-1.0, -(1.2 - 0.1 * kl2), -(2.0 * -1.0)]
    assert out.loss.item() == pytest.approx(sum(per_token) / 3, abs=1e-6)
    stats = _stats(out.stats)
    assert stats["tokens"] == 3
    assert stats["clipped"] == 1
    assert stats["truncated"] == 1
    assert stats["kl"] == pytest.approx(kl2, abs=1e-6)
    assert stats["advantage"] == pytest.approx(1.0)
    assert stats["is_weight"] == pytest.approx(1 + 1 + 2)
    assert stats["ratio"] == pytest.approx(1 + math.exp(0.5) + 1, abs=1e-5)
    means = summarize(out.stats)
    assert means["clip_fraction"] == pytest.approx(1 / 3)
    assert means["truncation_fraction"] == pytest.approx(1 / 3)
    assert means["loss"] == pytest.approx(out.loss.item(), abs=1e-6)


def test_mean_reward_is_a_mean_over_rows_not_tokens() -> None:
    # Two rows whose advantage is their reward: +1 over three tokens, -1 over one. Tokens
    # weigh the advantage (+0.5); each row counts once in the reward (0).
    zero = torch.zeros(2, 3)
    mask = torch.tensor([[True, True, True], [True, False, False]])
    out = policy_loss(
        zero, zero, zero, torch.tensor([1.0, -1.0]), mask, settings=SETTINGS, normalizer=4
    )
    step = torch.cat([out.stats, row_stats([1.0, -1.0])])
    means = summarize(step)
    assert means["mean_advantage"] == pytest.approx(0.5)
    assert means["mean_reward"] == pytest.approx(0.0)
    # Micro-batches and ranks add up: the same rows split in two give the same mean.
    split = torch.cat([out.stats, row_stats([1.0])]) + torch.cat(
        [torch.zeros_like(out.stats), row_stats([-1.0])]
    )
    assert summarize(split)["mean_reward"] == pytest.approx(0.0)
    # A row without a reward: none for the step, not a mean over the others.
    assert "mean_reward" not in summarize(torch.cat([out.stats, row_stats([1.0, None])]))
    assert "mean_reward" not in summarize(torch.cat([out.stats, row_stats([None, None])]))
    assert "mean_reward" not in summarize(out.stats)  # the loss's own stats: no rows


def test_first_step_gradient_is_reinforce_with_the_advantage() -> None:
    # Policy = the cycle's start = what served: every ratio is 1, no clip, no truncation,
    # and the k3 term has zero gradient; what remains is -A * sw * grad(logp) / N.
    generator = torch.Generator().manual_seed(0)
    logp = -torch.rand(3, 5, generator=generator) * 4
    mask = torch.rand(3, 5, generator=generator) > 0.3
    advantages = torch.randn(3, generator=generator)
    weights = torch.rand(3, generator=generator) + 0.5
    n = int(mask.sum())
    policy = logp.clone().requires_grad_(True)
    out = policy_loss(
        policy,
        logp,
        logp,
        advantages,
        mask,
        settings=SETTINGS,
        normalizer=n,
        logp_ref=logp,
        sample_weight=weights,
    )
    out.loss.backward()
    expected = -(advantages * weights)[:, None] * mask.float() / n
    assert policy.grad is not None
    torch.testing.assert_close(policy.grad, expected)
    assert _stats(out.stats)["clipped"] == 0 and _stats(out.stats)["truncated"] == 0


def test_first_step_parameter_gradient_matches_reinforce_on_a_model() -> None:
    # The same through a real (linear softmax) policy: gradients w.r.t. its weights agree
    # with the textbook REINFORCE surrogate -sum(A * log pi(a|s)) / N.
    torch.manual_seed(1)
    states = torch.randn(4, 6, 8)
    actions = torch.randint(0, 10, (4, 6))
    mask = torch.rand(4, 6) > 0.2
    advantages = torch.randn(4)
    policy = torch.nn.Linear(8, 10)

    def logprobs() -> torch.Tensor:
        logits = policy(states).log_softmax(-1)
        return logits.gather(-1, actions[..., None])[..., 0]

    with torch.no_grad():
        start = logprobs()
    n = int(mask.sum())
    out = policy_loss(
        logprobs(), start, start, advantages, mask, settings=SETTINGS, normalizer=n, logp_ref=start
    )
    ours = torch.autograd.grad(out.loss, list(policy.parameters()))
    reinforce = -(advantages[:, None] * logprobs() * mask).sum() / n
    theirs = torch.autograd.grad(reinforce, list(policy.parameters()))
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b)


def _logp_for_ratio(target: float, beyond: int) -> torch.Tensor:
    """A float32 log-prob whose ratio to log-prob 0 is exactly float32(``target``), or (for
    ``beyond`` +1/-1) the first float32 ratio above/below it."""
    goal = torch.tensor(target, dtype=torch.float32)
    lp = torch.log(goal)
    for _ in range(16):
        r = torch.exp(lp)
        if r == goal:
            break
        lp = torch.nextafter(lp, torch.tensor(1.0 if r < goal else -1.0))
    else:
        raise AssertionError(f"no float32 log-prob gives ratio {target}")
    while beyond and not (torch.exp(lp) - goal) * beyond > 0:
        lp = torch.nextafter(lp, torch.tensor(float(beyond)))
    return lp


@pytest.mark.parametrize(
    ("bound", "beyond", "advantage", "clipped"),
    [
        (1.2, 0, 1.0, False),  # exactly at the upper bound: clip(r) == r, nothing changes
        (1.2, 1, 1.0, True),  # the next ratio above it, A > 0: clipped
        (1.2, 1, -1.0, False),  # above it but A < 0: min() keeps r * A, the lower value
        (0.8, 0, -1.0, False),  # exactly at the lower bound
        (0.8, -1, -1.0, True),  # the next ratio below it, A < 0: clipped
        (0.8, -1, 1.0, False),  # below it but A > 0: min() keeps r * A
        (1.5, 0, 0.0, False),  # no advantage, nothing to clip
    ],
)
def test_clipping_engages_exactly_past_the_bound(
    bound: float, beyond: int, advantage: float, clipped: bool
) -> None:
    logp = _logp_for_ratio(bound, beyond)[None, None].clone().requires_grad_(True)
    zero = torch.zeros(1, 1)
    out = policy_loss(
        logp,
        zero,
        zero,
        torch.tensor([advantage]),
        torch.tensor([[True]]),
        settings=LossSettings(clip_ratio=0.2, is_truncation=2.0, kl_coef=0.0),
        normalizer=1,
    )
    out.loss.backward()
    assert _stats(out.stats)["clipped"] == (1.0 if clipped else 0.0)
    assert logp.grad is not None
    # A clipped token contributes no gradient; an unclipped one -A * r.
    expected = 0.0 if clipped else -advantage * math.exp(float(logp.detach()))
    assert float(logp.grad) == pytest.approx(expected, abs=1e-6)


def test_truncation_engages_exactly_past_the_cap() -> None:
    cap = 2.0
    log_cap = torch.tensor(math.log(cap), dtype=torch.float32)
    below = torch.nextafter(log_cap, torch.tensor(0.0))
    above = torch.nextafter(log_cap, torch.tensor(10.0))
    old = torch.stack([below, log_cap, above, torch.tensor(5.0)])[None, :]
    serve = torch.zeros_like(old)
    out = policy_loss(
        old.clone(),
        old,
        serve,
        torch.ones(1),
        torch.ones_like(old, dtype=torch.bool),
        settings=LossSettings(clip_ratio=0.2, is_truncation=cap, kl_coef=0.0),
        normalizer=4,
    )
    # Only the tokens whose ratio exceeds the cap are truncated (the last two); the weight
    # is the ratio below the cap and the cap above it.
    assert _stats(out.stats)["truncated"] == 2
    assert _stats(out.stats)["is_weight"] == pytest.approx(
        math.exp(float(below)) + 2.0 + 2.0 + 2.0, abs=1e-5
    )
    # Truncated importance weights scale the loss: -(sum of w * r * A) / N with r = 1.
    assert out.loss.item() == pytest.approx(-(math.exp(float(below)) + 6.0) / 4, abs=1e-5)


def test_kl_is_nonnegative_and_zero_at_the_parent() -> None:
    generator = torch.Generator().manual_seed(2)
    ref = -torch.rand(64, 32, generator=generator) * 20
    logp = -torch.rand(64, 32, generator=generator) * 20
    mask = torch.ones_like(ref, dtype=torch.bool)
    zero_adv = torch.zeros(64)
    settings = LossSettings(clip_ratio=0.2, is_truncation=2.0, kl_coef=1.0)
    apart = policy_loss(
        logp, ref, ref, zero_adv, mask, settings=settings, normalizer=1, logp_ref=ref
    )
    assert _stats(apart.stats)["kl"] > 0
    # With zero advantage the loss is the KL term alone: k3 >= 0 token by token.
    delta = ref - logp
    per_token = torch.exp(delta) - delta - 1
    assert bool((per_token >= 0).all())
    assert apart.loss.item() == pytest.approx(per_token.sum().item(), rel=1e-5)
    same = policy_loss(ref, ref, ref, zero_adv, mask, settings=settings, normalizer=1, logp_ref=ref)
    assert same.loss.item() == 0.0
    assert _stats(same.stats)["kl"] == 0.0


def test_kl_gradient_pulls_toward_the_parent_and_vanishes_without_coefficient() -> None:
    ref = torch.tensor([[-1.0, -1.0]])
    logp = torch.tensor([[-0.5, -2.0]], requires_grad=True)
    mask = torch.ones_like(ref, dtype=torch.bool)
    settings = LossSettings(clip_ratio=0.2, is_truncation=2.0, kl_coef=1.0)
    policy_loss(logp, logp.detach(), logp.detach(), torch.zeros(1), mask, settings=settings,
                normalizer=1, logp_ref=ref).loss.backward()  # fmt: skip
    assert logp.grad is not None
    # Above the parent: descending the loss lowers logp; below it: raises it.
    assert logp.grad[0, 0] > 0 and logp.grad[0, 1] < 0
    plain = torch.tensor([[-0.5, -2.0]], requires_grad=True)
    out = policy_loss(
        plain,
        plain.detach(),
        plain.detach(),
        torch.zeros(1),
        mask,
        settings=LossSettings(clip_ratio=0.2, is_truncation=2.0, kl_coef=0.0),
        normalizer=1,
        logp_ref=ref,
    )
    out.loss.backward()
    assert plain.grad is not None and bool((plain.grad == 0).all())
    assert _stats(out.stats)["kl"] > 0  # still reported


def test_token_mean_is_the_same_however_the_batch_is_split() -> None:
    # Micro-batches normalised by the global token count add up to the whole batch's loss
    # and gradient, which is what makes accumulation and data parallelism exact.
    generator = torch.Generator().manual_seed(3)
    logp = -torch.rand(6, 7, generator=generator) * 3
    old = logp + 0.3 * torch.randn(6, 7, generator=generator)
    serve = old + 0.5 * torch.randn(6, 7, generator=generator)
    advantages = torch.randn(6, generator=generator)
    weights = torch.rand(6, generator=generator)
    mask = torch.rand(6, 7, generator=generator) > 0.4
    n = int(mask.sum())

    def loss_and_grad(rows: slice) -> tuple[float, torch.Tensor]:
        x = logp.clone().requires_grad_(True)
        out = policy_loss(
            x[rows],
            old[rows],
            serve[rows],
            advantages[rows],
            mask[rows],
            settings=SETTINGS,
            normalizer=n,
            logp_ref=old[rows],
            sample_weight=weights[rows],
        )
        out.loss.backward()
        assert x.grad is not None
        return out.loss.item(), x.grad

    whole_loss, whole_grad = loss_and_grad(slice(0, 6))
    a_loss, a_grad = loss_and_grad(slice(0, 2))
    b_loss, b_grad = loss_and_grad(slice(2, 6))
    assert a_loss + b_loss == pytest.approx(whole_loss, abs=1e-6)
    torch.testing.assert_close(a_grad + b_grad, whole_grad)


def test_sample_weight_scales_a_rows_contribution() -> None:
    logp = torch.tensor([[-1.0], [-1.0]])
    mask = torch.ones_like(logp, dtype=torch.bool)
    out = policy_loss(
        logp,
        logp,
        logp,
        torch.tensor([1.0, 1.0]),
        mask,
        settings=SETTINGS,
        normalizer=2,
        sample_weight=torch.tensor([0.0, 3.0]),
    )
    assert out.loss.item() == pytest.approx(-3.0 / 2)


def test_masked_garbage_gives_no_nan_gradient() -> None:
    logp = torch.tensor([[-1.0, -1e30]], requires_grad=True)
    old = torch.tensor([[-1.0, 1e30]])
    serve = torch.tensor([[-1.0, float("nan")]])
    out = policy_loss(
        logp,
        old,
        serve,
        torch.tensor([1.0]),
        torch.tensor([[True, False]]),
        settings=SETTINGS,
        normalizer=1,
        logp_ref=old,
    )
    out.loss.backward()
    assert logp.grad is not None and bool(torch.isfinite(logp.grad).all())
    assert float(logp.grad[0, 1]) == 0.0


def test_normalizer_must_be_positive() -> None:
    x = torch.zeros(1, 1)
    with pytest.raises(ValueError, match="normalizer"):
        policy_loss(x, x, x, torch.zeros(1), x.bool(), settings=SETTINGS, normalizer=0)


def test_a_token_outside_the_start_policys_support_has_weight_zero() -> None:
    # token 1: ordinary, on-policy: w=1, r=1, obj=A=1
    # token 2: the start policy keeps it out of its top-p (logp_old -inf): w=0, nothing
    #          of it reaches the loss or the gradient, whatever A and logp are
    for advantage in (1.0, -1.0, 0.0):
        logp = torch.tensor([[-1.0, -0.5]], requires_grad=True)
        old = torch.tensor([[-1.0, -math.inf]])
        serve = torch.tensor([[-1.0, -3.0]])
        out = policy_loss(
            logp,
            old,
            serve,
            torch.tensor([[1.0, advantage]]),
            torch.tensor([[True, True]]),
            settings=SETTINGS,
            normalizer=2,
            logp_ref=old,
        )
        assert out.loss.item() == pytest.approx(-1.0 / 2)
        out.loss.backward()
        assert logp.grad is not None
        assert logp.grad[0].tolist() == pytest.approx([-1.0 / 2, 0.0])
        stats = _stats(out.stats)
        assert stats["tokens"] == 2
        assert stats["unsupported"] == 1
        assert stats["is_weight"] == pytest.approx(1.0)
        assert stats["kl"] == 0.0
        assert summarize(out.stats)["unsupported_fraction"] == pytest.approx(0.5)


def test_a_token_the_update_pushed_out_of_the_support_has_ratio_zero() -> None:
    # logp -inf, logp_old finite: r = 0. A > 0: min(0, 0.8) = 0; A < 0: min(0, -0.8) =
    # -0.8 (clipped). The k3 term is clamped at the log-ratio limit; no NaN anywhere.
    for advantage, objective in ((1.0, 0.0), (-1.0, -0.8)):
        logp = torch.tensor([[-math.inf]], requires_grad=True)
        old = torch.tensor([[-1.0]])
        out = policy_loss(
            logp,
            old,
            old,
            torch.tensor([advantage]),
            torch.tensor([[True]]),
            settings=LossSettings(clip_ratio=0.2, is_truncation=2.0, kl_coef=0.0),
            normalizer=1,
            logp_ref=old,
        )
        assert out.loss.item() == pytest.approx(-objective)
        out.loss.backward()
        assert logp.grad is not None and bool(torch.isfinite(logp.grad).all())
        stats = _stats(out.stats)
        assert stats["ratio"] == 0.0
        assert stats["kl"] == pytest.approx(math.exp(20) - 21, rel=1e-5)
        assert stats["unsupported"] == 0
