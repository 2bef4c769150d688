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
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rtrl_trainer.train.batches import Schedule
from rtrl_trainer.train.collectives import Ranks, TrainAbortError, say
from rtrl_trainer.train.config import TrainConfig
from rtrl_trainer.train.deepspeed_config import deepspeed_config

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


def build_engine(
    parent_dir: Path, vocab_size: int, config: TrainConfig, schedule: Schedule, ranks: Ranks
) -> tuple[DeepSpeedEngine, dict[str, float], bool]:
    """(engine, the dropout settings switched off, whether the model takes
    ``logits_to_keep``) for the Hugging Face checkpoint in ``parent_dir``."""
    import deepspeed

    ds_config = deepspeed_config(
        config.training,
        gradient_accumulation_steps=schedule.gradient_accumulation_steps,
        world_size=ranks.world_size,
        cuda=uses_cuda(config),
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
