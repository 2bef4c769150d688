"""The train step's configuration, and the ``rtrl-job train`` command line that builds it.

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

import argparse
import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError

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


# TrainingSpec fields (camelCase) a flag may override -> (flag, argparse type).
TRAINING_FLAGS: dict[str, tuple[str, Any]] = {
    "zeroStage": ("--zero-stage", int),
    "precision": ("--precision", str),
    "learningRate": ("--learning-rate", float),
    "batchTokens": ("--batch-tokens", int),
    "microBatchSize": ("--micro-batch-size", int),
    "maxSequenceLength": ("--max-sequence-length", int),
    "epochs": ("--epochs", int),
    "clipRatio": ("--clip-ratio", float),
    "isTruncation": ("--is-truncation", float),
    "klCoef": ("--kl-coef", float),
    "gradClip": ("--grad-clip", float),
    "seed": ("--seed", int),
}
TRAINER_FLAGS: dict[str, tuple[str, Any]] = {
    "saveEverySteps": ("--save-every-steps", int),
    "maxSteps": ("--max-steps", int),
    "scratchDir": ("--scratch-dir", str),
}
# TrainingSpec fields that change what is computed; a resumed run must agree on all of them.
LEARNING_FIELDS = (
    "zero_stage",
    "precision",
    "learning_rate",
    "batch_tokens",
    "micro_batch_size",
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

    @property
    def bf16(self) -> bool:
        return self.training.precision == Precision.BF16

    def learning_settings(self) -> dict[str, Any]:
        """The training fields that determine the result (for train.json and resume)."""
        dumped = self.training.model_dump(mode="json")
        return {name: dumped[name] for name in LEARNING_FIELDS}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Train the next checkpoint from the parent and a staged training set, with DeepSpeed. "
        "Run the same command in every rank (torchrun / an Indexed Job); rank 0 publishes."
    )
    parser.add_argument("--parent", required=True, metavar="URI", help="parent checkpoint prefix")
    parser.add_argument("--data", required=True, metavar="URI", help="staged training set prefix")
    parser.add_argument("--out", required=True, metavar="URI", help="new checkpoint prefix")
    parser.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help="RLCycle manifest, its spec, or a mapping with training (and trainer)",
    )
    parser.add_argument("--endpoint-url", help="S3 endpoint (default: $AWS_ENDPOINT_URL)")
    group = parser.add_argument_group("overrides of spec.training (the RLCycle API's fields)")
    for field, (flag, kind) in TRAINING_FLAGS.items():
        group.add_argument(
            flag,
            type=kind,
            dest=f"training_{field}",
            metavar=_METAVARS.get(field, field_metavar(kind)),
            help=_help(TrainingSpec, field),
        )
    group.add_argument(
        "--activation-checkpointing",
        action=argparse.BooleanOptionalAction,
        dest="training_activationCheckpointing",
        default=None,
        help=_help(TrainingSpec, "activationCheckpointing"),
    )
    run = parser.add_argument_group("this run")
    for field, (flag, kind) in TRAINER_FLAGS.items():
        run.add_argument(
            flag,
            type=kind,
            dest=f"trainer_{field}",
            metavar=_METAVARS.get(field, field_metavar(kind)),
            help=_help(TrainerOptions, field),
        )
    run.add_argument(
        "--keep-deepspeed-state",
        action="store_true",
        default=None,
        dest="trainer_keepDeepspeedState",
        help=_help(TrainerOptions, "keepDeepspeedState"),
    )


_METAVARS = {"precision": "bf16|fp32", "scratchDir": "DIR"}


def _help(model: type[ApiModel], camel: str) -> str:
    info = model.model_fields[_snake(camel)]
    text = info.description or ""
    said = info.default is None or "default" in text or isinstance(info.default, bool)
    default = "" if said else f" (default {info.default})"
    # argparse formats help with %: a literal percent sign must be doubled.
    return (text + default).replace("%", "%%")


def field_metavar(kind: Any) -> str:
    return {int: "N", float: "X"}.get(kind, "VALUE")


def run_cli(args: argparse.Namespace) -> int:
    """``rtrl-job train``: exit 2 on a bad config, else the step's own exit code."""
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        print(f"rtrl-job train: {exc}", file=sys.stderr)
        return 2
    # Imported here: torch, DeepSpeed and transformers take seconds to import.
    from rtrl_trainer import train

    return train.run(config)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    training_flags = {
        field: getattr(args, f"training_{field}")
        for field in (*TRAINING_FLAGS, "activationCheckpointing")
        if getattr(args, f"training_{field}", None) is not None
    }
    trainer_flags = {
        field: getattr(args, f"trainer_{field}")
        for field in (*TRAINER_FLAGS, "keepDeepspeedState")
        if getattr(args, f"trainer_{field}", None) is not None
    }
    return build_config(
        parent=args.parent,
        data=args.data,
        out=args.out,
        config_file=args.config,
        training_overrides=training_flags,
        trainer_overrides=trainer_flags,
        endpoint_url=args.endpoint_url,
    )


