"""A tiny coding model that rtrl can train and a real vLLM can serve, built offline in seconds.

Why here: the tests (the session's vLLM engine), the demo and the quick start on the local
control plane all need a model that a real engine serves the way a production one is
served (chat with tools, completions, log-probs) and that rtrl's trainer can train, with
no download. ``rtrl_localkube`` is what all three already import to run Kubernetes on one
machine; the model is the last piece of that machine's cluster.

What it is:

- A Llama-architecture model (vLLM's Llama supports LoRA adapters, its GPT-2 does not;
  rtrl's trainer loads any ``AutoModelForCausalLM``): 2 layers, width 64, 2 heads of 32
  (the smallest head size vLLM's CPU attention takes), one key-value head, float32.
- A byte-level tokenizer (:mod:`rtrl_localkube.tinytokenizer`; token id ``b`` is byte
  ``b``) whose chat template writes tool calls in the Hermes format that vLLM's ``hermes``
  tool parser reads (``--tool-call-parser hermes``): ``<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>``.
- Trained (AdamW, a few hundred steps, seconds on a CPU) until, at temperature 0, each
  prompt of :data:`CASES` gives exactly its answer: plain text, a valid tool call, a tool
  call whose arguments violate the tool's schema, and malformed tool-call text. The
  builder checks this itself with greedy decoding and fails if the model does not get
  there.

:func:`publish` commits it through rtrl's store code exactly as the train step commits a
checkpoint (files 0644, manifest with sizes and sha256 last). A build is kept in a cache
keyed on this code, the seed and the libraries' versions (:func:`built`): a machine builds
it once. Tests read the committed files back through the store, never assume the bytes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rtrl.core.store import Manifest, open_store

from .tinytokenizer import TOOL_CALL_END, TOOL_CALL_START, VOCAB_SIZE, build_tokenizer

# The tool the tool-call cases are asked with: what a client passes as ``tools``.
RUN_TESTS_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "run_tests",
        "description": "Run a test file and report the failures.",
        "parameters": {
            "type": "object",
            "properties": {"path": {"type": "string", "description": "the test file"}},
            "required": ["path"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [RUN_TESTS_TOOL]


@dataclass(frozen=True)
class Case:
    """A fixed prompt and the answer the model gives it at temperature 0 (without the
    closing ``<|im_end|>``)."""

    name: str
    messages: tuple[dict[str, str], ...]
    tools: bool
    answer: str


def _user(text: str) -> tuple[dict[str, str], ...]:
    return ({"role": "user", "content": text},)


CASES = (
    Case(
        "text",
        _user("Write a function that adds two numbers."),
        tools=False,
        answer="def add(a, b):\n    return a + b\n",
    ),
    Case(
        "tool_call",
        _user("Run the math tests."),
        tools=True,
        answer=f'{TOOL_CALL_START}{{"name": "run_tests", "arguments": '
        f'{{"path": "tests/test_math.py"}}}}{TOOL_CALL_END}',
    ),
    # "path" must be a string: the call parses, but violates the tool's schema
    Case(
        "tool_call_invalid_arguments",
        _user("Check that the parser works."),
        tools=True,
        answer=f'{TOOL_CALL_START}{{"name": "run_tests", "arguments": {{"path": 7}}}}'
        f"{TOOL_CALL_END}",
    ),
    # the JSON is cut off: no parser can read a call out of it
    Case(
        "tool_call_malformed",
        _user("Please verify the database layer!"),
        tools=True,
        answer=f'{TOOL_CALL_START}{{"name": "run_tests", "arguments": {{"path": '
        f'"tests/test_db.py"{TOOL_CALL_END}',
    ),
)
# The logit gap the training stops at: wide enough that bfloat16 serving (and batching's
# rounding) picks the same tokens at temperature 0.
MARGIN = 6.0
CASE = {case.name: case for case in CASES}


def prompt_ids(tokenizer: Any, case: Case) -> list[int]:
    """The token ids of ``case``'s prompt as a chat server renders it (generation prompt
    added, no second BOS)."""
    text = tokenizer.apply_chat_template(
        list(case.messages),
        tools=TOOLS if case.tools else None,
        add_generation_prompt=True,
        tokenize=False,
    )
    return list(tokenizer.encode(text, add_special_tokens=False))


def answer_ids(tokenizer: Any, case: Case) -> list[int]:
    """The answer's token ids with the closing ``<|im_end|>``."""
    return [*tokenizer.encode(case.answer, add_special_tokens=False), tokenizer.eos_token_id]


