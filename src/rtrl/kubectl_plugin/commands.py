"""The verbs of ``kubectl rtrl``: what each checks before it asks, the one change it makes
(an annotation or a spec field, through :mod:`.session`), and the notes it prints.

Before asking for something the operator would ignore or apply much later (promote with no
canary, a pin to a Checkpoint without a model), a verb says so and raises
:class:`~.session.PluginError` instead.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from ..core.api.checkpoint import CheckpointPhase
from ..core.api.names import (
    ANNOTATION_APPROVE,
    ANNOTATION_PROMOTE,
    ANNOTATION_ROLLBACK,
    ANNOTATION_TRIGGER,
    PRE_CANARY_PHASES,
)
from ..core.api.rlcycle import RLCyclePhase
from . import live, render, view
from .session import RESOURCE, PluginError, Session, annotate

DOCS = "docs/kubectl.md"
# RLCycle phases while a canary runs (AwaitingApproval: held at an approval gate)
CANARY_PHASES = (RLCyclePhase.CANARY, RLCyclePhase.AWAITING_APPROVAL)
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
    return f"follow it with: kubectl rtrl status {args.name}{ns} --watch"


def print_objects(items: list[dict[str, Any]], output: str) -> None:
    doc = {"apiVersion": "v1", "kind": "List", "items": items}
    if output == "yaml":
        import yaml

        print(yaml.safe_dump(doc, sort_keys=False), end="")
    else:
        print(json.dumps(doc, indent=2))


# --- the verbs ----------------------------------------------------------------------------
def cmd_status(args: argparse.Namespace) -> int:
    session: Session = args.session
    if args.watch:
        if args.output != "text":
            raise PluginError("--watch shows the text view: leave out -o")
        return live.watch(session, args.name)
    snap = live.snapshot(session, args.name)
    if args.output != "text":
        ck = snap.checkpoint
        print_objects([snap.rlcycle, *([ck] if ck else [])], args.output)
        return 0
    print(view.frame(snap, datetime.now(UTC), live.painter(sys.stdout)), end="")
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
    if phase not in (None, RLCyclePhase.IDLE, RLCyclePhase.PENDING):
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
    if phase not in CANARY_PHASES:
        busy: dict[str, str] = {
            RLCyclePhase.PROMOTING: "a promotion is already in progress",
            RLCyclePhase.ROLLING_BACK: "a rollback is in progress",
        }
        why = busy.get(str(phase), "promote acts only on a running canary")
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
    if phase == RLCyclePhase.ROLLING_BACK:
        raise PluginError(f"RLCycle {args.name} is already rolling back: {st.get('message')}")
    if phase == RLCyclePhase.INVALID:
        raise PluginError(
            f"RLCycle {args.name} is Invalid, and the operator acts on nothing until that is "
            f"fixed: {st.get('message')}"
        )
    if phase in CANARY_PHASES:
        effect = f"the canary of {candidate} is aborted: all traffic back to {serving}"
    elif phase == RLCyclePhase.PROMOTING:
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
            f"Checkpoint {target} has no trained model (phase {phase or CheckpointPhase.PENDING}); "
            "pin one that has"
        )
    owner = render.spec(ck).get("rlCycle")
    if owner and owner != args.name:
        note(f"{target} was produced by RLCycle {owner}, not {args.name}")
    if phase in (
        CheckpointPhase.ROLLED_BACK,
        CheckpointPhase.REJECTED,
        CheckpointPhase.FAILED,
    ):
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
    if phase not in (
        None,
        RLCyclePhase.IDLE,
        RLCyclePhase.PENDING,
        RLCyclePhase.SUSPENDED,
        RLCyclePhase.PINNED,
        RLCyclePhase.INVALID,
    ):
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


VERBS: dict[str, tuple[Callable[[argparse.Namespace], int], str]] = {
    "status": (
        cmd_status,
        "the RLCycle, its cycle's objects, canary, A/B numbers, gates and Events "
        "(--watch follows it live)",
    ),
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


def cmd_approve(args: argparse.Namespace) -> int:
    """Release the manual approval gate the canary waits at (annotation rtrl.io/approve)."""
    session: Session = args.session
    rlc = session.rlcycle(args.name)
    st = render.status(rlc)
    waiting = st.get("awaitingApproval") or {}
    if not waiting:
        raise PluginError(
            f"RLCycle {args.name} waits at no approval gate (phase {st.get('phase') or 'unknown'})"
        )
    if waiting.get("mode") != "manual":
        raise PluginError(
            f"RLCycle {args.name} waits for its confirm webhook, not for a person: the "
            "webhook releases the gate by answering HTTP 200"
        )
    annotate(session, args.name, rlc, ANNOTATION_APPROVE, "lastApprove")
    what = (
        f"the canary of {waiting.get('checkpoint')} moves to {waiting.get('weight')}%"
        if waiting.get("gate") == "step"
        else f"{waiting.get('checkpoint')} is promoted"
    )
    note(f"{what} on the operator's next reconcile; {follow(args)}")
    return 0


VERBS["approve"] = (
    cmd_approve,
    "release the approval gate the canary waits at (annotation rtrl.io/approve)",
)
