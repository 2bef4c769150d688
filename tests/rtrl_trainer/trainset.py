"""Inputs of the train step for tests: tiny models saved as parent checkpoints in a store,
and staged training sets in the Stage step's format built from Python lists.

The train tests use these instead of the Stage step so that they pin the trainer to the
documented format (docs/train.md), not to whatever the stage happens to write today.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from rtrl.core.store import ObjectStore

VOCAB = 260
# The documented format (docs/train.md): per-token columns packed as binary, built here
# independently of the stage step's packing code.
_PACKED = {
    "prompt_ids": "<i4",
    "completion_ids": "<i4",
    "completion_logprobs": "<f4",
    "completion_mask": "u1",
}
TRAINSET_SCHEMA = pa.schema(
    [
        pa.field("interaction_id", pa.string()),
        pa.field("checkpoint_id", pa.string()),
        pa.field("org", pa.string()),
        *(
            pa.field(name, pa.binary(), nullable=False, metadata={"rtrl.packed": dtype})
            for name, dtype in _PACKED.items()
        ),
        pa.field("reward", pa.float32()),
        pa.field("advantage", pa.float32()),
        pa.field("sample_weight", pa.float32()),
        pa.field("on_policy", pa.bool_()),
    ]
)
# The format before packing (list columns), which the trainer still reads.
LIST_TRAINSET_SCHEMA = pa.schema(
    [
        pa.field("interaction_id", pa.string()),
        pa.field("checkpoint_id", pa.string()),
        pa.field("org", pa.string()),
        pa.field("prompt_ids", pa.list_(pa.int32())),
        pa.field("completion_ids", pa.list_(pa.int32())),
        pa.field("completion_logprobs", pa.list_(pa.float32())),
        pa.field("completion_mask", pa.list_(pa.bool_())),
        pa.field("reward", pa.float32()),
        pa.field("advantage", pa.float32()),
        pa.field("sample_weight", pa.float32()),
        pa.field("on_policy", pa.bool_()),
    ]
)


@dataclass
class Row:
    """One staged interaction; ``logprobs`` default to 0 (probability 1) and ``mask`` to
    all true."""

    prompt: list[int]
    completion: list[int]
    advantage: float
    logprobs: list[float] | None = None
    mask: list[bool] | None = None
    sample_weight: float = 1.0
    reward: float | None = None
    interaction_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    def list_record(self) -> dict[str, Any]:
        """The row with list columns (:data:`LIST_TRAINSET_SCHEMA`)."""
        n = len(self.completion)
        return {
            "interaction_id": self.interaction_id,
            "checkpoint_id": "parent",
            "org": "acme",
            "prompt_ids": self.prompt,
            "completion_ids": self.completion,
            "completion_logprobs": self.logprobs if self.logprobs is not None else [0.0] * n,
            "completion_mask": self.mask if self.mask is not None else [True] * n,
            "reward": self.advantage if self.reward is None else self.reward,
            "advantage": self.advantage,
            "sample_weight": self.sample_weight,
            "on_policy": True,
        }

    def record(self) -> dict[str, Any]:
        """The row as staged (:data:`TRAINSET_SCHEMA`): per-token columns packed."""
        record = self.list_record()
        for name, dtype in _PACKED.items():
            record[name] = np.asarray(record[name], dtype=dtype).tobytes()
        return record


def write_trainset(
    store: ObjectStore,
    prefix: str,
    files: Sequence[Sequence[Row]],
    tmp: Path,
    *,
    sufficient: bool = True,
    commit: bool = True,
    rewards: bool = True,
) -> None:
    """A staged set under ``prefix``: one ``train/rank-*.parquet`` per entry of ``files``
    and ``stage.json``, committed (manifest last) unless ``commit`` is false; without the
    ``reward`` column (as a set written by hand may be) when ``rewards`` is false."""
    work = tmp / f"trainset-{uuid.uuid4().hex[:8]}"
    (work / "train").mkdir(parents=True)
    paths: dict[str, Path] = {}
    for index, rows in enumerate(files):
        name = f"train/rank-{index:05d}-of-{len(files):05d}.parquet"
        table = pa.Table.from_pylist([r.record() for r in rows], schema=TRAINSET_SCHEMA)
        if not rewards:
            table = table.drop_columns(["reward"])
        pq.write_table(table, work / name)
        paths[name] = work / name
    stage = {
        "sufficient": sufficient,
        "interactions_used": sum(len(rows) for rows in files),
        "tokens_used": sum(sum(r.mask or [True] * len(r.completion)) for f in files for r in f),
        "ranks": [
            {"rows": len(rows), "tokens": sum(len(r.completion) for r in rows)} for rows in files
        ],
    }
    (work / "stage.json").write_text(json.dumps(stage))
    paths["stage.json"] = work / "stage.json"
    if commit:
        store.commit(prefix, paths, {"step": "stage"})
    else:
        for name, path in paths.items():
            store.put_file(f"{prefix.rstrip('/')}/{name}", path)


def tiny_gpt2(seed: int = 0, *, layers: int = 2, width: int = 64, vocab: int = VOCAB) -> Any:
    """A GPT-2 small enough to train in a second, built from a config (no download)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        n_layer=layers,
        n_head=2,
        n_embd=width,
        vocab_size=vocab,
        n_positions=256,
        bos_token_id=1,
        eos_token_id=2,
    )
    return GPT2LMHeadModel(config).eval()


