"""A checkpoint loaded for evaluation: tokenizer, generation, and per-token log-probs.

Both checkpoints of an eval are Hugging Face directories, or LoRA adapters (what
``rtrl-job train`` publishes with ``--adapter-*``). An adapter is fetched with the base its
manifest names and refused when the base's files are not the ones it was trained on (its
``baseDigest``: :func:`~rtrl_trainer.checkpoint_io.fetch_model`, as stage and train fetch
theirs), then evaluated as the base with the adapter merged in (:mod:`rtrl_trainer.models`).
Each checkpoint is loaded on its own base: a candidate adapter on the parent's base, two
adapters on one base, an adapter whose base is not the parent's, a whole candidate against
an adapter parent: all are evaluated as the two models they are, which need not share a
base, only a vocabulary the held-out token ids fit (each model bounds them by its own).

A checkpoint's tokenizer is the one saved with it (an adapter's: its base's); one without
(tiny test models, a bare base model) falls back to bytes: UTF-8 bytes are token ids
0..255, which needs a vocabulary of at least 256.
Generation is seeded per call, so two identical checkpoints produce identical completions
under any decoding settings, and a rerun reproduces its completions.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rtrl.core.store import ObjectStore
from rtrl_trainer.checkpoint_io import Fetched, fetch_model, has_tokenizer
from rtrl_trainer.models import load_causal_lm, tokenizer_directory
from rtrl_trainer.progress import Progress


class ModelError(ValueError):
    """The checkpoint cannot be used for evaluation."""


@dataclass(frozen=True)
class Decoding:
    """Decoding of generated completions: the ``evaluator`` config section's values
    (:meth:`~rtrl_trainer.evaluate.config.EvaluatorOptions.decoding`; its defaults there)."""

    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    batch_size: int


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint fetched for evaluation, and the base under it when it is an adapter."""

    fetched: Fetched
    base: Fetched | None = None

    @classmethod
    def fetch(
        cls, store: ObjectStore, dest: Path, label: str, endpoint_url: str | None
    ) -> Checkpoint:
        """Fetched into ``dest`` (its base, if any, beside it: one download for two adapters
        on one base); InputError when it cannot be."""
        fetched, base = fetch_model(store, dest, label=label, endpoint_url=endpoint_url)
        return cls(fetched, base)

    @property
    def files(self) -> dict[str, str]:
        """What the model is made of (name -> sha256), for a cache key: an adapter's files
        and its base's (under ``base/``)."""
        if self.base is None:
            return self.fetched.files
        return {**self.fetched.files, **{f"base/{n}": s for n, s in self.base.files.items()}}

    def says(self, label: str) -> str:
        """What the step's log says of it: that it is an adapter, and on which base."""
        return "" if self.base is None else f"; the {label} is an adapter on {self.base.uri}"

    def load(self, label: str) -> EvalModel:
        base = self.base.directory if self.base is not None else None
        return EvalModel(self.fetched.directory, label=label, base=base)


class EvalModel:
    """The checkpoint in ``directory``; with ``base``, a LoRA adapter on the base there."""

    def __init__(self, directory: Path, *, label: str, base: Path | None = None) -> None:
        from transformers import AutoTokenizer

        self.label = label
        try:
            self.model: Any = load_causal_lm(directory, base=base, dtype=torch.float32)
        except (OSError, ValueError) as exc:
            raise ModelError(f"{label}: cannot load the checkpoint: {exc}") from None
        self.vocab = int(self.model.config.vocab_size)
        self.tokenizer: Any = None
        own = tokenizer_directory(directory, base=base)
        if has_tokenizer(p.name for p in own.iterdir()):
            self.tokenizer = AutoTokenizer.from_pretrained(own)
        elif self.vocab < 256:
            raise ModelError(
                f"{label}: no tokenizer and a vocabulary of {self.vocab} < 256 (byte fallback)"
            )
        eos = self.model.config.eos_token_id
        self.eos: int | None = eos if isinstance(eos, int) else None
        self.max_positions = int(
            getattr(self.model.config, "n_positions", 0)
            or getattr(self.model.config, "max_position_embeddings", 0)
            or 2048
        )

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is not None:
            ids: list[int] = self.tokenizer.encode(text, add_special_tokens=False)
            return ids
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is not None:
            text: str = self.tokenizer.decode(ids, skip_special_tokens=True)
            return text
        return bytes(i for i in ids if i < 256).decode("utf-8", "replace")

    @torch.no_grad()
    def generate(
        self, prompts: list[list[int]], decoding: Decoding, progress: Progress | None = None
    ) -> list[list[int]]:
        """One completion per prompt (left-padded batches), without the prompt; each batch
        counted on ``progress``."""
        out: list[list[int]] = []
        room = max(1, self.max_positions - decoding.max_tokens)
        pad = self.eos if self.eos is not None else 0
        for start in range(0, len(prompts), decoding.batch_size):
            batch = [p[-room:] or [pad] for p in prompts[start : start + decoding.batch_size]]
            width = max(len(p) for p in batch)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            torch.manual_seed(decoding.seed + start)
            sample = decoding.temperature > 0
            extra: dict[str, Any] = (
                {"do_sample": True, "temperature": decoding.temperature, "top_p": decoding.top_p}
                if sample
                else {"do_sample": False}
            )
            generated = self.model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=decoding.max_tokens,
                pad_token_id=pad,
                eos_token_id=self.eos,
                **extra,
            )
            for row in generated[:, width:].tolist():
                end = row.index(self.eos) if self.eos is not None and self.eos in row else len(row)
                out.append(row[:end])
            if progress is not None:
                progress.advance(len(batch))
        return out

    @torch.no_grad()
    def logits(self, prompt: list[int], completion: list[int]) -> torch.Tensor:
        """Log-softmax over the vocabulary at each completion position (len(completion) x V)."""
        ids = (prompt + completion)[-self.max_positions :]
        n = len(completion)
        logits = self.model(input_ids=torch.tensor([ids])).logits[0, -n - 1 : -1]
        result: torch.Tensor = torch.log_softmax(logits.float(), dim=-1)
        return result
