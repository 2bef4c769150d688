"""Log-probs under the distribution each completion was sampled from, as vLLM computes it.

The trainer's importance weight ``exp(logp_old - logp_logged)`` is only right when both
numbers describe the same distribution: the one the engine sampled from. vLLM (0.32,
``vllm/v1/sample/sampler.py`` and ``ops/topk_topp_sampler.py``) samples from::

    z = logits (float32) / temperature
    z = top_k_top_p(z)          # tokens outside the top-k, then outside the top-p: -inf
    sample ~ softmax(z)

and with ``--logprobs-mode processed_logprobs`` logs ``log_softmax(z)`` of the sampled
token. Top-k keeps the tokens whose logit is at least the k-th largest (ties kept); top-p
sorts the remaining tokens by logit, ascending, and removes those whose cumulative
probability is at most ``1 - top_p``, always keeping the largest. This module computes the
same numbers from the trainer's logits, per position, so packed lines and micro-batches of
rows sampled under different settings each get their own:

- :func:`sampled_logprobs`: the log-prob of each target token, differentiable; the
  truncation (which tokens are kept) is decided without gradient, like the engine's, and
  the log-prob is the tempered logit minus the log-sum-exp over the kept tokens;
- a target outside the kept set gets ``-inf``: the policy could not have sampled it (a
  bf16 engine can keep a token at the edge of the nucleus that the float32 trainer does
  not). The loss gives such a token importance weight 0 (:mod:`rtrl_trainer.train.loss`).

What a row's sampling columns mean, and which rows cannot be matched at all (raw log-probs
at another temperature or with truncation, greedy rows), is
:mod:`rtrl.core.shards.sampling`'s; here only rows whose log-probs can be matched arrive.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from rtrl.core.shards.sampling import PROCESSED_LOGPROBS

# Sorting whole vocabularies for the top-p cut is done this many elements at a time (the
# sort's values and int64 indices: ~200 MB), whatever the micro-batch.
_CUT_CHUNK_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class Sampling:
    """How one row was sampled, as far as its log-probs are concerned: ``temperature``,
    and the truncation that applies to its logged log-probs (``top_p`` below 1, ``top_k``
    at least 1; only for processed log-probs: raw ones describe the untruncated
    distribution, and rows sampled with truncation but logged raw never get here)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0

    @property
    def is_default(self) -> bool:
        """Temperature 1, no truncation: the model's own distribution."""
        return self.temperature == 1.0 and self.top_p >= 1.0 and self.top_k < 1

    @staticmethod
    def of_row(
        temperature: float | None,
        top_p: float | None,
        top_k: int | None,
        logprobs_mode: str | None,
    ) -> Sampling:
        """A row's sampling from its (nullable) shard columns: nulls are the neutral values;
        truncation counts only where the engine logged processed log-probs."""
        processed = logprobs_mode == PROCESSED_LOGPROBS
        t = 1.0 if temperature is None or not math.isfinite(temperature) else float(temperature)
        p = float(top_p) if processed and top_p is not None else 1.0
        k = int(top_k) if processed and top_k is not None else 0
        return Sampling(temperature=t, top_p=min(p, 1.0), top_k=max(k, 0))


DEFAULT = Sampling()


def sampled_logprobs(
    logits: Tensor,
    targets: Tensor,
    *,
    temperature: Tensor | None = None,
    top_p: Tensor | None = None,
    top_k: Tensor | None = None,
    where: Tensor | None = None,
) -> Tensor:
    """Log-prob of each target under its position's sampling distribution.

    ``logits`` ``(..., V)``; ``targets`` and the per-position parameters ``(...)``
    (``temperature`` float, ``top_p`` float in (0, 1], ``top_k`` int, 0 or >= V for none);
    a parameter left None is neutral everywhere. Truncation is computed only at positions
    ``where`` is true (the loss positions: elsewhere the value is never used, so the sort it
    needs is not paid). float32, differentiable through the kept logits; ``-inf`` for a
    target outside its position's kept set.
    """
    z = logits.float()
    if temperature is not None:
        z = z / temperature.to(z.device, torch.float32).unsqueeze(-1)
    picked = z.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    cut = _truncating(z.shape[-1], top_p, top_k, where, z.device)
    if cut is None:
        return picked - torch.logsumexp(z, dim=-1)
    positions = cut.nonzero(as_tuple=True)
    p = top_p[positions] if top_p is not None else None
    k = top_k[positions] if top_k is not None else None
    cutoff = torch.full(z.shape[:-1], -math.inf, device=z.device)
    cutoff[positions] = _cutoffs(z.detach()[positions], p, k)
    # Kept: at or above the cutoff (ties kept, as vLLM's top-k keeps them).
    removed = z.detach() < cutoff.unsqueeze(-1)
    lse = torch.logsumexp(z.masked_fill(removed, -math.inf), dim=-1)
    kept = picked.detach() >= cutoff
    minus_inf = torch.full_like(picked, -math.inf)
    return torch.where(kept, picked - lse, minus_inf)


def _truncating(
    vocab: int,
    top_p: Tensor | None,
    top_k: Tensor | None,
    where: Tensor | None,
    device: torch.device,
) -> Tensor | None:
    """The positions whose distribution is truncated; None when there are none."""
    cut: Tensor | None = None
    if top_p is not None:
        cut = top_p.to(device) < 1
    if top_k is not None:
        k = top_k.to(device)
        limited = (k >= 1) & (k < vocab)
        cut = limited if cut is None else cut | limited
    if cut is None:
        return None
    if where is not None:
        cut = cut & where.to(device)
    return cut if bool(cut.any()) else None


@torch.no_grad()
def _cutoffs(z: Tensor, top_p: Tensor | None, top_k: Tensor | None) -> Tensor:
    """The smallest kept logit of each row of ``z`` ``(N, V)`` (tempered) under its top-k
    and top-p, computed as vLLM's ``apply_top_k_top_p_pytorch`` does, in chunks of rows."""
    n, vocab = z.shape
    out = torch.empty(n, device=z.device)
    step = max(1, _CUT_CHUNK_ELEMENTS // vocab)
    for start in range(0, n, step):
        rows = slice(start, min(n, start + step))
        ordered, _ = z[rows].sort(dim=-1)  # ascending
        removed = torch.zeros_like(ordered, dtype=torch.bool)
        if top_k is not None:
            k = top_k[rows].to(torch.long)
            k = torch.where((k >= 1) & (k < vocab), k, torch.full_like(k, vocab))
            threshold = ordered.gather(1, (vocab - k).unsqueeze(1))
            removed |= ordered < threshold
        if top_p is not None:
            masked = ordered.masked_fill(removed, -math.inf)
            cumulative = masked.softmax(dim=-1).cumsum(dim=-1)
            p = top_p[rows].to(cumulative.dtype).unsqueeze(1)
            below = cumulative <= 1 - p
            below[:, -1] = False  # at least one token
            removed |= below
        first_kept = (~removed).to(torch.int8).argmax(dim=-1)
        out[rows] = ordered.gather(1, first_kept.unsqueeze(1)).squeeze(1)
    return out
