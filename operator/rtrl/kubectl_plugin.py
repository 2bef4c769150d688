"""``kubectl rtrl``: the kubectl plugin (an executable named ``kubectl-rtrl`` on PATH).

Today it validates manifests offline, exactly as ``rtrl validate`` does; the cluster verbs
(status, promote, rollback, pause, resume, trigger, history) arrive with the canary
rollout and are reported as not yet available rather than silently doing nothing.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from . import __version__
from .cli import main as rtrl_main

CLUSTER_VERBS = ("status", "promote", "rollback", "pause", "resume", "trigger", "history")
USAGE = f"""usage: kubectl rtrl COMMAND [ARGS]

commands:
  validate FILE...   validate RLCycle/Checkpoint manifests offline (as `rtrl validate`)
  version            print the plugin version

not yet available in rtrl {__version__}: {", ".join(CLUSTER_VERBS)}
"""


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in {"-h", "--help", "help"}:
        print(USAGE, end="")
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command == "version":
        print(f"kubectl-rtrl {__version__}")
        return 0
    if command == "validate":
        return rtrl_main(["validate", *rest])
    if command in CLUSTER_VERBS:
        print(f"kubectl rtrl {command}: not available in rtrl {__version__} yet", file=sys.stderr)
        return 2
    print(f"kubectl rtrl: unknown command {command!r}\n\n{USAGE}", end="", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
