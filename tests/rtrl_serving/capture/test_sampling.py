"""The sampling parameters recorded are those vLLM 0.32 uses (request, else the model's
generation config, else OpenAI's defaults; greedy and tiny temperatures as vLLM treats them)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rtrl_serving.capture.engine import normalise_model_uri
from rtrl_serving.capture.sampling import Sampling, SamplingDefaults, load_defaults


def test_the_request_wins_then_the_engines_defaults_then_openais() -> None:
    defaults = SamplingDefaults({"temperature": 0.6, "top_k": 20}, "test")
    assert defaults.resolve({"temperature": 0.9}) == Sampling(0.9, 1.0, 20)
    assert defaults.resolve({}) == Sampling(0.6, 1.0, 20)
    assert defaults.resolve({"top_p": "0.5", "top_k": None}) == Sampling(0.6, 0.5, 20)
    assert SamplingDefaults({}, "none").resolve(None) == Sampling(1.0, 1.0, 0)


def test_greedy_resets_truncation_and_a_tiny_temperature_is_raised() -> None:
    defaults = SamplingDefaults({"top_p": 0.9, "top_k": 5}, "test")
    assert defaults.resolve({"temperature": 0}) == Sampling(0.0, 1.0, 0)
    assert defaults.resolve({"temperature": 0.001}) == Sampling(0.01, 0.9, 5)


def test_defaults_come_from_the_generation_config_unless_told_otherwise(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.7, "top_p": 0.8, "top_k": 50, "eos_token_id": 2})
    )
    auto = load_defaults("auto", str(tmp_path), {})
    assert dict(auto.values) == {"temperature": 0.7, "top_p": 0.8, "top_k": 50}
    assert dict(load_defaults("vllm", str(tmp_path), {}).values) == {}
    override = load_defaults("auto", f"file://{tmp_path}", {"temperature": 0.2})
    assert dict(override.values)["temperature"] == 0.2
    assert dict(load_defaults("auto", str(tmp_path / "missing"), {}).values) == {}


@pytest.mark.parametrize(
    ("a", "b", "same"),
    [
        ("/models/ckpt-1/", "file:///models/ckpt-1", True),
        ("/models/./ckpt-1", "/models/ckpt-1", True),
        ("s3://bucket/ckpt-1/", "s3://bucket/ckpt-1", True),
        ("s3://bucket/ckpt-1", "s3://bucket/ckpt-2", False),
        ("s3://bucket/Ckpt", "s3://bucket/ckpt", False),
    ],
)
def test_checkpoint_locations_compare_normalised(a: str, b: str, same: bool) -> None:
    assert (normalise_model_uri(a) == normalise_model_uri(b)) is same
