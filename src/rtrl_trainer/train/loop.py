"""``rtrl-job train``: one cycle of on-policy policy-gradient training with DeepSpeed.

The training loop, read top to bottom:

1. setup: the inputs fetched and verified (state.py), this rank's rows and the schedule
   every rank follows (examples.py, batches.py), the policy and its DeepSpeed engine
   (engine.py), then resume from the last saved state or compute the start-of-cycle
   log-probs (resume.py);
2. for each optimizer step: its micro-batches, forward, loss (forward.py, loss.py),
   backward, step; its TensorBoard scalars and progress line (events.py); DeepSpeed state
   saved every ``saveEverySteps`` steps;
3. publish: rank 0 writes the Hugging Face checkpoint and train.json (publish.py).

Exit codes: 0 done (or already done), 1 training cannot go on (one line on stderr, nothing
published), 2 bad configuration (cli.py, through the shared runner).
"""

from __future__ import annotations

import math
import os
import shutil
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from rtrl.core.store import StoreError, open_store
from rtrl_trainer import checkpoint_io as cio
from rtrl_trainer.runner import EXIT_FAILED, EXIT_OK
from rtrl_trainer.train.batches import row_lengths, step_micro_batches
from rtrl_trainer.train.collectives import (
    Ranks,
    TrainAbortError,
    distributed_env,
    exit_now,
    fail,
    say,
)
from rtrl_trainer.train.config import TrainConfig
from rtrl_trainer.train.engine import build_engine, start_distributed
from rtrl_trainer.train.events import RunEvents
from rtrl_trainer.train.examples import DataError, Example
from rtrl_trainer.train.forward import (
    GRAD_NORM,
    INPUT_TOKENS,
    NONFINITE,
    STATS_SIZE,
    grad_norm,
    micro_batch_loss,
    unsharded_grad_norm,
)
from rtrl_trainer.train.loss import STEP_STAT_NAMES, LossSettings, summarize
from rtrl_trainer.train.publish import delete_leftover_state, publish_checkpoint
from rtrl_trainer.train.resume import run_fingerprint, save_state, start_or_resume
from rtrl_trainer.train.state import load_data, scratch_dir, share_inputs

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine

# Test-only: exit hard (as a killed pod would) right after step N and its saved state.
TEST_EXIT_ENV = "RTRL_TEST_EXIT_AFTER_STEP"


def run(config: TrainConfig) -> int:
    """Run the train step in this process (one rank); the process exit code."""
    started = time.time()
    try:
        out_store = open_store(config.out, endpoint_url=config.endpoint_url)
        if out_store.committed("") is not None:
            say(f"{config.out} is already committed: nothing to do", force=True)
            if int(os.environ.get("RANK", "0")) == 0:
                delete_leftover_state(out_store)
            return EXIT_OK
        ranks = distributed_env(os.environ)
    except (StoreError, TrainAbortError) as exc:
        return fail(exc)
    device = start_distributed(config, ranks)
    code = EXIT_OK
    try:
        train(config, ranks, device=device, started=started)
    except (TrainAbortError, StoreError, cio.InputError, DataError) as exc:
        # An agreed abort is raised on every rank: rank 0 alone says it.
        code = fail(exc) if ranks.is_main or not isinstance(exc, TrainAbortError) else EXIT_FAILED
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if ranks.world_size > 1:
        # Everything is committed and agreed by now. Leave without running C++ static
        # destructors: a communication thread still joinable at interpreter exit makes
        # std::terminate abort the process (seen as SIGABRT after a successful run), which
        # would turn a finished Job pod into a failed one.
        exit_now(code)
    return code


