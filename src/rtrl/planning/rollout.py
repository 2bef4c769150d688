"""Decisions of the canary rollout of a Checkpoint that passed eval.

After eval passes, the Checkpoint goes ``Evaluated`` -> ``Canary``: the canary workload is
created at the first step's weight and, once ready and after the step's ``minDuration``,
an analysis Job (``rtrl-job analyze``) judges the arms every ``analysis.interval``. Its
decision is recorded in the step's entry of ``status.rollout``:

- ``continue``: stay, or move to the next step once both arms have ``minSamples``;
- ``promote``: patch the target Deployment's checkpoint env (JSON patch on that field only,
  field manager ``rtrl``), wait for its rollout, remove the canary, Checkpoint ``Promoted``,
  the previous serving one ``Superseded``;
- ``rollback``: traffic back to stable, the canary removed, Checkpoint ``RolledBack`` with
  the A/B numbers and the reason. Also on a canary not ready in time, a failed analysis,
  ``spec.pin``, the annotation ``rtrl.io/rollback``, or a record of ``status.rollout`` this
  rtrl cannot read (:mod:`.records`); ``rtrl.io/promote`` promotes by hand.

An adapter RLCycle's canary workload, promotion and rollback are its organisation's route
(:mod:`.adapter_routes`). A decision is written into the Checkpoint's status before it is
carried out, so a restarted operator finishes what was decided instead of deciding again."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from rtrl.core.api.checkpoint import CheckpointPhase
from rtrl.core.api.common import parse_duration
from rtrl.core.api.names import ANNOTATION_PROMOTE, ANNOTATION_ROLLBACK
from rtrl.core.api.reasons import ConditionType, Reason
from rtrl.core.api.rlcycle import NotificationEvent, RLCyclePhase
from rtrl.core.results import AnalysisResult, Decision

from . import gates
from .adapter_routes import is_adapter, stale_candidate
from .analysis import (
    analysis_due,
    analyze_args,
    forget_analyses,
    hours_to_decide,
    read_verdict,
    record_verdict,
)
from .cycle import create_step, end_cycle
from .manifests import canary as cn
from .manifests.names import result_uri
from .reading import fresh, meta, step_jobs
from .records import Record, RecordError, read_records, step_index, written
from .round import READY_POLL_SECONDS, Plan, Round
from .steps import keep_share, new_record, restart_steps, steps_changed, steps_hash
from .timeutil import iso, whole
from .workload import (
    StableServiceMissingError,
    canary_at_weight,
    canary_ready,
    ensure_canary,
    remove_canary,
    serve,
    serves,
)

PROMOTE, ROLLBACK = Decision.PROMOTE, Decision.ROLLBACK


def drive_canary(r: Round, ck: dict[str, Any]) -> Plan:
    """The canary of a Checkpoint that passed eval: a decision already recorded is carried
    out; else a manual one (pin, annotations) is recorded; else the current step runs."""
    name = meta(ck)["name"]
    gates.clear(r)
    try:
        records = read_records(ck)
    except RecordError as exc:  # a record this rtrl cannot read: no step can be judged
        return roll_back(r, ck, f"{exc}: this rtrl cannot read the canary's record")
    decided = records[-1].decision if records else None
    if decided not in (PROMOTE, ROLLBACK):
        reason, decision = manual_decision(r, ck)
        if decision is not None:
            return decide(r, ck, records, decision, reason)
    if records and decided == PROMOTE:
        return promote(r, ck, records)
    if records and decided == ROLLBACK:
        return roll_back(r, ck, str(records[-1].reason or ROLLBACK))
    if not records:
        first = r.spec.rollout.steps[0]
        records = [new_record(r, 0)]
        r.patch_checkpoint(
            ck,
            phase=CheckpointPhase.CANARY,
            reason=Reason.CANARY_STARTED,
            message=f"canary at {first.weight}%",
            rollout=written(records),
        )
        r.event(
            Reason.CANARY_STARTED,
            f"{name}: canary at {first.weight}%",
            kind="Checkpoint",
            name=name,
            notify=(NotificationEvent.CANARY_STARTED,),
        )
        warn_too_little_traffic(r, ck)
    elif steps_changed(r, records):
        full = restart_steps(r, ck, records)  # or why it cannot: the records are full
        if full:
            return decide(r, ck, records, ROLLBACK, full)
    return run_step(r, ck, records)


def manual_decision(r: Round, ck: dict[str, Any]) -> tuple[str, Decision | None]:
    """``(reason, decision)`` asked for by hand or by ``spec.pin``; ``("", None)`` if none."""
    if r.spec.pin:
        return f"spec.pin is set to {r.spec.pin}", ROLLBACK
    stale = stale_candidate(r, ck)
    if stale:
        return stale, ROLLBACK
    # The decision's write on the Checkpoint carries the request (status.requests): that
    # write is what takes the token, so an operator killed before the RLCycle's status says
    # so does not take it again (Round.pending_annotation reads them).
    for key, status_key, decision, words in (
        (ANNOTATION_ROLLBACK, "lastRollback", ROLLBACK, "manual rollback"),
        (ANNOTATION_PROMOTE, "lastPromote", PROMOTE, "manual promotion"),
    ):
        token = r.pending_annotation(key, status_key)
        if token is not None:
            r.status[status_key] = token
            r.carry(ck, key, token)
            return f"{words} ({key}={token})", decision
    return "", None


def decide(
    r: Round, ck: dict[str, Any], records: list[Record], decision: Decision, reason: str
) -> Plan:
    """Record ``decision`` in the current step's entry, then carry it out next round."""
    if not records:
        records = [Record(weight=0, started_at=whole(r.now), analyses=0)]
    record = records[-1]
    record.decision, record.reason, record.ended_at = decision, reason[:32768], whole(r.now)
    r.patch_checkpoint(ck, phase=CheckpointPhase.CANARY, rollout=written(records))
    r.out.soon(0)
    phase = RLCyclePhase.PROMOTING if decision == PROMOTE else RLCyclePhase.ROLLING_BACK
    return r.finish(phase, f"{meta(ck)['name']}: {decision}: {reason}")


