"""The DeepSpeed side of the train step: runtime settings, the process group, the policy
model and its engine.

DeepSpeed and transformers read part of their configuration from the environment when
they are imported, so :func:`prepare_runtime` runs before either is; the engine itself is
configured from the typed config only (deepspeed_config.py).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import sys
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rtrl.core.api.adapter import AdapterSpec
from rtrl_trainer.train import adapter as lora
from rtrl_trainer.train.batches import Schedule
from rtrl_trainer.train.collectives import Ranks, TrainAbortError, gather, say
from rtrl_trainer.train.config import TrainConfig
from rtrl_trainer.train.cpu_ops import OpBuildError, ensure_shm_op, use_environment_extensions
from rtrl_trainer.train.deepspeed_config import deepspeed_config
from rtrl_trainer.train.hostmem import PhaseMemory, freed_to_the_os, rss_bytes

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine


def uses_cuda(config: TrainConfig) -> bool:
    return config.training.gpus_per_node > 0 and torch.cuda.is_available()


def start_distributed(config: TrainConfig, ranks: Ranks) -> torch.device:
    """Join the run's process group (NCCL on GPUs, gloo on CPU); the device to train on."""
    cuda = uses_cuda(config)
    prepare_runtime(cuda)
    import deepspeed

    # stdout is the step's progress lines (each one JSON object under --log-format json):
    # DeepSpeed's log lines, and the line it prints once its shared-memory op is built,
    # go to stderr.
    for handler in logging.getLogger("DeepSpeed").handlers:
        if isinstance(handler, logging.StreamHandler):
            handler.setStream(sys.stderr)
    if cuda:
        torch.cuda.set_device(ranks.local_rank)
    else:
        # Loaded (or built under a lock that cannot go stale) before DeepSpeed asks torch's
        # JIT loader for it, whose wait on a dead build's lock file never ends: cpu_ops.py.
        try:
            ensure_shm_op(say=lambda text: say(text, force=True))
        except OpBuildError as exc:
            raise TrainAbortError(str(exc)) from exc
    with contextlib.redirect_stdout(sys.stderr):
        deepspeed.init_distributed(
            dist_backend="nccl" if cuda else "gloo", auto_mpi_discovery=False, verbose=False
        )
    if ranks.world_size > 1:
        # Every rank says where it met the others: a pod's log shows the rendezvous it made
        # (the master's name as the pod resolved it, e.g. <job>-0.<service>:29500).
        where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        say(f"rank {ranks.rank} of {ranks.world_size} joined the group at {where}", force=True)
    return torch.device("cuda" if cuda else "cpu")


def prepare_runtime(cuda: bool) -> None:
    """Environment DeepSpeed and transformers read at import: CPU accelerator without CUDA,
    a persistent cache for the one extension DeepSpeed compiles on CPU, offline hub."""
    if not cuda:
        os.environ["DS_ACCELERATOR"] = "cpu"
    use_environment_extensions()
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


def build_engine(
    parent_dir: Path,
    vocab_size: int,
    config: TrainConfig,
    schedule: Schedule,
    ranks: Ranks,
    *,
    adapter: AdapterSpec | None = None,
    parent_adapter: Path | None = None,
) -> tuple[DeepSpeedEngine, dict[str, float], bool, dict[str, Any]]:
    """(engine, the dropout settings switched off, whether the model takes
    ``logits_to_keep``, this rank's host memory while loading: :func:`memory_report`) for
    the Hugging Face checkpoint in ``parent_dir``. ZeRO-3 loads the parent straight into
    partitions (zero3_load.py); ZeRO 0-2 keep a whole copy on every rank anyway. With
    ``adapter`` the checkpoint is the frozen base of a LoRA adapter (``parent_adapter``'s,
    or a fresh one: adapter.py), and only the adapter is trained."""
    import deepspeed

    ds_config = deepspeed_config(
        config.training,
        gradient_accumulation_steps=schedule.gradient_accumulation_steps,
        world_size=ranks.world_size,
        cuda=uses_cuda(config),
    )
    hf_config, dropout = policy_config(parent_dir)
    # The model's code is imported before the load is measured: the figure is the model's.
    import_model_code(hf_config)
    loading = PhaseMemory.start()
    t0 = time.time()
    zero3 = config.training.zero_stage == 3
    with freed_to_the_os():
        model = load_policy(parent_dir, hf_config, zero3_config=ds_config if zero3 else None,
                            bf16=config.bf16)  # fmt: skip
    loading.stop()
    rows = getattr(model.get_input_embeddings(), "num_embeddings", None)
    if rows is not None and rows != vocab_size:
        raise TrainAbortError(
            f"parent {config.parent}: config.json says vocab_size {vocab_size} but the "
            f"embedding has {rows} rows"
        )
    if adapter is not None:
        model = lora.wrap(model, adapter, parent_adapter)
        say(f"training a LoRA adapter of rank {adapter.rank}: "
            f"{lora.trainable_parameters(model):,} parameters, the base frozen")  # fmt: skip
    set_training_mode(model, activation_checkpointing=config.training.activation_checkpointing)
    forward = lora.base_model(model).forward  # an adapter passes the base's arguments on
    keep_logits = "logits_to_keep" in inspect.signature(forward).parameters
    initialising = PhaseMemory.start()
    with freed_to_the_os():
        engine, *_ = deepspeed.initialize(
            model=model,
            model_parameters=[p for p in model.parameters() if p.requires_grad],
            config=ds_config,
        )
    initialising.stop()
    if config.training.pack_sequences:
        check_packing(engine, vocab_size)
    memory = memory_report(loading, initialising)
    reports = gather(memory)
    most = {k: max(r[k] for r in reports) / 2**20 for k in memory if k.endswith(("peak", "growth"))}
    say(
        f"policy loaded in {time.time() - t0:.1f}s "
        f"({'partitioned at construction' if zero3 else 'a whole copy per rank'}): host "
        f"memory per rank {most['load_growth']:,.0f} MiB for the weights (peak "
        f"{most['load_peak']:,.0f} MiB), {most['initialize_growth']:,.0f} MiB more for "
        f"DeepSpeed's partitions (peak {most['initialize_peak']:,.0f} MiB); the most of "
        f"{ranks.world_size} rank(s)"
    )
    return engine, dropout, keep_logits, memory


