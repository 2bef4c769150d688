"""``plan(observed, now)``: the RLCycle reconciler's decisions.

One cycle: create the Checkpoint ``<rlcycle>-<n>`` (parent: the serving checkpoint), then
drive it through its step Jobs, one after the other: stage -> train -> eval. A step is done
when its Job succeeded *and* its result document is committed in the store; the summary is
then written into the Checkpoint's status, which is how the next reconcile knows the step
is behind it. A failed Job is retried as a new attempt after a doubling delay; when the
attempts are spent the Checkpoint is Failed. Insufficient data ends the attempt without a
Checkpoint: it and its Jobs are deleted, the RLCycle says ``InsufficientData`` and the next
schedule tick tries again.

Everything is derived from what was observed, nothing from memory: the active cycle is the
owned Checkpoint in a running phase, the serving checkpoint is the one whose URI the target
Deployment serves, attempts are counted from the Jobs that exist.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from pydantic import ValidationError

from rtrl.core.api import names
from rtrl.core.api.checkpoint import DataSummary, EvalSummary, GateResult, TrainingSummary
from rtrl.core.api.common import parse_duration
from rtrl.core.api.errors import error_message, format_loc
from rtrl.core.api.names import API_VERSION, STEP_PHASE
from rtrl.core.api.names import RUNNING_PHASES as RUNNING
from rtrl.core.api.rlcycle import RLCycleMeta, RLCycleSpec

from . import children as ch
from .actions import Action, Create, Delete, Emit, PatchStatus
from .conditions import Conditions
from .observed import JobState, Observed
from .reading import active as _active
from .reading import current_step as _current_step
from .reading import fresh as _fresh
from .reading import meta as _meta
from .reading import owned as _owned
from .reading import phase as _phase
from .reading import step_jobs as _step_jobs
from .rollout import (
    READY_POLL_SECONDS,
    drive_canary,
    pending_annotation,
    serve,
)
from .schedule import next_run
from .timeutil import iso, parse_time

STEP_TITLE = {"stage": "Stage", "train": "Train", "eval": "Eval"}
MAX_BACKOFF = 3600.0
# Why eval.json failed a candidate (its "reason"), as the Checkpoint's condition reason.
EVAL_FAILURES = ("EvalGatesFailed", "SandboxUnsafe")


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


def results_to_read(observed: Observed) -> list[str]:
    """Result documents the next plan needs: the current step's, once its Job succeeded."""
    name = _meta(observed.rlcycle).get("name")
    active = _active(_owned(observed, str(name)))
    if active is None:
        return []
    step = _current_step(active)
    if step is None:
        return []
    jobs = [j for j in _step_jobs(observed, active, step) if _fresh(j, active)]
    if jobs and jobs[-1].succeeded:
        return [ch.result_uri(active["spec"]["uri"], step)]
    return []


def validate_spec(raw: Any) -> tuple[RLCycleSpec | None, str]:
    """The spec, or None and the first problem as ``spec.<field>: <message>``."""
    return _validate_spec_json(json.dumps(raw or {}))


@functools.lru_cache(maxsize=512)
def _validate_spec_json(text: str) -> tuple[RLCycleSpec | None, str]:
    """:func:`validate_spec` of a spec's JSON: a round of an unchanged spec reuses the
    result (validation is a third of a plan's time; the models are never changed)."""
    try:
        return RLCycleSpec.model_validate_json(text, strict=True), ""
    except ValidationError as exc:
        problems = sorted(
            f"{format_loc(('spec', *e['loc']))}: {error_message(e)}" for e in exc.errors()
        )
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        return None, problems[0] + more


@functools.lru_cache(maxsize=512)
def validate_name(name: str) -> str:
    """The problem with an RLCycle's name ("" if none): its children's names derive from it. The
    CRD refuses such names; an RLCycle stored before it did still reaches the operator."""
    try:
        RLCycleMeta.model_validate({"name": name}, strict=True)
    except ValidationError as exc:
        return f"metadata.name: {error_message(exc.errors()[0])}"
    return ""


# --- the plan ------------------------------------------------------------------------------