def warn_too_little_traffic(r: Round, ck: dict[str, Any]) -> None:
    """Say so, as the canary starts, when the traffic its stage found cannot bring the
    canary through its steps within ``analysis.maxDuration`` (an organisation too small
    for its adapter's canary): it will end on the inconclusive policy instead."""
    expected = hours_to_decide(r, ck)
    limit = parse_duration(r.spec.rollout.analysis.max_duration) / 3600
    if expected is None or expected[1] <= limit:
        return
    rate, hours = expected
    who = f"organisation {r.spec.adapter_org()}" if r.spec.adapter else "the target"
    name = meta(ck)["name"]
    r.event(
        Reason.TRAFFIC_TOO_LOW,
        f"{name}: {who} served {rate:.0f} interactions/h in the span {name} staged; its "
        f"canary needs at least {hours:.1f}h to pass its steps' minDuration and minSamples, "
        f"more than rollout.analysis.maxDuration {r.spec.rollout.analysis.max_duration}: "
        f"it will end on the inconclusive policy ({r.spec.rollout.analysis.inconclusive}); "
        "raise the steps' weights, lower their minSamples or lengthen maxDuration",
        warning=True,
        kind="Checkpoint",
        name=name,
    )


# --- one step ----------------------------------------------------------------------
def run_step(r: Round, ck: dict[str, Any], records: list[Record]) -> Plan:
    """The current step: the canary at its weight and ready, then its analyses in turn."""
    name = meta(ck)["name"]
    index = step_index(records)
    steps = r.spec.rollout.steps
    step = steps[min(index, len(steps) - 1)]
    record = records[-1]
    record.steps_hash = record.steps_hash or steps_hash(r)  # an older rtrl's record adopts them
    try:
        share = ensure_canary(r, ck, step.weight)
    except StableServiceMissingError as missing:
        namespace = r.meta.get("namespace")
        reason = f"spec.rollout.service: Service {missing} not found in namespace {namespace}"
        return decide(r, ck, records, ROLLBACK, reason)
    r.status["canaryWeight"] = round(share)
    keep_share(r, ck, records, share)
    if record.restarted:
        text = f"{name} at {share:.0f}%: restarted at step 1: {record.restarted}"
        r.conditions.set(ConditionType.PROGRESSING, True, Reason.ROLLOUT_RESTARTED, text)
    else:
        r.conditions.set(ConditionType.PROGRESSING, True, Reason.CANARY, f"{name} at {share:.0f}%")
    canary_start = records[0].started_at
    counted_from = records[0].ready_at or canary_start
    if not canary_ready(r, ck, step.weight):
        timeout = parse_duration(r.spec.rollout.ready_timeout)
        if r.now - canary_start > timedelta(seconds=timeout) and index == 0:
            return decide(
                r,
                ck,
                records,
                ROLLBACK,
                f"canary not ready within {r.spec.rollout.ready_timeout}",
            )
        r.out.soon(READY_POLL_SECONDS)
        return r.finish(RLCyclePhase.CANARY, f"{name}: waiting for the canary to be ready")
    if not record.ready_at and canary_at_weight(r, ck, step.weight):
        # Until now the canary served nothing (or less than its weight): the analysis, and
        # its sample-ratio test, count this step from here.
        record.ready_at = whole(r.now)
        r.patch_checkpoint(ck, phase=CheckpointPhase.CANARY, rollout=written(records))
        r.out.soon(0)
        return r.finish(RLCyclePhase.CANARY, f"{name} at {share:.0f}%: ready")
    if record.awaiting_approval and not record.approved:
        gate = gates.passed(r, ck, records)  # None: still held, the analyses go on
        if gate == "promotion":
            return decide(r, ck, records, PROMOTE, gates.promotion_reason(record))
        if gate == "step":
            next_step(r, ck, records)
            r.patch_checkpoint(ck, phase=CheckpointPhase.CANARY, rollout=written(records))
            r.out.soon(0)
            return r.finish(RLCyclePhase.CANARY, f"{name}: approved ({record.approved})")
    judged = sum(e.analyses for e in records)
    forget_analyses(r, ck, judged)
    analysis = f"analyze-{judged}"
    jobs = [j for j in step_jobs(r.obs, ck, analysis) if fresh(j, ck)]
    if not jobs:
        due = analysis_due(r, ck, record, step.min_duration, judged)
        if due > r.now:
            r.out.soon((due - r.now).total_seconds())
            return r.finish(
                RLCyclePhase.CANARY, f"{name} at {share:.0f}%: next analysis {iso(due)}"
            )
        max_reached = r.now - canary_start >= timedelta(
            seconds=parse_duration(r.spec.rollout.analysis.max_duration)
        )
        create_step(
            r,
            ck,
            analysis,
            0,
            analyze_args(
                r, ck, records, analysis, share=share, since=counted_from, max_reached=max_reached
            ),
        )
        return r.finish(RLCyclePhase.CANARY, f"{name} at {share:.0f}%: analysing")
    job = jobs[-1]
    if not job.finished:
        return r.finish(RLCyclePhase.CANARY, f"{name} at {share:.0f}%: analysing ({job.name})")
    if job.failed:
        if job.attempt < r.spec.jobs.backoff_limit:
            args = analyze_args(
                r, ck, records, analysis, share=share, since=counted_from, max_reached=False
            )
            create_step(r, ck, analysis, job.attempt + 1, args)
            return r.finish(RLCyclePhase.CANARY, f"{name}: retrying the analysis")
        return decide(
            r, ck, records, ROLLBACK, f"analysis failed: {job.name}: {job.message or job.reason}"
        )
    doc = r.obs.results.get(result_uri(ck["spec"]["uri"], analysis))
    if isinstance(doc, str) or doc is None:
        if doc is None:
            return decide(
                r, ck, records, ROLLBACK, f"analysis {job.name} committed no analysis.json"
            )
        r.out.soon(10)
        return r.finish(RLCyclePhase.CANARY, f"cannot read the analysis: {doc}")
    try:
        verdict = read_verdict(dict(doc))
    except (KeyError, TypeError, ValueError) as exc:
        # The canary cannot be judged: as when the analysis fails, it is rolled back (once;
        # a result that raised in every round would stop the RLCycle instead).
        why = " ".join(str(exc).split())[:500]
        uri = result_uri(ck["spec"]["uri"], analysis)
        return decide(r, ck, records, ROLLBACK, f"{uri} is not a valid analysis result: {why}")
    return judge(r, ck, records, verdict)


