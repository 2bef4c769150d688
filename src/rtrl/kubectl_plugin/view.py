"""What ``kubectl rtrl status`` (one-off or ``--watch``) and ``list`` print beyond the
RLCycle's and Checkpoint's own blocks (:mod:`.render`): the tree of the cycle's objects
(RLCycle -> Checkpoints -> Jobs and the canary Deployment), the recent Events, the frame
that puts them together, and the one-line-per-RLCycle table of ``list``.

Pure functions of a :class:`Snapshot` (the objects as the API returns them) and the clock,
as :mod:`.render` is; colour is a :data:`~.render.Paint` the caller chooses.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from rtrl.core.api.checkpoint import CheckpointPhase
from rtrl.core.api.names import LABEL_ATTEMPT, LABEL_STEP
from rtrl.core.api.reasons import JobCondition, PodPhase
from rtrl.planning.timeutil import parse_time

from .render import (
    Paint,
    age,
    checkpoint_lines,
    duration,
    meta,
    one_line,
    plain,
    rlcycle_lines,
    spec,
    status,
    table,
    text,
)

EVENTS_SHOWN = 8
MESSAGE_WIDTH = 100
BRANCH, LAST, PIPE, SPACE = "├── ", "└── ", "│   ", "    "


@dataclass
class Snapshot:
    """One look at an RLCycle: the objects a frame shows, and what could not be read."""

    rlcycle: dict[str, Any]
    checkpoint: dict[str, Any] | None = None  # the candidate, else the last cycle's
    role: str = "Candidate"  # or "Last cycle"
    serving: dict[str, Any] | None = None
    jobs: list[dict[str, Any]] = field(default_factory=list)
    canaries: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    unreadable: list[str] = field(default_factory=list)  # "jobs: forbidden", ...

    def versions(self) -> tuple[str, ...]:
        """The resourceVersions of everything shown: a frame differs only if these do."""
        objects = [self.rlcycle, self.checkpoint, self.serving, *self.jobs, *self.canaries]
        return tuple(
            f"{meta(o).get('uid')}@{meta(o).get('resourceVersion')}"
            for o in [*objects, *self.events]
            if o is not None
        ) + tuple(self.unreadable)


# --- the tree ------------------------------------------------------------------------------
def job_state(job: dict[str, Any]) -> str:
    st = status(job)
    for c in st.get("conditions") or []:
        if c.get("status") == "True" and c.get("type") in (
            JobCondition.COMPLETE,
            JobCondition.FAILED,
        ):
            return PodPhase.SUCCEEDED if c["type"] == JobCondition.COMPLETE else PodPhase.FAILED
    if spec(job).get("suspend"):
        return "Suspended"
    return PodPhase.RUNNING if st.get("active") else PodPhase.PENDING


def canary_row(deployment: dict[str, Any], weight: int, now: datetime) -> list[str]:
    st = status(deployment)
    wanted = int(spec(deployment).get("replicas") or 0)
    ready = int(st.get("readyReplicas") or 0)
    state = "Ready" if wanted and ready >= wanted else "Progressing"
    info = f"canary {weight}%, {ready}/{wanted} ready"
    return [str(meta(deployment).get("name")), "Deployment", state, age(deployment, now), info]


def job_row(job: dict[str, Any], now: datetime) -> list[str]:
    labels = meta(job).get("labels") or {}
    step = labels.get(LABEL_STEP) or "-"
    attempt = labels.get(LABEL_ATTEMPT)
    info = f"{step}, attempt {attempt}" if attempt else step
    return [str(meta(job).get("name")), "Job", job_state(job), age(job, now), info]


def tree_lines(snap: Snapshot, now: datetime, paint: Paint = plain) -> list[str]:
    """NAME, KIND, STATUS, AGE, INFO of the RLCycle and what it owns in this cycle, as
    ``kubectl argo rollouts get rollout`` lays out a Rollout."""
    rlc, ck = snap.rlcycle, snap.checkpoint
    st = status(rlc)
    weight = int(st.get("canaryWeight") or 0)
    head = f"cycle {text(st.get('cycle'))}, serving {text(st.get('serving'))}"
    rows = [[str(meta(rlc).get("name")), "RLCycle", phase_of(rlc), age(rlc, now), head]]
    checkpoints: list[tuple[dict[str, Any], str, list[list[str]]]] = []
    if snap.serving is not None and (ck is None or name_of(snap.serving) != name_of(ck)):
        checkpoints.append((snap.serving, "serving", []))
    if ck is not None:
        children = [job_row(j, now) for j in sorted(snap.jobs, key=created)]
        children += [canary_row(d, weight, now) for d in snap.canaries]
        role = snap.role.lower() + (", serving" if name_of(ck) == st.get("serving") else "")
        checkpoints.append((ck, role, children))
    for i, (obj, info, children) in enumerate(checkpoints):
        last = i == len(checkpoints) - 1
        rows.append([(LAST if last else BRANCH) + name_of(obj), "Checkpoint", phase_of(obj),
                     age(obj, now), info])  # fmt: skip
        for j, child in enumerate(children):
            twig = LAST if j == len(children) - 1 else BRANCH
            rows.append([(SPACE if last else PIPE) + twig + child[0], *child[1:]])
    lines = table(["NAME", "KIND", "STATUS", "AGE", "INFO"], rows, paint=paint, styled=[2])
    return lines + [f"({what})" for what in snap.unreadable]


# --- the Events ------------------------------------------------------------------------------
def event_time(event: dict[str, Any]) -> datetime | None:
    for key in ("lastTimestamp", "eventTime", "firstTimestamp"):
        moment = parse_time(event.get(key))
        if moment is not None:
            return moment
    return parse_time(meta(event).get("creationTimestamp"))


def event_lines(events: Sequence[dict[str, Any]], now: datetime, paint: Paint = plain) -> list[str]:
    """The newest Events of the RLCycle and its Checkpoint, oldest first (as ``kubectl
    describe``), a warning painted as a failure."""
    if not events:
        return ["Events: none"]
    timed = sorted(events, key=lambda e: (event_time(e) or now, str(meta(e).get("name"))))
    rows = []
    for e in timed[-EVENTS_SHOWN:]:
        moment = event_time(e)
        seen = duration((now - moment).total_seconds()) if moment else "-"
        count = int(e.get("count") or 1)
        involved = e.get("involvedObject") or {}
        rows.append(
            [
                seen + (f" (x{count})" if count > 1 else ""),
                text(e.get("type")),
                text(e.get("reason")),
                f"{involved.get('kind')}/{involved.get('name')}",
                one_line(e.get("message"), MESSAGE_WIDTH),
            ]
        )

    def warnings_red(cell: str, value: str | None) -> str:
        return paint(cell, CheckpointPhase.FAILED if value == "Warning" else None)

    headers = ["AGE", "TYPE", "REASON", "OBJECT", "MESSAGE"]
    shown = f" (last {EVENTS_SHOWN})" if len(events) > EVENTS_SHOWN else ""
    return [f"Events{shown}:", *table(headers, rows, "  ", paint=warnings_red, styled=[1])]


# --- the frame -------------------------------------------------------------------------------
def frame(snap: Snapshot, now: datetime, paint: Paint = plain) -> str:
    """Everything ``kubectl rtrl status`` shows: the RLCycle, the tree, the candidate (or
    last) Checkpoint with its gates, rollout and A/B table, and the Events."""
    lines = rlcycle_lines(snap.rlcycle, now, paint)
    lines += ["", *tree_lines(snap, now, paint)]
    if snap.checkpoint is not None:
        lines += ["", *checkpoint_lines(snap.checkpoint, snap.role, now, paint)]
    lines += ["", *event_lines(snap.events, now, paint)]
    return "\n".join(lines) + "\n"


# --- list ------------------------------------------------------------------------------------
def list_lines(
    rlcycles: Sequence[dict[str, Any]], now: datetime, all_namespaces: bool, paint: Paint = plain
) -> list[str]:
    """``kubectl rtrl list``: one row per RLCycle, as ``kubectl get`` lays them out."""
    rows = []
    ordered = sorted(rlcycles, key=lambda r: (str(meta(r).get("namespace")), name_of(r)))
    for r in ordered:
        st = status(r)
        next_run = parse_time(st.get("nextRun"))
        if next_run is None:
            upcoming = "-"
        elif next_run > now:
            upcoming = f"in {duration((next_run - now).total_seconds())}"
        else:
            upcoming = f"{duration((now - next_run).total_seconds())} ago"
        row = [name_of(r), phase_of(r), text(st.get("serving")), text(st.get("candidate")),
               f"{int(st.get('canaryWeight') or 0)}%", text(st.get("cycle")), upcoming,
               age(r, now)]  # fmt: skip
        rows.append([text(meta(r).get("namespace")), *row] if all_namespaces else row)
    headers = ["NAME", "PHASE", "SERVING", "CANDIDATE", "CANARY", "CYCLE", "NEXT RUN", "AGE"]
    if all_namespaces:
        headers.insert(0, "NAMESPACE")
    return table(headers, rows, paint=paint, styled=[2 if all_namespaces else 1])


# --- small helpers ---------------------------------------------------------------------------
def name_of(obj: dict[str, Any]) -> str:
    return str(meta(obj).get("name"))


def phase_of(obj: dict[str, Any]) -> str:
    return str(status(obj).get("phase") or CheckpointPhase.PENDING)  # an RLCycle's too


def created(obj: dict[str, Any]) -> tuple[str, str]:
    return str(meta(obj).get("creationTimestamp") or ""), name_of(obj)
