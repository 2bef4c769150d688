"""The ``rtrl-job train`` command line: flags over the config file, into a TrainConfig.

Every field a flag may set is spelled once (config.py's tables); the flags' help is the
API field's own description, so ``--help`` and the RLCycle reference cannot disagree.
Nothing here imports torch: ``rtrl-job train --help`` and config errors stay instant, and
the training loop is imported only once the config is known to be good.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rtrl.core.api.adapter import AdapterSpec
from rtrl.core.api.common import ApiModel
from rtrl.core.api.rlcycle import TrainingSpec
from rtrl_trainer.runner import add_endpoint_argument, run_step
from rtrl_trainer.train.config import (
    ADAPTER_FLAGS,
    TRAINER_FLAGS,
    TRAINER_SWITCHES,
    TRAINING_FLAGS,
    TRAINING_SWITCHES,
    TrainConfig,
    TrainerOptions,
    build_config,
    snake,
)

_METAVARS = {"precision": "bf16|fp32", "scratchDir": "DIR", "targetModules": "NAME,..."}


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
    add_endpoint_argument(parser)
    group = parser.add_argument_group("overrides of spec.training (the RLCycle API's fields)")
    _add_flags(group, "training", TrainingSpec, TRAINING_FLAGS)
    for switch, name in TRAINING_SWITCHES.items():
        group.add_argument(
            name,
            action=argparse.BooleanOptionalAction,
            dest=f"training_{switch}",
            default=None,
            help=_help(TrainingSpec, switch),
        )
    adapter = parser.add_argument_group(
        "a LoRA adapter instead of all weights (any of these asks for one; a parent that "
        "is an adapter is continued with its own shape)"
    )
    _add_flags(adapter, "adapter", AdapterSpec, ADAPTER_FLAGS)
    run_group = parser.add_argument_group("this run")
    _add_flags(run_group, "trainer", TrainerOptions, TRAINER_FLAGS)
    run_group.add_argument(
        TRAINER_SWITCHES["keepDeepspeedState"],
        action="store_true",
        default=None,
        dest="trainer_keepDeepspeedState",
        help=_help(TrainerOptions, "keepDeepspeedState"),
    )


def _add_flags(
    group: argparse._ArgumentGroup,
    section: str,
    model: type[ApiModel],
    flags: Mapping[str, tuple[str, Any]],
) -> None:
    """One valued flag per field of ``flags``, stored as ``<section>_<field>``."""
    for field, (flag, kind) in flags.items():
        group.add_argument(
            flag,
            type=kind,
            dest=f"{section}_{field}",
            metavar=_METAVARS.get(field, field_metavar(kind)),
            help=_help(model, field),
        )


def _help(model: type[ApiModel], camel: str) -> str:
    info = model.model_fields[snake(camel)]
    text = info.description or ""
    said = info.default is None or "default" in text or isinstance(info.default, bool)
    default = "" if said else f" (default {info.default})"
    # argparse formats help with %: a literal percent sign must be doubled.
    return (text + default).replace("%", "%%")


def field_metavar(kind: Any) -> str:
    return {int: "N", float: "X"}.get(kind, "VALUE")


def run(args: argparse.Namespace) -> int:
    """``rtrl-job train``: exit 2 on a bad config (the shared runner), else the training
    run's own exit code (it decides per rank what to print; see loop.run)."""

    def body() -> int:
        config = config_from_args(args)
        # Imported here: torch, DeepSpeed and transformers take seconds to import.
        from rtrl_trainer.train import loop

        return loop.run(config)

    return run_step("train", body)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    return build_config(
        parent=args.parent,
        data=args.data,
        out=args.out,
        config_file=args.config,
        training_overrides=_given(args, "training", (*TRAINING_FLAGS, *TRAINING_SWITCHES)),
        trainer_overrides=_given(args, "trainer", (*TRAINER_FLAGS, *TRAINER_SWITCHES)),
        adapter_overrides=_adapter_given(args),
        endpoint_url=args.endpoint_url,
    )


def _adapter_given(args: argparse.Namespace) -> dict[str, Any]:
    """The adapter fields a flag set; ``--adapter-target-modules`` is comma-separated."""
    given = _given(args, "adapter", tuple(ADAPTER_FLAGS))
    if "targetModules" in given:
        given["targetModules"] = [m.strip() for m in given["targetModules"].split(",")]
    return given


def _given(args: argparse.Namespace, section: str, fields: tuple[str, ...]) -> dict[str, Any]:
    """The fields of ``section`` a flag set (None: not given)."""
    values = {field: getattr(args, f"{section}_{field}", None) for field in fields}
    return {field: value for field, value in values.items() if value is not None}