class _Planner:
    def __init__(self, observed: Observed, now: datetime):
        self.obs = observed
        self.now = now
        self.rlc = dict(observed.rlcycle)
        self.meta = _meta(self.rlc)
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
        self.owned = _owned(observed, self.name)
        promoted = [c for c in self.owned if _phase(c) in ("Promoted", "Superseded")]
        if promoted:  # read back from the Checkpoints, not only from the status
            self.status["lastPromoted"] = _meta(promoted[-1])["name"]
        if self.owned:
            self.status["cycle"] = max(
                self.status["cycle"], int(self.owned[-1]["spec"].get("cycle") or 0)
            )

    # small helpers
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
    ) -> None:
        self.act(Emit(kind, name or self.name, reason, message, warning))

    def finish(self, phase: str, message: str) -> Plan:
        self.status["phase"] = phase
        self.status["message"] = message
        self.status["conditions"] = self.conditions.to_list()
        self.out.status = self.status
        return self.out

    def invalid(self, reason: str, message: str) -> Plan:
        if self.conditions.previous_status("InvalidSpec") != "True" or (
            self.old.get("message") != message
        ):
            self.event(reason, message, warning=True)
        self.conditions.set("InvalidSpec", True, reason, message)
        self.conditions.set("Ready", False, reason, message)
        self.conditions.set("Progressing", False, "InvalidSpec", "no Jobs start until it is fixed")
        return self.finish("Invalid", message)

    # the decision
    def run(self) -> Plan:
        problem = validate_name(self.name)
        if problem:
            return self.invalid("NameInvalid", problem)
        spec, problem = validate_spec(self.rlc.get("spec"))
        if spec is None:
            return self.invalid("SpecInvalid", problem)
        self.spec = spec
        problem_reason, problem = self.check_environment()
        if problem_reason:
            return self.invalid(problem_reason, problem)
        if self.conditions.previous_status("InvalidSpec") == "True":
            self.event("SpecValid", "the spec is valid again; resuming")
        self.conditions.set("InvalidSpec", False, "SpecValid", "")
        if self.conditions.previous_status("InsufficientData") is None:
            self.conditions.set("InsufficientData", False, "NotStaged", "no cycle staged yet")
        self.prune_history()
        active = _active(self.owned)
        if active is not None and _phase(active) not in ("Evaluated", "Canary"):
            why = self.cancel_reason()
            if why:
                self.cancel(active, why)
                active = None
        if active is not None:
            return self.drive(active)
        return self.idle()

    def cancel_reason(self) -> str:
        """A pin or a rollback asked for while a cycle is still before its canary: serving
        must change now, not after hours of training, so the cycle is cancelled. (A running
        canary is rolled back by the rollout instead.)"""
        if self.spec.pin:
            return f"cancelled: spec.pin is set to {self.spec.pin}"
        token = pending_annotation(self, names.ANNOTATION_ROLLBACK, "lastRollback")
        return f"cancelled by {names.ANNOTATION_ROLLBACK}={token}" if token else ""

    def cancel(self, ck: dict[str, Any], why: str) -> None:
        name = _meta(ck)["name"]
        for job in self.obs.jobs:
            if job.checkpoint == name and not job.finished and not job.deleting:
                self.act(Delete("batch/v1", "Job", job.name))
        self.patch_checkpoint(
            ck, phase="Failed", reason="Cancelled", message=why, completedAt=iso(self.now)
        )
        self.event("CycleCancelled", f"{name}: {why}", warning=True)
        self.owned = [c for c in self.owned if _meta(c)["name"] != name]

    def check_environment(self) -> tuple[str, str]:
        """Target Deployment, credentials Secret, serving checkpoint: what the spec names
        must exist before any Job is created."""
        spec, dep = self.spec, self.obs.deployment
        target = spec.target
        ns = self.meta.get("namespace")
        if not dep.found:
            return (
                "DeploymentNotFound",
                f"spec.target.deployment: Deployment {target.deployment} not found in "
                f"namespace {ns}",
            )
        if not dep.has_container:
            return (
                "ContainerNotFound",
                f"spec.target.container: Deployment {target.deployment} has no container "
                f"{target.container}",
            )
        secret = self.obs.secret
        if spec.storage.credentials_secret and secret is not None:
            if not secret.found:
                return (
                    "SecretNotFound",
                    f"spec.storage.credentialsSecret: Secret {spec.storage.credentials_secret} "
                    f"not found in namespace {ns}",
                )
            if secret.missing_keys:
                return (
                    "SecretIncomplete",
                    f"spec.storage.credentialsSecret: Secret {spec.storage.credentials_secret} "
                    f"lacks key(s) {', '.join(secret.missing_keys)}",
                )
        if spec.pin and self.checkpoint(spec.pin) is None:
            return (
                "PinnedCheckpointNotFound",
                f"spec.pin: Checkpoint {spec.pin} not found in namespace {ns}",
            )
        if not dep.serving_uri:
            return (
                "CheckpointEnvMissing",
                f"spec.target.checkpointEnv: container {target.container} of Deployment "
                f"{target.deployment} has no value for {target.checkpoint_env}",
            )
        serving = [
            c
            for c in self.obs.checkpoints
            if ch.same_uri(c.get("spec", {}).get("uri"), dep.serving_uri)
        ]
        if not serving:
            return (
                "ServingCheckpointUnknown",
                f"spec.target: Deployment {target.deployment} serves {dep.serving_uri}, and no "
                f"Checkpoint in namespace {ns} has that spec.uri; register the base model as "
                "a Checkpoint (see examples/checkpoint-base.yaml)",
            )
        # Several Checkpoints may share a URI (re-registered); the newest cycle wins.
        self.serving = max(
            (dict(c) for c in serving),
            key=lambda c: (int((c.get("spec") or {}).get("cycle") or 0), _meta(c)["name"]),
        )
        self.status["serving"] = _meta(self.serving)["name"]
        return "", ""

    def checkpoint(self, name: str) -> dict[str, Any] | None:
        for c in self.obs.checkpoints:
            if _meta(c).get("name") == name:
                return dict(c)
        return None

    # --- no cycle running: start one when due ---------------------------------------------
    def last_start(self) -> datetime | None:
        starts = [parse_time(self.status.get("cycleStartedAt"))]
        starts += [
            parse_time((_meta(c).get("annotations") or {}).get(names.ANNOTATION_STARTED))
            for c in self.owned
        ]
        known = [s for s in starts if s is not None]
        return max(known) if known else None

    def pending_trigger(self) -> str | None:
        value = (self.meta.get("annotations") or {}).get(names.ANNOTATION_TRIGGER)
        if not value:
            return None
        used = {self.status.get("lastTrigger")} | {
            (_meta(c).get("annotations") or {}).get(names.ANNOTATION_TRIGGER) for c in self.owned
        }
        return None if value in used else str(value)

    def idle(self) -> Plan:
        created = parse_time(self.meta.get("creationTimestamp")) or self.now
        due = next_run(self.spec.schedule, self.last_start(), created)
        self.status["nextRun"] = iso(due) if due else None
        self.set_degraded()
        serving = _meta(self.serving)["name"]
        self.conditions.set(
            "Ready", True, "Serving", f"{serving} serves {self.spec.target.deployment}"
        )
        if self.spec.pin:
            self.status["nextRun"] = None
            pinned = self.checkpoint(self.spec.pin) or {}
            if not serve(self, pinned["spec"]["uri"], self.spec.pin):
                self.event("Pinned", f"{self.spec.target.deployment} set to {self.spec.pin}")
                self.out.soon(READY_POLL_SECONDS)
            self.conditions.set("Progressing", False, "Pinned", f"pinned to {self.spec.pin}")
            return self.finish("Pinned", f"pinned to {self.spec.pin}; no cycles start")
        token = pending_annotation(self, names.ANNOTATION_ROLLBACK, "lastRollback")
        if token is not None:
            return self.manual_rollback(token)
        if self.spec.suspend:
            self.conditions.set("Progressing", False, "Suspended", "spec.suspend is true")
            return self.finish(
                "Suspended", "suspended: no cycle starts until spec.suspend is false"
            )
        trigger = self.pending_trigger()
        if trigger is None and (due is None or due > self.now):
            self.conditions.set("Progressing", False, "Idle", "waiting for the next cycle")
            if due is not None:
                self.out.soon((due - self.now).total_seconds())
            when = f"next cycle at {iso(due)}" if due else "the cron schedule never fires"
            return self.finish("Idle", f"{serving} serving; {when}")
        return self.start(trigger)

    def manual_rollback(self, token: str) -> Plan:
        """``rtrl.io/rollback`` with no canary running: serve the checkpoint the serving one
        superseded. The token is recorded first, so a crash can lose this rollback (the
        status shows it was taken; annotate again) but never roll back twice."""
        serving = self.serving
        name = _meta(serving)["name"]
        parent_name = (serving.get("spec") or {}).get("parent")
        parent = self.checkpoint(parent_name) if parent_name else None
        self.status["lastRollback"] = token
        self.act(PatchStatus(API_VERSION, "RLCycle", self.name, {"lastRollback": token}))
        if parent is None:
            message = f"{names.ANNOTATION_ROLLBACK}={token}: {name} has no parent to roll back to"
            self.event("RollbackImpossible", message, warning=True)
            return self.finish("Idle", message)
        serve(self, parent["spec"]["uri"], str(parent_name))
        self.patch_checkpoint(
            serving,
            phase="RolledBack",
            reason="ManualRollback",
            message=f"{names.ANNOTATION_ROLLBACK}={token}",
            completedAt=iso(self.now),
        )
        self.event(
            "RolledBack",
            f"{name} rolled back to {parent_name} ({names.ANNOTATION_ROLLBACK}={token})",
            warning=True,
        )
        self.status["serving"] = parent_name
        self.out.soon(READY_POLL_SECONDS)
        return self.finish("RollingBack", f"rolling back {name} to {parent_name}")

    def start(self, trigger: str | None) -> Plan:
        cycle = self.status["cycle"] + 1
        parent = _meta(self.serving)["name"]
        manifest = ch.checkpoint_manifest(
            self.rlc, self.spec, cycle=cycle, parent=parent, now=self.now, trigger=trigger
        )
        name = manifest["metadata"]["name"]
        self.act(Create(manifest))
        why = f"triggered by {names.ANNOTATION_TRIGGER}={trigger}" if trigger else "scheduled"
        self.event("CycleStarted", f"cycle {cycle} ({why}): training {name} from {parent}")
        self.status.update(
            cycle=cycle,
            candidate=name,
            cycleStartedAt=iso(self.now),
            lastTrigger=trigger if trigger is not None else self.status.get("lastTrigger"),
        )
        due = next_run(self.spec.schedule, self.now, self.now)
        self.status["nextRun"] = iso(due) if due else None
        self.conditions.set("Progressing", True, "CycleStarted", f"cycle {cycle} started")
        self.conditions.set(
            "Ready", True, "Serving", f"{parent} serves {self.spec.target.deployment}"
        )
        self.set_degraded()
        self.out.soon(0)  # the Checkpoint's uid is needed for its children
        return self.finish("Staging", f"cycle {cycle}: creating {name}")

    def set_degraded(self) -> None:
        finished = [c for c in self.owned if _phase(c) not in RUNNING]
        last = finished[-1] if finished else None
        cancelled = last is not None and (last.get("status") or {}).get("reason") == "Cancelled"
        if last is not None and _phase(last) == "Failed" and not cancelled:
            status = last.get("status") or {}
            self.conditions.set(
                "Degraded",
                True,
                "CycleFailed",
                f"{_meta(last)['name']}: "
                f"{status.get('message') or status.get('reason') or 'failed'}",
            )
        else:
            self.conditions.set("Degraded", False, "AsExpected", "")

    # --- a cycle is running: drive its Checkpoint through the steps ----------------------
    def drive(self, ck: dict[str, Any]) -> Plan:
        meta = _meta(ck)
        name = meta["name"]
        self.status["candidate"] = name
        started = (meta.get("annotations") or {}).get(names.ANNOTATION_STARTED)
        if started:
            self.status["cycleStartedAt"] = started
        created = parse_time(self.meta.get("creationTimestamp")) or self.now
        due = next_run(self.spec.schedule, self.last_start(), created)
        self.status["nextRun"] = iso(due) if due else None
        self.conditions.set(
            "Ready",
            True,
            "Serving",
            f"{_meta(self.serving)['name']} serves {self.spec.target.deployment}",
        )
        self.set_degraded()
        if not meta.get("uid"):
            self.out.soon(1)
            return self.finish("Staging", f"waiting for {name} to be created")
        if _phase(ck) in ("Evaluated", "Canary"):
            return drive_canary(self, ck)
        step = _current_step(ck)
        assert step is not None  # a Checkpoint with all three summaries is not running
        return self.drive_step(ck, step)

    def drive_step(self, ck: dict[str, Any], step: str) -> Plan:
        name = _meta(ck)["name"]
        phase = STEP_PHASE[step]
        jobs = _step_jobs(self.obs, ck, step)
        for stale in [j for j in jobs if not _fresh(j, ck)]:
            self.act(Delete("batch/v1", "Job", stale.name))
        jobs = [j for j in jobs if _fresh(j, ck)]
        ck_status = dict(ck.get("status") or {})
        if _phase(ck) != phase:
            started = ck_status.get("startedAt") or self.status.get("cycleStartedAt")
            self.patch_checkpoint(
                ck,
                phase=phase,
                reason=f"{STEP_TITLE[step]}Running",
                message=f"{step} step running",
                startedAt=started,
            )
        self.conditions.set("Progressing", True, f"{STEP_TITLE[step]}Running", f"{name}: {step}")
        if not jobs:
            self.create_step(ck, step, 0)
            return self.finish(phase, f"cycle {self.status['cycle']}: {step} of {name}")
        job = jobs[-1]
        if not job.finished:
            return self.finish(
                phase, f"cycle {self.status['cycle']}: {step} of {name} ({job.name})"
            )
        if job.succeeded:
            return self.step_succeeded(ck, step, job)
        return self.step_failed(ck, step, job)

    def create_step(
        self, ck: dict[str, Any], step: str, attempt: int, args: list[str] | None = None
    ) -> None:
        name = _meta(ck)["name"]
        if ch.config_map_name(name) not in self.obs.config_maps:
            text = json.dumps(self.rlc.get("spec") or {}, indent=2, sort_keys=True) + "\n"
            self.act(Create(ch.config_map_manifest(self.rlc, ck, text)))
        if step == "train" and ch.service_name(name) not in self.obs.services:
            self.act(Create(ch.service_manifest(self.rlc, ck)))
        if args is None:
            args = ch.step_args(
                step,
                self.spec,
                ck,
                self.serving_of(ck),
                previous=(self.serving_of(ck).get("spec") or {}).get("parent"),
                excluded=self.rolled_back(),
            )
        job = ch.job_manifest(self.rlc, self.spec, ck, step=step, attempt=attempt, args=args)
        self.act(Create(job))
        again = f" (attempt {attempt + 1} of {self.spec.jobs.backoff_limit + 1})" if attempt else ""
        self.event(
            f"{STEP_TITLE.get(step, 'Analysis')}Started",
            f"{job['metadata']['name']}{again}",
            kind="Checkpoint",
            name=name,
        )

    def rolled_back(self) -> list[str]:
        """Checkpoints rolled back: their interactions are never staged again."""
        return [_meta(c)["name"] for c in self.obs.checkpoints if _phase(dict(c)) == "RolledBack"]

    def serving_of(self, ck: dict[str, Any]) -> dict[str, Any]:
        """The checkpoint this cycle trains from: its parent (which served when it began)."""
        parent = (ck.get("spec") or {}).get("parent")
        found = self.checkpoint(parent) if parent else None
        return found if found is not None else self.serving

    def patch_summary(self, ck: dict[str, Any], key: str, summary: Any, **fields: Any) -> None:
        dumped = summary.model_dump(mode="json", by_alias=True, exclude_none=True)
        self.patch_checkpoint(ck, **{key: dumped}, **fields)

    def patch_checkpoint(self, ck: dict[str, Any], **fields: Any) -> None:
        name = _meta(ck)["name"]
        status = {k: v for k, v in fields.items() if v is not None}
        status["observedGeneration"] = int(_meta(ck).get("generation") or 0)
        self.act(PatchStatus(API_VERSION, "Checkpoint", name, status))

    def step_failed(self, ck: dict[str, Any], step: str, job: JobState) -> Plan:
        name = _meta(ck)["name"]
        limit = self.spec.jobs.backoff_limit
        why = job.message or job.reason or "failed"
        if job.attempt < limit:
            delay = min(MAX_BACKOFF, parse_duration(self.spec.jobs.backoff) * 2**job.attempt)
            retry_at = (job.finished_at or self.now) + timedelta(seconds=delay)
            if retry_at > self.now:
                self.out.soon((retry_at - self.now).total_seconds())
                return self.finish(
                    STEP_PHASE[step],
                    f"cycle {self.status['cycle']}: {job.name} failed ({why}); retrying at "
                    f"{iso(retry_at)}",
                )
            self.event(
                f"{STEP_TITLE[step]}Retrying",
                f"{job.name} failed: {why}",
                warning=True,
                kind="Checkpoint",
                name=name,
            )
            self.create_step(ck, step, job.attempt + 1)
            return self.finish(STEP_PHASE[step], f"cycle {self.status['cycle']}: retrying {step}")
        message = f"{step} failed after {job.attempt + 1} attempt(s): {job.name}: {why}"
        return self.fail(ck, f"{STEP_TITLE[step]}Failed", message)

    def fail(self, ck: dict[str, Any], reason: str, message: str) -> Plan:
        name = _meta(ck)["name"]
        self.patch_checkpoint(
            ck, phase="Failed", reason=reason, message=message, completedAt=iso(self.now)
        )
        self.event(reason, message, warning=True, kind="Checkpoint", name=name)
        self.event(
            "CycleFailed", f"{name}: {message}; the serving model is unchanged", warning=True
        )
        self.conditions.set("Degraded", True, "CycleFailed", f"{name}: {message}")
        self.conditions.set("Progressing", False, "CycleFailed", message)
        return self.end_cycle(f"cycle {self.status['cycle']} failed: {message}")

    def end_cycle(self, message: str) -> Plan:
        created = parse_time(self.meta.get("creationTimestamp")) or self.now
        due = next_run(self.spec.schedule, self.last_start(), created)
        self.status["nextRun"] = iso(due) if due else None
        if due is not None:
            self.out.soon((due - self.now).total_seconds())
        phase = "Suspended" if self.spec.suspend else ("Pinned" if self.spec.pin else "Idle")
        if self.spec.pin:  # phase and condition agree: the pin is why nothing progresses now
            self.conditions.set("Progressing", False, "Pinned", f"pinned to {self.spec.pin}")
        return self.finish(phase, message)

    def step_succeeded(self, ck: dict[str, Any], step: str, job: JobState) -> Plan:
        uri = ch.result_uri(ck["spec"]["uri"], step)
        doc = self.obs.results.get(uri)
        if isinstance(doc, str):  # the store could not be read: look again soon
            self.out.soon(10)
            return self.finish(STEP_PHASE[step], f"cannot read {uri}: {doc}")
        if doc is None:
            return self.fail(
                ck, "ResultMissing", f"{job.name} succeeded but {uri} holds no committed result"
            )
        try:
            if step == "stage":
                return self.staged(ck, dict(doc), uri)
            if step == "train":
                return self.trained(ck, dict(doc), uri)
            return self.evaluated(ck, dict(doc), uri)
        except (KeyError, TypeError, ValueError) as exc:
            return self.fail(ck, "ResultInvalid", f"{uri} is not a valid {step} result: {exc}")

    def staged(self, ck: dict[str, Any], doc: dict[str, Any], uri: str) -> Plan:
        name = _meta(ck)["name"]
        if not doc.get("sufficient"):
            message = str(doc.get("message") or "not enough matured interactions")
            self.conditions.set("InsufficientData", True, "InsufficientData", message)
            self.conditions.set("Progressing", False, "InsufficientData", message)
            self.event("InsufficientData", f"{name}: {message}; retrying at the next tick")
            for job in self.obs.jobs:
                if job.checkpoint == name:
                    self.act(Delete("batch/v1", "Job", job.name))
            if ch.config_map_name(name) in self.obs.config_maps:
                self.act(Delete("v1", "ConfigMap", ch.config_map_name(name)))
            self.act(Delete(API_VERSION, "Checkpoint", name))
            self.status["candidate"] = None
            return self.end_cycle(f"cycle {self.status['cycle']}: insufficient data: {message}")
        quarantined = doc.get("quarantined") or None
        summary = DataSummary(
            manifest=doc.get("out") or uri.rsplit("/", 1)[0] + "/",
            interactions=int(doc["interactions_used"]),
            tokens=int(doc["tokens_used"]),
            on_policy_fraction=doc.get("on_policy_fraction"),
            quarantined=quarantined if isinstance(quarantined, dict) else None,
            files_bad=len(doc.get("quarantined_files") or []),
        )
        self.conditions.set(
            "InsufficientData", False, "DataSufficient", str(doc.get("message") or "")
        )
        self.patch_summary(
            ck,
            "data",
            summary,
            phase="Training",
            reason="Staged",
            message=str(doc.get("message") or ""),
        )
        self.event("Staged", f"{name}: {doc.get('message')}", kind="Checkpoint", name=name)
        self.out.soon(0)
        return self.finish(
            "Training", f"cycle {self.status['cycle']}: staged {summary.interactions} interactions"
        )

    def trained(self, ck: dict[str, Any], doc: dict[str, Any], uri: str) -> Plan:
        name = _meta(ck)["name"]
        summary = TrainingSummary.model_validate(doc["summary"])
        text = f"{summary.steps} steps on {summary.tokens} tokens" + (
            f", loss {summary.loss:.4g}, kl {summary.kl:.3g}"
            if summary.loss is not None and summary.kl is not None
            else ""
        )
        self.patch_summary(
            ck, "training", summary, phase="Evaluating", reason="Trained", message=text
        )
        self.event("Trained", f"{name}: {text}", kind="Checkpoint", name=name)
        self.out.soon(0)
        return self.finish("Evaluating", f"cycle {self.status['cycle']}: trained {name}")

    def evaluated(self, ck: dict[str, Any], doc: dict[str, Any], uri: str) -> Plan:
        name = _meta(ck)["name"]
        gates = [
            GateResult.model_validate({k: g[k] for k in GateResult.model_fields})
            for g in doc.get("gates") or []
        ]
        summary = EvalSummary(
            verdict="Passed" if doc["passed"] else "Failed", report=uri, gates=gates[:64] or None
        )
        message = str(doc.get("message") or summary.verdict)
        if doc.get("gates_source") == "default":  # spec.eval.gates unset
            message += " (default gates)"
        passed = bool(doc["passed"])
        # SandboxUnsafe: the code suites were not scored (a sandbox guarantee is missing)
        failure = str(doc["reason"]) if doc.get("reason") in EVAL_FAILURES else "EvalGatesFailed"
        phase, reason = ("Evaluated", "EvalPassed") if passed else ("Rejected", failure)
        self.patch_summary(
            ck,
            "eval",
            summary,
            phase=phase,
            reason=reason,
            message=message,
            completedAt=None if passed else iso(self.now),
        )
        self.event(reason, f"{name}: {message}", warning=not passed, kind="Checkpoint", name=name)
        if passed:
            self.conditions.set("Progressing", True, reason, f"{name}: {message}; canary next")
            self.out.soon(0)
            return self.finish("Canary", f"cycle {self.status['cycle']}: {name} passed eval")
        self.conditions.set("Progressing", False, reason, f"{name}: {message}")
        serving = _meta(self.serving)["name"]
        text = (
            f"cycle {self.status['cycle']}: {name} rejected by eval ({message}); "
            f"{serving} keeps serving"
        )
        self.event("CycleCompleted", text, warning=True)
        return self.end_cycle(text)

    # --- history -------------------------------------------------------------------------
    def prune_history(self) -> None:
        limit = self.spec.history_limit
        finished = [c for c in self.owned if _phase(c) not in RUNNING]
        if len(self.owned) <= limit:
            return
        protected = {_meta(self.serving)["name"], self.spec.pin, self.old.get("candidate")}
        protected |= {_meta(c)["name"] for c in self.owned if _phase(c) in RUNNING}
        for name in list(protected):
            found = self.checkpoint(name) if name else None
            if found is not None:
                protected.add((found.get("spec") or {}).get("parent"))
        excess = len(self.owned) - limit
        for ck in finished:  # oldest first
            if excess <= 0:
                break
            name = _meta(ck)["name"]
            if name in protected:
                continue
            self.act(Delete(API_VERSION, "Checkpoint", name))
            self.event(
                "CheckpointPruned",
                f"{name} deleted: more than historyLimit={limit} "
                "Checkpoints (its stored files are kept)",
            )
            excess -= 1
        self.owned = [
            c
            for c in self.owned
            if not any(
                isinstance(a, Delete) and a.kind == "Checkpoint" and a.name == _meta(c)["name"]
                for a in self.out.actions
            )
        ]


def plan(observed: Observed, now: datetime) -> Plan:
    """Decide the next actions for one RLCycle and its new status."""
    return _Planner(observed, now).run()


def plan_rejected(observed: Observed, now: datetime, message: str) -> Plan:
    """The status (and Event) for a round whose plan the API server refused as invalid:
    ``InvalidSpec`` with the server's words. The next round plans afresh (and meets the
    same refusal until the spec or the cluster changes)."""
    return _Planner(observed, now).invalid("RejectedByAPIServer", message)
