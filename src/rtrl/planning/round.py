"""One reconcile round of one RLCycle: what was observed, the clock, and the plan being
built, with the primitives every decision uses.

The decisions themselves live in one module per area (environment, cycle, rollout, idle,
history); each is a set of functions taking the :class:`Round`, like Argo Rollouts'
``rolloutContext``: one object carries what a round knows and what it has decided so far,
so that the areas share it without calling back into each other or into the dispatch in
:mod:`.plan` (no import circle), and a decision reads as "given this round, do that".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from rtrl.core.api.checkpoint import CheckpointPhase
from rtrl.core.api.names import (
    ANNOTATION_APPROVE,
    ANNOTATION_PROMOTE,
    ANNOTATION_ROLLBACK,
    ANNOTATION_STARTED,
    ANNOTATION_TRIGGER,
    API_VERSION,
)
from rtrl.core.api.names import RUNNING_PHASES as RUNNING
from rtrl.core.api.reasons import ConditionType, Reason
from rtrl.core.api.rlcycle import NotificationEvent, RLCyclePhase, RLCycleSpec

from .actions import Action, Emit, PatchStatus
from .conditions import Conditions, bounded
from .observed import Observed
from .reading import data_watermark, meta, owned, phase
from .schedule import next_run
from .timeutil import iso, parse_time

READY_POLL_SECONDS = 5.0
# Requests a Checkpoint's status keeps (the CRD's bound): the newest.
MAX_REQUESTS = 16


@dataclass
class Plan:
    """What to do, in order, then the RLCycle's status to write; ``requeue_after`` says
    when to look again without an event (None: only on events and the periodic resync)."""

    actions: list[Action] = field(default_factory=list)
    status: dict[str, Any] = field(default_factory=dict)
    requeue_after: float | None = None

    def soon(self, seconds: float) -> None:
        seconds = max(0.0, seconds)
        self.requeue_after = (
            seconds if self.requeue_after is None else min(self.requeue_after, seconds)
        )


class Round:
    """The context of one round: ``obs`` and ``now`` (what it decides from), ``out`` (the
    plan being built), ``status`` (the RLCycle's status being written), ``conditions``,
    the owned Checkpoints (oldest first), and, once the spec validated and the environment
    checked, ``spec`` and ``serving`` (the Checkpoint the target serves; in an adapter
    RLCycle, the organisation's adapter)."""

    spec: RLCycleSpec
    serving: dict[str, Any]
    # The Checkpoint the target Deployment serves: ``serving`` too, except in an adapter
    # RLCycle whose organisation has an adapter (rtrl.planning.adapter_routes); and that
    # organisation's adapter when it was trained on another base (None: none is stale).
    base: dict[str, Any]
    stale: dict[str, Any] | None = None

    def __init__(self, observed: Observed, now: datetime):
        self.obs = observed
        self.now = now
        self.rlc = dict(observed.rlcycle)
        self.meta = meta(self.rlc)
        self.name = str(self.meta["name"])
        self.generation = int(self.meta.get("generation") or 0)
        self.old = dict(self.rlc.get("status") or {})
        self.conditions = Conditions(self.old.get("conditions"), now, self.generation)
        self.out = Plan()
        self.status: dict[str, Any] = {
            "cycle": int(self.old.get("cycle") or 0),
            "serving": self.old.get("serving"),
            "candidate": self.old.get("candidate"),
            "lastPromoted": self.old.get("lastPromoted"),
            "canaryWeight": int(self.old.get("canaryWeight") or 0),
            "cycleStartedAt": self.old.get("cycleStartedAt"),
            "nextRun": None,
            "lastTrigger": self.old.get("lastTrigger"),
            "lastRollback": self.old.get("lastRollback"),
            "lastPromote": self.old.get("lastPromote"),
            "observedGeneration": self.generation,
        }
        for key in ("lastApprove", "awaitingApproval", "outbox"):
            if key in self.old:  # written only by RLCycles that use gates or notifications
                self.status[key] = self.old[key] if key != "awaitingApproval" else None
        # requests carried out in this round, by the Checkpoint whose write takes them
        self.carried: dict[str, list[dict[str, str]]] = {}
        self.owned = owned(observed, self.name)
        promoted = [
            c
            for c in self.owned
            if phase(c) in (CheckpointPhase.PROMOTED, CheckpointPhase.SUPERSEDED)
        ]
        if promoted:  # read back from the Checkpoints, not only from the status
            self.status["lastPromoted"] = meta(promoted[-1])["name"]
        self._take_recorded_requests()
        if self.owned:
            self.status["cycle"] = max(
                self.status["cycle"], int(self.owned[-1]["spec"].get("cycle") or 0)
            )

    # --- building the plan ---------------------------------------------------------------
    def act(self, action: Action) -> None:
        self.out.actions.append(action)

    def event(
        self,
        reason: str,
        message: str,
        *,
        warning: bool = False,
        kind: str = "RLCycle",
        name: str | None = None,
        notify: tuple[NotificationEvent, ...] = (),
    ) -> None:
        self.act(Emit(kind, name or self.name, reason, message, warning, notify))

    def finish(self, phase: RLCyclePhase, message: str) -> Plan:
        self.status["phase"] = phase
        serving = self.checkpoint(str(self.status.get("serving") or ""))
        self.status["dataWatermark"] = (
            data_watermark(serving, self.name) if serving else self.old.get("dataWatermark")
        )
        self.status["message"] = bounded(message)
        self.status["conditions"] = self.conditions.to_list()
        self.out.status = self.status
        return self.out

    def invalid(self, reason: str, message: str) -> Plan:
        if self.conditions.previous_status(ConditionType.INVALID_SPEC) != "True" or (
            self.old.get("message") != message
        ):
            self.event(reason, message, warning=True)
        self.conditions.set(ConditionType.INVALID_SPEC, True, reason, message)
        self.conditions.set(ConditionType.READY, False, reason, message)
        self.conditions.set(
            ConditionType.PROGRESSING, False, Reason.INVALID_SPEC, "no Jobs start until it is fixed"
        )
        return self.finish(RLCyclePhase.INVALID, message)

    def patch_summary(self, ck: dict[str, Any], key: str, summary: Any, **fields: Any) -> None:
        dumped = summary.model_dump(mode="json", by_alias=True, exclude_none=True)
        self.patch_checkpoint(ck, **{key: dumped}, **fields)

    def patch_rlcycle(self, status: dict[str, Any]) -> None:
        """Write ``status`` into the RLCycle's at this point of the round (its own status
        is written after every action), conditional on the version the round saw."""
        seen = str(self.meta.get("resourceVersion") or "")
        self.act(PatchStatus(API_VERSION, "RLCycle", self.name, status, seen))

    def carry(self, ck: dict[str, Any], annotation: str, token: str) -> None:
        """The request ``annotation=token`` is carried out by ``ck``'s next status write in
        this round: that write records it (``status.requests``), which takes its token."""
        self.carried.setdefault(meta(ck)["name"], []).append(
            {"annotation": annotation, "value": token}
        )

    def patch_checkpoint(
        self, ck: dict[str, Any], phase: CheckpointPhase | None = None, **fields: Any
    ) -> None:
        """Write ``fields`` (those not None) and ``phase`` into ``ck``'s status."""
        name = meta(ck)["name"]
        status = {k: v for k, v in {"phase": phase, **fields}.items() if v is not None}
        if name in self.carried:  # the requests this write carries out, with the earlier ones
            earlier = list((ck.get("status") or {}).get("requests") or [])
            status["requests"] = [*earlier, *self.carried[name]][-MAX_REQUESTS:]
        if isinstance(status.get("message"), str):
            status["message"] = bounded(status["message"])
        status["observedGeneration"] = int(meta(ck).get("generation") or 0)
        seen = str(meta(ck).get("resourceVersion") or "")
        self.act(PatchStatus(API_VERSION, "Checkpoint", name, status, seen))

    # --- lookups -------------------------------------------------------------------------
    def checkpoint(self, name: str) -> dict[str, Any] | None:
        for c in self.obs.checkpoints:
            if meta(c).get("name") == name:
                return dict(c)
        return None

    def serving_of(self, ck: dict[str, Any]) -> dict[str, Any]:
        """The checkpoint this cycle trains from: its parent (which served when it began)."""
        parent = (ck.get("spec") or {}).get("parent")
        found = self.checkpoint(parent) if parent else None
        return found if found is not None else self.serving

    def rolled_back(self) -> list[str]:
        """Checkpoints rolled back: their interactions are never staged again."""
        return [
            meta(c)["name"]
            for c in self.obs.checkpoints
            if phase(dict(c)) == CheckpointPhase.ROLLED_BACK
        ]

    def pending_annotation(self, key: str, status_key: str) -> str | None:
        """The RLCycle's annotation ``key`` when its value is a request not yet taken: not
        the one recorded in ``status.<status_key>``, nor in an owned Checkpoint's
        ``status.requests`` (:meth:`carry`). The Checkpoint's write is the one that carries
        a request out; the RLCycle's status follows in a later write, which a crash can
        lose, and the same request must not be carried out twice (a second rollback of the
        serving model)."""
        value = (self.meta.get("annotations") or {}).get(key)
        if not value or value == self.status.get(status_key):
            return None
        return None if self._recorded(key, str(value)) else str(value)

    def _take_recorded_requests(self) -> None:
        """``status.lastTrigger``/``lastRollback``/``lastPromote`` for a request a
        Checkpoint shows was carried out (a trigger: the cycle's Checkpoint carries it), in
        case the status write that said so was lost."""
        annotations = self.meta.get("annotations") or {}
        trigger = annotations.get(ANNOTATION_TRIGGER)
        if trigger and trigger != self.status.get("lastTrigger"):
            started = {
                (meta(c).get("annotations") or {}).get(ANNOTATION_TRIGGER) for c in self.owned
            }
            if trigger in started:
                self.status["lastTrigger"] = str(trigger)
        for key, status_key in (
            (ANNOTATION_ROLLBACK, "lastRollback"),
            (ANNOTATION_PROMOTE, "lastPromote"),
            (ANNOTATION_APPROVE, "lastApprove"),
        ):
            value = annotations.get(key)
            if value and value != self.status.get(status_key) and self._recorded(key, value):
                self.status[status_key] = str(value)

    def _recorded(self, annotation: str, token: str) -> bool:
        """Whether an owned Checkpoint's write carried out ``annotation=token``."""
        request = {"annotation": annotation, "value": token}
        return any(request in ((c.get("status") or {}).get("requests") or []) for c in self.owned)

    # --- status --------------------------------------------------------------------------
    def last_start(self) -> datetime | None:
        starts = [parse_time(self.status.get("cycleStartedAt"))]
        starts += [
            parse_time((meta(c).get("annotations") or {}).get(ANNOTATION_STARTED))
            for c in self.owned
        ]
        known = [s for s in starts if s is not None]
        return max(known) if known else None

    def schedule_next(self) -> datetime | None:
        """The next scheduled start after the last one, written as ``status.nextRun``."""
        created = parse_time(self.meta.get("creationTimestamp")) or self.now
        due = next_run(self.spec.schedule, self.last_start(), created)
        self.status["nextRun"] = iso(due) if due else None
        return due

    def set_ready(self, serving: str) -> None:
        self.conditions.set(
            ConditionType.READY,
            True,
            Reason.SERVING,
            f"{serving} serves {self.spec.target.deployment}",
        )

    def set_degraded(self) -> None:
        finished = [c for c in self.owned if phase(c) not in RUNNING]
        last = finished[-1] if finished else None
        cancelled = (
            last is not None and (last.get("status") or {}).get("reason") == Reason.CANCELLED
        )
        if last is not None and phase(last) == CheckpointPhase.FAILED and not cancelled:
            status = last.get("status") or {}
            self.conditions.set(
                ConditionType.DEGRADED,
                True,
                Reason.CYCLE_FAILED,
                f"{meta(last)['name']}: "
                f"{status.get('message') or status.get('reason') or 'failed'}",
            )
        else:
            self.conditions.set(ConditionType.DEGRADED, False, Reason.AS_EXPECTED, "")