def build_config(
    *,
    parent: str,
    data: str,
    out: str,
    config_file: Path | None = None,
    training_overrides: Mapping[str, Any] | None = None,
    trainer_overrides: Mapping[str, Any] | None = None,
    endpoint_url: str | None = None,
) -> TrainConfig:
    """Validate the file and the flags into a :class:`TrainConfig`; :class:`ConfigError`
    naming the field (and the file or flag it came from) when anything is wrong."""
    for flag, uri in (("--parent", parent), ("--data", data), ("--out", out)):
        try:
            parse_store_uri(uri)
        except ValueError as exc:
            raise ConfigError(f"{flag}: {exc}") from None
    named = {"--parent": _norm(parent), "--data": _norm(data), "--out": _norm(out)}
    if len(set(named.values())) != 3:
        raise ConfigError("--parent, --data and --out must be three different prefixes")
    for flag, uri in named.items():
        for other, outer in named.items():
            if flag != other and uri.startswith(outer):
                # A listing of the outer prefix would include the inner one's files.
                raise ConfigError(f"{flag} {uri} is inside {other} {outer}; use separate prefixes")
    training_doc: dict[str, Any] = {}
    trainer_doc: dict[str, Any] = {}
    base, where = "", "flags"
    if config_file is not None:
        found, base = load_sections(config_file, ("training",), extra=("trainer",))
        training_doc, trainer_doc = found["training"], found["trainer"]
        where = str(config_file)
    training_doc = _override(training_doc, training_overrides or {})
    trainer_doc = _override(trainer_doc, trainer_overrides or {})
    if "image" not in training_doc:
        training_doc["image"] = PLACEHOLDER_IMAGE
    prefix = f"{base}." if base else ""
    flags = {k: v[0] for k, v in TRAINING_FLAGS.items()} | {
        "activationCheckpointing": "--activation-checkpointing"
    }
    try:
        training = TrainingSpec.model_validate_json(to_json(training_doc), strict=True)
    except ValidationError as exc:
        raise ConfigError(
            validation_problems(
                exc,
                where=where,
                path=f"{prefix}training",
                flags={k: v for k, v in flags.items() if k in (training_overrides or {})},
            )
        ) from None
    trainer_flags = {k: v[0] for k, v in TRAINER_FLAGS.items()} | {
        "keepDeepspeedState": "--keep-deepspeed-state"
    }
    try:
        trainer = TrainerOptions.model_validate_json(to_json(trainer_doc), strict=True)
    except ValidationError as exc:
        raise ConfigError(
            validation_problems(
                exc,
                where=where,
                path="trainer",
                flags={k: v for k, v in trainer_flags.items() if k in (trainer_overrides or {})},
            )
        ) from None
    return TrainConfig(
        parent=parent,
        data=data,
        out=out,
        training=training,
        trainer=trainer,
        endpoint_url=endpoint_url,
    )


def _override(doc: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(doc)
    for key, value in overrides.items():
        # The file may spell a field in snake_case (populate_by_name); the flag wins.
        out.pop(_snake(key), None)
        out[key] = value
    return out


def _snake(camel: str) -> str:
    return "".join(f"_{c.lower()}" if c.isupper() else c for c in camel)


def _norm(uri: str) -> str:
    return uri.rstrip("/") + "/"


def describe(config: TrainConfig) -> dict[str, Any]:
    """The config as recorded in train.json (the placeholder image left out)."""
    training = config.training.model_dump(mode="json", exclude_none=True)
    if training.get("image") == PLACEHOLDER_IMAGE:
        training.pop("image")
    return {"training": training, "trainer": config.trainer.model_dump(mode="json")}


def fingerprint_source(config: TrainConfig) -> str:
    """Canonical JSON of the settings a resumed run must share with the interrupted one."""
    return json.dumps(config.learning_settings(), sort_keys=True)
