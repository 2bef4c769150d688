"""The model's side of a training step: per-token log-probs, the loss of one micro-batch,
and the gradient norm.

The loss itself is loss.py's pure function; this module feeds it the model's numbers on the
micro-batch's loss grid (batches.py). :func:`micro_batch_loss` is shared by the trainer and
the benchmark's plain-PyTorch baseline, so both compute exactly the same loss.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from rtrl_trainer.logprobs import sampled_logprobs
from rtrl_trainer.train.batches import Schedule, collate, epoch_micro_batches, row_lengths
from rtrl_trainer.train.examples import Example
from rtrl_trainer.train.loss import STEP_STAT_NAMES, LossSettings, policy_loss, row_stats

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine

# A step's stats vector: the loss and row stats (STEP_STAT_NAMES), then these entries.
INPUT_TOKENS = len(STEP_STAT_NAMES)
NONFINITE = len(STEP_STAT_NAMES) + 1
GRAD_NORM = len(STEP_STAT_NAMES) + 2  # only where DeepSpeed does not report it (ZeRO-0 fp32)
STATS_SIZE = len(STEP_STAT_NAMES) + 3


def token_logprobs(model: Callable[..., Any], mb: Any, keep_logits: bool) -> torch.Tensor:
    """Log-prob of each target token of the micro-batch's loss grid, (B, K) float32, under
    the distribution its row was sampled from (temperature, top-p/top-k: the micro-batch's
    ``sampling`` grids; :mod:`rtrl_trainer.logprobs`); a loss token outside its row's
    top-p/top-k gets -inf."""
    length = int(mb.input_ids.shape[1])
    kwargs: dict[str, Any] = {"logits_to_keep": length - mb.first} if keep_logits else {}
    if mb.position_ids is not None:
        kwargs["position_ids"] = mb.position_ids
    logits = model(input_ids=mb.input_ids, use_cache=False, **kwargs).logits
    if not keep_logits:
        logits = logits[:, mb.first :]
    logits = logits[:, :-1].float()
    if mb.sampling is not None:
        temperature, top_p, top_k = mb.sampling
        return sampled_logprobs(
            logits, mb.targets, temperature=temperature, top_p=top_p, top_k=top_k, where=mb.mask
        )
    picked = logits.gather(-1, mb.targets.unsqueeze(-1)).squeeze(-1)
    logp: torch.Tensor = picked - torch.logsumexp(logits, dim=-1)
    return logp


@torch.no_grad()
def start_logprobs(
    model: Callable[..., Any],
    *,
    examples: Sequence[Example],
    schedule: Schedule,
    rank: int,
    device: torch.device,
    keep_logits: bool,
) -> list[np.ndarray]:
    """Each row's completion log-probs under the current (parent) weights, before any
    update. Micro-batches as in epoch 0, so the first step sees exactly these numbers;
    filler micro-batches run too (ZeRO-3 gathers weights in collectives)."""
    out: list[np.ndarray] = [np.zeros(0, np.float32)] * len(examples)
    for rows in epoch_micro_batches(row_lengths(examples), schedule, epoch=0, rank=rank):
        mb = collate(examples, rows, device=device, packed=schedule.packed)
        logp = token_logprobs(model, mb, keep_logits)
        if mb.rows:
            for row, values in zip(mb.rows, mb.gather(logp), strict=True):
                out[row] = values
    return out


@torch.no_grad()
def packing_keeps_rows_apart(
    model: Callable[..., Any], vocab_size: int, device: torch.device
) -> bool:
    """Whether ``model`` keeps packed rows apart (batches.collate, packed): the second of two
    rows packed with restarting position ids must score as it does alone, far closer than
    with positions running on. A model whose attention ignores the restarts fails; trained
    packed, each row would learn from the rows before it. Every rank runs it (ZeRO-3)."""
    ids = torch.tensor([(7 * i + 3) % vocab_size for i in range(16)], device=device)[None]
    restart = torch.arange(8, device=device).repeat(2)[None]

    def second_row(**kwargs: Any) -> torch.Tensor:
        logits = model(input_ids=ids, use_cache=False, **kwargs).logits[:, 8:].float()
        return torch.log_softmax(logits, dim=-1)

    alone = torch.log_softmax(model(input_ids=ids[:, 8:], use_cache=False).logits.float(), -1)
    apart = float((second_row(position_ids=restart) - alone).abs().max())
    leaked = float((second_row() - alone).abs().max())
    return apart <= 0.1 * leaked


def micro_batch_loss(
    model: Callable[..., Any],
    examples: Sequence[Example],
    start_lp: Sequence[np.ndarray],
    rows: Sequence[int],
    *,
    normalizer: int,
    settings: LossSettings,
    device: torch.device,
    keep_logits: bool,
    packed: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(loss, summed stats in STEP_STAT_NAMES order: the loss's over tokens, then its rows'
    with their rewards, input tokens) of one micro-batch: shared by the trainer and the
    benchmark's plain-PyTorch baseline."""
    mb = collate(examples, rows, device=device, packed=packed)
    # To the device with collate's copies, before the forward is queued (a copy from the
    # host waits for the stream).
    rewards = row_stats([examples[i].reward for i in mb.rows], device=device)
    logp = token_logprobs(model, mb, keep_logits)
    # Filler micro-batches have no rows; their loss is zero whatever "old" holds.
    old = mb.scatter([start_lp[i] for i in mb.rows]) if mb.rows else mb.logp_serve
    result = policy_loss(
        logp,
        old,
        mb.logp_serve,
        mb.advantages,
        mb.mask,
        settings=settings,
        normalizer=normalizer,
        logp_ref=old,
        sample_weight=mb.sample_weight,
    )
    return result.loss, torch.cat([result.stats, rewards]), mb.input_tokens


def unsharded_grad_norm(engine: DeepSpeedEngine) -> float:
    """The gradient norm before the step where DeepSpeed's optimizer does not record it
    (no ZeRO, fp32: the gradients are whole, and already reduced, on every rank); 0 else."""
    if engine.zero_optimization_stage() or engine.bfloat16_enabled():
        return 0.0
    grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
    return float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0


def grad_norm(engine: DeepSpeedEngine, stats: torch.Tensor) -> float | None:
    """The step's gradient norm: DeepSpeed's, else the one in ``stats`` (None: unknown)."""
    norm = engine.get_global_grad_norm()
    if norm is None:
        # Summed over ranks by the stats all-reduce; every rank had the same value.
        return float(stats[GRAD_NORM]) / dist.get_world_size() if stats[GRAD_NORM] else None
    return float(norm.item() if isinstance(norm, torch.Tensor) else norm)


def step_line(m: dict[str, Any], total: int) -> str:
    """A step's one progress line."""
    if m.get("tokens", 0) == 0:
        return f"step {m['step']}/{total}: no tokens"
    norm = m["grad_norm"]
    rate = m["tokens"] / m["seconds"] if m["seconds"] > 0 else 0.0
    reward = f"reward {m['mean_reward']:+.3f}  " if "mean_reward" in m else ""
    return (
        f"step {m['step']}/{total}  loss {m['loss']:+.5f}  kl {m['kl']:.2e}  "
        f"clip {m['clip_fraction']:.3f}  trunc {m['truncation_fraction']:.3f}  "
        f"adv {m['mean_advantage']:+.3f}  {reward}|g| {'-' if norm is None else f'{norm:.3g}'}  "
        f"tokens {int(m['tokens'])}  {rate:,.0f} tok/s"
    )
