"""Train-step throughput: rtrl's DeepSpeed training loop against a plain PyTorch loop that
computes the same loss on the same model and the same batches, side by side in one run, with
rows padded into micro-batches and packed into sequences.

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

Rows have varied lengths (a quarter to all of ``seq`` tokens), as real interactions do.
Unpacked, a micro-batch is ``micro_batch`` rows padded to the longest; packed
(``packSequences``), rows are packed back to back into sequences of up to
``micro_batch x seq`` tokens (``microBatchTokens``), the same budget per forward pass. Every
loop trains on the same rows in every step. The start-of-cycle log-probs are computed once
by the trainer's own pre-pass and shared. Steps alternate between the loops one by one, so
drift in machine speed hits all alike; the median of the per-step ratios is reported next to
the ratio of totals.

With ``--adapter-rank R`` a third loop trains a LoRA adapter of rank R (every linear layer,
``rtrl-job train --adapter-rank R``) with the same engine and loop on the same rows: what
an adapter cycle costs next to a full-weight one (``rtrl adapter/rtrl``), with the
parameters each trains.

Tokens/s counts real (unpadded) tokens. Model FLOPs come from the model's config, per row
of n tokens: 6 x params x n + 12 x layers x d_model x n^2 (weights, and attention over the
row's own tokens, forward and backward), so padding is never counted as useful work. MFU
is model FLOP/s over the device's dense bf16 peak (``--peak-tflops``; 989 TFLOP/s on an
H100/H200, none on a CPU, where only FLOP/s is reported). Goals: on CPU (b) within 1.15x of
(a) (ratio >= 0.87); on an H200 with ``--model llama-1b``, (b) >= 40% MFU and >= 0.9x (a).

    .venv/bin/python bench/train_throughput.py [--model gpt2-4x256] [--steps 10] [--json]
        [--adapter-rank 16]
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

from rtrl.core.api.adapter import AdapterSpec
from rtrl_trainer.train.adapter import trainable_parameters
from rtrl_trainer.train.batches import (
    Schedule,
    most_micro_batches,
    row_lengths,
    step_micro_batches,
    step_tokens,
)
from rtrl_trainer.train.collectives import distributed_env
from rtrl_trainer.train.config import build_config
from rtrl_trainer.train.engine import build_engine, load_policy, policy_config, prepare_runtime
from rtrl_trainer.train.examples import Example
from rtrl_trainer.train.forward import INPUT_TOKENS, micro_batch_loss, start_logprobs
from rtrl_trainer.train.loop import train_step
from rtrl_trainer.train.loss import LossSettings

# Dense bf16 peak of the GPUs the goal is stated for, TFLOP/s (H100 and H200 SXM alike).
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0}


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
    """Rows of a quarter to all of ``shape.seq`` tokens, half prompt and half completion,
    with logged log-probs near the policy's (so importance weights vary a little, as in
    real data)."""
    rng = np.random.default_rng(0)
    out = []
    for i in range(rows):
        length = int(rng.integers(shape.seq // 4, shape.seq + 1))
        half = length // 2
        ids = rng.integers(3, shape.vocab, length)
        out.append(
            Example(
                input_ids=ids.astype(np.int64),
                completion_start=half,
                logprobs=np.full(length - half, -math.log(shape.vocab), np.float32)
                + rng.normal(0, 0.05, length - half).astype(np.float32),
                mask=rng.random(length - half) > 0.05,
                advantage=float(rng.normal()),
                sample_weight=1.0,
                source=f"synthetic row {i}",
            )
        )
    return out


def row_flops(hf_config: Any, params: int, length: int) -> float:
    """Model FLOPs of training on one row of ``length`` tokens, from the model's config
    (see the module docstring)."""
    layers = int(hf_config.num_hidden_layers)
    width = int(hf_config.hidden_size)
    return 6.0 * params * length + 12.0 * layers * width * length * length


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def default_peak(device: torch.device) -> float | None:
    """The device's dense bf16 peak in TFLOP/s where known (see PEAK_TFLOPS)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name()
    return next((peak for key, peak in PEAK_TFLOPS.items() if key in name), None)


