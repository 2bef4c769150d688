"""Notifications: which of a round's decisions the RLCycle's webhooks hear of, kept in an
outbox in its status until they are delivered.

A decision site marks its Event with the notification events it is (``Emit.notify``: a
promotion is ``Promoted`` and ``CycleCompleted``); one pass after the round turns those into
entries of ``status.outbox``, one per decision, with the names of the notifications
(``spec.notifications``) that want it. The kube layer writes the outbox before the round's
other writes, delivers it after, and tells the next round what it is done with
(``Observed.delivered``), which drops it from the outbox: at-least-once delivery that
survives a restart. An entry's id is derived from what was decided (the RLCycle's uid, the
event, the object and the words), so the same decision planned again after a crash gets the
same id: the outbox keeps it once, and a receiver that saw it already can drop it.
"""

from __future__ import annotations

import hashlib
from typing import Any

from rtrl.core.api.reasons import ConditionType, Reason
from rtrl.core.api.rlcycle import MAX_OUTBOX, NotificationEvent, RLCyclePhase

from .actions import Emit
from .round import Plan, Round
from .timeutil import iso

MAX_MESSAGE = 1024


def event_id(uid: str, event: NotificationEvent, emit: Emit) -> str:
    """The stable id of notification ``event`` of ``emit``."""
    text = "\x00".join((uid, event, emit.kind, emit.name, emit.message))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def collect(r: Round, plan: Plan) -> None:
    """The round's outbox: the old one less what was delivered, plus the round's
    notifications; and the conditions and Events of deliveries that failed."""
    spec = getattr(r, "spec", None)
    wanted = {n.name: n for n in (spec.notifications or [])} if spec is not None else {}
    done = r.obs.delivered
    outbox: list[dict[str, Any]] = []
    for old in r.old.get("outbox") or []:
        targets = [
            t
            for t in old.get("targets") or []
            if f"{old.get('id')}/{t}" not in done and (spec is None or t in wanted)
        ]
        if targets:
            outbox.append({**old, "targets": targets})
    failed(r)
    if wanted:
        ids = {str(e.get("id")) for e in outbox}
        uid = str(r.meta.get("uid") or r.name)
        for action in list(plan.actions):
            if not isinstance(action, Emit):
                continue
            for event in action.notify:
                targets = [
                    name for name, n in wanted.items() if n.events is None or event in n.events
                ]
                key = event_id(uid, event, action)
                if not targets or key in ids:
                    continue
                ids.add(key)
                outbox.append(new_entry(r, key, event, action, targets))
    if len(outbox) > MAX_OUTBOX:
        dropped = outbox[:-MAX_OUTBOX]
        outbox = outbox[-MAX_OUTBOX:]
        r.event(
            Reason.NOTIFICATION_DROPPED,
            f"{len(dropped)} notifications not delivered in time were dropped "
            f"(the outbox holds {MAX_OUTBOX}): "
            + ", ".join(f"{e['event']} {e['id']}" for e in dropped)[:MAX_MESSAGE],
            warning=True,
        )
    if outbox or r.old.get("outbox"):
        r.status["outbox"] = outbox or None


def new_entry(
    r: Round, key: str, event: NotificationEvent, emit: Emit, targets: list[str]
) -> dict[str, Any]:
    checkpoint = emit.name if emit.kind == "Checkpoint" else r.status.get("candidate")
    return {
        "id": key,
        "event": event,
        "time": iso(r.now),
        "cycle": int(r.status.get("cycle") or 0),
        **({"checkpoint": str(checkpoint)} if checkpoint else {}),
        "message": emit.message[:MAX_MESSAGE],
        "targets": targets,
    }


def failed(r: Round) -> None:
    """Deliveries given up (their retries spent) and deliveries made: the condition
    ``NotificationsDelivered`` (False from a failure until that notification delivers
    again) and a Warning Event per failure. The reasons come from the kube layer, which
    never puts a webhook's URL in them."""
    for key, target, why in r.obs.undeliverable:
        r.event(
            Reason.NOTIFICATION_FAILED,
            f"notification {target}: {key} not delivered: {why}"[:MAX_MESSAGE],
            warning=True,
        )
    if r.obs.undeliverable:
        key, target, why = r.obs.undeliverable[-1]
        r.conditions.set(
            ConditionType.NOTIFICATIONS_DELIVERED,
            False,
            Reason.DELIVERY_FAILED,
            f"{target}: {key}: {why}",
        )
        return
    succeeded = {key.split("/", 1)[1] for key in r.obs.delivered}
    if not succeeded:
        return
    if r.conditions.previous_status(ConditionType.NOTIFICATIONS_DELIVERED) == "False":
        target = r.conditions.previous_message(ConditionType.NOTIFICATIONS_DELIVERED)
        target = target.split(": ", 1)[0]
        if target not in succeeded:
            return
    r.conditions.set(ConditionType.NOTIFICATIONS_DELIVERED, True, Reason.DELIVERED, "")


def finish_round(r: Round, plan: Plan) -> Plan:
    """After the round's decisions: the outbox, and the phase ``AwaitingApproval`` while a
    gate holds the canary."""
    collect(r, plan)
    status = plan.status
    if status.get("awaitingApproval") and status.get("phase") == RLCyclePhase.CANARY:
        status["phase"] = RLCyclePhase.AWAITING_APPROVAL
    if "conditions" in status:
        status["conditions"] = r.conditions.to_list()
    return plan
