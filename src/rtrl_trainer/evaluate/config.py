"""The eval step's settings: the RLCycle's ``eval`` section (suites, gates, alpha) and the
evaluator's own knobs (the config file's ``evaluator`` section: decoding, bootstrap,
sandbox limits), validated once (:class:`ConfigError` names the field or flag otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError

from rtrl.core.api.common import ApiModel
from rtrl.core.api.rlcycle import EvalSpec, EvalSuite
from rtrl.core.store import parse_store_uri
from rtrl_trainer.evaluate.model import Decoding
from rtrl_trainer.evaluate.sandbox_types import Limits
from rtrl_trainer.spec_file import ConfigError, load_sections, to_json, validation_problems

RESULT_NAME = "eval.json"
CACHE_DIR = "_eval-cache"
# 3: replay log-likelihoods under each row's sampling distribution (rtrl_trainer.logprobs)
CACHE_FORMAT = 3
CODE_SUITES = (EvalSuite.TASKS, EvalSuite.HUMANEVAL)


class EvaluatorOptions(ApiModel):
    """Knobs of one run of the eval step that are not part of the RLCycle API (the config
    file's ``evaluator`` section)."""

    max_tokens: int = Field(128, ge=1, le=8192, description="Tokens generated per completion.")
    temperature: float = Field(0.0, ge=0, le=5, description="0: greedy decoding.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling (temperature > 0).")
    seed: int = Field(0, ge=0, description="Seed of sampling and of the bootstrap.")
    batch_size: int = Field(8, ge=1, le=1024, description="Prompts generated at once.")
    resamples: int = Field(2000, ge=100, le=100_000, description="Bootstrap resamples.")
    max_tasks: int | None = Field(None, ge=1, description="Run only the first N tasks.")
    task_file: str | None = Field(None, min_length=1, description="Task suite file.")
    task_wall_seconds: float = Field(10.0, gt=0, le=600, description="Wall clock per task.")
    task_cpu_seconds: int = Field(5, ge=1, le=600, description="CPU seconds per task.")
    task_memory_mb: int = Field(512, ge=64, le=65536, description="Address space per task.")
    task_output_kb: int = Field(64, ge=1, le=65536, description="Output (and file) size cap.")
    task_workers: int = Field(2, ge=1, le=256, description="Sandboxes run at once.")
    insecure_sandbox: bool = Field(
        False,
        description="Score the tasks suites even where a sandbox guarantee is missing "
        "(local runs only: eval.json still says which).",
    )
    replay_max_rows: int = Field(2000, ge=1, description="Held-out rows scored (the first N).")
    behaviour_max_prompts: int = Field(64, ge=1, description="Held-out prompts generated.")

    def decoding(self) -> Decoding:
        return Decoding(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            seed=self.seed,
            batch_size=self.batch_size,
        )

    def limits(self) -> Limits:
        return Limits(
            wall_seconds=self.task_wall_seconds,
            cpu_seconds=self.task_cpu_seconds,
            memory_bytes=self.task_memory_mb << 20,
            output_bytes=self.task_output_kb << 10,
        )


@dataclass(frozen=True)
class EvalConfig:
    candidate: str
    parent: str
    out: str
    heldout: str | None
    spec: EvalSpec
    options: EvaluatorOptions
    endpoint_url: str | None = None


class EvalError(Exception):
    """The step could not evaluate; the message says why."""


def build_config(
    *,
    candidate: str,
    parent: str,
    out: str,
    heldout: str | None,
    config_file: Path | None,
    endpoint_url: str | None = None,
    max_tasks: int | None = None,
    insecure_sandbox: bool = False,
) -> EvalConfig:
    # Every store URI is checked before anything is read (a usage error, exit 2, whichever
    # flag holds it), as train and stage do.
    uris = {"--candidate": candidate, "--parent": parent, "--out": out, "--heldout": heldout}
    for option, uri in uris.items():
        try:
            if uri is not None:
                parse_store_uri(uri)
        except ValueError as exc:
            raise ConfigError(f"{option}: {exc}") from None
    eval_doc: dict[str, Any] = {}
    options_doc: dict[str, Any] = {}
    where, prefix = "--config", ""
    if config_file is not None:
        found, base = load_sections(config_file, ("eval",), extra=("evaluator",))
        eval_doc, options_doc = found["eval"], found["evaluator"]
        where, prefix = str(config_file), f"{base}." if base else ""
    if max_tasks is not None:
        options_doc = {**options_doc, "maxTasks": max_tasks}
    if insecure_sandbox:
        options_doc = {**options_doc, "insecureSandbox": True}
    try:
        spec = EvalSpec.model_validate_json(to_json(eval_doc), strict=True)
    except ValidationError as exc:
        raise ConfigError(
            validation_problems(exc, where=where, path=f"{prefix}eval", flags={})
        ) from None
    try:
        options = EvaluatorOptions.model_validate_json(to_json(options_doc), strict=True)
    except ValidationError as exc:
        flags = {"maxTasks": "--max-tasks"} if max_tasks is not None else {}
        raise ConfigError(
            validation_problems(exc, where=where, path="evaluator", flags=flags)
        ) from None
    suites = set(spec.suites)
    if suites & {EvalSuite.REPLAY, EvalSuite.BEHAVIOUR} and heldout is None:
        needing = sorted(str(s) for s in suites & {EvalSuite.REPLAY, EvalSuite.BEHAVIOUR})
        raise ConfigError(
            f"--heldout: required by the {' and '.join(needing)} suite(s) (a stage output "
            "prefix with heldout/*.parquet)"
        )
    return EvalConfig(candidate, parent, out, heldout, spec, options, endpoint_url)
