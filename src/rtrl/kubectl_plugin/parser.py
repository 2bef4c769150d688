"""The command line of ``kubectl rtrl``: the verbs' arguments and the kubectl-style
cluster options, accepted before and after the verb."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from ..core.api.common import parse_duration
from .commands import DOCS, VERBS
from .live import cmd_list, cmd_wait, phase_name


class Parser(argparse.ArgumentParser):
    """argparse that raises instead of exiting, so ``main([...])`` returns 2 in-process."""

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        if message:
            self._print_message(message, sys.stderr)
        raise ParserExit(status)


class ParserExit(Exception):  # noqa: N818 (control flow, not an error)
    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


def add_cluster_options(parser: argparse.ArgumentParser, *, top: bool) -> None:
    """The kubectl-style flags, accepted before and after the verb. After it they default
    to SUPPRESS, so that they override a value given before the verb instead of resetting
    it (argparse copies a subcommand's defaults over the top-level ones)."""
    unset = None if top else argparse.SUPPRESS
    group = parser.add_argument_group("cluster options")
    group.add_argument(
        "-n",
        "--namespace",
        default=unset,
        help="namespace (default: the kubeconfig context's, else default)",
    )
    group.add_argument(
        "--kubeconfig",
        default=unset,
        help="kubeconfig file (default: $KUBECONFIG, ~/.kube/config)",
    )
    group.add_argument("--context", default=unset, help="kubeconfig context")
    group.add_argument(
        "--request-timeout",
        type=float,
        default=30.0 if top else argparse.SUPPRESS,
        metavar="SECONDS",
        help="per-request timeout (default: 30)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="kubectl rtrl",
        description="Operate rtrl RLCycles: see what they do, trigger, promote, roll back, "
        f"pause and resume (see {DOCS}).",
    )
    add_cluster_options(parser, top=True)
    verbs = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (func, help_text) in VERBS.items():
        aliases = ["get"] if name == "status" else []
        sub = verbs.add_parser(name, help=help_text, description=help_text, aliases=aliases)
        sub.add_argument("name", metavar="RLCYCLE", help="name of the RLCycle")
        add_cluster_options(sub, top=False)
        sub.set_defaults(func=func)
        if name in ("status", "history"):
            sub.add_argument(
                "-o",
                "--output",
                choices=("text", "json", "yaml"),
                default="text",
                help="text (default), or the raw objects as a json/yaml List",
            )
        if name == "status":
            sub.add_argument(
                "-w",
                "--watch",
                action="store_true",
                help="follow it: redraw on a terminal, else print each change; Ctrl-C stops",
            )
        if name == "rollback":
            sub.add_argument(
                "--to",
                metavar="CHECKPOINT",
                help="pin this Checkpoint (spec.pin) instead of stepping back one",
            )
        if name == "resume":
            sub.add_argument("--unpin", action="store_true", help="also remove spec.pin")
    add_list_and_wait(verbs)
    verbs.add_parser(
        "validate",
        help="validate RLCycle/Checkpoint manifests offline (as `rtrl validate`)",
        add_help=False,
    )
    verbs.add_parser("version", help="print the plugin version")
    return parser


def seconds(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_list_and_wait(verbs: argparse._SubParsersAction[Parser]) -> None:
    text = "one line per RLCycle: phase, serving, candidate, canary weight, cycle, next run"
    sub = verbs.add_parser("list", help=text, description=text)
    sub.add_argument(
        "-A", "--all-namespaces", action="store_true", help="the RLCycles of every namespace"
    )
    add_cluster_options(sub, top=False)
    sub.set_defaults(func=cmd_list)
    text = (
        "wait until the running (or next) cycle reaches a phase; exit 0 when it does, 3 when "
        "the cycle ended otherwise, 1 on timeout"
    )
    sub = verbs.add_parser("wait", help=text, description=text)
    sub.add_argument("name", metavar="RLCYCLE", help="name of the RLCycle")
    sub.add_argument(
        "--for",
        dest="for_phase",
        required=True,
        type=phase_name,
        metavar="PHASE",
        help="a Checkpoint phase (Promoted, RolledBack, Rejected, Canary, ...) of the cycle's "
        "candidate, or an RLCycle phase (Idle, Promoting, Suspended, ...)",
    )
    sub.add_argument(
        "--timeout",
        type=seconds,
        default=30.0,
        metavar="DURATION",
        help="how long to wait, e.g. 30s, 10m, 1h (default 30s; 0s: look once)",
    )
    add_cluster_options(sub, top=False)
    sub.set_defaults(func=cmd_wait)
