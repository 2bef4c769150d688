"""``plan(observed, now)``: the RLCycle reconciler's decisions, and the dispatch between them.

A round validates the RLCycle's name and spec and what they name in the cluster
(:mod:`.environment`), prunes the history (:mod:`.history`), then drives the running
cycle, if any: its step Jobs (:mod:`.cycle`) or, after eval passed, its canary
(:mod:`.rollout`); with none running it waits, serves a pin or starts the next cycle
(:mod:`.idle`). Each area is a set of functions of the :class:`~.round.Round`.

Everything is derived from what was observed, nothing from memory: the active cycle is the
owned Checkpoint in a running phase, the serving checkpoint is the one whose URI the target
Deployment serves, attempts are counted from the Jobs that exist.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any

from pydantic import ValidationError

from rtrl.core.api import names
from rtrl.core.api.errors import error_message, format_loc
from rtrl.core.api.reasons import ConditionType, Reason
from rtrl.core.api.rlcycle import RLCycleMeta, RLCyclePhase, RLCycleSpec

from .adapter_routes import retire_stale, stale_candidate
from .capture import keep_capture
from .cycle import cancel, cancel_reason, drive_step
from .environment import check_environment, mark_serving_base
from .gates import unused_approval
from .history import prune_history
from .idle import idle
from .manifests.names import result_uri
from .notify import finish_round
from .observed import Observed
from .reading import CANARY_PHASES
from .reading import active as _active
from .reading import current_step as _current_step
from .reading import fresh as _fresh
from .reading import meta as _meta
from .reading import owned as _owned
from .reading import phase as _phase
from .reading import step_jobs as _step_jobs
from .rollout import drive_canary
from .round import Plan, Round
from .tenancy import policy_problem
from .traffic import deleting, finalize, keep_finalizer


def results_to_read(observed: Observed) -> list[str]:
    """Result documents the next plan needs: the current step's, once its Job succeeded."""
    if deleting(observed.rlcycle):
        return []  # its round gives traffic back, nothing more (traffic.finalize)
    name = _meta(observed.rlcycle).get("name")
    active = _active(_owned(observed, str(name)))
    if active is None:
        return []
    step = _current_step(active)
    if step is None:
        return []
    jobs = [j for j in _step_jobs(observed, active, step) if _fresh(j, active)]
    if jobs and jobs[-1].succeeded:
        return [result_uri(active["spec"]["uri"], step)]
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


# --- the dispatch ---------------------------------------------------------------------


def run(r: Round) -> Plan:
    """The round: an invalid RLCycle stops here; else the history is pruned and the
    running cycle driven (or cancelled by a pin or a rollback before its canary), or,
    with none running, the idle decisions."""
    problem = validate_name(r.name)
    if problem:
        return r.invalid(Reason.NAME_INVALID, problem)
    spec, problem = validate_spec(r.rlc.get("spec"))
    if spec is None:
        return r.invalid(Reason.SPEC_INVALID, problem)
    r.spec = spec
    problem_reason, problem = policy_problem(spec, r.obs.policy, r.obs.secret)
    if problem_reason:
        return r.invalid(problem_reason, problem)
    problem_reason, problem = check_environment(r)
    if problem_reason:
        return r.invalid(problem_reason, problem)
    if r.conditions.previous_status(ConditionType.INVALID_SPEC) == "True":
        r.event(Reason.SPEC_VALID, "the spec is valid again; resuming")
    r.conditions.set(ConditionType.INVALID_SPEC, False, Reason.SPEC_VALID, "")
    mark_serving_base(r)
    if r.conditions.previous_status(ConditionType.INSUFFICIENT_DATA) is None:
        r.conditions.set(
            ConditionType.INSUFFICIENT_DATA, False, Reason.NOT_STAGED, "no cycle staged yet"
        )
    prune_history(r)
    active = _active(r.owned)
    if active is not None and _phase(active) not in CANARY_PHASES:
        why = cancel_reason(r) or stale_candidate(r, active)
        if why:
            cancel(r, active, why)
            active = None
    if active is None:
        retire_stale(r)  # (a running canary of a stale adapter is rolled back instead)
    out = drive(r, active) if active is not None else idle(r)
    keep_capture(r)
    return out


def drive(r: Round, ck: dict[str, Any]) -> Plan:
    """A cycle is running: its status fields, then its current step or its canary."""
    meta = _meta(ck)
    name = meta["name"]
    r.status["candidate"] = name
    started = (meta.get("annotations") or {}).get(names.ANNOTATION_STARTED)
    if started:
        r.status["cycleStartedAt"] = started
    r.schedule_next()
    r.set_ready(_meta(r.serving)["name"])
    r.set_degraded()
    if not meta.get("uid"):
        r.out.soon(1)
        return r.finish(RLCyclePhase.STAGING, f"waiting for {name} to be created")
    if _phase(ck) in CANARY_PHASES:
        return drive_canary(r, ck)
    step = _current_step(ck)
    if step is None:  # every step recorded, yet a running phase: not a status rtrl writes
        return inconsistent(r, ck)
    return drive_step(r, ck, step)


def inconsistent(r: Round, ck: dict[str, Any]) -> Plan:
    """A Checkpoint whose status records every step (eval's verdict too) in a phase that
    says a step still runs: someone else wrote it (rtrl's status writes are conditional on
    the version they were planned for). Which half is true cannot be told from here, so
    nothing is done until a person sets the phase."""
    name = _meta(ck)["name"]
    status = ck.get("status") or {}
    verdict = (status.get("eval") or {}).get("verdict")
    return r.invalid(
        Reason.CHECKPOINT_INCONSISTENT,
        f"Checkpoint {name}: status.phase {_phase(ck)} says a step runs, but its status "
        f"records every step (eval: {verdict}); set status.phase to what is true, e.g. "
        f"kubectl patch checkpoint {name} --subresource=status --type=merge "
        '-p \'{"status":{"phase":"Failed"}}\'',
    )


def plan(observed: Observed, now: datetime) -> Plan:
    """Decide the next actions for one RLCycle and its new status; for one being deleted,
    only what must be given back before it goes (:mod:`.traffic`)."""
    r = Round(observed, now)
    if deleting(r.rlc):
        return finalize(r)
    out = run(r)
    if getattr(r, "spec", None) is not None:
        unused_approval(r)
    keep_finalizer(r)
    return finish_round(r, out)


def plan_rejected(observed: Observed, now: datetime, message: str) -> Plan:
    """The status (and Event) for a round whose plan the API server refused as invalid:
    ``InvalidSpec`` with the server's words. The next round plans afresh (and meets the
    same refusal until the spec or the cluster changes)."""
    r = Round(observed, now)
    return finish_round(r, r.invalid(Reason.REJECTED_BY_API_SERVER, message))