def judge(r: Round, ck: dict[str, Any], records: list[Record], result: AnalysisResult) -> Plan:
    """An analysis's verdict (:func:`read_verdict`) into the step's record: promote, roll
    back, the next step (once both arms have ``minSamples``), or stay."""
    name, record, decision = meta(ck)["name"], records[-1], result.decision
    record_verdict(record, result)
    held = gates.as_recorded(r, record)
    record.analyses += 1
    r.event(
        Reason.of("analysis", decision.title()),
        f"{name}: {gates.reason_text(record)}",
        warning=decision == ROLLBACK,
        kind="Checkpoint",
        name=name,
        notify=(NotificationEvent.GUARDRAIL_TRIPPED,) if result.guardrail_tripped else (),
    )
    if record.decision in (PROMOTE, ROLLBACK):
        record.ended_at = whole(r.now)
        r.patch_checkpoint(ck, phase=CheckpointPhase.CANARY, rollout=written(records))
        r.out.soon(0)
        return r.finish(
            RLCyclePhase.PROMOTING if decision == PROMOTE else RLCyclePhase.ROLLING_BACK,
            f"{name}: {decision}: {gates.reason_text(record)}",
        )
    steps = r.spec.rollout.steps
    index = step_index(records)
    step = steps[min(index, len(steps) - 1)]
    samples = min(record.baseline_samples or 0, record.canary_samples or 0)
    enough = samples >= step.min_samples
    if held:
        gates.wait(r, ck, records, "promotion")
    elif index + 1 < len(steps) and enough:
        if gates.step_gate(r, index + 1):
            gates.wait(r, ck, records, "step")
        else:
            next_step(r, ck, records)
    r.patch_checkpoint(ck, phase=CheckpointPhase.CANARY, rollout=written(records))
    r.out.soon(0)
    return r.finish(RLCyclePhase.CANARY, f"{name}: {gates.reason_text(record)}")


