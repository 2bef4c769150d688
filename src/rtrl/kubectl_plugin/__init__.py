"""``kubectl rtrl``: the kubectl plugin (an executable named ``kubectl-rtrl`` on PATH).

It is a thin client of the operator: it reads the RLCycle, its Checkpoints and what they
own (Jobs, the canary Deployment, Events), and changes nothing but what the operator
reconciles from: the one-shot annotations ``rtrl.io/trigger``,
``rtrl.io/promote`` and ``rtrl.io/rollback`` (a new unique value is a new request; the
operator records the value it handled in the RLCycle's status), and the spec fields
``spec.suspend`` and ``spec.pin``. It never touches a Deployment, a Job or a status, so
what it does is exactly what a ``kubectl annotate``/``kubectl patch`` would do, and the
operator stays the only writer of what serves. Before asking for something the operator
would ignore or apply much later (promote with no canary, a pin to a Checkpoint without a
model), it says so and exits 1 instead.

Exit codes: 0 done, 1 refused or failed (one ``error:`` line on stderr), 2 usage error;
``wait`` also 1 on a timeout (as ``kubectl wait``) and 3 when the cycle ended otherwise.
The credentials are the user's kubeconfig (``--kubeconfig``, ``$KUBECONFIG``,
``~/.kube/config``; ``--context``), as for kubectl itself.

:mod:`.session` connects and patches, :mod:`.commands` holds the verbs, :mod:`.live` the
ones that follow a cycle (``status --watch``, ``wait``, ``list``), :mod:`.render` and
:mod:`.view` what ``status``, ``history`` and ``list`` print, :mod:`.parser` the command line.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from .. import __version__
from ..cli import main as rtrl_main
from ..completion import print_for_kubectl
from ..kube.client import KubeError
from .parser import ParserExit, build_parser
from .session import PluginError, connect, describe, is_transport_error


def complete(argv: Sequence[str] | None = None) -> int:
    """``kubectl_complete-rtrl``: what kubectl runs to complete ``kubectl rtrl ...``."""
    return print_for_kubectl(build_parser(), list(sys.argv[1:] if argv is None else argv))


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if not args_list:
        build_parser().print_usage(sys.stderr)
        return 2
    command, rest = args_list[0], args_list[1:]
    if command in ("version", "--version"):
        print(f"kubectl-rtrl {__version__}")
        return 0
    if command == "validate":
        return rtrl_main(["validate", *rest])
    try:
        args = build_parser().parse_args(args_list)
    except ParserExit as stop:
        return stop.code
    if not getattr(args, "func", None):
        build_parser().print_usage(sys.stderr)
        return 2
    # urllib3 logs each retry as a warning; the one error line below says it all.
    logging.getLogger("urllib3").setLevel(logging.ERROR)
    server = "?"
    try:
        args.session = connect(args.kubeconfig, args.context, args.namespace, args.request_timeout)
        server = args.session.server
        return int(args.func(args))
    except PluginError as exc:
        print(f"error: {exc}", file=sys.stderr)
    except KubeError as exc:
        print(f"error: {describe(exc, server)}", file=sys.stderr)
    except Exception as exc:  # transport errors (urllib3's are not OSErrors): one line
        if not is_transport_error(exc):
            raise
        print(f"error: {describe(exc, server)}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