def tiny_llama(seed: int = 0, *, vocab: int = VOCAB) -> Any:
    """A Llama small enough to train in a second (the architecture vLLM serves LoRA
    adapters on), built from a config (no download)."""
    from transformers import LlamaForCausalLM

    from rtrl_localkube.tinymodel import llama_config

    torch.manual_seed(seed)
    return LlamaForCausalLM(llama_config(vocab, bos=1, eos=2)).eval()


def save_tokenizer(directory: Path, size: int) -> None:
    """A word-level tokenizer of ``size`` tokens, saved the Hugging Face way."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(size)}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="t0")), unk_token="t0"
    )
    tokenizer.save_pretrained(directory)


def save_parent(
    store: ObjectStore,
    prefix: str,
    model: Any,
    tmp: Path,
    *,
    tokenizer_size: int | None = None,
    commit: bool = True,
) -> Path:
    """``model`` (and optionally a tokenizer) saved with save_pretrained and uploaded under
    ``prefix``: committed like an rtrl checkpoint, or as plain files like a base model
    registered by hand. Returns the local directory."""
    directory = tmp / f"parent-{uuid.uuid4().hex[:8]}"
    model.save_pretrained(directory)
    if tokenizer_size is not None:
        save_tokenizer(directory, tokenizer_size)
    files = {p.relative_to(directory).as_posix(): p for p in directory.rglob("*") if p.is_file()}
    if commit:
        store.commit(prefix, files, {"kind": "checkpoint"})
    else:
        for name, path in files.items():
            store.put_file(f"{prefix.rstrip('/')}/{name}", path)
    return directory


def save_adapter(
    store: ObjectStore,
    prefix: str,
    base_model: Any,
    base_uri: str,
    tmp: Path,
    *,
    seed: int,
    scale: float = 0.5,
) -> Any:
    """A LoRA adapter (rank 4 on q_proj and v_proj) on ``base_model``, committed under
    ``base_uri`` in ``store``, published under ``prefix`` as ``rtrl-job train`` publishes one
    (PEFT's files; the manifest's ``kind``, ``base`` and ``baseDigest``) without training:
    its ``lora_B`` is drawn at random (``seed``, standard deviation ``scale``) so that it
    changes the model. Returns base + adapter, merged (the base model is left as it was)."""
    import copy
    import warnings

    from peft import LoraConfig, get_peft_model

    from rtrl.core.api.adapter import base_digest
    from rtrl.core.store import open_store
    from rtrl_trainer.train.adapter import KIND, save

    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
        bias="none", task_type="CAUSAL_LM",
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing`", FutureWarning)
        model = get_peft_model(copy.deepcopy(base_model), config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if ".lora_B." in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * scale)
    directory = tmp / f"adapter-{uuid.uuid4().hex[:8]}"
    save(model, directory, base_uri=base_uri)
    manifest = open_store(base_uri).committed("")
    assert manifest is not None, f"{base_uri} is not committed"
    digest = base_digest({n: e["sha256"] for n, e in manifest.files.items()})
    files = {p.name: p for p in directory.iterdir() if p.is_file()}
    store.commit(prefix, files, {"kind": KIND, "base": base_uri, "baseDigest": digest})
    return model.merge_and_unload().eval()


@torch.no_grad()
def completion_logprobs(
    model: Any, prompt: Sequence[int], completion: Sequence[int]
) -> list[float]:
    """Log-prob of each completion token under ``model`` (what a serving engine logs)."""
    ids = torch.tensor([list(prompt) + list(completion)])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(-1, torch.tensor(completion)[:, None])[:, 0].tolist()


def mean_logprob(model: Any, rows: Sequence[Row]) -> float:
    """Mean per-token log-prob of the rows' completions under ``model``."""
    values = [lp for r in rows for lp in completion_logprobs(model, r.prompt, r.completion)]
    return sum(values) / len(values)


P = [5, 6, 7, 8, 9, 10]
Q = [11, 12, 13, 14, 15, 16]


def pattern_rows(model: Any, n: int, *, seed: int = 1) -> list[Row]:
    """``n`` interactions whose completion is pattern P (advantage +1) or Q (-1),
    alternating, after random prompts; logged log-probs are ``model``'s own (on-policy).
    Every fourth row has a stretch of tool output (mask false) inside the completion."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        length = int(torch.randint(4, 12, (1,), generator=generator))
        prompt = torch.randint(30, 200, (length,), generator=generator).tolist()
        completion = list(P if i % 2 == 0 else Q)
        mask = [True] * len(completion)
        if i % 4 == 3:
            completion = [*completion[:3], 250, 251, *completion[3:]]
            mask = [True, True, True, False, False, True, True, True]
        rows.append(
            Row(
                prompt=prompt,
                completion=completion,
                advantage=1.0 if i % 2 == 0 else -1.0,
                logprobs=completion_logprobs(model, prompt, completion),
                mask=mask,
            )
        )
    return rows