def run(
    shape: Shape,
    steps: int,
    warmup: int,
    zero_stage: int,
    *,
    packings: list[bool],
    peak_tflops: float | None,
    adapter_rank: int | None = None,
) -> dict[str, Any]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ranks = distributed_env(os.environ)
    prepare_runtime(device.type == "cuda")
    import deepspeed

    deepspeed.init_distributed(
        dist_backend="nccl" if device.type == "cuda" else "gloo",
        auto_mpi_discovery=False,
        verbose=False,
    )
    if peak_tflops is None:
        peak_tflops = default_peak(device)
    total = warmup + steps
    unpacked = Schedule(
        world_size=1,
        micro_batch_size=shape.micro_batch,
        steps_per_epoch=total,
        gradient_accumulation_steps=shape.accumulation,
        epochs=1,
        total_steps=total,
        seed=0,
    )
    examples = synthetic_examples(shape, total * shape.accumulation * shape.micro_batch)
    lengths = row_lengths(examples)
    norms = step_tokens(examples, unpacked, rank=0)
    # Packed: the same rows in each step (the same split of the shuffled rows), in
    # sequences of the same token budget per forward pass.
    budget = shape.micro_batch * shape.seq
    packed = dataclasses.replace(unpacked, micro_batch_tokens=budget, packed=shape.seq)
    packed = dataclasses.replace(
        packed, gradient_accumulation_steps=most_micro_batches(lengths, packed, rank=0)
    )
    schedules = {False: unpacked, True: packed}
    loops: dict[str, Callable[[int], int]] = {}
    trained: dict[str, int] = {}  # parameters each loop trains
    with tempfile.TemporaryDirectory() as tmp:
        parent = Path(tmp) / "parent"
        model = build_model(shape)
        params = sum(p.numel() for p in model.parameters())
        hf_config = model.config
        model.save_pretrained(parent)
        del model
        start_lp: list[np.ndarray] | None = None
        for pack in packings:
            schedule = schedules[pack]
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
                    **({"microBatchTokens": budget, "packSequences": True} if pack else {}),
                },
            )
            engine, _, keep, _ = build_engine(parent, shape.vocab, config, schedule, ranks)
            plain = load_policy(parent, policy_config(parent)[0]).to(device).train()
            if start_lp is None:
                t0 = time.perf_counter()
                start_lp = start_logprobs(
                    engine, examples=examples, schedule=schedule, rank=0, device=device,
                    keep_logits=keep,
                )  # fmt: skip
                _sync(device)
                prepass = time.perf_counter() - t0
            suffix = " packed" if pack else ""
            data = LoopData(examples, start_lp, norms, config, shape, device, keep)
            loops[f"plain{suffix}"] = _plain_loop(plain, schedule, data)
            loops[f"rtrl{suffix}"] = _rtrl_loop(engine, schedule, data)
            trained[f"rtrl{suffix}"] = trained[f"plain{suffix}"] = params
            if adapter_rank is not None:
                spec = AdapterSpec(rank=adapter_rank, alpha=2 * adapter_rank)
                lora, _, _, _ = build_engine(
                    parent, shape.vocab, config, schedule, ranks, adapter=spec
                )
                # a fresh adapter starts as the parent: the same start-of-cycle log-probs
                loops[f"rtrl adapter{suffix}"] = _rtrl_loop(lora, schedule, data)
                trained[f"rtrl adapter{suffix}"] = trainable_parameters(lora.module)
    for step in range(1, warmup + 1):
        for loop in loops.values():
            loop(step)
    # (seconds, tokens, model FLOPs) of each measured step, the loops taking turns.
    measured: dict[str, list[tuple[float, int]]] = {name: [] for name in loops}
    flops: list[float] = []
    for step in range(warmup + 1, total + 1):
        rows = [i for b in step_micro_batches(lengths, unpacked, step=step, rank=0) for i in b]
        flops.append(sum(row_flops(hf_config, params, lengths[i]) for i in rows))
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
        "packed_accumulation": packed.gradient_accumulation_steps,
        "micro_batch_tokens": budget,
        "steps": steps,
        "threads": torch.get_num_threads(),
        "prepass_seconds": prepass,
        "peak_tflops": peak_tflops,
        "loops": {},
    }
    for name, runs in measured.items():
        seconds = sum(t for t, _ in runs)
        entry = {
            "tokens_per_second": sum(n for _, n in runs) / seconds,
            "model_tflops": sum(flops) / seconds / 1e12,
            "trained_parameters": trained[name],
        }
        if peak_tflops:
            entry["mfu"] = entry["model_tflops"] / peak_tflops
        result["loops"][name] = entry
    ratios = {}
    for suffix in (" packed" if p else "" for p in packings):
        plain_runs, rtrl_runs = measured[f"plain{suffix}"], measured[f"rtrl{suffix}"]
        ratios[f"rtrl/plain{suffix}"] = {
            "ratio": result["loops"][f"rtrl{suffix}"]["tokens_per_second"]
            / result["loops"][f"plain{suffix}"]["tokens_per_second"],
            # Per step pair, (a)'s time over (b)'s: robust to bursts of load from others.
            "median_step_ratio": float(
                np.median([a[0] / b[0] for a, b in zip(plain_runs, rtrl_runs, strict=True)])
            ),
        }
        if adapter_rank is not None:
            lora_runs = measured[f"rtrl adapter{suffix}"]
            ratios[f"rtrl adapter/rtrl{suffix}"] = {
                "ratio": result["loops"][f"rtrl adapter{suffix}"]["tokens_per_second"]
                / result["loops"][f"rtrl{suffix}"]["tokens_per_second"],
                "median_step_ratio": float(
                    np.median([a[0] / b[0] for a, b in zip(rtrl_runs, lora_runs, strict=True)])
                ),
            }
    if len(packings) == 2:
        for side in ("plain", "rtrl"):
            ratios[f"{side} packed/unpacked"] = {
                "ratio": result["loops"][f"{side} packed"]["tokens_per_second"]
                / result["loops"][side]["tokens_per_second"]
            }
    result["ratios"] = ratios
    return result


