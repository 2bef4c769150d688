"""``rtrl-job train``: one cycle of on-policy policy-gradient training with DeepSpeed.

The training step is this one file, read top to bottom:

1. inputs: the staged training set and the parent checkpoint are downloaded to local
   scratch (by local rank 0 of each node) and verified against their manifests; every rank
   agrees on any error before anyone goes on, so a bad row read by rank 3 stops all ranks
   with one message instead of leaving the others waiting in a collective;
2. data: each rank reads and checks its rows; the schedule (steps, accumulation, per-step
   token counts) is agreed from all ranks' counts (batches.py);
3. model and engine: the parent in fp32 with dropout off, DeepSpeed configured from the
   typed config only (deepspeed_config.py);
4. start of the cycle: resume from the last committed DeepSpeed state, or compute once,
   before any update, the log-prob of every completion token under the parent. Those are
   at once the "old" policy of the PPO ratio (the policy at the start of the cycle) and the
   reference of the KL penalty (the parent), so no frozen copy of the model is kept;
5. the loop: forward, loss (loss.py), backward, step; DeepSpeed state committed to the
   store every ``saveEverySteps`` steps;
6. publish: rank 0 writes a Hugging Face checkpoint and train.json and commits them,
   manifest last.

Exit codes: 0 done (or already done), 1 training cannot go on (one line on stderr, nothing
published), 2 bad configuration (train_config.py).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import socket
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, MutableMapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from rtrl.core.api.checkpoint import TrainingSummary
from rtrl.core.store import MANIFEST_NAME, ObjectStore, StoreError, join_key, open_store
from rtrl_trainer import checkpoint_io as cio
from rtrl_trainer.batches import (
    DataError,
    Example,
    Schedule,
    assign_files,
    collate,
    epoch_micro_batches,
    make_schedule,
    read_rank,
    step_micro_batches,
    step_tokens,
)
from rtrl_trainer.deepspeed_config import deepspeed_config
from rtrl_trainer.loss import STAT_NAMES, LossSettings, policy_loss, summarize
from rtrl_trainer.train_config import TrainConfig, describe, fingerprint_source

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine

# Test-only: exit hard (as a killed pod would) right after step N and its saved state.
TEST_EXIT_ENV = "RTRL_TEST_EXIT_AFTER_STEP"
PROBE_LENGTH = 32
# Extra entries after the loss stats in a step's stats vector.
_INPUT_TOKENS = len(STAT_NAMES)
_NONFINITE = len(STAT_NAMES) + 1
_GRAD_NORM = len(STAT_NAMES) + 2  # only where DeepSpeed does not report it (ZeRO-0 fp32)

T = TypeVar("T")


class TrainAbortError(Exception):
    """Training cannot go on: exit 1 with this message; nothing is published."""


@dataclass(frozen=True)
class Ranks:
    rank: int
    local_rank: int
    world_size: int


@dataclass(frozen=True)
class Inputs:
    """What local rank 0 fetched and checked, shared with every rank."""

    parent: cio.Fetched
    data: cio.Fetched
    stage: dict[str, Any]
    vocab_size: int
    tokenizer_size: int | None


@dataclass
class Progress:
    """What a resumed run needs of the interrupted one (saved with the DeepSpeed state)."""

    history: list[dict[str, Any]] = field(default_factory=list)
    loop_seconds: float = 0.0
    input_tokens: float = 0.0
    earlier_wall_seconds: float = 0.0


# --- entry point ---------------------------------------------------------------------------


def run(config: TrainConfig) -> int:
    """Run the train step in this process (one rank); the process exit code."""
    started = time.time()
    try:
        out_store = open_store(config.out, endpoint_url=config.endpoint_url)
        if out_store.committed("") is not None:
            say(f"{config.out} is already committed: nothing to do", force=True)
            if int(os.environ.get("RANK", "0")) == 0:
                _delete_leftover_state(out_store)
            return 0
        ranks = distributed_env(os.environ)
    except (StoreError, TrainAbortError) as exc:
        print(f"rtrl-job train: {exc}", file=sys.stderr)
        return 1
    cuda = config.training.gpus_per_node > 0 and torch.cuda.is_available()
    prepare_runtime(cuda)
    import deepspeed

    if cuda:
        torch.cuda.set_device(ranks.local_rank)
    deepspeed.init_distributed(
        dist_backend="nccl" if cuda else "gloo", auto_mpi_discovery=False, verbose=False
    )
    code = 0
    try:
        train(config, ranks, device=torch.device("cuda" if cuda else "cpu"), started=started)
    except (TrainAbortError, StoreError, cio.InputError, DataError) as exc:
        if ranks.rank == 0 or not isinstance(exc, TrainAbortError):
            print(f"rtrl-job train: {exc}", file=sys.stderr)
        code = 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if ranks.world_size > 1:
        # Everything is committed and agreed by now. Leave without running C++ static
        # destructors: a communication thread still joinable at interpreter exit makes
        # std::terminate abort the process (seen as SIGABRT after a successful run), which
        # would turn a finished Job pod into a failed one.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def distributed_env(environ: MutableMapping[str, str]) -> Ranks:
    """The torchrun variables, filled in where this process is not launched by torchrun.

    Without RANK: one process per pod of an Indexed Job (rank = JOB_COMPLETION_INDEX, the
    pod template sets WORLD_SIZE, MASTER_ADDR, MASTER_PORT), or a single local process
    (DeepSpeed would otherwise look for MPI).
    """
    if "RANK" not in environ:
        index = environ.get("JOB_COMPLETION_INDEX")
        if index is not None and "WORLD_SIZE" in environ:
            environ["RANK"] = index
        else:
            environ["RANK"] = "0"
            environ["WORLD_SIZE"] = "1"
            environ.setdefault("MASTER_ADDR", "127.0.0.1")
            environ.setdefault("MASTER_PORT", str(_free_port()))
        environ.setdefault("LOCAL_RANK", "0")
    missing = [
        n for n in ("LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if not environ.get(n)
    ]
    if missing:
        raise TrainAbortError(
            f"RANK is set but {', '.join(missing)} is not: launch with torchrun, or set all of "
            "RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT"
        )
    return Ranks(int(environ["RANK"]), int(environ["LOCAL_RANK"]), int(environ["WORLD_SIZE"]))


def prepare_runtime(cuda: bool) -> None:
    """Environment DeepSpeed and transformers read at import: CPU accelerator without CUDA,
    a persistent cache for the one extension DeepSpeed compiles on CPU, offline hub."""
    if not cuda:
        os.environ["DS_ACCELERATOR"] = "cpu"
    if "TORCH_EXTENSIONS_DIR" not in os.environ:
        cache = Path(sys.prefix) / "torch_extensions"
        if os.access(cache if cache.is_dir() else Path(sys.prefix), os.W_OK):
            # The shared-memory op takes 20-40 s of g++ on first use; pay it once per env.
            os.environ["TORCH_EXTENSIONS_DIR"] = str(cache)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # save_pretrained's bar
    # DeepSpeed imports torch.jit-decorated code that warns at import; nothing to act on.
    warnings.filterwarnings(
        "ignore",
        message=r"`torch\.jit\.\w+` is (deprecated|not supported)",
        category=DeprecationWarning,
    )
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)


# --- the step -------------------------------------------------------------------------------


def train(config: TrainConfig, ranks: Ranks, *, device: torch.device, started: float) -> None:
    scratch = scratch_dir(config)
    out_store = open_store(config.out, endpoint_url=config.endpoint_url)
    torch.manual_seed(config.training.seed)

    # 1. Inputs, fetched once per node, verified, errors agreed.
    inputs: Inputs | None = None
    error = None
    if ranks.local_rank == 0:
        try:
            inputs = fetch_inputs(config, scratch)
        except (cio.InputError, DataError, StoreError) as exc:
            error = str(exc)
    agree(error)
    inputs = broadcast(inputs)
    assert inputs is not None
    inputs = replace(
        inputs,
        parent=replace(inputs.parent, directory=scratch / "parent"),
        data=replace(inputs.data, directory=scratch / "data"),
    )
    for note in inputs.parent.notes:
        say(note)

    # 2. This rank's rows, and the schedule every rank follows.
    one_per_rank, files = assign_files(list(inputs.data.files), ranks.world_size)
    examples: list[Example] = []
    rows_truncated = 0
    try:
        rank_data = read_rank(
            [(name, inputs.data.directory / name) for name in files],
            rank=ranks.rank,
            world_size=ranks.world_size,
            one_per_rank=one_per_rank,
            vocab_size=inputs.vocab_size,
            max_sequence_length=config.training.max_sequence_length,
        )
        examples, rows_truncated = rank_data.examples, rank_data.rows_truncated
    except DataError as exc:
        error = str(exc)
    agree(error)
    counts = gather((len(examples), sum(e.tokens for e in examples), rows_truncated))
    try:
        schedule = make_schedule(
            [c[0] for c in counts],
            sum(c[1] for c in counts),
            batch_tokens=config.training.batch_tokens,
            micro_batch_size=config.training.micro_batch_size,
            epochs=config.training.epochs,
            max_steps=config.trainer.max_steps,
            seed=config.training.seed,
        )
    except DataError as exc:
        raise TrainAbortError(f"staged training set {config.data}: {exc}") from None
    normalizers = torch.tensor(step_tokens(examples, schedule, rank=ranks.rank), device=device)
    dist.all_reduce(normalizers)
    step_norms = [max(1, int(n)) for n in normalizers.tolist()]
    say(
        f"{ranks.world_size} rank(s) on {device.type}, {config.training.precision}, "
        f"ZeRO-{config.training.zero_stage}: {sum(c[0] for c in counts)} rows, "
        f"{sum(c[1] for c in counts)} loss tokens; {schedule.total_steps} step(s) of "
        f"{schedule.gradient_accumulation_steps} micro-batch(es) of up to "
        f"{schedule.micro_batch_size} row(s) per rank"
    )

    # 3. Model and engine.
    engine, dropout, keep_logits = build_engine(
        inputs.parent.directory, inputs.vocab_size, config, schedule, ranks
    )

    # 4. Resume, or the start-of-cycle log-probs.
    fingerprint = run_fingerprint(config, inputs, ranks.world_size)
    progress = Progress()
    start_step = 0
    messages: list[str] = []
    if ranks.rank == 0:
        start_step, messages = find_resume_step(out_store, fingerprint, schedule.total_steps)
    start_step = broadcast(start_step)
    for message in messages:
        say(message)
    saves = config.trainer.save_every_steps
    if start_step:
        start_lp, progress = resume(
            engine, out_store, scratch, step=start_step, ranks=ranks, examples=examples
        )
        say(f"resumed from the state saved at step {start_step}")
    else:
        t0 = time.time()
        start_lp = start_logprobs(
            engine,
            examples=examples,
            schedule=schedule,
            rank=ranks.rank,
            device=device,
            keep_logits=keep_logits,
        )
        say(f"start-of-cycle log-probs in {time.time() - t0:.1f}s")
        if saves and any(s % saves == 0 for s in range(1, schedule.total_steps)):
            save_start_logprobs(out_store, scratch, start_lp, ranks, fingerprint)

    # 5. The loop.
    settings = LossSettings(
        clip_ratio=config.training.clip_ratio,
        is_truncation=config.training.is_truncation,
        kl_coef=config.training.kl_coef,
    )
    for step in range(start_step + 1, schedule.total_steps + 1):
        t0 = time.time()
        batches = step_micro_batches(len(examples), schedule, step=step, rank=ranks.rank)
        stats = train_step(
            engine,
            examples,
            start_lp,
            batches,
            normalizer=step_norms[step - 1],
            settings=settings,
            world_size=ranks.world_size,
            device=device,
            keep_logits=keep_logits,
            step=step,
        )
        seconds = time.time() - t0
        grad_norm = _grad_norm(engine, stats)
        if grad_norm is not None and not math.isfinite(grad_norm):
            raise TrainAbortError(f"non-finite gradient norm at step {step}; nothing published")
        metrics: dict[str, Any] = dict(summarize(stats[: len(STAT_NAMES)]))
        metrics.update(step=step, grad_norm=grad_norm, seconds=seconds)
        progress.history.append(metrics)
        progress.loop_seconds += seconds
        progress.input_tokens += float(stats[_INPUT_TOKENS])
        say(_step_line(metrics, schedule.total_steps))
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
        if os.environ.get(TEST_EXIT_ENV) == str(step):
            sys.stdout.flush()
            os._exit(137)

    # 6. Publish.
    probe = probe_logits(engine, inputs.vocab_size, device)
    zero3 = config.training.zero_stage == 3
    # ZeRO-3: every rank holds a shard; gathered layer by layer onto rank 0 (a collective).
    state_dict = engine._zero3_consolidated_16bit_state_dict() if zero3 else None
    error = None
    if ranks.rank == 0:
        doc = train_document(
            config,
            inputs,
            schedule,
            progress,
            counts=counts,
            world_size=ranks.world_size,
            device=device,
            start_step=start_step,
            probe=probe,
            wall_seconds=progress.earlier_wall_seconds + time.time() - started,
        )
        try:
            publish(
                engine,
                out_store,
                scratch,
                inputs=inputs,
                dropout=dropout,
                doc=doc,
                state_dict=state_dict,
                config=config,
            )
        except (StoreError, OSError) as exc:
            error = f"publishing {config.out} failed: {exc}"
        if error is None and not config.trainer.keep_deepspeed_state:
            try:
                _delete_leftover_state(out_store)
            except StoreError as exc:
                # The checkpoint is committed; a rerun (a no-op) deletes what is left.
                say(f"could not delete {out_store.url(cio.STATE_PREFIX)}/: {exc}")
    # Every rank ends with rank 0's outcome, so all pods of the Job succeed or fail together.
    agree(error)
    if ranks.local_rank == 0:
        shutil.rmtree(scratch, ignore_errors=True)


def fetch_inputs(config: TrainConfig, scratch: Path) -> Inputs:
    """Download and check the staged set (first: an insufficient set stops the step
    before a large parent is downloaded) and the parent, and compare vocabularies."""
    from transformers import AutoConfig

    data_store = open_store(config.data, endpoint_url=config.endpoint_url)
    manifest = data_store.committed("")
    if manifest is None:
        raise cio.InputError(
            f"staged training set {config.data}: not committed (no {MANIFEST_NAME}); "
            "treated as absent"
        )
    if "stage.json" not in manifest.files:
        raise cio.InputError(f"staged training set {config.data}: no stage.json in its manifest")
    cio.download(
        data_store,
        "",
        {"stage.json": manifest.files["stage.json"]},
        scratch / "data",
        label="staged training set",
        verify=True,
    )
    try:
        stage = json.loads((scratch / "data" / "stage.json").read_text())
    except ValueError as exc:
        raise cio.InputError(f"staged training set {config.data}: stage.json: {exc}") from None
    if not isinstance(stage, dict):
        raise cio.InputError(f"staged training set {config.data}: stage.json is not an object")
    if not stage.get("sufficient", True):
        raise DataError(
            f"staged training set {config.data} is marked insufficient "
            f"({stage.get('interactions_used', '?')} interactions, "
            f"{stage.get('tokens_used', '?')} tokens): nothing to train on"
        )
    names = [n for n in manifest.files if n.startswith("train/")]
    data, _ = cio.fetch_committed(
        data_store, scratch / "data", label="staged training set", names=names
    )
    parent_store = open_store(config.parent, endpoint_url=config.endpoint_url)
    parent = cio.fetch_checkpoint(parent_store, scratch / "parent")
    try:
        hf_config = AutoConfig.from_pretrained(parent.directory)
    except (OSError, ValueError) as exc:
        raise cio.InputError(f"parent {config.parent}: config.json is not usable ({exc})") from None
    vocab_size = int(hf_config.get_text_config().vocab_size)
    tokenizer_size = None
    if cio.has_tokenizer(parent.files):
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(parent.directory)
        except (OSError, ValueError) as exc:
            raise cio.InputError(
                f"parent {config.parent}: tokenizer cannot be loaded ({exc})"
            ) from None
        tokenizer_size = len(tokenizer)
        if tokenizer_size > vocab_size:
            raise cio.InputError(
                f"parent {config.parent}: the tokenizer has {tokenizer_size} tokens but the "
                f"model's vocabulary (config.json vocab_size) has {vocab_size}: mismatched "
                "tokenizer"
            )
    return Inputs(
        parent=parent,
        data=data,
        stage=stage,
        vocab_size=vocab_size,
        tokenizer_size=tokenizer_size,
    )


def build_engine(
    parent_dir: Path, vocab_size: int, config: TrainConfig, schedule: Schedule, ranks: Ranks
) -> tuple[DeepSpeedEngine, dict[str, float], bool]:
    """(engine, the dropout settings switched off, whether the model takes
    ``logits_to_keep``) for the Hugging Face checkpoint in ``parent_dir``."""
    import inspect

    import deepspeed

    ds_config = deepspeed_config(
        config.training,
        gradient_accumulation_steps=schedule.gradient_accumulation_steps,
        world_size=ranks.world_size,
        cuda=torch.cuda.is_available() and config.training.gpus_per_node > 0,
    )
    model, dropout = load_policy(parent_dir)
    rows = getattr(model.get_input_embeddings(), "num_embeddings", None)
    if rows is not None and rows != vocab_size:
        raise TrainAbortError(
            f"parent {config.parent}: config.json says vocab_size {vocab_size} but the "
            f"embedding has {rows} rows"
        )
    if config.training.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    keep_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
    engine, *_ = deepspeed.initialize(
        model=model,
        model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=ds_config,
    )
    return engine, dropout, keep_logits


def load_policy(parent_dir: Path) -> tuple[Any, dict[str, float]]:
    """The parent as the policy to train: fp32 weights, dropout off; and the dropout
    settings switched off (to restore in the published config).

    fp32 weights: in bf16 mode DeepSpeed keeps them as the master copy and casts the module
    itself, so the first master weights are exactly the parent's. The model is loaded whole
    into host memory; with ZeRO-3, deepspeed.initialize then partitions it (loading straight
    into partitions needs transformers' DeepSpeed integration, which needs accelerate).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.from_pretrained(parent_dir)
    dropout = disable_dropout(hf_config)
    model = AutoModelForCausalLM.from_pretrained(parent_dir, config=hf_config, dtype=torch.float32)
    return model, dropout


def disable_dropout(hf_config: Any) -> dict[str, float]:
    """Set every dropout probability of the config to 0; the original values.

    The PPO ratio compares the policy with itself at the start of the cycle: with dropout
    the two differ before the first update, and the ratio clips on noise. The published
    config keeps the parent's values.
    """
    saved: dict[str, float] = {}
    for name, value in hf_config.to_dict().items():
        lowered = name.lower()
        if ("dropout" in lowered or "pdrop" in lowered) and isinstance(value, float) and value:
            saved[name] = value
            setattr(hf_config, name, 0.0)
    return saved


# --- forward, loss, step --------------------------------------------------------------------


def token_logprobs(model: Callable[..., Any], mb: Any, keep_logits: bool) -> torch.Tensor:
    """Log-prob of each target token of the micro-batch's loss grid, (B, K) float32."""
    length = int(mb.input_ids.shape[1])
    kwargs = {"logits_to_keep": length - mb.first} if keep_logits else {}
    logits = model(input_ids=mb.input_ids, use_cache=False, **kwargs).logits
    if not keep_logits:
        logits = logits[:, mb.first :]
    logits = logits[:, :-1].float()
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
    for rows in epoch_micro_batches(len(examples), schedule, epoch=0, rank=rank):
        mb = collate(examples, rows, device=device)
        logp = token_logprobs(model, mb, keep_logits)
        if mb.rows:
            for row, values in zip(mb.rows, mb.gather(logp), strict=True):
                out[row] = values
    return out


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
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(loss, summed stats, input tokens) of one micro-batch: shared by the trainer and the
    benchmark's plain-PyTorch baseline."""
    mb = collate(examples, rows, device=device)
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
    return result.loss, result.stats, mb.input_tokens


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
) -> torch.Tensor:
    """One optimizer step over ``batches`` (this rank's micro-batches); the stats summed
    over all ranks (STAT_NAMES, input tokens, non-finite count)."""
    stats = torch.zeros(len(STAT_NAMES) + 3, dtype=torch.float64, device=device)
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
        )
        stats[: len(STAT_NAMES)] += micro_stats
        stats[_INPUT_TOKENS] += input_tokens
        stats[_NONFINITE] += (~torch.isfinite(loss.detach())).double()
        # The loss is already a mean over the global batch's tokens; DeepSpeed would also
        # divide by the accumulation steps (scale_wrt_gas) and average over ranks.
        engine.backward(loss * world_size, scale_wrt_gas=False)
        if index == len(batches) - 1:
            stats[_GRAD_NORM] = _unsharded_grad_norm(engine)
            # One collective per step: the metrics, and whether any rank saw a non-finite
            # loss, decided before the update so that a NaN never reaches the weights.
            dist.all_reduce(stats)
            if stats[_NONFINITE] > 0:
                raise TrainAbortError(
                    f"non-finite loss at step {step} (check the staged set's advantages, "
                    "sample weights and log-probs); nothing published"
                )
        engine.step()
    return stats