def train(config: TrainConfig, ranks: Ranks, *, device: torch.device, started: float) -> None:
    """One rank's run: setup, the loop, publish. Every rank runs the same collectives in
    the same order, so any rank's error is agreed and raised on all (collectives.py)."""
    # Setup: inputs, rows and schedule, engine, then resume or the start-of-cycle log-probs.
    scratch = scratch_dir(config)
    out_store = open_store(config.out, endpoint_url=config.endpoint_url)
    torch.manual_seed(config.training.seed)
    inputs = share_inputs(config, ranks, scratch)
    data = load_data(config, inputs, ranks, device)
    schedule, examples = data.schedule, data.examples
    say(
        f"{ranks.world_size} rank(s) on {device.type}, {config.training.precision}, "
        f"ZeRO-{config.training.zero_stage}: {sum(c[0] for c in data.counts)} rows, "
        f"{sum(c[1] for c in data.counts)} loss tokens; {schedule.total_steps} step(s) of "
        f"{schedule.gradient_accumulation_steps} micro-batch(es) of up to "
        f"{schedule.micro_batch_words()} per rank"
    )
    engine, dropout, keep_logits, load_memory = build_engine(
        inputs.model.directory,
        inputs.vocab_size,
        config,
        schedule,
        ranks,
        adapter=inputs.adapter,
        parent_adapter=inputs.parent_adapter,
    )
    fingerprint = run_fingerprint(config, inputs, ranks.world_size)
    start_step, start_lp, progress = start_or_resume(
        engine,
        out_store,
        scratch,
        config=config,
        data=data,
        ranks=ranks,
        fingerprint=fingerprint,
        device=device,
        keep_logits=keep_logits,
    )
    settings = LossSettings(
        clip_ratio=config.training.clip_ratio,
        is_truncation=config.training.is_truncation,
        kl_coef=config.training.kl_coef,
    )
    saves = config.trainer.save_every_steps
    watch = RunEvents(
        out_store, scratch, ranks=ranks, start_step=start_step, total_steps=schedule.total_steps
    )

    for step in range(start_step + 1, schedule.total_steps + 1):
        # Batch: this rank's micro-batches of the step (the same count on every rank).
        t0 = time.time()
        batches = step_micro_batches(row_lengths(examples), schedule, step=step, rank=ranks.rank)
        # Forward, loss, backward, step.
        stats = train_step(
            engine,
            examples,
            start_lp,
            batches,
            normalizer=data.step_norms[step - 1],
            settings=settings,
            world_size=ranks.world_size,
            device=device,
            keep_logits=keep_logits,
            step=step,
            packed=schedule.packed,
        )
        # Log.
        seconds = time.time() - t0
        norm = grad_norm(engine, stats)
        if norm is not None and not math.isfinite(norm):
            raise TrainAbortError(f"non-finite gradient norm at step {step}; nothing published")
        metrics: dict[str, Any] = dict(summarize(stats[: len(STEP_STAT_NAMES)]))
        metrics.update(step=step, grad_norm=norm, seconds=seconds)
        progress.history.append(metrics)
        progress.loop_seconds += seconds
        progress.input_tokens += float(stats[INPUT_TOKENS])
        watch.record(metrics, learning_rate=engine.get_lr()[0])
        # Checkpoint: the DeepSpeed state, for a restarted pod to resume from.
        if saves and step % saves == 0 and step < schedule.total_steps:
            save_state(
                engine,
                out_store,
                scratch,
                step=step,
                ranks=ranks,
                fingerprint=fingerprint,
                progress=progress,
                started=started,
            )
            say(f"saved state at step {step} to {out_store.url(cio.step_prefix(step))}/")
            watch.upload()
        if os.environ.get(TEST_EXIT_ENV) == str(step):
            exit_now(137)

    # Publish.
    watch.close()
    publish_checkpoint(
        engine,
        out_store,
        scratch,
        config=config,
        inputs=inputs,
        data=data,
        progress=progress,
        ranks=ranks,
        device=device,
        dropout=dropout,
        start_step=start_step,
        started=started,
        load_memory=load_memory,
    )
    if ranks.local_rank == 0:
        shutil.rmtree(scratch, ignore_errors=True)


def train_step(
    engine: DeepSpeedEngine,
    examples: Sequence[Example],
    start_lp: Sequence[np.ndarray],
    batches: Sequence[Sequence[int]],
    *,
    normalizer: int,
    settings: LossSettings,
    world_size: int,
    device: torch.device,
    keep_logits: bool,
    step: int,
    packed: int | None = None,
) -> torch.Tensor:
    """One optimizer step over ``batches`` (this rank's micro-batches); the stats summed
    over all ranks (STEP_STAT_NAMES, input tokens, non-finite count)."""
    stats = torch.zeros(STATS_SIZE, dtype=torch.float64, device=device)
    for index, rows in enumerate(batches):
        loss, micro_stats, input_tokens = micro_batch_loss(
            engine,
            examples,
            start_lp,
            rows,
            normalizer=normalizer,
            settings=settings,
            device=device,
            keep_logits=keep_logits,
            packed=packed,
        )
        stats[: len(STEP_STAT_NAMES)] += micro_stats
        stats[INPUT_TOKENS] += input_tokens
        stats[NONFINITE] += (~torch.isfinite(loss.detach())).double()
        # The loss is already a mean over the global batch's tokens; DeepSpeed would also
        # divide by the accumulation steps (scale_wrt_gas) and average over ranks.
        engine.backward(loss * world_size, scale_wrt_gas=False)
        if index == len(batches) - 1:
            stats[GRAD_NORM] = unsharded_grad_norm(engine)
            # One collective per step: the metrics, and whether any rank saw a non-finite
            # loss, decided before the update so that a NaN never reaches the weights.
            dist.all_reduce(stats)
            if stats[NONFINITE] > 0:
                raise TrainAbortError(
                    f"non-finite loss at step {step} (check the staged set's advantages, "
                    "sample weights and log-probs); nothing published"
                )
        engine.step()
    return stats
