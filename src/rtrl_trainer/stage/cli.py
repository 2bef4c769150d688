"""``rtrl-job stage``: its flags, and the run through the shared runner."""

from __future__ import annotations

import argparse
from datetime import UTC, datetime
from pathlib import Path

from rtrl.core.cliargs import fraction, non_negative_int, positive_int
from rtrl_trainer.runner import run_step
from rtrl_trainer.spec_file import ConfigError, time_arg
from rtrl_trainer.stage.config import DEFAULT_HELDOUT_FRACTION, build_config
from rtrl_trainer.stage.step import StageError, stage


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Select the matured interactions the serving checkpoint produced, quarantine bad "
        "data, reward them, compute behaviour monitors, and commit the training set (one "
        "Parquet file per rank) and stage.json to --out. Exit 0 when it ran (enough data or "
        "not: see stage.json), 1 when it failed (too much bad data, store errors), 2 for "
        "usage and config errors."
    )
    parser.add_argument("--shards", metavar="URI", help="shard source (sets data.shards)")
    parser.add_argument("--checkpoint", metavar="ID", required=True, help="serving checkpoint")
    parser.add_argument("--out", metavar="URI", required=True, help="where to commit the set")
    parser.add_argument(
        "--config",
        metavar="FILE",
        type=Path,
        help="YAML/JSON: an RLCycle, its spec, or a mapping with data and/or reward",
    )
    parser.add_argument(
        "--now", type=time_arg, metavar="ISO8601", help="the cycle's time (default: the clock)"
    )
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
        type=fraction,
        default=DEFAULT_HELDOUT_FRACTION,
        metavar="F",
        help="share of on-policy interactions held out for eval, never trained on "
        f"(default {DEFAULT_HELDOUT_FRACTION})",
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
        "--endpoint-url",
        metavar="URL",
        help="S3-compatible endpoint (default: $AWS_ENDPOINT_URL, else AWS)",
    )
    parser.add_argument(
        "--work-dir",
        type=Path,
        metavar="DIR",
        help="local scratch directory (default: $TMPDIR); needs about the set's size",
    )


def run(args: argparse.Namespace) -> int:
    """``rtrl-job stage``: build the config, run the step, print a one-line summary."""
    return run_step("stage", lambda: _run(args), failures=(StageError,))


def _run(args: argparse.Namespace) -> str:
    now = args.now if args.now is not None else datetime.now(UTC).replace(microsecond=0)
    if args.work_dir is not None and not args.work_dir.is_dir():
        raise ConfigError(f"--work-dir {args.work_dir}: not a directory")
    config = build_config(
        config_file=args.config,
        checkpoint=args.checkpoint,
        out=args.out,
        now=now,
        shards=args.shards,
        maturity=args.maturity,
        max_bad_fraction=args.max_bad_fraction,
        min_interactions=args.min_interactions,
        min_tokens=args.min_tokens,
        since=args.since,
        previous_checkpoint=args.previous_checkpoint,
        exclude_checkpoints=args.exclude_checkpoint,
        ranks=args.ranks,
        endpoint_url=args.endpoint_url,
        heldout_fraction=args.heldout_fraction,
    )
    doc = stage(config, work_dir=args.work_dir)
    verdict = "sufficient" if doc["sufficient"] else "insufficient"
    return f"stage: {verdict}: {doc['message']} -> {config.out}"
