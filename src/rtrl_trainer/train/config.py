"""The train step's configuration (the ``rtrl-job train`` command line that builds it is cli.py).

The learning settings are :class:`~rtrl.core.api.rlcycle.TrainingSpec`, the ``training`` part of
an RLCycle, reused rather than redefined: a spec the API server accepted is exactly a
config this step accepts, and a bad one is rejected naming the same field. What only a run
of the step needs (checkpoint cadence, a step limit, local scratch) is
:class:`TrainerOptions`.

The config file may be a whole RLCycle manifest, its ``spec``, or a mapping with
``training`` (and optionally ``trainer`` for the run-only knobs), in YAML or JSON. Flags
override the file. Nothing here imports torch: ``rtrl-job --help`` and config errors stay
instant, and the heavy step module is imported only once the config is known to be good.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, get_args

from pydantic import Field, ValidationError

from rtrl.core.api.adapter import AdapterSpec
from rtrl.core.api.common import ApiModel
from rtrl.core.api.rlcycle import Precision, TrainingSpec
from rtrl.core.store import parse_store_uri
from rtrl_trainer.spec_file import ConfigError, load_sections, to_json, validation_problems

# TrainingSpec requires the trainer image, which is the operator's business: the step runs
# inside that image and never reads the field. A config without one gets this placeholder,
# which is left out of train.json and of the resume fingerprint.
PLACEHOLDER_IMAGE = "rtrl-trainer:local"


class TrainerOptions(ApiModel):
    """Knobs of one run of the train step that are not part of the RLCycle API."""

    save_every_steps: int = Field(
        50,
        ge=0,
        description="Save DeepSpeed state to the store every this many optimizer steps, so a "
        "restarted pod resumes there (0: never).",
    )
    max_steps: int | None = Field(
        None, ge=1, description="Stop after this many optimizer steps (default: all epochs)."
    )
    scratch_dir: str | None = Field(
        None,
        min_length=1,
        description="Local directory for downloads and DeepSpeed state "
        "(default: $RTRL_SCRATCH, else a directory under the system temp dir).",
    )
    keep_deepspeed_state: bool = Field(
        False,
        description="Keep <out>/_deepspeed/ (optimizer state) after publishing; by default it "
        "is deleted once the checkpoint is committed.",
    )


def snake(camel: str) -> str:
    """A camelCase API field's Python name."""
    return "".join(f"_{c.lower()}" if c.isupper() else c for c in camel)


def flag(camel: str) -> str:
    """The flag of a field: its name in kebab case (``klCoef``: ``--kl-coef``)."""
    return "--" + snake(camel).replace("_", "-")


def _flags(model: type[ApiModel], fields: tuple[str, ...]) -> dict[str, tuple[str, Any]]:
    """Field -> (flag, argparse type): the field's own type, int or float, else str (an
    enum, a string); ``X | None`` is X."""
    out: dict[str, tuple[str, Any]] = {}
    for camel in fields:
        kind = model.model_fields[snake(camel)].annotation
        kind = next((a for a in get_args(kind) if a is not type(None)), kind)
        out[camel] = (flag(camel), kind if kind in (int, float) else str)
    return out


# Fields (camelCase) a flag may override -> (flag, argparse type), in --help's order.
TRAINING_FLAGS = _flags(
    TrainingSpec,
    (
        "zeroStage",
        "precision",
        "learningRate",
        "batchTokens",
        "microBatchSize",
        "microBatchTokens",
        "maxSequenceLength",
        "epochs",
        "clipRatio",
        "isTruncation",
        "klCoef",
        "gradClip",
        "seed",
    ),
)
TRAINER_FLAGS = _flags(TrainerOptions, ("saveEverySteps", "maxSteps", "scratchDir"))
# Boolean fields: field -> flag (a switch, no value).
TRAINING_SWITCHES = {name: flag(name) for name in ("activationCheckpointing", "packSequences")}
TRAINER_SWITCHES = {"keepDeepspeedState": flag("keepDeepspeedState")}
# AdapterSpec fields -> (flag, argparse type); a list is given comma-separated. Any of them
# asks for an adapter (the rest at their defaults), as an ``adapter:`` section does.
ADAPTER_FLAGS = {
    "rank": ("--adapter-rank", int),
    "alpha": ("--adapter-alpha", int),
    "targetModules": ("--adapter-target-modules", str),
}
# TrainingSpec fields that change what is computed; a resumed run must agree on all of them.
LEARNING_FIELDS = (
    "zero_stage",
    "precision",
    "learning_rate",
    "batch_tokens",
    "micro_batch_size",
    "micro_batch_tokens",
    "pack_sequences",
    "max_sequence_length",
    "epochs",
    "clip_ratio",
    "is_truncation",
    "kl_coef",
    "grad_clip",
    "activation_checkpointing",
    "seed",
)


@dataclass(frozen=True)
class TrainConfig:
    """Everything one run of ``rtrl-job train`` needs, validated."""

    parent: str
    data: str
    out: str
    training: TrainingSpec
    trainer: TrainerOptions
    endpoint_url: str | None = None
    # a LoRA adapter on the parent instead of all its weights (train/adapter.py); a parent
    # that is itself an adapter is continued with its own shape when this is None
    adapter: AdapterSpec | None = None

    @property
    def bf16(self) -> bool:
        return self.training.precision == Precision.BF16

    def learning_settings(self) -> dict[str, Any]:
        """The training fields that determine the result (for train.json and resume)."""
        dumped = self.training.model_dump(mode="json")
        return {name: dumped[name] for name in LEARNING_FIELDS}


