"""Approval gates of the canary: before a step's weight (``rollout.steps[i].approval``) and
before a promotion the analysis decided (``rollout.approval``).

A gate holds the canary where it is: the analysis goes on every interval, and a rollback it
decides (harm, a tripped guardrail) is carried out at once; a gate never holds one back.
``manual`` gates are released by the annotation ``rtrl.io/approve`` (``kubectl rtrl
approve``), taken once like ``rtrl.io/promote``; ``webhook`` gates by the confirm webhook
answering HTTP 200, which the kube layer asks while ``status.awaitingApproval`` says so
(:attr:`~.observed.Observed.confirmed`, Flagger's confirm-rollout).

Where a gate stands is written on the Checkpoint's rollout record, so a restarted operator
waits at the same gate: ``awaitingApproval`` (since when) and, once released, ``approved``
(what released it: ``rtrl.io/approve=<token>``, which is what marks the token as taken).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from rtrl.core.api.checkpoint import Decision, RolloutRecord
from rtrl.core.api.common import parse_duration
from rtrl.core.api.names import ANNOTATION_APPROVE
from rtrl.core.api.reasons import ConditionType, Reason
from rtrl.core.api.rlcycle import NotificationEvent

from .records import Record, step_index
from .round import Round
from .timeutil import iso, whole

Gate = Literal["step", "promotion"]

WEBHOOK_RELEASE = "confirm webhook answered 200"


# How a held promotion's reason is worded wherever it is shown (Events, the RLCycle's
# message, kubectl rtrl): the record itself says it with ``held``.
HELD = "promotion awaits approval: "


def as_recorded(r: Round, record: Record) -> bool:
    """The analysis's verdict just put in the step's ``record`` as the record keeps it, and
    whether it is a promotion held by ``rollout.approval``: recorded as what happens (the
    canary stays: continue) with ``held: promote``. An earlier analysis's hold ends."""
    record.held = None
    if record.decision != Decision.PROMOTE or promotion_gate(r) is None:
        return False
    record.decision, record.held = Decision.CONTINUE, Decision.PROMOTE
    return True


def reason_text(record: RolloutRecord | Mapping[str, Any]) -> str:
    """A record's reason as the Events, the status message and kubectl rtrl word it (a
    record as read from the API, for kubectl rtrl, or typed)."""
    if isinstance(record, RolloutRecord):
        reason, held = record.reason or "", record.held
    else:
        reason, held = str(record.get("reason") or ""), record.get("held")
    return f"{HELD}{reason}"[:32768] if held == Decision.PROMOTE else reason


def promotion_reason(record: Record) -> str:
    """The reason of a promotion released by its gate (the hold ends with it)."""
    record.held = None
    return f"{record.reason or ''} (approved: {record.approved})"


def gate_mode(r: Round, gate: Gate, next_index: int) -> tuple[str | None, int | None]:
    """The mode of ``gate`` at the current step, and the next step's weight (gate step)."""
    if gate == "promotion":
        return promotion_gate(r), None
    steps = r.spec.rollout.steps
    weight = steps[next_index].weight if next_index < len(steps) else None
    return step_gate(r, next_index), weight


def wait(r: Round, ck: dict[str, Any], records: list[Record], gate: Gate) -> None:
    """The current step waits at ``gate`` (step or promotion)."""
    mode, weight = gate_mode(r, gate, step_index(records) + 1)
    hold(r, ck, records, gate=gate, mode=str(mode), weight=weight)


def passed(r: Round, ck: dict[str, Any], records: list[Record]) -> Gate | None:
    """The current step waits at a gate: the gate (step or promotion) when it is released
    now, its record saying by what; None while it holds (held again)."""
    record = records[-1]
    gate = record.gate or "step"
    mode, weight = gate_mode(r, gate, step_index(records) + 1)
    by = release(r, ck, mode) if mode else "the gate was removed from the spec"
    if by is None:
        hold(r, ck, records, gate=gate, mode=str(mode), weight=weight)
        return None
    released(r, ck, record, by)
    clear(r)
    return gate


def step_gate(r: Round, next_index: int) -> str | None:
    """The approval mode that gates moving to ``steps[next_index]`` (None: no gate)."""
    steps = r.spec.rollout.steps
    return steps[next_index].approval if next_index < len(steps) else None


