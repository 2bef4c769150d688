"""The ``rtrl`` command line: generate CRDs, validate manifests and interaction shards
offline (and, as later commands arrive, run the operator and the local demo).

Exit codes: 0 success, 1 something checked was invalid, 2 usage error.
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path

from . import __version__


def _repo_crds_dir() -> Path:
    # Running from a checkout: <repo>/src/rtrl/cli.py -> <repo>/crds
    return Path(__file__).resolve().parents[2] / "crds"


def cmd_crds(args: argparse.Namespace) -> int:
    from .crdgen import drifted, write_crds

    out = Path(args.out) if args.out else _repo_crds_dir()
    if args.check:
        stale = drifted(out)
        for name in stale:
            print(f"{out / name}: differs from the API types; run `rtrl crds`", file=sys.stderr)
        return 1 if stale else 0
    changed = write_crds(out)
    for path in changed:
        print(f"wrote {path}")
    if not changed:
        print(f"{out}: up to date")
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    from .validation import validate_file

    bad = 0
    for name in args.files:
        report = validate_file(Path(name))
        for document, problem in report.problems:
            where = f"{name}: {document.label}" if document else name
            print(f"{where}: {problem}")
        if report.problems:
            bad += 1
        elif not args.quiet:
            parts = [f"{d.label} valid" for d in report.checked]
            parts += [f"{d.label} skipped (not rtrl.io)" for d in report.skipped]
            print(f"{name}: {', '.join(parts)}")
    if bad:
        print(f"{bad} of {len(args.files)} file(s) invalid", file=sys.stderr)
    return 1 if bad else 0


def cmd_operator(args: argparse.Namespace) -> int:
    """Run the operator: reconcile RLCycles in the given namespaces (or all of them)."""
    import kopf

    from .handlers import registry
    from .logs import configure

    configure(args.log_format, verbose=args.verbose)
    logging.getLogger("rtrl.operator").info("rtrl operator %s (kopf %s)", __version__,
                                            metadata.version("kopf"))  # fmt: skip
    if not args.all_namespaces and not args.namespace:
        print(
            "rtrl operator: give --namespace NS (repeatable) or --all-namespaces", file=sys.stderr
        )
        return 2
    if args.metrics_port:
        from .metrics import serve

        serve(args.metrics_port)
    kopf.run(
        registry=registry,
        clusterwide=args.all_namespaces,
        namespaces=args.namespace or (),
        standalone=args.standalone,
        peering_name=args.peering,
        priority=args.priority,
        liveness_endpoint=None if args.liveness == "none" else args.liveness,
    )
    return 0


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``rtrl`` parser. ``command``: the subcommand about to run, when known; the
    ``shards`` and ``demo`` subcommands are then added only if it is theirs, so that their
    modules (the shard reader's pyarrow, the demo) stay out of a long-running ``rtrl
    operator`` process: ~40 MB of its memory and a third of a second of its start."""
    parser = argparse.ArgumentParser(
        prog="rtrl",
        description="Real-time reinforcement learning operator for a served coding model.",
    )
    parser.add_argument("--version", action="version", version=f"rtrl {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    crds = commands.add_parser(
        "crds", help="write the CRDs generated from the API types", description=cmd_crds.__doc__
    )
    crds.add_argument("--out", help="directory to write into (default: the repository's crds/)")
    crds.add_argument(
        "--check", action="store_true", help="exit 1 if the files differ; write nothing"
    )
    crds.set_defaults(func=cmd_crds)

    validate = commands.add_parser(
        "validate",
        help="validate RLCycle/Checkpoint manifests offline (models and CRD schema)",
    )
    validate.add_argument("files", nargs="+", metavar="FILE", help="YAML manifest files")
    validate.add_argument("-q", "--quiet", action="store_true", help="print only problems")
    validate.set_defaults(func=cmd_validate)

    operator = commands.add_parser(
        "operator", help="run the operator (kopf)", description=cmd_operator.__doc__
    )
    scope = operator.add_mutually_exclusive_group()
    scope.add_argument(
        "-n", "--namespace", action="append", metavar="NS", help="watch this namespace (repeatable)"
    )
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch all namespaces")
    operator.add_argument(
        "--peering",
        metavar="NAME",
        help="KopfPeering object the replicas share, so that one of them is active at a "
        "time (high availability); default: kopf's 'default' peering if it exists",
    )
    operator.add_argument(
        "--priority",
        type=int,
        default=random.randint(1, 1_000_000),
        metavar="N",
        help="peering priority: the live replica with the highest one is active, the others "
        "stand by (default: random, so that identical replicas never tie; kopf pauses all "
        "replicas of equal priority)",
    )
    operator.add_argument(
        "--standalone", action="store_true", help="no peering (one replica, or tests)"
    )
    operator.add_argument(
        "--liveness",
        metavar="URL",
        default="http://0.0.0.0:8080/healthz",
        help="liveness endpoint, or 'none' (default: http://0.0.0.0:8080/healthz)",
    )
    operator.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        metavar="PORT",
        help="serve Prometheus metrics on this port at /metrics (default: off)",
    )
    operator.add_argument(
        "--log-format",
        choices=("text", "json"),
        default="text",
        help="text (default) or json: one object per line with rlcycle and checkpoint fields",
    )
    operator.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    operator.set_defaults(func=cmd_operator)

    completion = commands.add_parser(
        "completion",
        help="print a shell completion script: source <(rtrl completion bash)",
        description=cmd_completion.__doc__,
    )
    completion.add_argument("shell", choices=("bash", "zsh"))
    completion.set_defaults(func=cmd_completion)

    # anything else (none yet, a typo, --help) gets every subcommand
    every = command not in ("crds", "validate", "operator", "completion", "shards", "demo")
    if every or command == "shards":
        from .core.shards.cli import add_shards_parser

        add_shards_parser(commands)
    if not (every or command == "demo"):
        return parser

    demo = commands.add_parser(
        "demo",
        help="run the real-time RL loop on this machine with simulated users (docs/demo.md)",
    )
    from rtrl_demo.demo import add_arguments as add_demo_arguments

    add_demo_arguments(demo)
    demo.set_defaults(func=cmd_demo)
    return parser


def cmd_completion(args: argparse.Namespace) -> int:
    """Print the completion script for bash or zsh (it asks ``rtrl __complete`` for the
    candidates, computed from this parser). ``kubectl rtrl`` completes through
    ``kubectl_complete-rtrl``, installed beside ``kubectl-rtrl``."""
    from .completion import SCRIPTS

    print(SCRIPTS[args.shell], end="")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """The operator's planning core, a local executor and simulated users, end to end."""
    from rtrl_demo.demo import run

    return run(args)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["__complete"]:  # the completion script's question (rtrl.completion)
        from .completion import print_candidates

        return print_candidates(build_parser(), argv[1:])
    command = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(command).parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
