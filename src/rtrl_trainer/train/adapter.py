"""Training a LoRA adapter instead of all the weights (PEFT), and publishing it as vLLM
loads it.

A parent is either a whole checkpoint, on which a fresh adapter is put (PEFT starts every
``lora_B`` at zero, so the policy at the start of the cycle is the parent itself), or an
adapter this step published, which is continued: the base its manifest names is fetched,
checked against the digest of the files it was trained on
(:func:`~rtrl_trainer.checkpoint_io.fetch_model`, as stage and eval fetch one), and the
adapter loaded trainable on it. Either way the start-of-cycle log-probs are the parent
policy's (base + parent adapter), so the PPO ratio and the KL penalty are to the parent, as
for a whole model (resume.py), and only the adapter's matrices reach the optimizer.

Published: ``adapter_config.json`` and ``adapter_model.safetensors`` (what vLLM's
``--lora-modules`` and ``POST /v1/load_lora_adapter`` load) and train.json; nothing of the
base is copied. The manifest's metadata is the lineage: ``kind: adapter``, ``base`` (the
base's URI) and ``baseDigest`` (:func:`~rtrl.core.api.adapter.base_digest` of the base's
files), so whoever loads the adapter can refuse a base it was not trained on.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

from rtrl.core.api.adapter import ALL_LINEAR, AdapterSpec
from rtrl_trainer import checkpoint_io as cio

ADAPTER_CONFIG = cio.ADAPTER_CONFIG
ADAPTER_WEIGHTS = "adapter_model.safetensors"
KIND = cio.ADAPTER_KIND
# Whether a checkpoint's files are an adapter's: one rule for every step (checkpoint_io).
is_adapter = cio.is_adapter


def spec_of(directory: Path, label: str) -> AdapterSpec:
    """The shape of the adapter in ``directory`` (its adapter_config.json)."""
    try:
        doc = json.loads((directory / ADAPTER_CONFIG).read_text())
        if doc.get("peft_type", "LORA") != "LORA":
            raise ValueError(f"peft_type {doc.get('peft_type')!r}: only LORA is trained")
        targets = doc.get("target_modules") or ALL_LINEAR
        return AdapterSpec(
            rank=int(doc["r"]),
            alpha=int(doc["lora_alpha"]),
            target_modules=[targets] if isinstance(targets, str) else sorted(targets),
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise cio.InputError(f"{label}: {ADAPTER_CONFIG} is not usable ({exc})") from None


def resolve(asked: AdapterSpec | None, parent: AdapterSpec, label: str) -> AdapterSpec:
    """The shape to train when the parent is an adapter: the parent's own; a field asked
    for (set, not defaulted) that differs is an InputError naming it (an adapter cannot
    change rank or layers midway: its matrices would not fit)."""
    if asked is None:
        return parent
    given = asked.model_fields_set
    differs = []
    if "rank" in given and asked.rank != parent.rank:
        differs.append(f"adapter.rank {asked.rank} (the parent's is {parent.rank})")
    if "alpha" in given and asked.alpha != parent.alpha:
        differs.append(f"adapter.alpha {asked.alpha} (the parent's is {parent.alpha})")
    if (
        "target_modules" in given
        and asked.target_modules != [ALL_LINEAR]
        and sorted(asked.target_modules) != sorted(parent.target_modules)
    ):
        differs.append(
            f"adapter.targetModules {','.join(asked.target_modules)} (the parent's are "
            f"{','.join(parent.target_modules)})"
        )
    if differs:
        raise cio.InputError(
            f"{label} is an adapter of another shape: {'; '.join(differs)}. An adapter is "
            "continued with its own shape: leave adapter unset, or start a new one from the "
            "base"
        )
    return parent


def wrap(model: Any, spec: AdapterSpec, parent: Path | None) -> Any:
    """``model`` (the frozen base) with the adapter to train: the parent adapter in
    ``parent``, loaded trainable, or a fresh one of ``spec``."""
    from peft import LoraConfig, PeftModel, get_peft_model

    with warnings.catch_warnings():
        # peft 0.21 reads an alias transformers deprecated; nothing for a user to act on
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing`", FutureWarning)
        if parent is not None:
            return PeftModel.from_pretrained(model, parent, is_trainable=True)
        config = LoraConfig(
            r=spec.rank,
            lora_alpha=spec.alpha,
            target_modules=spec.peft_target_modules(),
            lora_dropout=0.0,  # as the whole model's dropout: the ratio must start at 1
            bias="none",
            task_type="CAUSAL_LM",
        )
        return get_peft_model(model, config)


def base_model(model: Any) -> Any:
    """The model under an adapter (``model`` itself when there is none)."""
    getter = getattr(model, "get_base_model", None)
    return getter() if callable(getter) else model


def trainable_parameters(model: Any) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def save(module: Any, out_dir: Path, *, base_uri: str) -> None:
    """Write the adapter's files into ``out_dir``: PEFT's, with the base's URI as
    ``base_model_name_or_path`` (PEFT writes the local path it was loaded from) and
    without the model card PEFT adds."""
    module.save_pretrained(out_dir)
    (out_dir / "README.md").unlink(missing_ok=True)
    path = out_dir / ADAPTER_CONFIG
    doc = json.loads(path.read_text())
    doc["base_model_name_or_path"] = base_uri
    path.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