def memory_report(loading: PhaseMemory, initialising: PhaseMemory) -> dict[str, Any]:
    """This rank's host memory while the policy was built, in bytes: the resident set
    before (``before_load``); the peak while the weights were loaded (``load_peak``) and how
    far that rose above ``before_load`` (``load_growth``); the peak while DeepSpeed built its
    optimizer partitions (``initialize_peak``) and how far that rose above the resident set
    after loading (``initialize_growth``); the resident set after (``after_initialize``).
    ``peak_is_phase`` false: the peaks are the process's so far (hostmem.py)."""
    return {
        "before_load": loading.before,
        "load_peak": loading.peak,
        "load_growth": loading.growth,
        "initialize_peak": initialising.peak,
        "initialize_growth": initialising.growth,
        "peak_is_phase": loading.peak_is_phase and initialising.peak_is_phase,
        "after_initialize": rss_bytes(),
    }


def check_packing(engine: DeepSpeedEngine, vocab_size: int) -> None:
    """Stop a packed run of a model that would let packed rows see each other."""
    from rtrl_trainer.train.forward import packing_keeps_rows_apart

    engine.module.eval()
    try:
        apart = packing_keeps_rows_apart(engine, vocab_size, engine.device)
    finally:
        engine.module.train()
    if not apart:
        raise TrainAbortError(
            "training.packSequences: this model's attention does not keep packed rows apart "
            "(it ignores restarting position ids); train it unpacked"
        )


def set_training_mode(model: Any, *, activation_checkpointing: bool) -> None:
    """Training mode, with activation checkpointing when asked: each decoder layer's
    activations are recomputed in backward instead of kept from forward (Hugging Face's
    gradient checkpointing, non-reentrant, which acts only in training mode)."""
    if activation_checkpointing:
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False}
        )
    model.train()


def policy_config(parent_dir: Path) -> tuple[Any, dict[str, float]]:
    """The parent's Hugging Face config with dropout off, and the dropout settings switched
    off (to restore in the published config)."""
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(parent_dir)
    return hf_config, disable_dropout(hf_config)


def import_model_code(hf_config: Any) -> None:
    """Import the model's module, and torch._dynamo, which transformers imports lazily with
    it: under ``deepspeed.zero.Init`` that import fails (zero3_load.py)."""
    import torch._dynamo  # noqa: F401
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    MODEL_FOR_CAUSAL_LM_MAPPING[type(hf_config)]


def load_policy(
    parent_dir: Path,
    hf_config: Any,
    *,
    zero3_config: dict[str, Any] | None = None,
    bf16: bool = False,
) -> Any:
    """The parent as the policy to train, with ``hf_config`` (policy_config: dropout off).

    Whole (``zero3_config`` None): fp32 weights on every rank; in bf16 mode DeepSpeed keeps
    them as the master copy and casts the module itself, so the first master weights are
    exactly the parent's. ZeRO-3 (``zero3_config``, the run's DeepSpeed config): partitioned
    at construction in the training dtype, bf16 or fp32 (zero3_load.py); DeepSpeed's fp32
    master partitions are then made from those, so with bf16 they are the parent rounded
    to bf16 (exactly the parent's where it is stored in bf16, as served models are).
    """
    if zero3_config is not None:
        from rtrl_trainer.train.zero3_load import load_partitioned

        import_model_code(hf_config)
        dtype = torch.bfloat16 if bf16 else torch.float32
        return load_partitioned(parent_dir, hf_config, zero3_config, dtype)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(parent_dir, config=hf_config, dtype=torch.float32)


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
