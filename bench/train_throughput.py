"""Train-step throughput: rtrl's DeepSpeed training loop against a plain PyTorch loop that
computes the same loss on the same model and the same batches, side by side in one run.

The train step's overhead over the simplest correct loop is what every cycle pays, so it is
measured rather than assumed. Both sides train a copy of the same parent (loaded the way the
trainer loads it: fp32, dropout off) on the same micro-batches, with the same loss function
(rtrl_trainer.train.loss via rtrl_trainer.train.forward.micro_batch_loss), gradient
accumulation, clipping and AdamW settings:

  (a) plain PyTorch: loss.backward() per micro-batch, clip_grad_norm_, torch.optim.AdamW
      (bf16: autocast with fp32 weights);
  (b) rtrl: the engine of rtrl_trainer.train.engine.build_engine (DeepSpeed, ZeRO-2 by default)
      driven by rtrl_trainer.train.loop.train_step, the very loop ``rtrl-job train`` runs,
      without the store round-trips around it.

The start-of-cycle log-probs are computed once by the trainer's own pre-pass and shared.
Steps alternate between (a) and (b) one by one, so drift in machine speed hits both alike;
the median of the per-step ratios is reported next to the ratio of totals. Goal on CPU:
(b) within 1.15x of (a), i.e. ratio (b)/(a) in tokens/s >= 0.87.

With ``--model llama-1b`` (a ~1.2B-parameter Llama-shaped model, seq 2048, bf16, on a GPU)
it also reports MFU: (6 * params + 12 * layers * d_model * seq) FLOPs per token over the
GPU's dense bf16 peak (989 TFLOP/s, and 790 TFLOP/s as a sustained reference).

    .venv/bin/python bench/train_throughput.py [--model gpt2-4x256] [--steps 10] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rtrl_trainer.train.batches import Schedule, step_micro_batches, step_tokens
from rtrl_trainer.train.collectives import distributed_env
from rtrl_trainer.train.config import build_config
from rtrl_trainer.train.engine import build_engine, load_policy, prepare_runtime
from rtrl_trainer.train.examples import Example
from rtrl_trainer.train.forward import micro_batch_loss, start_logprobs
from rtrl_trainer.train.loop import train_step
from rtrl_trainer.train.loss import STAT_NAMES, LossSettings

PEAKS = {"989": 989e12, "790": 790e12}


@dataclass(frozen=True)
class Shape:
    """A model and batch shape to benchmark."""

    name: str
    family: str
    layers: int
    d_model: int
    heads: int
    vocab: int
    seq: int
    micro_batch: int
    accumulation: int
    precision: str
    ffn: int = 0
    kv_heads: int = 0


SHAPES = {
    # Tiny but not trivial: what the CPU here can run in a minute.
    "gpt2-4x256": Shape("gpt2-4x256", "gpt2", 4, 256, 4, 4096, 256, 8, 2, "fp32"),
    # The Llama code path at CPU size, to check the script before a GPU run.
    "llama-tiny": Shape(
        "llama-tiny", "llama", 2, 128, 4, 4096, 256, 8, 2, "fp32", ffn=512, kv_heads=2
    ),
    # Llama-3.2-1B-shaped, for an H200: bf16 ZeRO-2, seq 2048.
    "llama-1b": Shape(
        "llama-1b", "llama", 16, 2048, 32, 128256, 2048, 4, 2, "bf16", ffn=8192, kv_heads=8
    ),
}


def build_model(shape: Shape) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if shape.family == "gpt2":
        return GPT2LMHeadModel(
            GPT2Config(
                n_layer=shape.layers,
                n_head=shape.heads,
                n_embd=shape.d_model,
                vocab_size=shape.vocab,
                n_positions=shape.seq,
                bos_token_id=1,
                eos_token_id=2,
            )
        )
    return LlamaForCausalLM(
        LlamaConfig(
            hidden_size=shape.d_model,
            intermediate_size=shape.ffn,
            num_hidden_layers=shape.layers,
            num_attention_heads=shape.heads,
            num_key_value_heads=shape.kv_heads,
            vocab_size=shape.vocab,
            max_position_embeddings=shape.seq,
            tie_word_embeddings=True,
            bos_token_id=1,
            eos_token_id=2,
        )
    )


def synthetic_examples(shape: Shape, rows: int) -> list[Example]:
    """Rows of ``shape.seq`` tokens, half prompt and half completion, with logged log-probs
    near the policy's (so importance weights vary a little, as in real data)."""
    rng = np.random.default_rng(0)
    half = shape.seq // 2
    out = []
    for i in range(rows):
        ids = rng.integers(3, shape.vocab, shape.seq)
        out.append(
            Example(
                input_ids=ids.astype(np.int64),
                completion_start=half,
                logprobs=np.full(shape.seq - half, -math.log(shape.vocab), np.float32)
                + rng.normal(0, 0.05, shape.seq - half).astype(np.float32),
                mask=rng.random(shape.seq - half) > 0.05,
                advantage=float(rng.normal()),
                sample_weight=1.0,
                source=f"synthetic row {i}",
            )
        )
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run(shape: Shape, steps: int, warmup: int, zero_stage: int) -> dict[str, Any]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ranks = distributed_env(os.environ)
    prepare_runtime(device.type == "cuda")
    import deepspeed

    deepspeed.init_distributed(
        dist_backend="nccl" if device.type == "cuda" else "gloo",
        auto_mpi_discovery=False,
        verbose=False,
    )
    total = warmup + steps
    schedule = Schedule(
        world_size=1,
        micro_batch_size=shape.micro_batch,
        steps_per_epoch=total,
        gradient_accumulation_steps=shape.accumulation,
        epochs=1,
        total_steps=total,
        seed=0,
    )
    examples = synthetic_examples(shape, total * shape.accumulation * shape.micro_batch)
    config = build_config(
        parent="file:///bench/parent/",
        data="file:///bench/data/",
        out="file:///bench/out/",
        training_overrides={
            "precision": shape.precision,
            "zeroStage": zero_stage,
            "microBatchSize": shape.micro_batch,
            "maxSequenceLength": shape.seq,
            "learningRate": 1e-5,
            "gpusPerNode": 1 if device.type == "cuda" else 0,
        },
    )
    settings = LossSettings(
        clip_ratio=config.training.clip_ratio,
        is_truncation=config.training.is_truncation,
        kl_coef=config.training.kl_coef,
    )
    norms = step_tokens(examples, schedule, rank=0)
    with tempfile.TemporaryDirectory() as tmp:
        parent = Path(tmp) / "parent"
        model = build_model(shape)
        params = sum(p.numel() for p in model.parameters())
        model.save_pretrained(parent)
        del model
        engine, _, keep = build_engine(parent, shape.vocab, config, schedule, ranks)
        plain, _ = load_policy(parent)
    plain.to(device).train()
    optimizer = torch.optim.AdamW(
        plain.parameters(), lr=config.training.learning_rate, betas=(0.9, 0.999), eps=1e-8,
        weight_decay=0.0,
    )  # fmt: skip
    t0 = time.perf_counter()
    start_lp = start_logprobs(
        engine, examples=examples, schedule=schedule, rank=0, device=device, keep_logits=keep
    )
    _sync(device)
    prepass = time.perf_counter() - t0

    def plain_step(step: int) -> int:
        tokens = 0
        for rows in step_micro_batches(len(examples), schedule, step=step, rank=0):
            with torch.autocast(device.type, torch.bfloat16, enabled=shape.precision == "bf16"):
                loss, _, n = micro_batch_loss(
                    plain, examples, start_lp, rows, normalizer=norms[step - 1],
                    settings=settings, device=device, keep_logits=keep,
                )  # fmt: skip
            loss.backward()  # type: ignore[no-untyped-call]
            tokens += n
        torch.nn.utils.clip_grad_norm_(plain.parameters(), config.training.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return tokens

    def rtrl_step(step: int) -> int:
        stats = train_step(
            engine, examples, start_lp,
            step_micro_batches(len(examples), schedule, step=step, rank=0),
            normalizer=norms[step - 1], settings=settings, world_size=1, device=device,
            keep_logits=keep, step=step,
        )  # fmt: skip
        return int(stats[len(STAT_NAMES)])

    loops: dict[str, Callable[[int], int]] = {"plain": plain_step, "rtrl": rtrl_step}
    for step in range(1, warmup + 1):
        for loop in loops.values():
            loop(step)
    # (seconds, tokens) of each measured step, the two loops taking turns step by step.
    measured: dict[str, list[tuple[float, int]]] = {"plain": [], "rtrl": []}
    for step in range(warmup + 1, total + 1):
        for name, loop in loops.items():
            _sync(device)
            t0 = time.perf_counter()
            tokens = loop(step)
            _sync(device)
            measured[name].append((time.perf_counter() - t0, tokens))
    result: dict[str, Any] = {
        "model": shape.name,
        "params": params,
        "device": device.type if device.type == "cpu" else torch.cuda.get_device_name(),
        "precision": shape.precision,
        "zero_stage": zero_stage,
        "seq": shape.seq,
        "micro_batch": shape.micro_batch,
        "accumulation": shape.accumulation,
        "steps": steps,
        "threads": torch.get_num_threads(),
        "prepass_seconds": prepass,
    }
    flops_per_token = 6 * params + 12 * shape.layers * shape.d_model * shape.seq
    for name, runs in measured.items():
        rate = sum(t for _, t in runs) / sum(s for s, _ in runs)
        result[f"{name}_tokens_per_second"] = rate
        if device.type == "cuda":
            for label, peak in PEAKS.items():
                result[f"{name}_mfu_{label}"] = rate * flops_per_token / peak
    result["ratio"] = result["rtrl_tokens_per_second"] / result["plain_tokens_per_second"]
    # Per step pair, (a)'s time over (b)'s: robust to bursts of load from other processes.
    pairs = [a[0] / b[0] for a, b in zip(measured["plain"], measured["rtrl"], strict=True)]
    result["median_step_ratio"] = float(np.median(pairs))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(SHAPES), default="gpt2-4x256")
    parser.add_argument("--steps", type=int, default=10, help="measured steps per side")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--zero-stage", type=int, default=2)
    parser.add_argument("--precision", choices=["fp32", "bf16"], help="default: the model's")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    shape = SHAPES[args.model]
    if args.precision:
        shape = dataclasses.replace(shape, precision=args.precision)
    if args.json:
        # DeepSpeed prints build notes on stdout; keep stdout one JSON document.
        with contextlib.redirect_stdout(sys.stderr):
            result = run(shape, args.steps, args.warmup, args.zero_stage)
        print(json.dumps(result, indent=2))
        return
    result = run(shape, args.steps, args.warmup, args.zero_stage)
    print(
        f"{result['model']} ({result['params'] / 1e6:.1f}M params) on {result['device']}, "
        f"{result['precision']}, seq {result['seq']}, micro-batch {result['micro_batch']} x "
        f"{result['accumulation']}, {result['threads']} threads, {result['steps']} steps each"
    )
    print(f"  (a) plain PyTorch        {result['plain_tokens_per_second']:>12,.0f} tokens/s")
    print(
        f"  (b) rtrl (ZeRO-{result['zero_stage']})        "
        f"{result['rtrl_tokens_per_second']:>12,.0f} tokens/s"
    )
    print(f"  ratio (b)/(a)            {result['ratio']:>12.3f}   (goal >= {1 / 1.15:.3f})")
    print(f"  median per-step ratio    {result['median_step_ratio']:>12.3f}")
    for label in PEAKS:
        if f"rtrl_mfu_{label}" in result:
            print(
                f"  MFU vs {label} TFLOP/s       (a) {result[f'plain_mfu_{label}']:.1%}  "
                f"(b) {result[f'rtrl_mfu_{label}']:.1%}"
            )


if __name__ == "__main__":
    main()