def llama_config(vocab_size: int, *, bos: int, eos: int, pad: int | None = None) -> Any:
    """The tiny model's architecture (module docstring) over ``vocab_size`` tokens: also
    what the train tests build their own tiny Llamas from."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
        attention_dropout=0.0,
    )


def build(directory: Path, *, seed: int = 0, max_steps: int = 1000) -> dict[str, Any]:
    """Build, train and save the model and tokenizer into ``directory`` (created). Returns
    what the training did (steps, final loss, seconds)."""
    import time

    import torch
    from transformers import GenerationConfig, LlamaForCausalLM

    started = time.monotonic()
    tokenizer = build_tokenizer(directory)
    torch.manual_seed(seed)
    config = llama_config(
        VOCAB_SIZE, bos=tokenizer.bos_token_id, eos=tokenizer.eos_token_id,
        pad=tokenizer.pad_token_id,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    rows = [(prompt_ids(tokenizer, c), answer_ids(tokenizer, c)) for c in CASES]
    width = max(len(p) + len(a) for p, a in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (p, a) in enumerate(rows):
        seq = p + a
        ids[i, : len(seq)] = torch.tensor(seq)
        labels[i, len(p) : len(seq)] = torch.tensor(a)
        mask[i, : len(seq)] = 1
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    model.train()
    step, loss_value, margin = 0, float("nan"), float("-inf")
    while step < max_steps:
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        step += 1
        loss_value = float(out.loss.item())
        margin = _margin(out.logits.detach(), labels)
        if margin >= MARGIN:
            break
    model.eval()  # type: ignore[no-untyped-call]
    wrong = _mismatches(model, tokenizer)
    if margin < MARGIN or wrong:
        raise RuntimeError(
            f"the tiny model did not learn its answers in {step} steps (loss {loss_value:.4f}, "
            f"margin {margin:.2f}): " + "; ".join(wrong)
        )
    model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )  # no sampling defaults: vLLM would apply them to every request that names none
    model.save_pretrained(directory)
    summary = {
        "steps": step,
        "loss": loss_value,
        "margin": margin,
        "seconds": round(time.monotonic() - started, 2),
        "cases": [c.name for c in CASES],
    }
    (directory / "tinymodel.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _margin(logits: Any, labels: Any) -> float:
    """The smallest gap, over every answer token, between the logit of the right next token
    and the best other one: positive means teacher-forced argmax is right everywhere, which
    is exactly greedy decoding reproducing every answer."""
    import torch

    logits = logits[:, :-1]
    target = labels[:, 1:]
    keep = target != -100
    right = logits.gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    others = logits.scatter(-1, target.clamp(min=0).unsqueeze(-1), float("-inf")).amax(-1)
    return float(torch.where(keep, right - others, torch.inf).min())


def greedy(model: Any, prompt: Sequence[int], eos_id: int, limit: int = 96) -> list[int]:
    """Greedy decoding with a plain forward per token: the reference the engine must match."""
    import torch

    seq = list(prompt)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(limit):
            logits = model(input_ids=torch.tensor([seq])).logits[0, -1]
            token = int(torch.argmax(logits))
            out.append(token)
            if token == eos_id:
                break
            seq.append(token)
    return out


def _mismatches(model: Any, tokenizer: Any) -> list[str]:
    was_training = model.training
    model.eval()
    wrong = []
    try:
        for case in CASES:
            got = greedy(model, prompt_ids(tokenizer, case), tokenizer.eos_token_id)
            if got != answer_ids(tokenizer, case):
                wrong.append(f"{case.name}: {tokenizer.decode(got)!r}")
    finally:
        model.train(was_training)
    return wrong


def cache_dir() -> Path:
    """Where built models are kept: ``$RTRL_CACHE_DIR``, else ``$XDG_CACHE_HOME/rtrl``, else
    ``~/.cache/rtrl`` (as the Makefile keeps mypy's cache)."""
    configured = os.environ.get("RTRL_CACHE_DIR")
    if configured:
        return Path(configured)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rtrl"


def cache_key(seed: int) -> str:
    """What a build depends on: this module's and the tokenizer's source, the seed, and the
    versions of the libraries that train and save it."""
    from importlib.metadata import version

    digest = hashlib.sha256()
    for module in (Path(__file__), Path(__file__).with_name("tinytokenizer.py")):
        digest.update(module.read_bytes())
    for package in ("torch", "transformers", "tokenizers", "safetensors"):
        digest.update(f"{package}=={version(package)}".encode())
    digest.update(f"seed={seed}".encode())
    return digest.hexdigest()[:16]


def built(seed: int = 0, cache: Path | None = None) -> Path:
    """The model's directory in the cache, built first if it is not there. A build is
    written beside and renamed into place, so a reader never sees half of one and two
    builders racing each keep a complete one."""
    root = (cache or cache_dir()) / "tinymodel"
    directory = root / cache_key(seed)
    if (directory / "tinymodel.json").exists():
        return directory
    root.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".building-", dir=root))
    try:
        build(scratch / "model", seed=seed)
        for path in (scratch / "model").iterdir():
            os.chmod(path, 0o644)
        with contextlib.suppress(OSError):  # another builder won: keep its copy
            (scratch / "model").rename(directory)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return directory


