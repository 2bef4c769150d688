"""The learning rule of one cycle as a pure function of per-token log-probs.

It is the part of the trainer that must be right to the last detail, so it lives apart from
DeepSpeed and models and is tested on hand-computed tensors; the trainer and the benchmark's
plain-PyTorch baseline call this one function, so they cannot disagree about the loss.

For each completion token with ``mask`` true (``A`` the row's advantage, ``sw`` its sample
weight, ``N`` the ``normalizer``: the masked tokens of the whole global batch)::

    w     = min(exp(logp_old - logp_serve), is_truncation)     truncated IS (detached)
    r     = exp(logp - logp_old)                               PPO ratio
    obj   = min(r * A, clip(r, 1 - clip_ratio, 1 + clip_ratio) * A)
    kl    = exp(logp_ref - logp) - (logp_ref - logp) - 1       k3 estimator, >= 0
    loss  = sum(sw * -(w * obj - kl_coef * kl)) / N

``logp_old`` is the policy at the start of the cycle, ``logp_serve`` what the serving
engine logged, ``logp_ref`` the parent checkpoint's (in the trainer the same numbers as
``logp_old``: the cycle starts from the parent). All three, and ``logp``, are log-probs of
the distribution the row was sampled from: at its temperature, truncated by its top-p and
top-k where the engine logged processed log-probs (:mod:`rtrl_trainer.logprobs`).
Normalising by ``N`` rather than by each micro-batch's own count makes the gradient a token
mean over the global batch however the tokens are split over micro-batches and ranks.

Truncation makes ``-inf`` a possible log-prob: a token outside a policy's top-p/top-k.
Where ``logp_old`` is ``-inf`` the start policy could not have sampled the token (a bf16
engine kept a token at the edge of the nucleus that the trainer's float32 does not): its
importance weight is 0 and it contributes nothing (counted in ``tokens``, ``unsupported``).
Where only ``logp`` is ``-inf`` the update pushed the token out: ``r = 0``, and the k3 term
is clamped like any other extreme log-ratio.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

# Order of the entries of PolicyLoss.stats: sums over masked tokens, so that micro-batches
# and ranks combine by addition (one all-reduce per optimizer step).
STAT_NAMES = (
    "tokens",
    "loss",
    "kl",
    "clipped",
    "truncated",
    "advantage",
    "is_weight",
    "ratio",
    "unsupported",
)
# After STAT_NAMES in a step's stats (STEP_STAT_NAMES): sums over the micro-batch's rows,
# each row once whatever its tokens (:func:`row_stats`), combined by addition the same way.
ROW_STAT_NAMES = ("rows", "rewarded_rows", "reward")
STEP_STAT_NAMES = (*STAT_NAMES, *ROW_STAT_NAMES)
# exp() of a log-ratio beyond this overflows float32 long before it means anything; the
# k3 term is clamped there (KL stays >= 0 and exact for any realistic policy move).
_KL_LOG_RATIO_LIMIT = 20.0


@dataclass(frozen=True)
class LossSettings:
    """The RLCycle's ``training`` knobs of the learning rule (see the module docstring)."""

    clip_ratio: float
    is_truncation: float
    kl_coef: float


@dataclass(frozen=True)
class PolicyLoss:
    """``loss``: the scalar to backpropagate. ``stats``: float64 sums in STAT_NAMES order,
    detached; divide by ``stats[0]`` (tokens) for means."""

    loss: Tensor
    stats: Tensor