def build_config(
    *,
    parent: str,
    data: str,
    out: str,
    config_file: Path | None = None,
    training_overrides: Mapping[str, Any] | None = None,
    trainer_overrides: Mapping[str, Any] | None = None,
    adapter_overrides: Mapping[str, Any] | None = None,
    endpoint_url: str | None = None,
) -> TrainConfig:
    """Validate the file and the flags into a :class:`TrainConfig`; :class:`ConfigError`
    naming the field (and the file or flag it came from) when anything is wrong."""
    for option, uri in (("--parent", parent), ("--data", data), ("--out", out)):
        try:
            parse_store_uri(uri)
        except ValueError as exc:
            raise ConfigError(f"{option}: {exc}") from None
    named = {"--parent": _norm(parent), "--data": _norm(data), "--out": _norm(out)}
    if len(set(named.values())) != 3:
        raise ConfigError("--parent, --data and --out must be three different prefixes")
    for option, uri in named.items():
        for other, outer in named.items():
            if option != other and uri.startswith(outer):
                # A listing of the outer prefix would include the inner one's files.
                raise ConfigError(
                    f"{option} {uri} is inside {other} {outer}; use separate prefixes"
                )
    training_doc: dict[str, Any] = {}
    trainer_doc: dict[str, Any] = {}
    adapter_doc: dict[str, Any] | None = None
    base, where = "", "flags"
    if config_file is not None:
        found, base = load_sections(
            config_file, ("training",), extra=("trainer",), optional=("adapter",)
        )
        training_doc, trainer_doc = found["training"], found["trainer"]
        adapter_doc = found.get("adapter")
        where = str(config_file)
    training_doc = _override(training_doc, training_overrides or {})
    trainer_doc = _override(trainer_doc, trainer_overrides or {})
    if adapter_overrides:
        adapter_doc = _override(adapter_doc or {}, adapter_overrides)
    if "image" not in training_doc:
        training_doc["image"] = PLACEHOLDER_IMAGE
    prefix = f"{base}." if base else ""
    training = _validate(
        TrainingSpec,
        training_doc,
        where=where,
        path=f"{prefix}training",
        flags=_flag_names(TRAINING_FLAGS, TRAINING_SWITCHES, training_overrides),
    )
    trainer = _validate(
        TrainerOptions,
        trainer_doc,
        where=where,
        path="trainer",
        flags=_flag_names(TRAINER_FLAGS, TRAINER_SWITCHES, trainer_overrides),
    )
    adapter = None
    if adapter_doc is not None:
        adapter = _validate(
            AdapterSpec,
            adapter_doc,
            where=where,
            path="adapter",
            flags={k: v[0] for k, v in ADAPTER_FLAGS.items() if k in (adapter_overrides or {})},
        )
        if training.zero_stage == 3:
            raise ConfigError(
                f"{where}: {prefix}training.zeroStage: 3 cannot train an adapter here (the "
                "frozen base is replicated, only the adapter is trained); use 0, 1 or 2"
            )
    return TrainConfig(
        parent=parent,
        data=data,
        out=out,
        training=training,
        trainer=trainer,
        endpoint_url=endpoint_url,
        adapter=adapter,
    )


M = TypeVar("M", bound=ApiModel)


def _validate(
    model: type[M], doc: Mapping[str, Any], *, where: str, path: str, flags: dict[str, str]
) -> M:
    """``doc`` as ``model`` (strict); a :class:`ConfigError` naming the field, and the file
    or the flag it came from, when it is not one."""
    try:
        return model.model_validate_json(to_json(doc), strict=True)
    except ValidationError as exc:
        raise ConfigError(validation_problems(exc, where=where, path=path, flags=flags)) from None


def _flag_names(
    valued: Mapping[str, tuple[str, Any]],
    switches: Mapping[str, str],
    overrides: Mapping[str, Any] | None,
) -> dict[str, str]:
    """Field -> flag, for the fields a flag set (a problem there names the flag)."""
    names = {k: v[0] for k, v in valued.items()} | dict(switches)
    return {k: v for k, v in names.items() if k in (overrides or {})}


def _override(doc: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(doc)
    for key, value in overrides.items():
        # The file may spell a field in snake_case (populate_by_name); the flag wins.
        out.pop(snake(key), None)
        out[key] = value
    return out


def _norm(uri: str) -> str:
    return uri.rstrip("/") + "/"


def describe(config: TrainConfig) -> dict[str, Any]:
    """The config as recorded in train.json (the placeholder image left out)."""
    training = config.training.model_dump(mode="json", exclude_none=True)
    if training.get("image") == PLACEHOLDER_IMAGE:
        training.pop("image")
    doc = {"training": training, "trainer": config.trainer.model_dump(mode="json")}
    if config.adapter is not None:
        doc["adapter"] = config.adapter.model_dump(mode="json")
    return doc


def fingerprint_source(config: TrainConfig) -> str:
    """Canonical JSON of the settings a resumed run must share with the interrupted one."""
    settings = config.learning_settings()
    if config.adapter is not None:
        settings["adapter"] = config.adapter.model_dump(mode="json")
    return json.dumps(settings, sort_keys=True)
