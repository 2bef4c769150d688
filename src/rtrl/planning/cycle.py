"""A cycle from its start to its end: the Checkpoint ``<rlcycle>-<n>`` is created (parent:
the serving checkpoint), then driven through its step Jobs one after the other, stage ->
train -> eval. A step is done when its Job succeeded *and* its result document is committed
in the store; the summary is then written into the Checkpoint's status, which is how the
next round knows the step is behind it. A failed Job is retried as a new attempt after a
doubling delay; when the attempts are spent the Checkpoint is Failed. Insufficient data
ends the attempt without a Checkpoint: it and its Jobs are deleted, the RLCycle says
``InsufficientData`` and the next schedule tick tries again. A pin or a rollback asked for
before the canary cancels the cycle. (The canary that follows a passed eval is
:mod:`.rollout`'s.)
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

from rtrl.core.api import names
from rtrl.core.api.checkpoint import CheckpointPhase, EvalSummary, Verdict
from rtrl.core.api.common import parse_duration
from rtrl.core.api.names import API_VERSION, STEP_PHASE
from rtrl.core.api.reasons import ConditionType, Reason
from rtrl.core.api.rlcycle import NotificationEvent, RLCyclePhase
from rtrl.core.results import EvalFailure, EvalResult, GatesSource, StageResult, TrainResult

from .actions import Create, Delete
from .manifests.jobs import (
    checkpoint_manifest,
    config_map_manifest,
    job_manifest,
    service_manifest,
    step_args,
)
from .manifests.names import config_map_name, result_uri, service_name
from .observed import JobState
from .progress import record_progress
from .reading import STEP_FAILED, STEP_RUNNING, data_watermark
from .reading import fresh as _fresh
from .reading import meta as _meta
from .reading import phase as _phase
from .reading import step_jobs as _step_jobs
from .round import Plan, Round
from .schedule import next_run
from .stage_result import data_summary
from .tenancy import job_service_account
from .timeutil import iso

MAX_BACKOFF = 3600.0


def cancel_reason(r: Round) -> str:
    """A pin or a rollback asked for while a cycle is still before its canary: serving
    must change now, not after hours of training, so the cycle is cancelled. (A running
    canary is rolled back by the rollout instead.)"""
    if r.spec.pin:
        return f"cancelled: spec.pin is set to {r.spec.pin}"
    token = r.pending_annotation(names.ANNOTATION_ROLLBACK, "lastRollback")
    return f"cancelled by {names.ANNOTATION_ROLLBACK}={token}" if token else ""


def cancel(r: Round, ck: dict[str, Any], why: str) -> None:
    """Stop the cycle's running Jobs and mark its Checkpoint Failed (reason Cancelled)."""
    name = _meta(ck)["name"]
    for job in r.obs.jobs:
        if job.checkpoint == name and not job.finished and not job.deleting:
            r.act(Delete("batch/v1", "Job", job.name))
    token = None if r.spec.pin else r.pending_annotation(names.ANNOTATION_ROLLBACK, "lastRollback")
    if token is not None:  # this write carries the rollback out (its token is taken)
        r.carry(ck, names.ANNOTATION_ROLLBACK, token)
    r.patch_checkpoint(
        ck,
        phase=CheckpointPhase.FAILED,
        reason=Reason.CANCELLED,
        message=why,
        completedAt=iso(r.now),
    )
    r.event(Reason.CYCLE_CANCELLED, f"{name}: {why}", warning=True)
    r.owned = [c for c in r.owned if _meta(c)["name"] != name]


def start(r: Round, trigger: str | None) -> Plan:
    """Create the next cycle's Checkpoint; its Jobs follow once it has a uid."""
    cycle = r.status["cycle"] + 1
    parent = _meta(r.serving)["name"]
    since = data_watermark(r.serving, r.name)
    base = _meta(r.base)["name"] if r.spec.adapter is not None else None
    manifest = checkpoint_manifest(
        r.rlc, r.spec, cycle=cycle, parent=parent, now=r.now, trigger=trigger, since=since,
        base=base,
    )  # fmt: skip
    name = manifest["metadata"]["name"]
    r.act(Create(manifest))
    why = f"triggered by {names.ANNOTATION_TRIGGER}={trigger}" if trigger else "scheduled"
    r.event(
        Reason.CYCLE_STARTED,
        f"cycle {cycle} ({why}): training {name} from {parent}",
        notify=(NotificationEvent.CYCLE_STARTED,),
    )
    r.status.update(
        cycle=cycle,
        candidate=name,
        cycleStartedAt=iso(r.now),
        lastTrigger=trigger if trigger is not None else r.status.get("lastTrigger"),
    )
    due = next_run(r.spec.schedule, r.now, r.now)
    r.status["nextRun"] = iso(due) if due else None
    r.conditions.set(
        ConditionType.PROGRESSING, True, Reason.CYCLE_STARTED, f"cycle {cycle} started"
    )
    r.set_ready(parent)
    r.set_degraded()
    r.out.soon(0)  # the Checkpoint's uid is needed for its children
    return r.finish(RLCyclePhase.STAGING, f"cycle {cycle}: creating {name}")


