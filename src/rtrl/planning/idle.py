"""No cycle is running: serve the pinned checkpoint, take a manual rollback, stay suspended,
wait for the schedule, or start the next cycle when it is due or triggered."""

from __future__ import annotations

from rtrl.core.api import names
from rtrl.core.api.checkpoint import CheckpointPhase
from rtrl.core.api.reasons import ConditionType, Reason
from rtrl.core.api.rlcycle import NotificationEvent, RLCyclePhase

from .cycle import start
from .reading import meta as _meta
from .round import READY_POLL_SECONDS, Plan, Round
from .timeutil import iso
from .workload import serve


def pending_trigger(r: Round) -> str | None:
    """The ``rtrl.io/trigger`` value not yet used by a cycle (None if there is none)."""
    value = (r.meta.get("annotations") or {}).get(names.ANNOTATION_TRIGGER)
    if not value:
        return None
    used = {r.status.get("lastTrigger")} | {
        (_meta(c).get("annotations") or {}).get(names.ANNOTATION_TRIGGER) for c in r.owned
    }
    return None if value in used else str(value)


def idle(r: Round) -> Plan:
    """No cycle running: pinned, rolling back by hand, suspended, waiting, or starting."""
    due = r.schedule_next()
    # No cycle runs, so no canary does: a round killed between a cycle's end and its
    # status write would leave the last weight (tests/e2e/test_crash_canary.py).
    r.status["canaryWeight"] = 0
    r.set_degraded()
    serving = _meta(r.serving)["name"]
    r.set_ready(serving)
    if r.spec.pin:
        r.status["nextRun"] = None
        pinned = r.checkpoint(r.spec.pin) or {}
        if not serve(r, pinned["spec"]["uri"], r.spec.pin):
            r.event(Reason.PINNED, f"{r.spec.target.deployment} set to {r.spec.pin}")
            r.out.soon(READY_POLL_SECONDS)
        r.conditions.set(ConditionType.PROGRESSING, False, Reason.PINNED, f"pinned to {r.spec.pin}")
        return r.finish(RLCyclePhase.PINNED, f"pinned to {r.spec.pin}; no cycles start")
    token = r.pending_annotation(names.ANNOTATION_ROLLBACK, "lastRollback")
    if token is not None:
        return manual_rollback(r, token)
    if r.spec.suspend:
        r.conditions.set(ConditionType.PROGRESSING, False, Reason.SUSPENDED, "spec.suspend is true")
        return r.finish(
            RLCyclePhase.SUSPENDED, "suspended: no cycle starts until spec.suspend is false"
        )
    trigger = pending_trigger(r)
    if trigger is None and (due is None or due > r.now):
        r.conditions.set(
            ConditionType.PROGRESSING, False, Reason.IDLE, "waiting for the next cycle"
        )
        if due is not None:
            r.out.soon((due - r.now).total_seconds())
        when = f"next cycle at {iso(due)}" if due else "the cron schedule never fires"
        return r.finish(RLCyclePhase.IDLE, f"{serving} serving; {when}")
    return start(r, trigger)


def manual_rollback(r: Round, token: str) -> Plan:
    """``rtrl.io/rollback`` with no canary running: serve the checkpoint the serving one
    superseded. The token is recorded first, so a crash can lose this rollback (the
    status shows it was taken; annotate again) but never roll back twice."""
    serving = r.serving
    name = _meta(serving)["name"]
    parent_name = (serving.get("spec") or {}).get("parent")
    parent = r.checkpoint(parent_name) if parent_name else None
    r.status["lastRollback"] = token
    r.patch_rlcycle({"lastRollback": token})
    if parent is None:
        message = f"{names.ANNOTATION_ROLLBACK}={token}: {name} has no parent to roll back to"
        r.event(Reason.ROLLBACK_IMPOSSIBLE, message, warning=True)
        return r.finish(RLCyclePhase.IDLE, message)
    serve(r, parent["spec"]["uri"], str(parent_name))
    r.carry(serving, names.ANNOTATION_ROLLBACK, token)
    r.patch_checkpoint(
        serving,
        phase=CheckpointPhase.ROLLED_BACK,
        reason=Reason.MANUAL_ROLLBACK,
        message=f"{names.ANNOTATION_ROLLBACK}={token}: serving {parent_name} again",
        completedAt=iso(r.now),
    )
    # the parent serves again: no longer Superseded (a user reading `kubectl get ckpt` saw
    # the serving checkpoint Superseded and the rolled-back one as last decided "promote")
    r.patch_checkpoint(
        parent,
        phase=CheckpointPhase.PROMOTED,
        reason=Reason.SERVING_AGAIN,
        message=f"serving again: {name} was rolled back ({names.ANNOTATION_ROLLBACK}={token})",
    )
    r.event(
        Reason.ROLLED_BACK,
        f"{name} rolled back to {parent_name} ({names.ANNOTATION_ROLLBACK}={token})",
        warning=True,
        notify=(NotificationEvent.ROLLED_BACK,),
    )
    r.status["serving"] = parent_name
    r.out.soon(READY_POLL_SECONDS)
    return r.finish(RLCyclePhase.ROLLING_BACK, f"rolling back {name} to {parent_name}")
