"""How far a real vLLM's logged log-probs are from the trainer's: the importance-weight
distribution, float32 and bfloat16 engines, at temperature 1 and 0.7, side by side.

A tiny GPT-2 (2 layers, width 64, 260 tokens, large weights: entropy ~3 nats) is served by
vLLM (``--logprobs-mode processed_logprobs``, once ``--dtype float32``, once ``bfloat16``);
each engine samples ``--rows`` completions of ``--tokens`` tokens at temperature 1 and at
0.7 (plain, and with top-p 0.9 / top-k 40). The trainer's float32 forward then recomputes
every token's log-prob under the row's distribution (rtrl_trainer.logprobs) and the old way
(temperature 1, full vocabulary), and the weights ``w = exp(trainer - logged)`` are
summarised: quantiles, mean |log w|, max |log w|. Also printed: what the stage's fidelity
gate would conclude at its default bounds.

    .venv/bin/python bench/logprob_fidelity.py [--rows 64] [--tokens 32] [--json] [--model llama]

``--model llama`` serves the tests' tiny Llama instead (rtrl_localkube/tinymodel.py). The
engine is rtrl_localkube.engine's, so it needs the vLLM environment: ``.venv-vllm`` (``make
vllm``) or ``RTRL_VLLM_PYTHON``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rtrl.core.api.rlcycle import FidelitySpec
from rtrl_localkube import tinymodel
from rtrl_localkube.engine import Engine as LocalEngine
from rtrl_localkube.engine import EngineError, EngineSpec, check_installed
from rtrl_trainer.logprobs import Sampling, sampled_logprobs

REPO = Path(__file__).resolve().parents[1]
SETTINGS = {"T=1": (1.0, 1.0, -1), "T=0.7": (0.7, 1.0, -1), "T=0.7 p=0.9 k=40": (0.7, 0.9, 40)}
QUANTILES = (0.001, 0.01, 0.5, 0.99, 0.999)


def _model(directory: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=260, n_positions=256,
                        bos_token_id=1, eos_token_id=2, initializer_range=0.3)  # fmt: skip
    GPT2LMHeadModel(config).eval().save_pretrained(directory)
    for path in directory.iterdir():
        path.chmod(0o644)


class Engine:
    """The real vLLM (rtrl_localkube.engine: .venv-vllm, processed log-probs, eager mode) on
    ``model`` in ``dtype``; ``complete`` posts one completion request."""

    def __init__(self, model: Path, dtype: str, log: Path) -> None:
        spec = EngineSpec(model=os.fspath(model), served_model_name="tiny", dtype=dtype,
                          max_model_len=256, tool_call_parser=None)  # fmt: skip
        self.engine = LocalEngine(spec, log).start()
        self.port = self.engine.port
        self.startup = self.engine.startup_seconds or 0.0

    def complete(self, prompt: list[int], setting: tuple[float, float, int], seed: int,
                 tokens: int) -> tuple[list[int], list[float]]:  # fmt: skip
        temperature, top_p, top_k = setting
        body = {"model": "tiny", "prompt": prompt, "max_tokens": tokens, "seed": seed,
                "temperature": temperature, "top_p": top_p, "top_k": top_k, "logprobs": 0,
                "return_token_ids": True, "ignore_eos": True}  # fmt: skip
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/v1/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=300) as response:
            choice = json.load(response)["choices"][0]
        return choice["token_ids"], choice["logprobs"]["token_logprobs"]

    def stop(self) -> None:
        self.engine.stop()


def _summary(log_w: np.ndarray) -> dict[str, Any]:
    finite = log_w[np.isfinite(log_w)]
    weights = np.exp(log_w)
    return {
        "tokens": int(log_w.size),
        "unsupported": int((~np.isfinite(log_w)).sum()),
        "mean_abs_log_w": float(np.abs(finite).mean()),
        "max_abs_log_w": float(np.abs(finite).max()),
        "w_quantiles": {str(q): float(np.quantile(weights, q)) for q in QUANTILES},
    }


def measure(engine: Engine, trainer: Any, rows: int, tokens: int) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    out: dict[str, Any] = {}
    for name, setting in SETTINGS.items():
        right: list[np.ndarray] = []
        old: list[np.ndarray] = []
        sampling = Sampling(setting[0], setting[1], max(setting[2], 0))
        for i in range(rows):
            prompt = [int(t) for t in rng.integers(3, 260, int(rng.integers(2, 20)))]
            ids, logged = engine.complete(prompt, setting, seed=i, tokens=tokens)
            with torch.no_grad():
                logits = trainer(input_ids=torch.tensor([prompt + ids])).logits[0]
            logits = logits[len(prompt) - 1 : -1].float()
            n = len(ids)
            mine = sampled_logprobs(
                logits, torch.tensor(ids), temperature=torch.full((n,), sampling.temperature),
                top_p=torch.full((n,), sampling.top_p),
                top_k=torch.full((n,), sampling.top_k, dtype=torch.long),
            ).double().numpy()  # fmt: skip
            plain = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids)[:, None])[:, 0]
            logged_np = np.asarray(logged, dtype=np.float64)
            right.append(mine - logged_np)
            old.append(plain.double().numpy() - logged_np)
        out[name] = {
            "under the row's distribution": _summary(np.concatenate(right)),
            "old: T=1, full vocabulary": _summary(np.concatenate(old)),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--model", choices=("gpt2", "llama"), default="gpt2",
        help="gpt2: random weights, entropy ~3 nats; llama: the tests' tiny model, trained "
        "to fixed answers (sharp distributions)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    try:
        check_installed()
    except EngineError as exc:
        raise SystemExit(str(exc)) from None
    from transformers import AutoModelForCausalLM

    results: dict[str, Any] = {
        "model": args.model,
        "rows": args.rows,
        "tokens_per_row": args.tokens,
    }
    with tempfile.TemporaryDirectory(prefix="rtrl-bench-logprobs-") as tmp:
        if args.model == "llama":
            model = tinymodel.built()  # rtrl_localkube/tinymodel.py: what the tests serve
        else:
            model = Path(tmp) / "model"
            _model(model)
        trainer = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        for dtype in ("float32", "bfloat16"):
            engine = Engine(model, dtype, Path(tmp) / f"{dtype}.log")
            try:
                results[dtype] = measure(engine, trainer, args.rows, args.tokens)
                results[dtype]["engine_startup_seconds"] = round(engine.startup, 1)
            finally:
                engine.stop()
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    bound = FidelitySpec().max_mean_abs_delta
    print(f"{args.rows} rows x {args.tokens} tokens per setting; w = exp(trainer - logged)")
    print(f"{'engine':9} {'setting':18} {'log-probs':30} {'mean|log w|':>11} "
          f"{'max|log w|':>10}  w at 0.1%/1%/50%/99%/99.9%   gate (<= {bound})")  # fmt: skip
    for dtype in ("float32", "bfloat16"):
        for setting in SETTINGS:
            for way, s in results[dtype][setting].items():
                q = "/".join(f"{v:.4f}" for v in s["w_quantiles"].values())
                verdict = "pass" if s["mean_abs_log_w"] <= bound else "QUARANTINE"
                print(f"{dtype:9} {setting:18} {way:30} {s['mean_abs_log_w']:11.2e} "
                      f"{s['max_abs_log_w']:10.2e}  {q}   {verdict}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
