"""``rtrl-job <step>``: the entry point of every Job pod (and of local runs).

Steps are registered in ``STEPS`` as they are built (stage, train, eval, analyze); each
reads and writes the object store only and commits a small JSON result last. Asking for a
step this version does not have is a usage error (exit 2) that names the steps it has.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from rtrl_trainer import evaluate, stage, train_config

# step name -> (one-line help, function adding its arguments, function running it)
STEPS: dict[
    str,
    tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]],
] = {
    "stage": (
        "select, quarantine and reward matured interactions; write the training set",
        stage.add_arguments,
        stage.run,
    ),
    "train": (
        "train the next checkpoint from the parent and the staged set (DeepSpeed)",
        train_config.add_arguments,
        train_config.run_cli,
    ),
    "eval": (
        "evaluate a candidate checkpoint against its parent and judge the regression gates",
        evaluate.add_arguments,
        evaluate.run,
    ),
}
PLANNED = ("stage", "train", "eval", "analyze")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rtrl-job",
        description="Run one step of an rtrl cycle (inside a Job pod, or locally).",
    )
    steps = parser.add_subparsers(dest="step", metavar="STEP")
    for name, (help_text, add_arguments, run) in STEPS.items():
        sub = steps.add_parser(name, help=help_text)
        add_arguments(sub)
        sub.set_defaults(run=run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if argv and not argv[0].startswith("-") and argv[0] not in STEPS:
        available = ", ".join(STEPS) or "none yet"
        print(
            f"rtrl-job: step {argv[0]!r} is not available in this version "
            f"(available: {available}; planned: {', '.join(PLANNED)})",
            file=sys.stderr,
        )
        return 2
    args = parser.parse_args(argv)
    if args.step is None:
        parser.print_help()
        return 2
    code: int = args.run(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