def drive_step(r: Round, ck: dict[str, Any], step: str) -> Plan:
    """One step of the running cycle: its Job created, awaited, retried or judged."""
    name = _meta(ck)["name"]
    phase = CheckpointPhase(STEP_PHASE[step])
    jobs = _step_jobs(r.obs, ck, step)
    for stale in [j for j in jobs if not _fresh(j, ck)]:
        r.act(Delete("batch/v1", "Job", stale.name))
    jobs = [j for j in jobs if _fresh(j, ck)]
    ck_status = dict(ck.get("status") or {})
    if _phase(ck) != phase:
        started = ck_status.get("startedAt") or r.status.get("cycleStartedAt")
        r.patch_checkpoint(
            ck,
            phase=phase,
            reason=STEP_RUNNING[step],
            message=f"{step} step running",
            startedAt=started,
        )
    r.conditions.set(ConditionType.PROGRESSING, True, STEP_RUNNING[step], f"{name}: {step}")
    if not jobs:
        create_step(r, ck, step, 0)
        return r.finish(RLCyclePhase(phase), f"cycle {r.status['cycle']}: {step} of {name}")
    job = jobs[-1]
    if not job.finished:
        progress = record_progress(r, ck, step)
        detail = f": {progress}" if progress else ""
        return r.finish(
            RLCyclePhase(phase), f"cycle {r.status['cycle']}: {step} of {name} ({job.name}){detail}"
        )
    if job.succeeded:
        return step_succeeded(r, ck, step, job)
    return step_failed(r, ck, step, job)


def create_step(
    r: Round, ck: dict[str, Any], step: str, attempt: int, args: list[str] | None = None
) -> None:
    """Create attempt ``attempt`` of a step's Job (and the cycle's ConfigMap, and for
    training its Service, when missing); ``args`` default to the step's own. The canary's
    analysis Jobs are created here too, with their arguments."""
    name = _meta(ck)["name"]
    if config_map_name(name) not in r.obs.config_maps:
        text = json.dumps(r.rlc.get("spec") or {}, indent=2, sort_keys=True) + "\n"
        r.act(Create(config_map_manifest(r.rlc, ck, text)))
    if step == "train" and service_name(name) not in r.obs.services:
        r.act(Create(service_manifest(r.rlc, ck)))
    if args is None:
        args = step_args(
            step,
            r.spec,
            ck,
            r.serving_of(ck),
            previous=(r.serving_of(ck).get("spec") or {}).get("parent"),
            excluded=r.rolled_back(),
        )
    account = job_service_account(r.spec, r.obs.policy)
    job = job_manifest(
        r.rlc, r.spec, ck, step=step, attempt=attempt, args=args, service_account=account
    )
    r.act(Create(job))
    again = f" (attempt {attempt + 1} of {r.spec.jobs.backoff_limit + 1})" if attempt else ""
    r.event(
        Reason.of(step if step in STEP_PHASE else "analysis", "Started"),
        f"{job['metadata']['name']}{again}",
        kind="Checkpoint",
        name=name,
    )