def policy_loss(
    logp: Tensor,
    logp_old: Tensor,
    logp_serve: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    settings: LossSettings,
    normalizer: float,
    logp_ref: Tensor | None = None,
    sample_weight: Tensor | None = None,
) -> PolicyLoss:
    """The policy loss of one micro-batch (see the module docstring for the formula).

    Per-token tensors are ``(B, T)``; ``advantages`` and ``sample_weight`` are per row
    ``(B,)`` or per token ``(B, T)``. ``logp_ref`` None (or ``kl_coef`` 0 with no reference)
    leaves the KL term out. Positions with ``mask`` false contribute nothing and their
    values are never used, so callers may pad them with anything.
    """
    if normalizer <= 0:
        raise ValueError(f"normalizer must be positive, got {normalizer}")
    mask = mask.bool()
    zero = torch.zeros((), dtype=torch.float32, device=logp.device)
    # Masked-out positions are replaced before any exp(), so padding can never overflow
    # into a NaN gradient (0 * inf) through torch.where's unselected branch.
    lp = torch.where(mask, logp.float(), zero)
    old = torch.where(mask, logp_old.float(), zero)
    serve = torch.where(mask, logp_serve.float(), zero)
    ref_in = None if logp_ref is None else torch.where(mask, logp_ref.float(), zero)
    adv = _per_token(advantages, lp)
    weight = _per_token(sample_weight, lp) if sample_weight is not None else None
    # Tokens the start policy gives no probability: weight 0, every term neutral (0 - 0),
    # so that no inf - inf reaches the loss or its gradient.
    unsupported = old == -math.inf
    if bool(unsupported.any()):
        lp = torch.where(unsupported, zero, lp)
        old = torch.where(unsupported, zero, old)
        serve = torch.where(unsupported, zero, serve)
        if ref_in is not None:
            ref_in = torch.where(unsupported, zero, ref_in)

    log_is = old - serve
    log_cap = math.log(settings.is_truncation)
    truncated = log_is > log_cap
    is_weight = torch.exp(torch.clamp(log_is, max=log_cap)).detach()
    is_weight = torch.where(unsupported, zero, is_weight)

    ratio = torch.exp(lp - old)
    clipped_ratio = torch.clamp(ratio, 1.0 - settings.clip_ratio, 1.0 + settings.clip_ratio)
    unclipped_obj = ratio * adv
    clipped_obj = clipped_ratio * adv
    objective = torch.minimum(unclipped_obj, clipped_obj)
    clipped = clipped_obj < unclipped_obj

    per_token = -(is_weight * objective)
    kl = torch.zeros_like(lp)
    if ref_in is not None:
        delta = torch.clamp(ref_in - lp, -_KL_LOG_RATIO_LIMIT, _KL_LOG_RATIO_LIMIT)
        kl = torch.exp(delta) - delta - 1.0
        if settings.kl_coef:
            per_token = per_token + settings.kl_coef * kl
    if weight is not None:
        per_token = per_token * weight
    per_token = torch.where(mask, per_token, zero)
    loss = per_token.sum() / normalizer

    fmask = mask.float()
    with torch.no_grad():
        stats = torch.stack(
            [
                fmask.sum(),
                per_token.sum(),
                (kl * fmask).sum(),
                (clipped & mask).float().sum(),
                (truncated & mask).float().sum(),
                (adv * fmask).sum(),
                (is_weight * fmask).sum(),
                (ratio * fmask).sum(),
                (unsupported & mask).float().sum(),
            ]
        ).double()
    return PolicyLoss(loss=loss, stats=stats)


def _per_token(values: Tensor, like: Tensor) -> Tensor:
    values = values.to(device=like.device, dtype=torch.float32)
    if values.dim() == 1:
        return values[:, None].expand_as(like)
    return values


def row_stats(rewards: Sequence[float | None], device: torch.device | None = None) -> Tensor:
    """A micro-batch's row sums (float64, ROW_STAT_NAMES order) from its rows' rewards
    (None: a row without one): rows, rows with a reward, and the sum of those rewards."""
    known = [r for r in rewards if r is not None]
    return torch.tensor(
        [len(rewards), len(known), math.fsum(known)], dtype=torch.float64, device=device
    )


def summarize(stats: Tensor) -> dict[str, float]:
    """Means from summed stats (:class:`PolicyLoss` ``stats``, or a step's in
    STEP_STAT_NAMES order): loss (already a token mean), kl, clip_fraction,
    truncation_fraction, mean_advantage, mean_is_weight, mean_ratio, unsupported_fraction
    (tokens outside the start policy's top-p/top-k), and tokens; and, from
    a step's row sums, mean_reward: the mean combined reward of the step's rows, each row
    counted once however many tokens it has (mean_advantage, by contrast, weighs each row by
    its tokens), present only when every row had a reward."""
    values = [float(v) for v in stats.detach().cpu().tolist()]
    names = STEP_STAT_NAMES if len(values) == len(STEP_STAT_NAMES) else STAT_NAMES
    sums = dict(zip(names, values, strict=True))
    tokens = sums["tokens"]
    if tokens <= 0:
        return {"tokens": 0.0}
    rows = sums.get("rows", 0.0)
    rewarded = rows > 0 and sums["rewarded_rows"] == rows
    return {
        "tokens": tokens,
        "loss": sums["loss"] / tokens,
        "kl": sums["kl"] / tokens,
        "clip_fraction": sums["clipped"] / tokens,
        "truncation_fraction": sums["truncated"] / tokens,
        "mean_advantage": sums["advantage"] / tokens,
        "mean_is_weight": sums["is_weight"] / tokens,
        "mean_ratio": sums["ratio"] / tokens,
        "unsupported_fraction": sums["unsupported"] / tokens,
        **({"mean_reward": sums["reward"] / rows} if rewarded else {}),
    }
