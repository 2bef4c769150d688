"""The sampling parameters an engine actually used for a request, as vLLM 0.32 decides them.

vLLM takes each of temperature, top_p and top_k from the request, else from its *default
sampling parameters*, else from OpenAI's defaults (1.0, 1.0, 0 = no truncation)
(``to_sampling_params``, chat and completions alike). Its defaults come from the model's
``generation_config.json`` unless the engine runs with ``--generation-config vllm`` (none) or
a directory (that one's), with ``--override-generation-config`` on top
(``ModelConfig.get_diff_sampling_param``). A temperature below 1e-5 is greedy: top_p and
top_k are then reset to 1.0 and 0; a positive one below 0.01 is raised to 0.01
(``SamplingParams.__post_init__``). The proxy reads the same file (from the checkpoint's URI)
and applies the same rules, and checks its belief against the engine once at start
(:func:`probe_request`): a seeded request without the parameters and one with them must sample
the same tokens with the same log-probs.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rtrl.core.store import ObjectNotFound, StoreError, open_store

log = logging.getLogger(__name__)

OPENAI_DEFAULTS: dict[str, float | int] = {"temperature": 1.0, "top_p": 1.0, "top_k": 0}
SAMPLING_EPS = 1e-5
MIN_TEMPERATURE = 1e-2
PROBE_SEED = 20261203
PROBE_TOKENS = 8


@dataclass(frozen=True)
class Sampling:
    temperature: float
    top_p: float
    top_k: int


@dataclass(frozen=True)
class SamplingDefaults:
    """The engine's defaults (from its generation config), and where they came from."""

    values: Mapping[str, float | int]
    source: str

    def resolve(self, request: Mapping[str, Any] | None) -> Sampling:
        """The parameters used for ``request`` (its own values first)."""
        chosen: dict[str, float] = {}
        for name, fallback in OPENAI_DEFAULTS.items():
            value = _number((request or {}).get(name))
            if value is None:
                value = _number(self.values.get(name))
            chosen[name] = float(fallback) if value is None else value
        temperature, top_p, top_k = chosen["temperature"], chosen["top_p"], int(chosen["top_k"])
        if 0 < temperature < MIN_TEMPERATURE:
            temperature = MIN_TEMPERATURE
        if temperature < SAMPLING_EPS:
            top_p, top_k = 1.0, 0
        return Sampling(temperature, top_p, top_k)


def _number(value: object) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def _read_config(location: str) -> dict[str, Any] | None:
    """generation_config.json (else config.json, as transformers falls back) of a checkpoint
    directory given as a local path or a store URI; None when neither is there."""
    for name in ("generation_config.json", "config.json"):
        try:
            if "://" in location:
                raw = open_store(location.rstrip("/") + "/").get_bytes(name)
            else:
                raw = (Path(location) / name).read_bytes()
        except (FileNotFoundError, ObjectNotFound, NotADirectoryError):
            continue
        doc = json.loads(raw)
        return doc if isinstance(doc, dict) else None
    return None


def load_defaults(
    generation_config: str, model: str | None, override: Mapping[str, object]
) -> SamplingDefaults:
    """The engine's defaults for ``--generation-config`` (auto, vllm or a location) and the
    checkpoint at ``model``, with ``override`` on top."""
    config: dict[str, Any] = {}
    source = "vllm defaults"
    location = model if generation_config == "auto" else generation_config
    if generation_config != "vllm" and location:
        try:
            found = _read_config(location)
        except (StoreError, OSError, ValueError) as exc:
            log.error("cannot read the generation config at %s: %s", location, exc)
            found = None
        if found is not None:
            config, source = found, f"generation config of {location}"
    config.update(override)
    if override:
        source += " with overrides"
    values = {k: config[k] for k in OPENAI_DEFAULTS if config.get(k) is not None}
    numbers: dict[str, float | int] = {}
    for name, value in values.items():
        parsed = _number(value)
        if parsed is not None:
            numbers[name] = int(parsed) if name == "top_k" else parsed
    return SamplingDefaults(numbers, source)


def probe_request(served_model: str | None, sampling: Sampling | None) -> dict[str, Any]:
    """A short seeded completion of token 0; with ``sampling`` it names the parameters the
    proxy believes the engine uses by default, without them the engine chooses."""
    body: dict[str, Any] = {
        "prompt": [0],
        "max_tokens": PROBE_TOKENS,
        "seed": PROBE_SEED,
        "logprobs": 0,
        "return_token_ids": True,
        "ignore_eos": True,
    }
    if served_model:
        body["model"] = served_model
    if sampling is not None:
        body.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k)
    return body


def probe_outcome(response: Mapping[str, Any]) -> tuple[list[int], list[float]] | None:
    """The sampled token ids and log-probs of a probe's response."""
    try:
        choice = response["choices"][0]
        return list(choice["token_ids"]), list(choice["logprobs"]["token_logprobs"])
    except (KeyError, IndexError, TypeError):
        return None