def publish(uri: str, *, seed: int = 0, cache: Path | None = None) -> Manifest:
    """Commit the model (:func:`built`) under ``uri`` (``s3://`` or ``file://``) the way the
    train step commits a checkpoint: every file 0644, the manifest last. A prefix already
    committed is left as it is (idempotent)."""
    store = open_store(uri)
    existing = store.committed("")
    if existing is not None:
        return existing
    directory = built(seed, cache)
    files = {path.name: path for path in sorted(directory.iterdir()) if path.is_file()}
    metadata = {"kind": "checkpoint", "committedBy": "rtrl_localkube.tinymodel"}
    return store.commit("", files, metadata)


def fetch(uri: str, directory: Path) -> Path:
    """A local copy of the committed checkpoint at ``uri`` in ``directory``, every file
    checked against the manifest's sha256."""
    from rtrl.core.store.base import sha256_file

    store = open_store(uri)
    manifest = store.committed("")
    if manifest is None:
        raise FileNotFoundError(f"no committed checkpoint at {uri}")
    directory.mkdir(parents=True, exist_ok=True)
    for name, entry in manifest.files.items():
        target = directory / name
        target.parent.mkdir(parents=True, exist_ok=True)
        store.get_file(name, target)
        if sha256_file(target) != entry["sha256"]:
            raise ValueError(f"{uri}{name}: sha256 differs from the manifest")
    return directory


def main(argv: list[str]) -> int:
    """``python -m rtrl_localkube.tinymodel URI [--copy-to DIR]``: build the model and commit
    it under URI (a committed URI is left as it is); with ``--copy-to``, also write a copy of
    what is committed there into DIR, checked against the manifest."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m rtrl_localkube.tinymodel")
    parser.add_argument("uri", help="where to commit it: s3://bucket/prefix/ or file:///dir/")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--copy-to", type=Path, help="a local copy of the committed files")
    args = parser.parse_args(argv)
    manifest = publish(args.uri, seed=args.seed)
    print(f"committed {args.uri} ({len(manifest.files)} files)")
    if args.copy_to is not None:
        fetch(args.uri, args.copy_to)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
