"""``rtrl-job analyze``: its flags, and the run that turns them into a config, runs the
analysis and prints the decision (exit codes: :mod:`rtrl_trainer.runner`)."""

from __future__ import annotations

import argparse
import math
from datetime import datetime

from rtrl_trainer.analyze.config import AnalyzeError, build_config
from rtrl_trainer.analyze.step import analyze
from rtrl_trainer.runner import (
    add_config_argument,
    add_endpoint_argument,
    add_now_argument,
    run_step,
    step_now,
)
from rtrl_trainer.spec_file import time_arg


def _weight(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 1 <= value <= 99:
        raise argparse.ArgumentTypeError(f"expected a percentage in 1..99, not {text!r}")
    return value


def _step(text: str) -> tuple[datetime, float]:
    at, sep, share = text.rpartition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected ISO8601=SHARE, not {text!r}")
    return time_arg(at), _weight(share)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Judge a canary: per-arm statistics of the matured interactions each checkpoint "
        "served since the canary started, always-valid intervals, guardrails and a "
        "sample-ratio check; commit analysis.json (decision promote, rollback or continue, "
        "with reasons) to --out. Exit 0 when it ran (whatever the decision), 1 when it "
        "could not (store errors, too much bad data), 2 for usage and config errors."
    )
    parser.add_argument("--shards", metavar="URI", help="shard source (sets data.shards)")
    parser.add_argument("--baseline", metavar="ID", required=True, help="stable checkpoint")
    parser.add_argument("--canary", metavar="ID", required=True, help="canary checkpoint")
    parser.add_argument("--out", metavar="URI", required=True, help="where analysis.json goes")
    parser.add_argument(
        "--canary-weight",
        type=_weight,
        metavar="W",
        help="the canary's configured traffic share in percent (1..99): enables the "
        "sample-ratio check",
    )
    parser.add_argument(
        "--since",
        type=time_arg,
        metavar="ISO8601",
        help="canary start: only interactions created at or after it",
    )
    parser.add_argument(
        "--weight-since",
        type=time_arg,
        metavar="ISO8601",
        help="when the canary weight last changed (default --since): the sample-ratio check "
        "counts interactions created at or after it",
    )
    parser.add_argument(
        "--step",
        dest="steps",  # "step" names the rtrl-job subcommand
        type=_step,
        action="append",
        metavar="ISO8601=SHARE",
        help="a canary step: when it started and the canary's share (percent) during it; "
        "repeat for every step so far, in order. The estimates are stratified by step and "
        "the sample-ratio test spans every step (default: one step from --since at "
        "--canary-weight)",
    )
    parser.add_argument(
        "--pre-exposure-from",
        action="append",
        metavar="ID",
        help="a checkpoint that served as stable before the baseline (its ancestors): its "
        "interactions in analysis.preExposure before --since give covariates too; repeat",
    )
    parser.add_argument(
        "--events",
        metavar="URI",
        help="the capture proxy's events root (spec.capture.events): each arm's served "
        "requests in the canary's sealed hours, reconciled with the rows it logged "
        "(guardrail loggedPerServed)",
    )
    parser.add_argument(
        "--org",
        metavar="ORG",
        help="only this organisation's rows and served requests: the canary of its adapter, "
        "which its users alone see (the other organisations' rows are counted as excluded)",
    )
    parser.add_argument(
        "--exclude-org",
        dest="exclude_orgs",
        action="append",
        metavar="ORG",
        help="leave this organisation's rows and served requests out (repeatable): those "
        "served by adapters of their own, when the base is the canary (counted as excluded)",
    )
    add_config_argument(parser, "rollout and/or data")
    add_now_argument(parser, "the analysis time")
    parser.add_argument(
        "--max-duration-reached",
        action="store_true",
        help="the canary ran for analysis.maxDuration: apply the inconclusive policy",
    )
    add_endpoint_argument(parser)


# The flags passed to build_config as they are: each dest is the parameter's name.
CONFIG_FLAGS = (
    "baseline",
    "canary",
    "out",
    "shards",
    "since",
    "weight_since",
    "canary_weight",
    "max_duration_reached",
    "endpoint_url",
    "steps",
    "pre_exposure_from",
    "events",
    "org",
    "exclude_orgs",
)


def run(args: argparse.Namespace) -> int:
    """``rtrl-job analyze``: build the config, run the analysis, print the decision."""
    now = step_now(args)

    def body() -> str:
        flags = {name: getattr(args, name) for name in CONFIG_FLAGS}
        config = build_config(config_file=args.config, now=now, **flags)
        doc = analyze(config)
        return f"analyze: {doc['decision']}: {doc['message']} -> {config.out}"

    return run_step("analyze", body, failures=(AnalyzeError,), prefix="cannot analyse: ")