def step_failed(r: Round, ck: dict[str, Any], step: str, job: JobState) -> Plan:
    """A step's Job failed: a new attempt after the doubling delay, or the cycle fails."""
    name = _meta(ck)["name"]
    limit = r.spec.jobs.backoff_limit
    why = job.message or job.reason or "failed"
    if job.attempt < limit:
        delay = min(MAX_BACKOFF, parse_duration(r.spec.jobs.backoff) * 2**job.attempt)
        retry_at = (job.finished_at or r.now) + timedelta(seconds=delay)
        if retry_at > r.now:
            r.out.soon((retry_at - r.now).total_seconds())
            return r.finish(
                RLCyclePhase(STEP_PHASE[step]),
                f"cycle {r.status['cycle']}: {job.name} failed ({why}); retrying at "
                f"{iso(retry_at)}",
            )
        r.event(
            Reason.of(step, "Retrying"),
            f"{job.name} failed: {why}",
            warning=True,
            kind="Checkpoint",
            name=name,
        )
        create_step(r, ck, step, job.attempt + 1)
        return r.finish(
            RLCyclePhase(STEP_PHASE[step]), f"cycle {r.status['cycle']}: retrying {step}"
        )
    message = f"{step} failed after {job.attempt + 1} attempt(s): {job.name}: {why}"
    return fail(r, ck, STEP_FAILED[step], message)


def fail(r: Round, ck: dict[str, Any], reason: str, message: str) -> Plan:
    name = _meta(ck)["name"]
    r.patch_checkpoint(
        ck, phase=CheckpointPhase.FAILED, reason=reason, message=message, completedAt=iso(r.now)
    )
    r.event(reason, message, warning=True, kind="Checkpoint", name=name)
    r.event(
        Reason.CYCLE_FAILED,
        f"{name}: {message}; the serving model is unchanged",
        warning=True,
        notify=(NotificationEvent.CYCLE_FAILED,),
    )
    r.conditions.set(ConditionType.DEGRADED, True, Reason.CYCLE_FAILED, f"{name}: {message}")
    r.conditions.set(ConditionType.PROGRESSING, False, Reason.CYCLE_FAILED, message)
    return end_cycle(r, f"cycle {r.status['cycle']} failed: {message}")


def end_cycle(r: Round, message: str) -> Plan:
    """The round's end once a cycle is over (failed, rejected, promoted, rolled back): the
    phase says what the RLCycle does until the next one is due."""
    due = r.schedule_next()
    if due is not None:
        r.out.soon((due - r.now).total_seconds())
    phase = (
        RLCyclePhase.SUSPENDED
        if r.spec.suspend
        else (RLCyclePhase.PINNED if r.spec.pin else RLCyclePhase.IDLE)
    )
    if r.spec.pin:  # phase and condition agree: the pin is why nothing progresses now
        r.conditions.set(ConditionType.PROGRESSING, False, Reason.PINNED, f"pinned to {r.spec.pin}")
    return r.finish(phase, message)


def step_succeeded(r: Round, ck: dict[str, Any], step: str, job: JobState) -> Plan:
    """A step's Job succeeded: its committed result document says what it did."""
    uri = result_uri(ck["spec"]["uri"], step)
    doc = r.obs.results.get(uri)
    if isinstance(doc, str):  # the store could not be read: look again soon
        r.out.soon(10)
        return r.finish(RLCyclePhase(STEP_PHASE[step]), f"cannot read {uri}: {doc}")
    if doc is None:
        return fail(
            r,
            ck,
            Reason.RESULT_MISSING,
            f"{job.name} succeeded but {uri} holds no committed result",
        )
    try:  # through the step's contract: a ResultError names the field and the problem
        if step == "stage":
            return staged(r, ck, StageResult.read(doc), uri)
        if step == "train":
            return trained(r, ck, TrainResult.read(doc), uri)
        return evaluated(r, ck, EvalResult.read(doc), uri)
    except (KeyError, TypeError, ValueError) as exc:
        return fail(r, ck, Reason.RESULT_INVALID, f"{uri} is not a valid {step} result: {exc}")


