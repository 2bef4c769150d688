"""A fetched checkpoint loaded as a causal language model for inference (the stage's fidelity
gate, the eval step): a whole Hugging Face checkpoint, or a LoRA adapter on its base.

:func:`~rtrl_trainer.checkpoint_io.fetch_model` fetches the adapter and its base, checked
by digest; here the base is loaded and the adapter put on it with PEFT and merged into its
weights (``merge_and_unload``: one matrix per layer again, so inference costs what the base
costs). The vocabulary and the tokenizer are the base's: an adapter has neither. torch,
transformers and peft are imported only when a model is loaded.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any


def load_causal_lm(directory: Path, *, base: Path | None = None, dtype: Any = None) -> Any:
    """The model in ``directory`` (in ``dtype``; None: float32), in eval mode, on the CPU:
    the whole checkpoint there, or, with ``base``, the base in ``base`` with the adapter in
    ``directory`` merged into it. OSError or ValueError when it cannot be loaded."""
    import torch
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(
        base or directory, dtype=dtype if dtype is not None else torch.float32
    )
    if base is not None:
        from peft import PeftModel

        with warnings.catch_warnings():
            # peft 0.21 reads an alias transformers deprecated; nothing for a user to act on
            warnings.filterwarnings("ignore", "`is_gradient_checkpointing`", FutureWarning)
            try:
                model = PeftModel.from_pretrained(model, directory).merge_and_unload()
            except (RuntimeError, KeyError, TypeError) as exc:  # shapes or layers that differ
                raise ValueError(f"the adapter does not fit its base: {exc}") from None
    model.eval()
    return model


def tokenizer_directory(directory: Path, *, base: Path | None = None) -> Path:
    """Where the model's tokenizer (and config.json) lie: the base's directory under an
    adapter, else the checkpoint's own."""
    return base or directory