def promotion_gate(r: Round) -> str | None:
    return r.spec.rollout.approval


def release(r: Round, ck: dict[str, Any], mode: str) -> str | None:
    """What releases a gate of ``mode`` in this round, or None while it holds. A manual
    approval's token is taken here: by the Checkpoint's write that records the release
    (``status.requests``), then ``status.lastApprove``."""
    if mode == "webhook":
        return WEBHOOK_RELEASE if r.obs.confirmed is True else None
    token = r.pending_annotation(ANNOTATION_APPROVE, "lastApprove")
    if token is None:
        return None
    r.status["lastApprove"] = token
    r.carry(ck, ANNOTATION_APPROVE, token)
    return f"{ANNOTATION_APPROVE}={token}"


def hold(
    r: Round,
    ck: dict[str, Any],
    records: list[Record],
    *,
    gate: Gate,
    mode: str,
    weight: int | None,
) -> bool:
    """Mark the current step as waiting at ``gate``; the RLCycle's status says so. Returns
    whether the wait starts now (the record must then be written)."""
    name = str((ck.get("metadata") or {}).get("name"))
    record = records[-1]
    starts = not record.awaiting_approval or record.gate != gate
    if starts:
        record.awaiting_approval = record.awaiting_approval or whole(r.now)
        record.gate = gate
        what = f"step {weight}%" if gate == "step" else "promotion"
        how = "kubectl rtrl approve" if mode == "manual" else "the confirm webhook"
        r.event(
            Reason.AWAITING_APPROVAL,
            f"{name}: {what} awaits approval ({how})",
            kind="Checkpoint",
            name=name,
            notify=(NotificationEvent.AWAITING_APPROVAL,),
        )
    r.status["awaitingApproval"] = {
        "checkpoint": name,
        "gate": gate,
        **({"weight": weight} if weight is not None else {}),
        "mode": mode,
        "since": iso(record.awaiting_approval or r.now),
    }
    r.conditions.set(
        ConditionType.AWAITING_APPROVAL, True, Reason.AWAITING_APPROVAL, awaiting_text(r, mode)
    )
    if mode == "webhook":
        # Flagger's semantics: asked again every interval until it answers 200; the first
        # time at once (the next round, which reads status.awaitingApproval).
        hook = r.spec.rollout.confirm_webhook
        interval = parse_duration(hook.interval) if hook is not None else 60.0
        r.out.soon(0 if starts else interval)
    return starts


def awaiting_text(r: Round, mode: str) -> str:
    if mode == "manual":
        return f"run kubectl rtrl approve {r.name} (annotation {ANNOTATION_APPROVE})"
    why = r.obs.confirm_error or "not asked yet"
    return f"the confirm webhook holds the gate ({why})"


def released(r: Round, ck: dict[str, Any], record: Record, by: str) -> None:
    """The gate the current step waited at is released by ``by``."""
    name = str((ck.get("metadata") or {}).get("name"))
    record.approved = by
    r.event(
        Reason.APPROVED,
        f"{name}: approved ({by})",
        kind="Checkpoint",
        name=name,
        notify=(NotificationEvent.APPROVED,),
    )


def clear(r: Round) -> None:
    """No gate waits: the status and condition say so (called every canary round)."""
    r.status["awaitingApproval"] = None
    if r.conditions.previous_status(ConditionType.AWAITING_APPROVAL) == "True":
        r.conditions.set(ConditionType.AWAITING_APPROVAL, False, Reason.RELEASED, "")


def unused_approval(r: Round) -> None:
    """An ``rtrl.io/approve`` given while no gate waited is taken and ignored (with an
    Event): it must not release a gate reached later, which nobody has looked at yet."""
    token = r.pending_annotation(ANNOTATION_APPROVE, "lastApprove")
    if token is None or (r.status.get("awaitingApproval") or {}).get("mode") == "manual":
        return
    r.status["lastApprove"] = token
    r.event(
        Reason.APPROVAL_IGNORED,
        f"{ANNOTATION_APPROVE}={token}: no approval gate is waiting; nothing approved",
        warning=True,
    )