def staged(r: Round, ck: dict[str, Any], doc: StageResult, uri: str) -> Plan:
    name = _meta(ck)["name"]
    if not doc.sufficient:
        message = doc.message or "not enough matured interactions"
        r.conditions.set(ConditionType.INSUFFICIENT_DATA, True, Reason.INSUFFICIENT_DATA, message)
        r.conditions.set(ConditionType.PROGRESSING, False, Reason.INSUFFICIENT_DATA, message)
        r.event(Reason.INSUFFICIENT_DATA, f"{name}: {message}; retrying at the next tick")
        r.status["candidate"] = None
        # Crash-safe order: the verdict recorded, then the Checkpoint deleted, then its
        # children (owned by it: garbage collection takes them anyway). Deleting the Jobs
        # first let an operator killed in between find the Checkpoint staging without a
        # Job, and run stage again (tests/e2e/test_crash_lifecycle.py).
        # (with the trigger that started the cycle and its number: the Checkpoint that
        # records them goes, and a status write of the round that created it may have been
        # lost, so a restarted operator would count this cycle again)
        verdict = {
            "cycle": r.status["cycle"],
            "candidate": None,
            "conditions": r.conditions.to_list(),
            "lastTrigger": r.status.get("lastTrigger"),
        }
        r.patch_rlcycle(verdict)
        r.act(Delete(API_VERSION, "Checkpoint", name))
        for job in r.obs.jobs:
            if job.checkpoint == name:
                r.act(Delete("batch/v1", "Job", job.name))
        if config_map_name(name) in r.obs.config_maps:
            r.act(Delete("v1", "ConfigMap", config_map_name(name)))
        return end_cycle(r, f"cycle {r.status['cycle']}: insufficient data: {message}")
    summary = data_summary(doc, uri)
    r.conditions.set(ConditionType.INSUFFICIENT_DATA, False, Reason.DATA_SUFFICIENT, doc.message)
    r.patch_summary(
        ck,
        "data",
        summary,
        phase=CheckpointPhase.TRAINING,
        reason=Reason.STAGED,
        message=doc.message,
    )
    r.event(Reason.STAGED, f"{name}: {doc.message}", kind="Checkpoint", name=name)
    r.out.soon(0)
    return r.finish(
        RLCyclePhase.TRAINING,
        f"cycle {r.status['cycle']}: staged {summary.interactions} interactions",
    )


def trained(r: Round, ck: dict[str, Any], doc: TrainResult, uri: str) -> Plan:
    name = _meta(ck)["name"]
    summary = doc.summary
    text = f"{summary.steps} steps on {summary.tokens} tokens" + (
        f", loss {summary.loss:.4g}, kl {summary.kl:.3g}"
        if summary.loss is not None and summary.kl is not None
        else ""
    )
    r.patch_summary(
        ck,
        "training",
        summary,
        phase=CheckpointPhase.EVALUATING,
        reason=Reason.TRAINED,
        message=text,
    )
    r.event(Reason.TRAINED, f"{name}: {text}", kind="Checkpoint", name=name)
    r.out.soon(0)
    return r.finish(RLCyclePhase.EVALUATING, f"cycle {r.status['cycle']}: trained {name}")


def eval_summary(doc: EvalResult, uri: str) -> tuple[EvalSummary, str, str]:
    """The Checkpoint's ``status.eval`` from the eval.json at ``uri``, its message and its
    reason (SandboxUnsafe: the code suites were not scored, a sandbox guarantee missing)."""
    gates = [g.to_status() for g in doc.gates]
    verdict = Verdict.PASSED if doc.passed else Verdict.FAILED
    summary = EvalSummary(verdict=verdict, report=uri, gates=gates[:64] or None)
    message = doc.message or str(verdict)
    if doc.gates_source == GatesSource.DEFAULT:  # spec.eval.gates unset
        message += " (default gates)"
    reason = Reason.EVAL_PASSED if doc.passed else str(doc.reason or EvalFailure.GATES_FAILED)
    return summary, message, reason


def evaluated(r: Round, ck: dict[str, Any], doc: EvalResult, uri: str) -> Plan:
    name = _meta(ck)["name"]
    summary, message, reason = eval_summary(doc, uri)
    passed = doc.passed
    phase = CheckpointPhase.EVALUATED if passed else CheckpointPhase.REJECTED
    r.patch_summary(
        ck,
        "eval",
        summary,
        phase=phase,
        reason=reason,
        message=message,
        completedAt=None if passed else iso(r.now),
    )
    r.event(
        reason,
        f"{name}: {message}",
        warning=not passed,
        kind="Checkpoint",
        name=name,
        notify=() if passed else (NotificationEvent.EVAL_REJECTED,),
    )
    if passed:
        r.conditions.set(ConditionType.PROGRESSING, True, reason, f"{name}: {message}; canary next")
        r.out.soon(0)
        return r.finish(RLCyclePhase.CANARY, f"cycle {r.status['cycle']}: {name} passed eval")
    r.conditions.set(ConditionType.PROGRESSING, False, reason, f"{name}: {message}")
    serving = _meta(r.serving)["name"]
    text = (
        f"cycle {r.status['cycle']}: {name} rejected by eval ({message}); {serving} keeps serving"
    )
    r.event(Reason.CYCLE_COMPLETED, text, warning=True, notify=(NotificationEvent.CYCLE_COMPLETED,))
    return end_cycle(r, text)