@dataclass(frozen=True)
class LoopData:
    """What every loop of one run shares: the rows, the start-of-cycle log-probs, each
    step's token count, the config and the device."""

    examples: list[Example]
    start_lp: list[np.ndarray]
    norms: list[int]
    config: Any
    shape: Shape
    device: torch.device
    keep_logits: bool


def _plain_loop(plain: Any, schedule: Schedule, d: LoopData) -> Callable[[int], int]:
    optimizer = torch.optim.AdamW(
        plain.parameters(), lr=d.config.training.learning_rate, betas=(0.9, 0.999), eps=1e-8,
        weight_decay=0.0,
    )  # fmt: skip
    settings = _settings(d.config)
    lengths = row_lengths(d.examples)
    bf16 = d.shape.precision == "bf16"

    def step_fn(step: int) -> int:
        tokens = 0
        for rows in step_micro_batches(lengths, schedule, step=step, rank=0):
            with torch.autocast(d.device.type, torch.bfloat16, enabled=bf16):
                loss, _, n = micro_batch_loss(
                    plain, d.examples, d.start_lp, rows, normalizer=d.norms[step - 1],
                    settings=settings, device=d.device, keep_logits=d.keep_logits,
                    packed=schedule.packed,
                )  # fmt: skip
            loss.backward()  # type: ignore[no-untyped-call]
            tokens += n
        torch.nn.utils.clip_grad_norm_(plain.parameters(), d.config.training.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return tokens

    return step_fn


def _rtrl_loop(engine: Any, schedule: Schedule, d: LoopData) -> Callable[[int], int]:
    settings = _settings(d.config)
    lengths = row_lengths(d.examples)

    def step_fn(step: int) -> int:
        stats = train_step(
            engine, d.examples, d.start_lp,
            step_micro_batches(lengths, schedule, step=step, rank=0),
            normalizer=d.norms[step - 1], settings=settings, world_size=1, device=d.device,
            keep_logits=d.keep_logits, step=step, packed=schedule.packed,
        )  # fmt: skip
        return int(stats[INPUT_TOKENS])

    return step_fn


def _settings(config: Any) -> LossSettings:
    return LossSettings(
        clip_ratio=config.training.clip_ratio,
        is_truncation=config.training.is_truncation,
        kl_coef=config.training.kl_coef,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(SHAPES), default="gpt2-4x256")
    parser.add_argument("--steps", type=int, default=10, help="measured steps per loop")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--zero-stage", type=int, default=2)
    parser.add_argument("--precision", choices=["fp32", "bf16"], help="default: the model's")
    parser.add_argument(
        "--packing", choices=["both", "off", "on"], default="both", help="unpacked, packed, both"
    )
    parser.add_argument(
        "--peak-tflops", type=float, help="the device's dense peak for MFU (default: H100/H200)"
    )
    parser.add_argument(
        "--adapter-rank", type=int, help="also train a LoRA adapter of this rank (a third loop)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    shape = SHAPES[args.model]
    if args.precision:
        shape = dataclasses.replace(shape, precision=args.precision)
    packings = {"both": [False, True], "off": [False], "on": [True]}[args.packing]
    with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
        # DeepSpeed prints build notes on stdout; with --json stdout is one document.
        result = run(
            shape,
            args.steps,
            args.warmup,
            args.zero_stage,
            packings=packings,
            peak_tflops=args.peak_tflops,
            adapter_rank=args.adapter_rank,
        )
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(
        f"{result['model']} ({result['params'] / 1e6:.1f}M params) on {result['device']}, "
        f"{result['precision']}, ZeRO-{result['zero_stage']}, rows of {result['seq'] // 4}-"
        f"{result['seq']} tokens; unpacked {result['micro_batch']} rows x "
        f"{result['accumulation']}, packed {result['micro_batch_tokens']} tokens x "
        f"{result['packed_accumulation']}; {result['threads']} threads, {result['steps']} "
        "steps each"
    )
    for name, entry in result["loops"].items():
        mfu = f"  MFU {entry['mfu']:.1%}" if "mfu" in entry else ""
        print(
            f"  {name:<20} {entry['tokens_per_second']:>12,.0f} tokens/s  "
            f"{entry['model_tflops']:>9.3f} model TFLOP/s{mfu}  "
            f"{entry['trained_parameters']:,} parameters trained"
        )
    for name, entry in result["ratios"].items():
        median = entry.get("median_step_ratio")
        print(
            f"  {name:<24} {entry['ratio']:.3f}"
            + (f"  (median per step {median:.3f})" if median is not None else "")
        )


if __name__ == "__main__":
    main()
