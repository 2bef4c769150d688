"""``rtrl-job stage``: its flags, and the run through the shared runner."""

from __future__ import annotations

import argparse

from rtrl.core.cliargs import fraction, fraction_up_to, non_negative_int, positive_int
from rtrl_trainer.runner import (
    add_config_argument,
    add_endpoint_argument,
    add_now_argument,
    add_work_dir_argument,
    run_step,
    step_now,
    work_dir,
)
from rtrl_trainer.spec_file import time_arg
from rtrl_trainer.stage.config import (
    DEFAULT_HELDOUT_FRACTION,
    MAX_HELDOUT_FRACTION,
    build_config,
)
from rtrl_trainer.stage.step import StageError, stage

DESCRIPTION = """Select the matured interactions the serving checkpoint produced, quarantine
bad data, reward them, compute behaviour monitors, and commit the training set (one Parquet
file per rank) and stage.json to --out. Exit 0 when it ran (enough data or not: see
stage.json), 1 when it failed (too much bad data, store errors), 2 for usage and config
errors."""

# build_config's keywords that are flags of the same name.
# (One string, not one line a name: the list would read like the set's column lists.)
SAME_NAMED = (  # noqa: SIM905
    "checkpoint out shards maturity max_bad_fraction min_interactions min_tokens since "
    "previous_checkpoint ranks endpoint_url heldout_fraction parent sealed fidelity_sample_rows"
).split()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = DESCRIPTION
    parser.add_argument("--shards", metavar="URI", help="shard source (sets data.shards)")
    parser.add_argument("--checkpoint", metavar="ID", required=True, help="serving checkpoint")
    parser.add_argument("--out", metavar="URI", required=True, help="where to commit the set")
    parser.add_argument(
        "--parent",
        metavar="URI",
        help="the serving checkpoint's prefix (a LoRA adapter: loaded on the base its "
        "manifest names, checked by digest): token ids at or beyond its config.json "
        "vocab_size are quarantined (without it, only negative ids are), and the fidelity "
        "gate recomputes sampled rows' log-probs with it",
    )
    parser.add_argument(
        "--fidelity-sample-rows",
        type=non_negative_int,
        metavar="N",
        help="sets data.fidelity.sampleRows: rows per partition the fidelity gate recomputes "
        "(0: off)",
    )
    add_config_argument(parser, "data and/or reward")
    add_now_argument(parser, "the cycle's time")
    parser.add_argument(
        "--since",
        type=time_arg,
        metavar="ISO8601",
        help="skip rows that became ready at or before this (the previous stage's next_since)",
    )
    parser.add_argument("--maturity", metavar="DURATION", help="sets data.maturity, e.g. 1h")
    parser.add_argument(
        "--max-bad-fraction", type=fraction, metavar="F", help="sets data.maxBadFraction"
    )
    parser.add_argument(
        "--min-interactions", type=positive_int, metavar="N", help="sets data.minInteractions"
    )
    parser.add_argument(
        "--min-tokens", type=non_negative_int, metavar="N", help="sets data.minTokens"
    )
    parser.add_argument(
        "--ranks", type=positive_int, default=1, metavar="N", help="data-parallel ranks"
    )
    parser.add_argument(
        "--heldout-fraction",
        type=fraction_up_to(MAX_HELDOUT_FRACTION),
        default=DEFAULT_HELDOUT_FRACTION,
        metavar="F",
        help="share of on-policy interactions held out for eval, never trained on "
        f"(default {DEFAULT_HELDOUT_FRACTION}, at most {MAX_HELDOUT_FRACTION})",
    )
    parser.add_argument(
        "--previous-checkpoint",
        metavar="ID",
        help="admit its rows up to data.maxOffPolicyFraction of the set",
    )
    parser.add_argument(
        "--exclude-checkpoint",
        action="append",
        default=[],
        metavar="ID",
        help="a rolled-back checkpoint: its rows are never staged (repeatable)",
    )
    parser.add_argument(
        "--sealed",
        action="store_true",
        help="read only the files the seal markers (rtrl-job seal) under the shards list: "
        "hours not sealed yet are not read at all",
    )
    add_endpoint_argument(parser)
    add_work_dir_argument(parser, "about the set's size")


def run(args: argparse.Namespace) -> int:
    """``rtrl-job stage``: build the config, run the step, print a one-line summary."""
    return run_step("stage", lambda: _run(args), failures=(StageError,))


def _run(args: argparse.Namespace) -> str:
    scratch = work_dir(args)
    config = build_config(
        config_file=args.config,
        now=step_now(args),
        exclude_checkpoints=args.exclude_checkpoint,
        **{name: getattr(args, name) for name in SAME_NAMED},
    )
    doc = stage(config, work_dir=scratch)
    verdict = "sufficient" if doc["sufficient"] else "insufficient"
    return f"stage: {verdict}: {doc['message']} -> {config.out}"