def _unsharded_grad_norm(engine: DeepSpeedEngine) -> float:
    """The gradient norm before the step where DeepSpeed's optimizer does not record it
    (no ZeRO, fp32: the gradients are whole, and already reduced, on every rank); 0 else."""
    if engine.zero_optimization_stage() or engine.bfloat16_enabled():
        return 0.0
    grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
    return float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0


def _grad_norm(engine: DeepSpeedEngine, stats: torch.Tensor) -> float | None:
    norm = engine.get_global_grad_norm()
    if norm is None:
        # Summed over ranks by the stats all-reduce; every rank had the same value.
        return float(stats[_GRAD_NORM]) / dist.get_world_size() if stats[_GRAD_NORM] else None
    return float(norm.item() if isinstance(norm, torch.Tensor) else norm)


def _step_line(m: dict[str, Any], total: int) -> str:
    if m.get("tokens", 0) == 0:
        return f"step {m['step']}/{total}: no tokens"
    norm = m["grad_norm"]
    rate = m["tokens"] / m["seconds"] if m["seconds"] > 0 else 0.0
    return (
        f"step {m['step']}/{total}  loss {m['loss']:+.5f}  kl {m['kl']:.2e}  "
        f"clip {m['clip_fraction']:.3f}  trunc {m['truncation_fraction']:.3f}  "
        f"adv {m['mean_advantage']:+.3f}  |g| {'-' if norm is None else f'{norm:.3g}'}  "
        f"tokens {int(m['tokens'])}  {rate:,.0f} tok/s"
    )


