"""``rtrl-job <step>``: the entry point of every Job pod (and of local runs).

Each step reads and writes the object store only and commits a small JSON result last.
A step's module is imported only when that step runs: eval pulls in torch and
transformers, which a stage pod must not pay for at start-up. Asking for a step this
version does not have is a usage error (exit 2) that names the steps it has.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from rtrl import __version__
from rtrl_trainer import progress
from rtrl_trainer.runner import EXIT_USAGE

# step name -> one-line help; the step's package has a ``cli`` module defining
# ``add_arguments(parser)`` and ``run(args) -> int`` (which goes through rtrl_trainer.runner).
STEPS: dict[str, str] = {
    "stage": "select, quarantine and reward matured interactions; write the training set",
    "train": "train the next checkpoint from the parent and the staged set (DeepSpeed)",
    "eval": "evaluate a candidate checkpoint against its parent and judge the regression gates",
    "analyze": "judge a canary against the stable checkpoint: promote, rollback or continue",
    "seal": "join each matured hour's generation and feedback events into shards",
}
# step name -> its package, where it is not the step's name
PACKAGES: dict[str, str] = {"eval": "evaluate"}
PLANNED: tuple[str, ...] = ()


def build_parser(step: str | None = None) -> argparse.ArgumentParser:
    """The parser; only ``step``'s module is imported (for its arguments)."""
    parser = argparse.ArgumentParser(
        prog="rtrl-job",
        description="Run one step of an rtrl cycle (inside a Job pod, or locally).",
    )
    parser.add_argument("--version", action="version", version=f"rtrl-job {__version__}")
    steps = parser.add_subparsers(dest="step", metavar="STEP")
    for name, help_text in STEPS.items():
        sub = steps.add_parser(name, help=help_text)
        sub.add_argument(
            "--log-format",
            choices=progress.FORMATS,
            help=f"progress lines as text or one JSON object per line (default: "
            f"${progress.LOG_FORMAT_ENV}, else text)",
        )
        if name == step:
            module = importlib.import_module(f"rtrl_trainer.{PACKAGES.get(name, name)}.cli")
            module.add_arguments(sub)
            sub.set_defaults(run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and not argv[0].startswith("-") and argv[0] not in STEPS:
        planned = f"; planned: {', '.join(PLANNED)}" if PLANNED else ""
        print(
            f"rtrl-job: step {argv[0]!r} is not available in this version "
            f"(available: {', '.join(STEPS)}{planned})",
            file=sys.stderr,
        )
        return EXIT_USAGE
    step = argv[0] if argv and argv[0] in STEPS else None
    parser = build_parser(step)
    args = parser.parse_args(argv)
    if args.step is None:
        parser.print_help()
        return EXIT_USAGE
    try:
        progress.configure(args.log_format)
    except ValueError as exc:
        print(f"rtrl-job {args.step}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    code: int = args.run(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
