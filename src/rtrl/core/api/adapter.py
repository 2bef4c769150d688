"""LoRA adapters in the API's spelling: the shape to train (:class:`AdapterSpec`), the
digest that ties an adapter to its base (:func:`base_digest`), and which organisation's
requests the capture sidecar sends to which adapter (:class:`AdapterRouting`).

Why in the core API: the train step reads the shape from its config file (``adapter:``,
beside ``training:``), the sidecar reads the routing from a file, and the same models are
what an RLCycle and the operator will carry once the operator runs one cycle per
organisation, so what the steps accept is exactly what the spec will accept, rejected with
the same field names.

The published adapter is what vLLM loads (``adapter_config.json`` and
``adapter_model.safetensors``, PEFT's format): ``rank`` must not exceed the engine's
``--max-lora-rank``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Annotated, Self

from pydantic import Field, model_validator

from rtrl.core.api.common import DNS_SUBDOMAIN_PATTERN, ApiModel, StoreUri

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


# What a checkpoint's prefix holds besides the model: the trainer's account (train.json),
# its resumable state and its TensorBoard events; not part of what a base computes.
NOT_MODEL = ("train.json",)
NOT_MODEL_PREFIXES = ("_deepspeed/", "tensorboard/")


def base_digest(files: Mapping[str, str]) -> str:
    """One sha256 over a checkpoint's model files (name -> sha256, as its manifest lists
    them; :data:`NOT_MODEL` and :data:`NOT_MODEL_PREFIXES` left out): what an adapter
    records of the base it was trained on (``metadata.baseDigest`` of its manifest), and
    what an engine's base is checked against before the adapter is served on it. Every
    reader computes it here, from whatever subset of the manifest it holds."""
    kept = sorted(
        (name, sha)
        for name, sha in files.items()
        if name not in NOT_MODEL and not name.startswith(NOT_MODEL_PREFIXES)
    )
    return hashlib.sha256(json.dumps(kept).encode()).hexdigest()


# --- routing: which adapter serves which organisation's requests ------------------------

# The name requests carry as their ``model`` to reach an adapter in the engine.
AdapterName = Annotated[str, Field(pattern=DNS_SUBDOMAIN_PATTERN, min_length=1, max_length=253)]
OrgName = Annotated[str, Field(min_length=1, max_length=256)]


class AdapterRef(ApiModel):
    """One published adapter, as the engine will serve it."""

    name: AdapterName = Field(description="Name the adapter is loaded under in the engine.")
    checkpoint: str = Field(
        min_length=1, max_length=253, description="Checkpoint id its events carry."
    )
    uri: StoreUri = Field(description="Where rtrl-job train published it (s3:// or file://).")
    rlcycle: str | None = Field(None, max_length=253, description="The RLCycle it belongs to.")


class OrgRoute(ApiModel):
    """Where one organisation's requests go: its stable adapter (none: the base), and a
    candidate for a share of its units (users, else sessions), sticky per candidate."""

    stable: AdapterRef | None = Field(None, description="The org's adapter (none: the base).")
    canary: AdapterRef | None = Field(None, description="A candidate adapter on trial.")
    weight: int = Field(
        0, ge=0, le=100, description="Percent of the org's units sent to the canary."
    )

    @model_validator(mode="after")
    def _canary_weight(self) -> Self:
        if self.weight and self.canary is None:
            raise ValueError("weight without a canary: nothing to send that share to")
        return self


class AdapterRouting(ApiModel):
    """The capture sidecar's routing table (``rtrl-capture --adapters FILE``)."""

    orgs: dict[OrgName, OrgRoute] = Field(
        default_factory=dict, max_length=10_000, description="Routes by organisation."
    )

    @model_validator(mode="after")
    def _one_uri_per_name(self) -> Self:
        seen: dict[str, str] = {}
        for org, route in self.orgs.items():
            for ref in (route.stable, route.canary):
                if ref is None:
                    continue
                if seen.setdefault(ref.name, ref.uri) != ref.uri:
                    raise ValueError(
                        f"orgs.{org}: adapter name {ref.name!r} names two adapters "
                        f"({seen[ref.name]} and {ref.uri}); one name, one adapter"
                    )
        return self

    def adapters(self) -> dict[str, AdapterRef]:
        """Every adapter the table routes to, by name."""
        out: dict[str, AdapterRef] = {}
        for route in self.orgs.values():
            for ref in (route.stable, route.canary):
                if ref is not None:
                    out[ref.name] = ref
        return out
