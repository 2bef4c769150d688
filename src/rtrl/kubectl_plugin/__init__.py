"""``kubectl rtrl``: the kubectl plugin (an executable named ``kubectl-rtrl`` on PATH).

It is a thin client of the operator: it reads the RLCycle and its Checkpoints, and changes
nothing but what the operator reconciles from: the one-shot annotations ``rtrl.io/trigger``,
``rtrl.io/promote`` and ``rtrl.io/rollback`` (a new unique value is a new request; the
operator records the value it handled in the RLCycle's status), and the spec fields
``spec.suspend`` and ``spec.pin``. It never touches a Deployment, a Job or a status, so
what it does is exactly what a ``kubectl annotate``/``kubectl patch`` would do, and the
operator stays the only writer of what serves. Before asking for something the operator
would ignore or apply much later (promote with no canary, a pin to a Checkpoint without a
model), it says so and exits 1 instead.

Exit codes: 0 done, 1 refused or failed (one ``error:`` line on stderr), 2 usage error.
The credentials are the user's kubeconfig (``--kubeconfig``, ``$KUBECONFIG``,
``~/.kube/config``; ``--context``), as for kubectl itself.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NoReturn

from kubernetes.client import ApiClient

from .. import __version__
from ..cli import main as rtrl_main
from ..core.api.names import (
    ANNOTATION_PROMOTE,
    ANNOTATION_ROLLBACK,
    ANNOTATION_TRIGGER,
    PRE_CANARY_PHASES,
    RUNNING_PHASES,
)
from ..kube.client import KubeClient, KubeError, path
from . import render

FIELD_MANAGER = "kubectl-rtrl"
MERGE_PATCH = "application/merge-patch+json"
RESOURCE = "rlcycle.rtrl.io"
DOCS = "docs/kubectl.md"
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
# How a GitOps controller shows on an object it applies: (where, key or manager, tool).
GITOPS_MARKS = (
    ("annotation", "argocd.argoproj.io/tracking-id", "Argo CD"),
    ("label", "kustomize.toolkit.fluxcd.io/name", "Flux"),
    ("label", "helm.toolkit.fluxcd.io/name", "Flux"),
    ("manager", "argocd-controller", "Argo CD"),
    ("manager", "argocd-application-controller", "Argo CD"),
    ("manager", "kustomize-controller", "Flux"),
    ("manager", "helm-controller", "Flux"),
)


class PluginError(Exception):
    """Refused or failed: the message is the one line the user reads."""


# --- the connection ------------------------------------------------------------------------
@dataclass
class Session:
    """The user's cluster and namespace, and the few requests the verbs make."""

    client: KubeClient
    namespace: str
    server: str

    def rlcycle(self, name: str) -> dict[str, Any]:
        found = self.client.get("RLCycle", self.namespace, name)
        if found is None:
            raise PluginError(f"RLCycle {name} not found in namespace {self.namespace}")
        return found

    def checkpoint(self, name: str) -> dict[str, Any] | None:
        return self.client.get("Checkpoint", self.namespace, name)

    def checkpoints_of(self, rlcycle: str) -> list[dict[str, Any]]:
        """The RLCycle's Checkpoints (``spec.rlCycle``), and the ones registered by hand for
        it (label ``rtrl.io/rlcycle``, e.g. its base model), newest first."""
        items = self.client.list("Checkpoint", self.namespace)
        mine = [
            c
            for c in items
            if render.spec(c).get("rlCycle") == rlcycle
            or (render.meta(c).get("labels") or {}).get("rtrl.io/rlcycle") == rlcycle
        ]
        return render.newest_first(mine)

    def patch_rlcycle(self, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        """A JSON merge patch of the RLCycle, field manager ``kubectl-rtrl``."""
        try:
            result = self.client.request(
                "PATCH",
                path("RLCycle", self.namespace, name),
                patch,
                content_type=MERGE_PATCH,
                query={"fieldManager": FIELD_MANAGER},
            )
        except KubeError as exc:
            if exc.status == 404:
                raise PluginError(
                    f"RLCycle {name} not found in namespace {self.namespace}"
                ) from None
            raise
        return dict(result or {})


class TimedApiClient(ApiClient):
    """An ``ApiClient`` whose every call has a timeout: a wrong or unroutable server must
    end in an error line, not a hang (KubeClient passes none)."""

    def __init__(self, configuration: Any, timeout: float):
        super().__init__(configuration)
        self.timeout = timeout

    def call_api(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("_request_timeout") is None and len(args) < 6:
            kwargs["_request_timeout"] = self.timeout
        return super().call_api(*args, **kwargs)


def _kubeconfig_paths(explicit: str | None) -> list[str]:
    if explicit:
        return [explicit]
    env = os.environ.get("KUBECONFIG")
    if env:
        return [p for p in env.split(os.pathsep) if p]
    return [os.path.expanduser("~/.kube/config")]


def connect(
    kubeconfig: str | None, context: str | None, namespace: str | None, timeout: float
) -> Session:
    """The kubeconfig's cluster and credentials; the namespace from ``-n``, else the
    context's, else ``default`` (as kubectl). In a pod with no kubeconfig: its service
    account."""
    from kubernetes import config as kconfig
    from kubernetes.client import Configuration

    configuration = Configuration()
    paths = _kubeconfig_paths(kubeconfig)
    files = [p for p in paths if Path(p).exists()]
    if kubeconfig and not files:
        raise PluginError(f"kubeconfig {kubeconfig} not found")
    try:
        if not files and os.environ.get("KUBERNETES_SERVICE_HOST") and not context:
            kconfig.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
            default_ns = (
                SERVICE_ACCOUNT_NAMESPACE.read_text().strip()
                if SERVICE_ACCOUNT_NAMESPACE.exists()
                else "default"
            )
        else:
            if not files:
                raise PluginError(
                    f"no kubeconfig found (looked at {', '.join(paths)}); "
                    "set KUBECONFIG or pass --kubeconfig"
                )
            config_file = os.pathsep.join(files)
            kconfig.load_kube_config(  # type: ignore[no-untyped-call]
                config_file=config_file,
                context=context,
                client_configuration=configuration,
                persist_config=False,
            )
            contexts, active = kconfig.list_kube_config_contexts(config_file)  # type: ignore[no-untyped-call]
            chosen = next((c for c in contexts if c.get("name") == context), None) or active
            default_ns = ((chosen or {}).get("context") or {}).get("namespace") or "default"
    except kconfig.ConfigException as exc:
        raise PluginError(f"kubeconfig: {render.one_line(exc)}") from None
    configuration.retries = 1
    client = KubeClient(TimedApiClient(configuration, timeout))
    return Session(client, namespace or default_ns, str(configuration.host))


# --- helpers of the verbs -----------------------------------------------------------------
def token(*taken: object) -> str:
    """A new request value: the UTC time to the microsecond, never one already used."""
    value = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    n = 0
    candidate = value
    while candidate in taken:
        n += 1
        candidate = f"{value}-{n}"
    return candidate


def note(message: str) -> None:
    print(f"note: {message}", file=sys.stderr)


def gitops_manager(rlc: dict[str, Any]) -> str | None:
    md = render.meta(rlc)
    annotations, labels = md.get("annotations") or {}, md.get("labels") or {}
    managers = {str(m.get("manager")) for m in md.get("managedFields") or []}
    for where, key, tool in GITOPS_MARKS:
        found = (
            (where == "annotation" and key in annotations)
            or (where == "label" and key in labels)
            or (where == "manager" and key in managers)
        )
        if found:
            return f"{tool} ({where} {key})"
    return None


def spec_edit_note(rlc: dict[str, Any], field: str) -> None:
    tool = gitops_manager(rlc)
    if tool:
        print(
            f"warning: this RLCycle is applied by {tool}: if git sets {field}, the next sync "
            f"reverts this edit; make the change in git instead (see {DOCS})",
            file=sys.stderr,
        )
    else:
        note(
            f"{field} is declarative: a GitOps tool (Argo CD, Flux) that applies this RLCycle "
            f"from git reverts it if git sets it; then make the change in git (see {DOCS})"
        )


def follow(args: argparse.Namespace) -> str:
    ns = f" -n {args.session.namespace}"
    return f"follow it with: kubectl rtrl status {args.name}{ns}"


def print_objects(items: list[dict[str, Any]], output: str) -> None:
    doc = {"apiVersion": "v1", "kind": "List", "items": items}
    if output == "yaml":
        import yaml

        print(yaml.safe_dump(doc, sort_keys=False), end="")
    else:
        print(json.dumps(doc, indent=2))


def annotate(session: Session, name: str, rlc: dict[str, Any], key: str, status_key: str) -> str:
    current = (render.meta(rlc).get("annotations") or {}).get(key)
    value = token(current, render.status(rlc).get(status_key))
    session.patch_rlcycle(name, {"metadata": {"annotations": {key: value}}})
    print(f"{RESOURCE}/{name} annotated: {key}={value}")
    return value


# --- the verbs ----------------------------------------------------------------------------
def cmd_status(args: argparse.Namespace) -> int:
    session: Session = args.session
    rlc = session.rlcycle(args.name)
    st = render.status(rlc)
    candidate = session.checkpoint(str(st["candidate"])) if st.get("candidate") else None
    role = "Candidate"
    if candidate is None or render.status(candidate).get("phase") not in RUNNING_PHASES:
        owned = [c for c in session.checkpoints_of(args.name) if render.spec(c).get("rlCycle")]
        candidate = candidate or (owned[0] if owned else None)
        role = "Last cycle"
    if args.output != "text":
        print_objects([rlc, *([candidate] if candidate else [])], args.output)
        return 0
    print(render.render_status(rlc, candidate, role, datetime.now(UTC)), end="")
    return 0


def cmd_history(args: argparse.Namespace) -> int:
    session: Session = args.session
    rlc = session.rlcycle(args.name)
    checkpoints = session.checkpoints_of(args.name)
    if args.output != "text":
        print_objects(checkpoints, args.output)
        return 0
    if not checkpoints:
        print(f"RLCycle {args.name} has no Checkpoints yet")
        return 0
    serving = render.status(rlc).get("serving")
    print(render.render_history(checkpoints, serving, datetime.now(UTC)), end="")
    return 0


def cmd_trigger(args: argparse.Namespace) -> int:
    session: Session = args.session
    rlc = session.rlcycle(args.name)
    sp, st = render.spec(rlc), render.status(rlc)
    if sp.get("pin"):
        raise PluginError(
            f"RLCycle {args.name} is pinned to {sp['pin']} (spec.pin): no cycle starts while "
            f"pinned; unpin it first (kubectl rtrl resume --unpin {args.name})"
        )
    if sp.get("suspend"):
        raise PluginError(
            f"RLCycle {args.name} is suspended (spec.suspend: true): no cycle starts while "
            f"suspended; resume it first (kubectl rtrl resume {args.name})"
        )
    annotate(session, args.name, rlc, ANNOTATION_TRIGGER, "lastTrigger")
    phase = st.get("phase")
    if phase not in (None, "Idle", "Pending"):
        note(f"a cycle is in progress (phase {phase}): the new one starts when it ends")
    else:
        note("the operator starts a cycle on its next reconcile")
    note(follow(args))
    return 0


def cmd_promote(args: argparse.Namespace) -> int:
    session: Session = args.session
    rlc = session.rlcycle(args.name)
    st = render.status(rlc)
    phase = st.get("phase")
    if phase != "Canary":
        why = {
            "Promoting": "a promotion is already in progress",
            "RollingBack": "a rollback is in progress",
        }.get(str(phase), "promote acts only on a running canary")
        raise PluginError(
            f"RLCycle {args.name} has no canary running (phase {phase or 'unknown'}): {why}"
        )
    annotate(session, args.name, rlc, ANNOTATION_PROMOTE, "lastPromote")
    note(
        f"the operator promotes {st.get('candidate')} (canary at {st.get('canaryWeight', 0)}%) "
        f"in place of {st.get('serving')} on its next reconcile; {follow(args)}"
    )
    return 0


def cmd_rollback(args: argparse.Namespace) -> int:
    session: Session = args.session
    rlc = session.rlcycle(args.name)
    if args.to:
        return pin(args, session, rlc, args.to)
    sp, st = render.spec(rlc), render.status(rlc)
    phase, serving, candidate = st.get("phase"), st.get("serving"), st.get("candidate")
    if sp.get("pin"):
        raise PluginError(
            f"RLCycle {args.name} is pinned to {sp['pin']} (spec.pin), which decides what "
            f"serves: pin another checkpoint (kubectl rtrl rollback {args.name} --to "
            f"CHECKPOINT) or unpin it (kubectl rtrl resume --unpin {args.name})"
        )
    if phase == "RollingBack":
        raise PluginError(f"RLCycle {args.name} is already rolling back: {st.get('message')}")
    if phase == "Invalid":
        raise PluginError(
            f"RLCycle {args.name} is Invalid, and the operator acts on nothing until that is "
            f"fixed: {st.get('message')}"
        )
    if phase == "Canary":
        effect = f"the canary of {candidate} is aborted: all traffic back to {serving}"
    elif phase == "Promoting":
        effect = f"once {candidate} is promoted, it is rolled back to {serving}"
    elif phase in PRE_CANARY_PHASES:
        effect = (
            f"the running cycle (phase {phase}) is cancelled and its Jobs stopped, then "
            f"{serving} is rolled back to its parent"
        )
    else:
        current = session.checkpoint(str(serving)) if serving else None
        if current is None:
            raise PluginError(
                f"RLCycle {args.name} reports no serving Checkpoint"
                + (f" ({serving} not found)" if serving else "")
                + "; nothing to roll back"
            )
        parent = render.spec(current).get("parent")
        if not parent:
            raise PluginError(f"{serving} has no parent checkpoint to roll back to")
        if session.checkpoint(str(parent)) is None:
            raise PluginError(
                f"{serving}'s parent {parent} no longer exists in namespace "
                f"{session.namespace}; pin another checkpoint with --to"
            )
        effect = f"{serving} is rolled back: {parent} serves again"
    annotate(session, args.name, rlc, ANNOTATION_ROLLBACK, "lastRollback")
    note(f"{effect}; {follow(args)}")
    return 0


def pin(args: argparse.Namespace, session: Session, rlc: dict[str, Any], target: str) -> int:
    ck = session.checkpoint(target)
    if ck is None:
        raise PluginError(f"Checkpoint {target} not found in namespace {session.namespace}")
    phase = render.status(ck).get("phase")
    trained = not render.spec(ck).get("rlCycle") or "training" in render.status(ck)
    if not trained:
        raise PluginError(
            f"Checkpoint {target} has no trained model (phase {phase or 'Pending'}); "
            "pin one that has"
        )
    owner = render.spec(ck).get("rlCycle")
    if owner and owner != args.name:
        note(f"{target} was produced by RLCycle {owner}, not {args.name}")
    if phase in ("RolledBack", "Rejected", "Failed"):
        note(f"{target} is {phase}: {render.one_line(render.status(ck).get('message'))}")
    session.patch_rlcycle(args.name, {"spec": {"pin": target}})
    print(f"{RESOURCE}/{args.name} pinned to {target} (spec.pin: {target})")
    running = render.status(rlc).get("phase")
    if running in PRE_CANARY_PHASES:
        note(
            f"a cycle is running (phase {running}): it is cancelled and its Jobs stopped, "
            f"and {target} serves at once"
        )
    note(
        f"the operator serves {target} and starts no cycles while pinned (a running canary is "
        f"rolled back); to resume cycles: kubectl rtrl resume --unpin {args.name}"
    )
    spec_edit_note(rlc, "spec.pin")
    return 0


def cmd_pause(args: argparse.Namespace) -> int:
    session: Session = args.session
    rlc = session.rlcycle(args.name)
    was = bool(render.spec(rlc).get("suspend"))
    session.patch_rlcycle(args.name, {"spec": {"suspend": True}})
    print(f"{RESOURCE}/{args.name} {'already ' if was else ''}paused (spec.suspend: true)")
    phase = render.status(rlc).get("phase")
    if phase not in (None, "Idle", "Pending", "Suspended", "Pinned", "Invalid"):
        note(f"the running cycle (phase {phase}) finishes, canary included; no new one starts")
    spec_edit_note(rlc, "spec.suspend")
    return 0


def cmd_resume(args: argparse.Namespace) -> int:
    session: Session = args.session
    rlc = session.rlcycle(args.name)
    sp = render.spec(rlc)
    patch: dict[str, Any] = {"suspend": False}
    if args.unpin:
        patch["pin"] = None
    session.patch_rlcycle(args.name, {"spec": patch})
    done = "resumed (spec.suspend: false" + (", spec.pin removed)" if args.unpin else ")")
    print(f"{RESOURCE}/{args.name} {done}")
    if sp.get("pin") and not args.unpin:
        note(f"still pinned to {sp['pin']} (spec.pin): add --unpin to resume cycles")
    spec_edit_note(rlc, "spec.pin" if args.unpin and sp.get("pin") else "spec.suspend")
    return 0


# --- the command line ---------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of exiting, so ``main([...])`` returns 2 in-process."""

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        if message:
            self._print_message(message, sys.stderr)
        raise _ParserExit(status)


class _ParserExit(Exception):  # noqa: N818 (control flow, not an error)
    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


VERBS: dict[str, tuple[Callable[[argparse.Namespace], int], str]] = {
    "status": (cmd_status, "summary: serving, candidate, canary weight, decisions and numbers"),
    "history": (cmd_history, "the RLCycle's Checkpoints, newest first"),
    "trigger": (cmd_trigger, "start a cycle now (annotation rtrl.io/trigger)"),
    "promote": (cmd_promote, "promote the running canary (annotation rtrl.io/promote)"),
    "rollback": (
        cmd_rollback,
        "abort the canary or roll back the serving checkpoint (annotation rtrl.io/rollback); "
        "--to CHECKPOINT pins one (spec.pin)",
    ),
    "pause": (cmd_pause, "start no new cycles (spec.suspend: true)"),
    "resume": (cmd_resume, "start cycles again (spec.suspend: false; --unpin clears spec.pin)"),
}


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
    parser = _Parser(
        prog="kubectl rtrl",
        description="Operate rtrl RLCycles: see what they do, trigger, promote, roll back, "
        f"pause and resume (see {DOCS}).",
    )
    add_cluster_options(parser, top=True)
    verbs = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (func, help_text) in VERBS.items():
        sub = verbs.add_parser(name, help=help_text, description=help_text)
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
        if name == "rollback":
            sub.add_argument(
                "--to",
                metavar="CHECKPOINT",
                help="pin this Checkpoint (spec.pin) instead of stepping back one",
            )
        if name == "resume":
            sub.add_argument("--unpin", action="store_true", help="also remove spec.pin")
    verbs.add_parser(
        "validate",
        help="validate RLCycle/Checkpoint manifests offline (as `rtrl validate`)",
        add_help=False,
    )
    verbs.add_parser("version", help="print the plugin version")
    return parser


def describe(exc: Exception, server: str) -> str:
    """One line for a failed request."""
    if isinstance(exc, KubeError) and exc.status in (401, 403):
        what = "unauthorized" if exc.status == 401 else "forbidden"
        return f"{what}: {render.one_line(exc)}"
    if isinstance(exc, KubeError) and exc.status:
        return render.one_line(exc)
    raw = str(exc)
    found = re.search(r"\[Errno -?\d+\] ([^'\")]+)", raw)
    if found:
        detail = found.group(1).strip()
    elif "timed out" in raw.lower() or "timeout" in raw.lower():
        detail = "timed out"
    else:
        detail = render.one_line(raw, 200)
    return f"cannot reach the Kubernetes API server at {server}: {detail}"


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if not args_list:
        build_parser().print_usage(sys.stderr)
        return 2
    command, rest = args_list[0], args_list[1:]
    if command == "version":
        print(f"kubectl-rtrl {__version__}")
        return 0
    if command == "validate":
        return rtrl_main(["validate", *rest])
    try:
        args = build_parser().parse_args(args_list)
    except _ParserExit as stop:
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
        if not _is_transport_error(exc):
            raise
        print(f"error: {describe(exc, server)}", file=sys.stderr)
    return 1


def _is_transport_error(exc: Exception) -> bool:
    import urllib3

    return isinstance(exc, OSError | urllib3.exceptions.HTTPError)


if __name__ == "__main__":
    sys.exit(main())
