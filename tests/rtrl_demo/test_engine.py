"""The demo's model server (:mod:`rtrl_demo.engine`): vLLM's completion fields, a seeded
request answered the same whatever shares its batch, and refusals that name the field."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from rtrl_demo import sim
from rtrl_demo.engine import (
    ModelServer,
    RequestError,
    Row,
    ServerThread,
    parse_request,
    sample,
)
from rtrl_demo.lora import merge_adapter
from rtrl_localkube.processes import free_port


@pytest.fixture(scope="module")
def model() -> Any:
    torch.manual_seed(0)
    config = GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=sim.VOCAB, n_positions=64,
                        bos_token_id=sim.BOS, eos_token_id=sim.EOS)  # fmt: skip
    return GPT2LMHeadModel(config).eval()


def rows(seeds: list[int], prompt: list[int], max_tokens: int = 6) -> list[Row]:
    return [Row(list(prompt), max_tokens, ignore_eos=False, seed=s) for s in seeds]


def test_a_seeded_row_is_sampled_the_same_in_any_batch(model: Any) -> None:
    alone = rows([7], [1, 120, 10, 21])
    sample(model, alone)
    crowd = rows([3, 7, 11], [1, 120, 10, 21]) + rows([5], [1, 130, 131, 12, 22])
    sample(model, crowd)
    assert crowd[1].tokens == alone[0].tokens
    # another batch shape may sum in another order: the same log-probs to float32 ulps
    assert crowd[1].logprobs == pytest.approx(alone[0].logprobs, rel=1e-5, abs=1e-6)
    assert crowd[0].tokens != crowd[2].tokens or crowd[0].logprobs != crowd[2].logprobs
    for row in crowd:
        assert 1 <= len(row.tokens) <= 6 and len(row.logprobs) == len(row.tokens)
        assert all(lp <= 0 for lp in row.logprobs)
        stopped = row.tokens[-1] == sim.EOS
        assert row.finish_reason == ("stop" if stopped else "length")
        assert sim.EOS not in row.tokens[:-1]


def test_the_logprob_is_the_models_log_softmax_of_the_sampled_token(model: Any) -> None:
    one = rows([1], [1, 150, 11, 20], max_tokens=2)
    sample(model, one)
    ids = torch.tensor([[1, 150, 11, 20]])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0, -1].float(), dim=-1)
    assert one[0].logprobs[0] == pytest.approx(float(logp[one[0].tokens[0]]), abs=1e-5)


def test_ignore_eos_samples_max_tokens(model: Any) -> None:
    row = Row([0], 12, ignore_eos=True, seed=4)
    sample(model, [row])
    assert len(row.tokens) == 12 and row.finish_reason == "length"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "text"}, "prompt"),
        ({"prompt": [1, 999]}, "prompt"),
        ({"prompt": [1, 2], "temperature": 0.7}, "temperature"),
        ({"prompt": [1, 2], "top_p": 0.9}, "top_p"),
        ({"prompt": [1, 2], "logprobs": 3}, "logprobs"),
        ({"prompt": [1, 2], "stream": True}, "stream"),
        ({"prompt": [1, 2], "n": 2}, "n"),
        ({"prompt": [1, 2], "max_tokens": 0}, "max_tokens"),
        ({"prompt": [1, 2], "seed": "x"}, "seed"),
    ],
)
def test_a_request_the_model_cannot_serve_is_refused_naming_the_field(
    body: dict[str, Any], param: str
) -> None:
    with pytest.raises(RequestError) as caught:
        parse_request(body, sim.VOCAB)
    assert caught.value.param == param


def post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return int(resp.status), json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return int(exc.code), json.loads(exc.read())


def test_served_over_http_with_vllms_fields(model: Any) -> None:
    servers = ServerThread()
    try:
        port = servers.start(ModelServer(model, "file:///models/demo-0/", "demo-0"), free_port())
        base = f"http://127.0.0.1:{port}"
        with urllib.request.urlopen(f"{base}/v1/models", timeout=10) as resp:
            listed = json.loads(resp.read())["data"][0]
        assert (listed["id"], listed["root"]) == ("demo-0", "file:///models/demo-0/")
        body = {"model": "demo-0", "prompt": [1, 120, 10, 21], "max_tokens": 6, "seed": 9,
                "logprobs": 0, "return_token_ids": True}  # fmt: skip
        status, doc = post(f"{base}/v1/completions", body)
        assert status == 200, doc
        choice = doc["choices"][0]
        assert choice["prompt_token_ids"] == [1, 120, 10, 21]
        assert len(choice["token_ids"]) == len(choice["logprobs"]["token_logprobs"])
        assert doc["usage"]["completion_tokens"] == len(choice["token_ids"])
        again = post(f"{base}/v1/completions", body)[1]["choices"][0]
        assert again["token_ids"] == choice["token_ids"]
        # without the fields asked for, vLLM leaves them out
        bare = post(f"{base}/v1/completions", {"prompt": [1, 2], "seed": 1})[1]["choices"][0]
        assert bare["logprobs"] is None and bare["token_ids"] is None
        status, error = post(f"{base}/v1/completions", {"prompt": [1, 2], "temperature": 0.5})
        assert status == 400 and error["error"]["param"] == "temperature"
        status, error = post(f"{base}/v1/completions", {"model": "other", "prompt": [1]})
        assert status == 404
    finally:
        servers.close()


def lora_adapter(model: Any, directory: Path) -> Path:
    """A PEFT LoRA adapter on ``model`` (every linear layer), its B matrices non-zero so
    that it changes the distribution, saved as rtrl-job train publishes one."""
    import copy

    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    peft = get_peft_model(
        copy.deepcopy(model),
        LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", fan_in_fan_out=True),
    )
    with torch.no_grad():
        for name, param in peft.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    peft.save_pretrained(directory)
    return directory


def post_text(url: str, body: dict[str, Any]) -> tuple[int, str]:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return int(resp.status), resp.read().decode()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read().decode()


def test_a_lora_adapter_is_loaded_listed_sampled_and_unloaded_as_vllm_does(
    model: Any, tmp_path: Path
) -> None:
    """The endpoints the capture sidecar calls; a request naming the adapter is sampled from
    the base with the adapter merged (its log-probs are the adapted model's), one naming the
    base from the base, both in one batch; the base itself is left as it was."""
    path = lora_adapter(model, tmp_path / "org-a-1")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    servers = ServerThread()
    try:
        port = servers.start(ModelServer(model, "file:///models/demo-0/", "demo-0"), free_port())
        base = f"http://127.0.0.1:{port}"
        load = {"lora_name": "org-a-1", "lora_path": str(path)}
        status, text = post_text(f"{base}/v1/load_lora_adapter", load)
        assert status == 200 and "org-a-1" in text, text
        status, text = post_text(f"{base}/v1/load_lora_adapter", load)
        assert status == 400 and "already" in text  # what the sidecar treats as loaded
        with urllib.request.urlopen(f"{base}/v1/models", timeout=10) as resp:
            listed = json.loads(resp.read())["data"]
        assert [(m["id"], m["root"]) for m in listed] == [
            ("demo-0", "file:///models/demo-0/"),
            ("org-a-1", str(path)),
        ]
        assert listed[1]["parent"] == "demo-0"
        prompt = [1, 120, 10, 21]
        asked = {"prompt": prompt, "max_tokens": 6, "seed": 9, "logprobs": 0,
                 "return_token_ids": True}  # fmt: skip
        answers = {}
        for name in ("org-a-1", "demo-0"):
            status, doc = post(f"{base}/v1/completions", {**asked, "model": name})
            assert status == 200 and doc["model"] == name, doc
            answers[name] = doc["choices"][0]
        merged = merge_adapter(model, str(path))
        for name, served_by in (("org-a-1", merged), ("demo-0", model)):
            expected = rows([9], prompt)
            sample(served_by, expected)
            assert answers[name]["token_ids"] == expected[0].tokens
            assert answers[name]["logprobs"]["token_logprobs"] == pytest.approx(
                expected[0].logprobs, rel=1e-5, abs=1e-6
            )
        # the adapter changes the distribution: the same seed's log-probs differ
        with torch.no_grad():
            ids = torch.tensor([prompt])
            assert not torch.allclose(model(input_ids=ids).logits, merged(input_ids=ids).logits)
        status, text = post_text(f"{base}/v1/unload_lora_adapter", {"lora_name": "org-a-1"})
        assert status == 200, text
        status, _ = post(f"{base}/v1/completions", {**asked, "model": "org-a-1"})
        assert status == 404
        status, text = post_text(f"{base}/v1/unload_lora_adapter", {"lora_name": "org-a-1"})
        assert status == 404 and "cannot be found" in text
        bad = {"lora_name": "broken", "lora_path": str(tmp_path / "nothing")}
        status, text = post_text(f"{base}/v1/load_lora_adapter", bad)
        assert status == 400 and "lora_path" in text
    finally:
        servers.close()
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