def next_step(r: Round, ck: dict[str, Any], records: list[Record]) -> None:
    """The current step ends; the next one starts (its record appended)."""
    name = meta(ck)["name"]
    records[-1].ended_at = whole(r.now)
    index = step_index(records) + 1
    following = r.spec.rollout.steps[index]
    records.append(new_record(r, index))
    r.event(
        Reason.CANARY_STEP,
        f"{name}: canary to {following.weight}%",
        kind="Checkpoint",
        name=name,
        notify=(NotificationEvent.CANARY_STEP,),
    )


# --- outcomes ------------------------------------------------------------------------
def promote(r: Round, ck: dict[str, Any], records: list[Record]) -> Plan:
    """Serve the candidate, wait for the target's rollout, then remove the canary."""
    name = meta(ck)["name"]
    rolled = r.spec.adapter is not None or cn.deployment_ready(dict(r.obs.target or {}))
    if not serve(r, ck["spec"]["uri"], name) or not rolled:  # (a route: nothing rolls)
        r.status["canaryWeight"] = r.status.get("canaryWeight") or 0
        r.out.soon(READY_POLL_SECONDS)
        return r.finish(RLCyclePhase.PROMOTING, f"{name}: rolling out to {serves(r)}")
    remove_canary(r, ck)
    # The parent Superseded before the candidate Promoted: once the candidate is Promoted no
    # cycle runs, so an operator killed between the two writes would never supersede the
    # parent (tests/e2e/test_crash_paths.py).
    parent = (ck.get("spec") or {}).get("parent")
    previous = r.checkpoint(parent) if parent else None
    # an adapter's parent that is the base goes on serving every other organisation
    base_serves_on = r.spec.adapter is not None and not is_adapter(previous)
    if (
        previous is not None
        and not base_serves_on
        and (previous.get("status") or {}).get("phase") != CheckpointPhase.SUPERSEDED
    ):
        r.patch_checkpoint(
            previous,
            phase=CheckpointPhase.SUPERSEDED,
            reason=Reason.SUPERSEDED,
            message=f"superseded by {name}",
        )
    r.patch_checkpoint(
        ck,
        phase=CheckpointPhase.PROMOTED,
        reason=Reason.PROMOTED,
        completedAt=iso(r.now),
        message=str(records[-1].reason or "promoted"),
    )
    r.status.update(lastPromoted=name, serving=name, canaryWeight=0)
    r.event(
        Reason.PROMOTED,
        f"{name} now serves {serves(r)}",
        notify=(NotificationEvent.PROMOTED, NotificationEvent.CYCLE_COMPLETED),
    )
    r.conditions.set(ConditionType.PROGRESSING, False, Reason.PROMOTED, f"{name} promoted")
    return end_cycle(r, f"cycle {r.status['cycle']}: {name} promoted")


def roll_back(r: Round, ck: dict[str, Any], reason: str) -> Plan:
    """Traffic back to the parent (undoing a half-done promotion), the canary removed."""
    name = meta(ck)["name"]
    parent = (ck.get("spec") or {}).get("parent")
    previous = r.checkpoint(parent) if parent else None
    if previous is not None:
        serve(r, previous["spec"]["uri"], parent or "")  # undo a half-done promotion
    remove_canary(r, ck)
    r.patch_checkpoint(
        ck,
        phase=CheckpointPhase.ROLLED_BACK,
        reason=Reason.ROLLED_BACK,
        message=reason,
        completedAt=iso(r.now),
    )
    r.status["canaryWeight"] = 0
    r.event(
        Reason.ROLLED_BACK,
        f"{name}: {reason}",
        warning=True,
        notify=(NotificationEvent.ROLLED_BACK, NotificationEvent.CYCLE_COMPLETED),
    )
    r.conditions.set(ConditionType.PROGRESSING, False, Reason.ROLLED_BACK, f"{name}: {reason}")
    return end_cycle(r, f"cycle {r.status['cycle']}: {name} rolled back: {reason}")