# --- saving and resuming ----------------------------------------------------------------


def run_fingerprint(config: TrainConfig, inputs: Inputs, world_size: int) -> str:
    """What saved state must match to be resumed: the same parent, data, learning settings
    and world size (DeepSpeed cannot re-partition optimizer state)."""
    doc = {
        "parent": inputs.parent.files,
        "data": inputs.data.files,
        "settings": fingerprint_source(config),
        "world_size": world_size,
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def find_resume_step(
    store: ObjectStore, fingerprint: str, total_steps: int
) -> tuple[int, list[str]]:
    """The highest committed step saved by a run with this fingerprint (0: none), and
    what was ignored, in words."""
    steps = cio.committed_steps(store)
    if not steps:
        return 0, []
    start = store.committed(cio.START_LOGPROBS)
    if start is None or start.metadata.get("fingerprint") != fingerprint:
        return 0, [
            f"ignoring saved state under {store.url(cio.STATE_PREFIX)}/: it belongs to a run "
            "with another parent, data, settings or world size; starting from the parent"
        ]
    usable = [
        s
        for s, m in steps.items()
        if m.metadata.get("fingerprint") == fingerprint and s <= total_steps
    ]
    ignored = sorted(set(steps) - set(usable))
    messages = []
    if ignored:
        messages.append(
            f"ignoring saved state of step(s) {', '.join(map(str, ignored))}: other settings, "
            "world size, or beyond --max-steps"
        )
    return max(usable, default=0), messages


def save_state(
    engine: DeepSpeedEngine,
    store: ObjectStore,
    scratch: Path,
    *,
    step: int,
    ranks: Ranks,
    fingerprint: str,
    progress: Progress,
    started: float,
) -> None:
    """DeepSpeed state of ``step`` to ``_deepspeed/step-<N>/``: each rank uploads its own
    files, rank 0 commits the manifest, then the older steps are deleted."""
    local = scratch / "deepspeed"
    tag = f"step-{step}"
    prefix = cio.step_prefix(step)
    if ranks.rank == 0:
        store.delete(join_key(prefix, MANIFEST_NAME))
    client_state = {
        "rtrl": {
            "step": step,
            "fingerprint": fingerprint,
            "history": progress.history,
            "loop_seconds": progress.loop_seconds,
            "input_tokens": progress.input_tokens,
            "wall_seconds": progress.earlier_wall_seconds + time.time() - started,
        }
    }
    engine.save_checkpoint(str(local), tag=tag, client_state=client_state)
    entries = store.upload_files(prefix, cio.owned_files(local / tag, ranks.rank))
    everything: dict[str, Any] = {}
    for part in gather(entries):
        everything.update(part)
    if ranks.rank == 0:
        metadata = {"step": step, "worldSize": ranks.world_size, "fingerprint": fingerprint}
        store.write_manifest(prefix, everything, metadata)
        for older in cio.committed_steps(store):
            if older < step:
                cio.delete_prefix(store, cio.step_prefix(older))
    dist.barrier()
    if ranks.local_rank == 0:
        shutil.rmtree(local / tag, ignore_errors=True)


def resume(
    engine: DeepSpeedEngine,
    store: ObjectStore,
    scratch: Path,
    *,
    step: int,
    ranks: Ranks,
    examples: Sequence[Example],
) -> tuple[list[np.ndarray], Progress]:
    """Load the state saved at ``step`` and the start-of-cycle log-probs."""
    tag = f"step-{step}"
    error = None
    try:
        manifest = store.committed(cio.step_prefix(step))
        if manifest is None:
            raise cio.InputError(f"saved state {store.url(cio.step_prefix(step))}/ vanished")
        names = cio.needed_files(manifest.files, ranks.rank, shared=ranks.local_rank == 0)
        cio.download(
            store,
            cio.step_prefix(step),
            {n: manifest.files[n] for n in names},
            scratch / "deepspeed" / tag,
            label="saved state",
            verify=True,
        )
        start_lp = load_start_logprobs(store, scratch, ranks, examples)
    except (cio.InputError, StoreError) as exc:
        error = str(exc)
    agree(error)
    dist.barrier()
    _, client = engine.load_checkpoint(str(scratch / "deepspeed"), tag=tag)
    saved = (client or {}).get("rtrl", {})
    if saved.get("step") != step:
        raise TrainAbortError(f"saved state at step {step} does not record its step; delete it")
    progress = Progress(
        history=list(saved.get("history", [])),
        loop_seconds=float(saved.get("loop_seconds", 0.0)),
        input_tokens=float(saved.get("input_tokens", 0.0)),
        earlier_wall_seconds=float(saved.get("wall_seconds", 0.0)),
    )
    return start_lp, progress


def _rank_file(ranks: Ranks) -> str:
    return f"rank-{ranks.rank:05d}-of-{ranks.world_size:05d}.npy"


def save_start_logprobs(
    store: ObjectStore, scratch: Path, values: Sequence[np.ndarray], ranks: Ranks, fingerprint: str
) -> None:
    """The start-of-cycle log-probs, one file per rank, committed once: a resumed run must
    use the parent's numbers, and the parent's weights are no longer in the engine."""
    path = scratch / "start-logprobs" / _rank_file(ranks)
    path.parent.mkdir(parents=True, exist_ok=True)
    flat = np.concatenate(values) if values else np.zeros(0, np.float32)
    np.save(path, flat.astype(np.float32))
    if ranks.rank == 0:
        store.delete(join_key(cio.START_LOGPROBS, MANIFEST_NAME))
    dist.barrier()
    entries = store.upload_files(cio.START_LOGPROBS, {path.name: path})
    everything: dict[str, Any] = {}
    for part in gather(entries):
        everything.update(part)
    if ranks.rank == 0:
        store.write_manifest(cio.START_LOGPROBS, everything, {"fingerprint": fingerprint})
    dist.barrier()


def load_start_logprobs(
    store: ObjectStore, scratch: Path, ranks: Ranks, examples: Sequence[Example]
) -> list[np.ndarray]:
    manifest = store.committed(cio.START_LOGPROBS)
    name = _rank_file(ranks)
    if manifest is None or name not in manifest.files:
        raise cio.InputError(f"saved state {store.url(cio.START_LOGPROBS)}/{name} is missing")
    dest = scratch / "start-logprobs"
    cio.download(
        store,
        cio.START_LOGPROBS,
        {name: manifest.files[name]},
        dest,
        label="saved state",
        verify=True,
    )
    flat = np.load(dest / name)
    lengths = [e.completion_length for e in examples]
    if len(flat) != sum(lengths):
        raise cio.InputError(
            f"saved state {store.url(cio.START_LOGPROBS)}/{name} has {len(flat)} values, "
            f"this rank's rows need {sum(lengths)}"
        )
    return [part.copy() for part in np.split(flat, np.cumsum(lengths)[:-1])]


# --- publishing -----------------------------------------------------------------------------


@torch.no_grad()
def probe_logits(engine: DeepSpeedEngine, vocab_size: int, device: torch.device) -> dict[str, Any]:
    """The engine's logits on a fixed input, hashed: whoever loads the published checkpoint
    can prove it computes exactly what the trainer's engine computed."""
    ids = [(7 * i + 3) % vocab_size for i in range(PROBE_LENGTH)]
    module = engine.module
    was_training = module.training
    module.eval()
    try:
        logits = engine(input_ids=torch.tensor([ids], device=device), use_cache=False).logits
    finally:
        module.train(was_training)
    host = logits.float().cpu().contiguous()
    return {
        "input_ids": ids,
        "logits_sha256": hashlib.sha256(host.numpy().tobytes()).hexdigest(),
        "logits_shape": list(host.shape),
        "dtype": str(logits.dtype).removeprefix("torch."),
    }


def train_document(
    config: TrainConfig,
    inputs: Inputs,
    schedule: Schedule,
    progress: Progress,
    *,
    counts: Sequence[tuple[int, int, int]],
    world_size: int,
    device: torch.device,
    start_step: int,
    probe: dict[str, Any],
    wall_seconds: float,
) -> dict[str, Any]:
    """train.json: the summary the operator puts on the Checkpoint (TrainingSummary) and
    the details behind it."""
    history = progress.history
    tokens = sum(h.get("tokens", 0.0) for h in history)

    def weighted(key: str) -> float | None:
        return (
            sum(h[key] * h["tokens"] for h in history if h.get("tokens")) / tokens
            if tokens
            else None
        )

    last = history[-1] if history else {}
    summary = TrainingSummary(
        steps=len(history),
        tokens=int(tokens),
        loss=last.get("loss"),
        kl=last.get("kl"),
        clip_fraction=weighted("clip_fraction"),
        truncation_fraction=weighted("truncation_fraction"),
        mean_advantage=weighted("mean_advantage"),
        grad_norm=last.get("grad_norm"),
        tokens_per_second=tokens / progress.loop_seconds if progress.loop_seconds > 0 else None,
        wall_seconds=wall_seconds,
    )
    return {
        "version": 1,
        "summary": summary.model_dump(mode="json", exclude_none=True),
        "parent": {
            "uri": inputs.parent.uri,
            "manifest": inputs.parent.manifest,
            "files": inputs.parent.files,
        },
        "data": {
            "uri": inputs.data.uri,
            "files": inputs.data.files,
            "rows": sum(c[0] for c in counts),
            "loss_tokens": sum(c[1] for c in counts),
            "rows_truncated": sum(c[2] for c in counts),
            "stage": {k: inputs.stage.get(k) for k in ("interactions_used", "tokens_used")},
        },
        "config": describe(config),
        "run": {
            "world_size": world_size,
            "device": device.type,
            "steps_per_epoch": schedule.steps_per_epoch,
            "total_steps": schedule.total_steps,
            "gradient_accumulation_steps": schedule.gradient_accumulation_steps,
            "resumed_from_step": start_step or None,
            "input_tokens": int(progress.input_tokens),
            "input_tokens_per_second": (
                progress.input_tokens / progress.loop_seconds if progress.loop_seconds else None
            ),
            "loop_seconds": progress.loop_seconds,
        },
        "history": history,
        "probe": probe,
        "finished_at": datetime.now(UTC).isoformat().replace("+00:00", "Z"),
    }


def publish(
    engine: DeepSpeedEngine,
    store: ObjectStore,
    scratch: Path,
    *,
    inputs: Inputs,
    dropout: dict[str, float],
    doc: dict[str, Any],
    state_dict: dict[str, torch.Tensor] | None,
    config: TrainConfig,
) -> None:
    """Rank 0: the Hugging Face checkpoint, the parent's tokenizer files and train.json,
    files 0644, committed with the manifest last."""
    out_dir = scratch / "publish"
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    module = engine.module
    for name, value in dropout.items():
        setattr(module.config, name, value)
    # ZeRO 0-2: every rank holds the whole module. ZeRO-3: state_dict was gathered from all
    # ranks; save_pretrained drops tied duplicates (lm_head = embeddings) in both cases.
    module.save_pretrained(out_dir, state_dict=state_dict)
    copied = cio.copy_parent_files(inputs.parent, out_dir)
    (out_dir / "train.json").write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    files = cio.checkpoint_files(out_dir)
    metadata = {
        "kind": "checkpoint",
        "producedBy": "rtrl-job train",
        "parent": config.parent,
        "data": config.data,
    }
    store.commit("", files, metadata)
    extra = f"; from the parent: {', '.join(copied)}" if copied else ""
    say(f"published {store.uri} ({len(files)} files{extra})")


def _delete_leftover_state(store: ObjectStore) -> None:
    """Optimizer state is only for resuming; once the checkpoint is committed it is waste
    (three times the model's size)."""
    for step in cio.committed_steps(store):
        cio.delete_prefix(store, cio.step_prefix(step))
    for info in list(store.list(f"{cio.STATE_PREFIX}/")):
        store.delete(info.key)


# --- small helpers ----------------------------------------------------------------------------


def scratch_dir(config: TrainConfig) -> Path:
    """Node-local working directory of this run (same path for every rank of a node)."""
    if config.trainer.scratch_dir:
        base = Path(config.trainer.scratch_dir)
    elif os.environ.get("RTRL_SCRATCH"):
        base = Path(os.environ["RTRL_SCRATCH"])
    else:
        base = Path(tempfile.gettempdir()) / "rtrl-train"
    return base / hashlib.sha256(config.out.encode()).hexdigest()[:16]


def say(message: str, *, force: bool = False) -> None:
    """One progress line on stdout, from rank 0 only (unless ``force``)."""
    if force or not dist.is_initialized() or dist.get_rank() == 0:
        print(f"rtrl-job train: {message}", flush=True)


def agree(error: str | None) -> None:
    """Every rank raises :class:`TrainAbortError` with the first error any rank found."""
    errors = gather(error)
    first = next((e for e in errors if e), None)
    if first:
        raise TrainAbortError(first)


def gather(value: T) -> list[T]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def broadcast(value: T) -> T:
    box: list[Any] = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]  # type: ignore[no-any-return]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
