"""The tiny model (rtrl_localkube/tinymodel.py, tinytokenizer.py): its tokenizer, its fixed
answers under a plain Hugging Face forward, and its publication through rtrl's store. The
build is the machine's cached one (the session's engine uses the same)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from rtrl.core.store import open_store
from rtrl_localkube import tinymodel, tinytokenizer


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return tinymodel.built()


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def test_token_ids_are_bytes_then_the_special_tokens(tokenizer: Any) -> None:
    text = "héllo <tool_call>{}</tool_call>"
    ids = tokenizer.encode(text, add_special_tokens=False)
    tag = tokenizer.convert_tokens_to_ids(tinytokenizer.TOOL_CALL_START)
    assert ids[:6] == list("héllo".encode())  # é is two bytes
    assert tag in ids and tag >= 256
    assert tokenizer.decode(ids) == text  # the tags stay in decoded text
    assert len(tokenizer) == tinytokenizer.VOCAB_SIZE
    assert tokenizer.encode("a")[0] == tokenizer.bos_token_id  # BOS on plain text


def test_the_chat_template_lists_tools_and_renders_calls(tokenizer: Any) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Run them."},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "run_tests", "arguments": '{"path": "t.py"}'}}],
        },
        {"role": "tool", "content": "1 failed"},
    ]
    text = tokenizer.apply_chat_template(
        messages, tools=tinymodel.TOOLS, add_generation_prompt=True, tokenize=False
    )
    assert text == (
        "<|begin_of_text|><|im_start|>system\nBe brief.\nTools: run_tests(path)<|im_end|>\n"
        "<|im_start|>user\nRun them.<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>{"name": "run_tests", "arguments": {"path": "t.py"}}'
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>1 failed</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


@pytest.fixture(scope="module")
def model(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("case", tinymodel.CASES, ids=lambda c: c.name)
def test_greedy_decoding_gives_each_fixed_answer(
    model: Any, tokenizer: Any, case: tinymodel.Case
) -> None:
    out = tinymodel.greedy(model, tinymodel.prompt_ids(tokenizer, case), tokenizer.eos_token_id)
    assert tokenizer.decode(out[:-1]) == case.answer
    assert out[-1] == tokenizer.eos_token_id


def test_the_answers_are_what_their_names_say() -> None:
    calls = {c.name: c.answer for c in tinymodel.CASES}
    body = calls["tool_call"].removeprefix("<tool_call>").removesuffix("</tool_call>")
    assert json.loads(body) == {"name": "run_tests", "arguments": {"path": "tests/test_math.py"}}
    invalid = calls["tool_call_invalid_arguments"].removeprefix("<tool_call>")
    assert json.loads(invalid.removesuffix("</tool_call>"))["arguments"] == {"path": 7}
    malformed = calls["tool_call_malformed"].removeprefix("<tool_call>")
    with pytest.raises(json.JSONDecodeError):
        json.loads(malformed.removesuffix("</tool_call>"))
    assert "<tool_call>" not in calls["text"]


def test_published_like_a_checkpoint_and_fetched_checked(model_dir: Path, tmp_path: Path) -> None:
    uri = f"file://{tmp_path}/store/tiny-0/"
    manifest = tinymodel.publish(uri)
    assert manifest.metadata["kind"] == "checkpoint"
    names = set(manifest.files)
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= names
    for name in names:
        assert (tmp_path / "store" / "tiny-0" / name).stat().st_mode & 0o777 == 0o644
    assert tinymodel.publish(uri).files == manifest.files  # committed: left as it is
    copy = tinymodel.fetch(uri, tmp_path / "copy")
    weights = "model.safetensors"
    assert (copy / weights).read_bytes() == (model_dir / weights).read_bytes()
    # a corrupt object in the store is caught by its checksum
    store = open_store(uri)
    store.put_bytes("config.json", b"{}")
    with pytest.raises(ValueError, match=r"config\.json: sha256 differs"):
        tinymodel.fetch(uri, tmp_path / "again")


def test_the_cache_key_follows_the_seed() -> None:
    assert tinymodel.cache_key(0) != tinymodel.cache_key(1)
    assert tinymodel.cache_key(0) == tinymodel.cache_key(0)
