"""A LoRA adapter to train instead of all the weights: its shape, in the API's spelling.

Why in the core API: the train step reads it from its config file today (``adapter:``,
beside ``training:``), and the same model is what an RLCycle will carry once the operator
serves adapters (one cycle per organisation, canaried inside the running engine), so a
config the step accepts is exactly what the spec will accept, rejected with the same
field names.

The published adapter is what vLLM loads (``adapter_config.json`` and
``adapter_model.safetensors``, PEFT's format): ``rank`` must not exceed the engine's
``--max-lora-rank``.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from rtrl.core.api.common import ApiModel

# PEFT's name for "every linear layer but the output head".
ALL_LINEAR = "all-linear"
# A layer's name as PEFT matches it (a suffix of the module path: q_proj, mlp.down_proj).
ModuleName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]+$", min_length=1, max_length=128)]


class AdapterSpec(ApiModel):
    """A LoRA adapter on the frozen base: only its low-rank matrices are trained."""

    rank: int = Field(
        8,
        ge=1,
        le=512,
        description="LoRA rank r of every adapted layer (at most the engine's --max-lora-rank).",
    )
    alpha: int = Field(
        16, ge=1, le=65536, description="LoRA alpha: the update is scaled by alpha / rank."
    )
    target_modules: list[ModuleName] = Field(
        default_factory=lambda: [ALL_LINEAR],
        min_length=1,
        max_length=64,
        description="Names of the layers to adapt (q_proj, v_proj, ...); all-linear: every "
        "linear layer but the output head.",
    )

    def peft_target_modules(self) -> str | list[str]:
        """``target_modules`` as PEFT takes it (``all-linear`` is a string there)."""
        return ALL_LINEAR if self.target_modules == [ALL_LINEAR] else list(self.target_modules)
