"""The DeepSpeed config, derived from the typed training config and never edited by hand.

One function owns every DeepSpeed setting so that a run's behaviour follows from the
RLCycle's ``training`` section and the data schedule alone; the reasons for the choices
that are not DeepSpeed's defaults are written next to them.
"""

from __future__ import annotations

from typing import Any

from rtrl.core.api.rlcycle import Precision, TrainingSpec

ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8


def deepspeed_config(
    training: TrainingSpec,
    *,
    gradient_accumulation_steps: int,
    world_size: int,
    cuda: bool,
) -> dict[str, Any]:
    """The DeepSpeed config of a run of ``world_size`` ranks with this accumulation."""
    zero: dict[str, Any] = {"stage": training.zero_stage}
    if training.zero_stage >= 1:
        zero["contiguous_gradients"] = True
        # Overlapping the reduction with the backward pays on GPUs (NCCL streams); with
        # gloo on CPU it only adds bookkeeping.
        zero["overlap_comm"] = cuda
    if training.zero_stage == 3:
        # Gathering a whole 16-bit state dict on rank 0 is how the trainer publishes.
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": training.micro_batch_size,
        "gradient_accumulation_steps": gradient_accumulation_steps,
        "train_batch_size": training.micro_batch_size * gradient_accumulation_steps * world_size,
        "gradient_clipping": training.grad_clip,
        "zero_optimization": zero,
        # bf16: bf16 weights and activations, fp32 master weights and Adam state (DeepSpeed's
        # bf16 mode); fp32: everything in fp32.
        "bf16": {"enabled": training.precision == Precision.BF16},
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": training.learning_rate,
                "betas": list(ADAM_BETAS),
                "eps": ADAM_EPS,
                # The KL term to the parent is the regulariser of this loss; weight decay
                # would pull every weight toward zero, away from the parent, each cycle.
                "weight_decay": 0.0,
                # torch.optim.AdamW instead of DeepSpeed's FusedAdam: no CUDA extension to
                # compile at startup (36 s on CPU, and nvcc is not in a runtime image).
                "torch_adam": True,
            },
        },
        # The trainer prints its own one line per step.
        "steps_per_print": 2**62,
        "wall_clock_breakdown": False,
    }
    return config
