"""Log-prob fidelity: how far the real vLLM engine's per-token log-probs are from the
trainer's, as the importance weights w = exp(trainer - engine) of the sampled tokens.

The tiny model (rtrl_localkube/tinymodel.py, float32) is served by the real vLLM
(``.venv-vllm``, ``--logprobs-mode processed_logprobs``) twice in one run: with ``--dtype
float32`` and with ``--dtype bfloat16`` (what vLLM does by default to a float32
checkpoint). Each engine samples completions at temperature 1 and 0.7 (top-p 1, no top-k)
for the chat cases' prompts and random byte prompts. The trainer's side is a plain Hugging
Face forward in float32 over the same tokens, computed two ways: right, from logits / T (the
distribution vLLM sampled from and reports in processed mode), and wrong, from the logits
alone (temperature ignored, as a trainer that does not know T computes it).

Per row: the weights' min, p1, p50, p99 and max, and the largest |log w|, also as a ratio to
the float32 / T=1 / right row (the best the engine can do). Output: a Markdown table on
stdout and ``bench/out/logprob_fidelity.json``.

Run: ``python bench/logprob_fidelity.py`` (``make vllm`` first; two engine starts, 3-10
minutes on two cores).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "src")]

import numpy as np  # noqa: E402
import openai  # noqa: E402
import torch  # noqa: E402

from rtrl_localkube import tinymodel  # noqa: E402
from rtrl_localkube.engine import Engine, EngineSpec  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"


def prompts(tokenizer: Any, count: int, length: int, seed: int) -> list[list[int]]:
    chat = [tinymodel.prompt_ids(tokenizer, case) for case in tinymodel.CASES]
    gen = torch.Generator().manual_seed(seed)
    text = [torch.randint(32, 127, (length,), generator=gen).tolist() for _ in range(count)]
    return chat + [[256, *ids] for ids in text]


def sample(
    client: openai.OpenAI, prompt: list[int], temperature: float, *, n: int, seed: int, tokens: int
) -> list[tuple[list[int], list[float]]]:
    answer = client.completions.create(
        model="tiny",
        prompt=prompt,
        n=n,
        max_tokens=tokens,
        temperature=temperature,
        seed=seed,
        logprobs=0,
        extra_body={"return_token_ids": True},
    )
    out = []
    for choice in answer.choices:
        assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
        ids = list((choice.model_extra or {})["token_ids"])
        out.append((ids, [float(lp) for lp in choice.logprobs.token_logprobs]))
    return out


def trainer_logprobs(
    model: Any, prompt: list[int], completion: list[int], temperature: float
) -> tuple[list[float], list[float]]:
    """(right: from logits / T, wrong: from the logits) for each completion token."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + completion])).logits[0].float()
    logits = logits[len(prompt) - 1 : -1]
    index = torch.tensor(completion).unsqueeze(-1)
    right = (logits / temperature).log_softmax(-1).gather(-1, index).squeeze(-1)
    wrong = logits.log_softmax(-1).gather(-1, index).squeeze(-1)
    return right.tolist(), wrong.tolist()


def summary(log_weights: list[float]) -> dict[str, float]:
    w = np.exp(np.array(log_weights))
    return {
        "tokens": len(log_weights),
        "min": float(w.min()),
        "p1": float(np.percentile(w, 1)),
        "p50": float(np.percentile(w, 50)),
        "p99": float(np.percentile(w, 99)),
        "max": float(w.max()),
        "max_abs_log_w": float(np.abs(np.log(w)).max()),
    }


def measure(args: argparse.Namespace, model_dir: Path, work: Path) -> list[dict[str, Any]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    batch = prompts(tokenizer, args.prompts, 12, args.seed)
    rows = []
    for dtype in ("float32", "bfloat16"):
        spec = EngineSpec(model=str(model_dir), served_model_name="tiny", dtype=dtype)
        with Engine(spec, work / f"engine-{dtype}.log") as engine:
            print(f"{dtype}: engine ready in {engine.startup_seconds:.0f}s", file=sys.stderr)
            client = openai.OpenAI(base_url=engine.base_url, api_key="unused")
            for temperature in (1.0, 0.7):
                right, wrong = [], []
                for i, prompt in enumerate(batch):
                    seed = args.seed + i
                    samples = sample(
                        client, prompt, temperature, n=args.n, seed=seed, tokens=args.tokens
                    )
                    for ids, engine_lp in samples:
                        r, w = trainer_logprobs(model, prompt, ids, temperature)
                        right += [t - e for t, e in zip(r, engine_lp, strict=True)]
                        wrong += [t - e for t, e in zip(w, engine_lp, strict=True)]
                for way, logs in (("logits / T", right), ("T ignored", wrong)):
                    if temperature == 1.0 and way == "T ignored":
                        continue  # the same numbers at T = 1
                    rows.append({"dtype": dtype, "temperature": temperature, "trainer": way,
                                 **summary(logs)})  # fmt: skip
    best = rows[0]["max_abs_log_w"]
    for row in rows:
        row["vs_best"] = row["max_abs_log_w"] / best if best > 0 else math.inf
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| engine dtype | T | trainer's log-prob | tokens | min w | p1 | p50 | p99 | max w "
        "| max abs log w | x best |\n|---|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"| {r['dtype']} | {r['temperature']} | {r['trainer']} | {r['tokens']} "
            f"| {r['min']:.6f} | {r['p1']:.6f} | {r['p50']:.6f} | {r['p99']:.6f} "
            f"| {r['max']:.6f} | {r['max_abs_log_w']:.2e} | {r['vs_best']:.0f} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=24, help="random byte prompts")
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--tokens", type=int, default=32, help="tokens per sample")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    OUT.mkdir(exist_ok=True)
    work = OUT / "logprob_fidelity"
    work.mkdir(exist_ok=True)
    started = time.monotonic()
    rows = measure(args, tinymodel.built(), work)
    print(table(rows))
    result = {"args": vars(args), "rows": rows, "seconds": time.monotonic() - started}
    (OUT / "logprob_fidelity.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
