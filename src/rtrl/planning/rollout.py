"""Decisions of the canary rollout, as a part of the RLCycle planner.

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
  ``spec.pin``, or the annotation ``rtrl.io/rollback``; ``rtrl.io/promote`` promotes by hand.

A decision is written into the Checkpoint's status before it is carried out, so a restarted
operator finishes what was decided instead of deciding again.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from rtrl.core.api.checkpoint import MetricComparison
from rtrl.core.api.common import parse_duration
from rtrl.core.api.names import ANNOTATION_PROMOTE, ANNOTATION_ROLLBACK, API_VERSION
from rtrl.core.api.rlcycle import Router

from . import canary as cn
from . import children as ch
from .actions import Create, Delete, Patch, PatchStatus
from .reading import fresh, meta, step_jobs
from .timeutil import iso, parse_time

if TYPE_CHECKING:
    from .plan import Plan, _Planner  # the planner drives the rollout through these

READY_POLL_SECONDS = 5.0


def pending_annotation(p: _Planner, key: str, status_key: str) -> str | None:
    value = (p.meta.get("annotations") or {}).get(key)
    return str(value) if value and value != p.status.get(status_key) else None


def drive_canary(p: _Planner, ck: dict[str, Any]) -> Plan:
    name = meta(ck)["name"]
    records = [dict(r) for r in (ck.get("status") or {}).get("rollout") or []]
    decided = records[-1].get("decision") if records else None
    if decided not in ("promote", "rollback"):
        reason, decision = manual_decision(p)
        if decision is not None:
            return decide(p, ck, records, decision, reason)
    if records and decided == "promote":
        return promote(p, ck, records)
    if records and decided == "rollback":
        return roll_back(p, ck, records, str(records[-1].get("reason") or "rollback"))
    if not records:
        first = p.spec.rollout.steps[0]
        records = [{"weight": first.weight, "startedAt": iso(p.now), "analyses": 0}]
        p.patch_checkpoint(
            ck,
            phase="Canary",
            reason="CanaryStarted",
            message=f"canary at {first.weight}%",
            rollout=records,
        )
        p.event("CanaryStarted", f"{name}: canary at {first.weight}%", kind="Checkpoint", name=name)
    return run_step(p, ck, records)


def manual_decision(p: _Planner) -> tuple[str, str | None]:
    if p.spec.pin:
        return f"spec.pin is set to {p.spec.pin}", "rollback"
    token = pending_annotation(p, ANNOTATION_ROLLBACK, "lastRollback")
    if token is not None:
        p.status["lastRollback"] = token
        return f"manual rollback ({ANNOTATION_ROLLBACK}={token})", "rollback"
    token = pending_annotation(p, ANNOTATION_PROMOTE, "lastPromote")
    if token is not None:
        p.status["lastPromote"] = token
        return f"manual promotion ({ANNOTATION_PROMOTE}={token})", "promote"
    return "", None


def decide(
    p: _Planner, ck: dict[str, Any], records: list[dict[str, Any]], decision: str, reason: str
) -> Plan:
    """Record ``decision`` in the current step's entry, then carry it out next round."""
    if not records:
        records = [{"weight": 0, "startedAt": iso(p.now), "analyses": 0}]
    records[-1].update(decision=decision, reason=reason[:32768], endedAt=iso(p.now))
    p.patch_checkpoint(ck, phase="Canary", rollout=records)
    p.out.soon(0)
    phase = "Promoting" if decision == "promote" else "RollingBack"
    return p.finish(phase, f"{meta(ck)['name']}: {decision}: {reason}")


# --- one step ----------------------------------------------------------------------
def canary_weight(p: _Planner, weight: int) -> tuple[int, float]:
    stable = int(((p.obs.target or {}).get("spec") or {}).get("replicas", 1))
    replicas, share = cn.canary_split(stable, weight)
    if p.spec.rollout.router == Router.GATEWAY_API:
        share = float(weight)
    return replicas, share


def ensure_canary(p: _Planner, ck: dict[str, Any], weight: int) -> float:
    """Create or resize the canary workload and route ``weight``; the share reached."""
    spec, target = p.spec, dict(p.obs.target or {})
    service = spec.rollout.service if spec.rollout.router == Router.GATEWAY_API else None
    if service and cn.canary_service_name(service) not in p.obs.services:
        if p.obs.stable_service is None:
            raise StableServiceMissingError(service)
        p.act(Create(cn.canary_service(spec, p.rlc, ck, dict(p.obs.stable_service))))
    replicas, share = canary_weight(p, weight)
    canary = p.obs.canary
    if canary is None:
        p.act(Create(cn.canary_deployment(spec, target, p.rlc, ck, replicas)))
    elif int((canary.get("spec") or {}).get("replicas", 0)) != replicas:
        p.act(
            Patch("apps/v1", "Deployment", meta(canary)["name"], {"spec": {"replicas": replicas}})
        )
    parent = (ck.get("spec") or {}).get("parent")
    container = spec.target.container
    if parent and cn.env_value(target, container, cn.CHECKPOINT_ID_ENV) != parent:
        ops = cn.set_env_patch(target, container, {cn.CHECKPOINT_ID_ENV: parent})
        p.act(Patch("apps/v1", "Deployment", spec.target.deployment, ops))
    if spec.rollout.router == Router.GATEWAY_API and spec.rollout.service:
        route_to(p, weight)
    return share


def route_to(p: _Planner, weight: int) -> None:
    """With the gatewayapi router: the HTTPRoute's weights, when they differ."""
    route = p.obs.http_route
    rules = cn.route_rules(p.spec, dict(route), weight) if route is not None else None
    if rules is not None:
        name = p.spec.rollout.http_route or ""
        p.act(Patch("gateway.networking.k8s.io/v1", "HTTPRoute", name, {"spec": {"rules": rules}}))


class StableServiceMissingError(Exception):
    """The gatewayapi router's ``rollout.service`` does not exist: no canary can be routed."""


def run_step(p: _Planner, ck: dict[str, Any], records: list[dict[str, Any]]) -> Plan:
    name = meta(ck)["name"]
    index = len(records) - 1
    steps = p.spec.rollout.steps
    step = steps[min(index, len(steps) - 1)]
    record = records[-1]
    try:
        share = ensure_canary(p, ck, step.weight)
    except StableServiceMissingError as missing:
        namespace = p.meta.get("namespace")
        reason = f"spec.rollout.service: Service {missing} not found in namespace {namespace}"
        return decide(p, ck, records, "rollback", reason)
    p.status["canaryWeight"] = round(share)
    p.conditions.set("Progressing", True, "Canary", f"{name} at {share:.0f}%")
    canary_start = parse_time(records[0].get("startedAt")) or p.now
    counted_from = parse_time(records[0].get("readyAt")) or canary_start
    if not cn.deployment_ready(dict(p.obs.canary) if p.obs.canary else None):
        timeout = parse_duration(p.spec.rollout.ready_timeout)
        if p.now - canary_start > timedelta(seconds=timeout) and index == 0:
            return decide(
                p,
                ck,
                records,
                "rollback",
                f"canary not ready within {p.spec.rollout.ready_timeout}",
            )
        p.out.soon(READY_POLL_SECONDS)
        return p.finish("Canary", f"{name}: waiting for the canary to be ready")
    scaled = int(((p.obs.canary or {}).get("spec") or {}).get("replicas", -1))
    if not record.get("readyAt") and scaled == canary_weight(p, step.weight)[0]:
        # Until now the canary served nothing (or less than its weight): the analysis, and
        # its sample-ratio test, count this step from here.
        record["readyAt"] = iso(p.now)
        p.patch_checkpoint(ck, phase="Canary", rollout=records)
        p.out.soon(0)
        return p.finish("Canary", f"{name} at {share:.0f}%: ready")
    judged = sum(int(r.get("analyses") or 0) for r in records)
    forget_analyses(p, ck, judged)
    analysis = f"analyze-{judged}"
    jobs = [j for j in step_jobs(p.obs, ck, analysis) if fresh(j, ck)]
    if not jobs:
        due = analysis_due(p, ck, record, step.min_duration, judged)
        if due > p.now:
            p.out.soon((due - p.now).total_seconds())
            return p.finish("Canary", f"{name} at {share:.0f}%: next analysis {iso(due)}")
        max_reached = p.now - canary_start >= timedelta(
            seconds=parse_duration(p.spec.rollout.analysis.max_duration)
        )
        p.create_step(
            ck,
            analysis,
            0,
            analyze_args(p, ck, analysis, share=share, since=counted_from, max_reached=max_reached),
        )
        return p.finish("Canary", f"{name} at {share:.0f}%: analysing")
    job = jobs[-1]
    if not job.finished:
        return p.finish("Canary", f"{name} at {share:.0f}%: analysing ({job.name})")
    if job.failed:
        if job.attempt < p.spec.jobs.backoff_limit:
            args = analyze_args(p, ck, analysis, share=share, since=counted_from, max_reached=False)
            p.create_step(ck, analysis, job.attempt + 1, args)
            return p.finish("Canary", f"{name}: retrying the analysis")
        return decide(
            p, ck, records, "rollback", f"analysis failed: {job.name}: {job.message or job.reason}"
        )
    doc = p.obs.results.get(ch.result_uri(ck["spec"]["uri"], analysis))
    if isinstance(doc, str) or doc is None:
        if doc is None:
            return decide(
                p, ck, records, "rollback", f"analysis {job.name} committed no analysis.json"
            )
        p.out.soon(10)
        return p.finish("Canary", f"cannot read the analysis: {doc}")
    return judge(p, ck, records, dict(doc))


def forget_analyses(p: _Planner, ck: dict[str, Any], judged: int) -> None:
    """Delete the Jobs of analyses judged before the last one: an analysis runs every few
    minutes for hours, its verdict is in ``status.rollout`` and its analysis.json in the
    store. The last judged one stays (its logs, and its end time schedules the next)."""
    for job in p.obs.jobs:
        step = job.step or ""
        if job.checkpoint != meta(ck)["name"] or job.deleting or not job.finished:
            continue
        index = step.removeprefix("analyze-")
        if step.startswith("analyze-") and index.isdigit() and int(index) < judged - 1:
            p.act(Delete("batch/v1", "Job", job.name))


def analysis_due(
    p: _Planner, ck: dict[str, Any], record: dict[str, Any], min_duration: str, judged: int
) -> datetime:
    started = parse_time(record.get("startedAt")) or p.now
    due = started + timedelta(seconds=parse_duration(min_duration))
    if int(record.get("analyses") or 0) > 0 and judged > 0:
        previous = [j for j in step_jobs(p.obs, ck, f"analyze-{judged - 1}") if j.finished]
        last = max((j.finished_at for j in previous if j.finished_at), default=None)
        if last is not None:
            interval = parse_duration(p.spec.rollout.analysis.interval)
            due = max(due, last + timedelta(seconds=interval))
    return due


def step_args(p: _Planner, ck: dict[str, Any], share: float) -> list[str]:
    """``--step START=SHARE`` for every step so far: the analysis stratifies by step and its
    sample-ratio test spans them all. Earlier steps' shares are what their weights give
    with today's stable replicas (the current step's is the share just reached)."""
    records = (ck.get("status") or {}).get("rollout") or []
    if not records:
        return [f"--weight-since={iso(p.now)}"]
    args = []
    for i, record in enumerate(records):
        reached = share if i == len(records) - 1 else canary_weight(p, int(record["weight"]))[1]
        start = record.get("readyAt") or record["startedAt"]
        args.append(f"--step={start}={reached:.2f}")
    return args


def lineage(p: _Planner, name: str, limit: int = 20) -> list[str]:
    """The checkpoints that served before ``name``, newest first: its parent, that one's
    parent, ... (the stable arm's history, for pre-exposure covariates)."""
    by_name = {meta(dict(c))["name"]: c for c in p.obs.checkpoints}
    found: list[str] = []
    current = by_name.get(name)
    while current is not None and len(found) < limit:
        parent = (current.get("spec") or {}).get("parent")
        if not parent or parent in found or parent == name:
            break
        found.append(str(parent))
        current = by_name.get(parent)
    return found


def analyze_args(
    p: _Planner,
    ck: dict[str, Any],
    analysis: str,
    *,
    share: float,
    since: datetime,
    max_reached: bool,
) -> list[str]:
    """Every attempt of one analysis judges the same data: ``--now`` is when it was planned."""
    baseline = (ck.get("spec") or {}).get("parent")
    args = [
        "analyze",
        f"--shards={p.spec.data.shards}",
        f"--baseline={baseline}",
        f"--canary={meta(ck)['name']}",
        f"--out={ch.step_out(ck['spec']['uri'], analysis)}",
        f"--canary-weight={share:.2f}",
        f"--since={iso(since)}",
        *step_args(p, ck, share),
        *[f"--pre-exposure-from={a}" for a in lineage(p, str(baseline))],
        f"--config={ch.CONFIG_MOUNT}/{ch.CONFIG_FILE}",
        f"--now={iso(p.now)}",
    ]
    if max_reached:
        args.append("--max-duration-reached")
    return args


def judge(
    p: _Planner, ck: dict[str, Any], records: list[dict[str, Any]], doc: dict[str, Any]
) -> Plan:
    name = meta(ck)["name"]
    record = records[-1]
    decision = str(doc.get("decision") or "continue")
    reasons = [str(r) for r in doc.get("reasons") or []]
    metrics = [
        MetricComparison.model_validate(
            {k: m[k] for k in MetricComparison.model_fields if m.get(k) is not None}
        ).model_dump(mode="json", by_alias=True, exclude_none=True)
        for m in doc.get("metrics") or []
    ][:64]
    record.update(
        analyses=int(record.get("analyses") or 0) + 1,
        decision=decision,
        reason="; ".join(reasons)[:32768] or decision,
        baselineSamples=int(doc.get("baseline_samples") or 0),
        canarySamples=int(doc.get("canary_samples") or 0),
        metrics=metrics or None,
    )
    p.event(
        f"Analysis{decision.title()}",
        f"{name}: {record['reason']}",
        warning=decision == "rollback",
        kind="Checkpoint",
        name=name,
    )
    if decision in ("promote", "rollback"):
        record["endedAt"] = iso(p.now)
        p.patch_checkpoint(ck, phase="Canary", rollout=records)
        p.out.soon(0)
        return p.finish(
            "Promoting" if decision == "promote" else "RollingBack",
            f"{name}: {decision}: {record['reason']}",
        )
    steps = p.spec.rollout.steps
    index = len(records) - 1
    step = steps[min(index, len(steps) - 1)]
    enough = min(record["baselineSamples"], record["canarySamples"]) >= step.min_samples
    if index + 1 < len(steps) and enough:
        record["endedAt"] = iso(p.now)
        following = steps[index + 1]
        records.append({"weight": following.weight, "startedAt": iso(p.now), "analyses": 0})
        p.event(
            "CanaryStep", f"{name}: canary to {following.weight}%", kind="Checkpoint", name=name
        )
    p.patch_checkpoint(ck, phase="Canary", rollout=records)
    p.out.soon(0)
    return p.finish("Canary", f"{name}: {record['reason']}")


# --- outcomes ------------------------------------------------------------------------
def remove_canary(p: _Planner, ck: dict[str, Any]) -> None:
    """The canary workload, its Service and route weight, and any analysis still running."""
    spec = p.spec
    for job in p.obs.jobs:
        running = job.checkpoint == meta(ck)["name"] and not job.finished and not job.deleting
        if running and (job.step or "").startswith("analyze"):
            p.act(Delete("batch/v1", "Job", job.name))
    if p.obs.canary is not None:
        p.act(Delete("apps/v1", "Deployment", meta(p.obs.canary)["name"]))
    if spec.rollout.router == Router.GATEWAY_API and spec.rollout.service:
        route_to(p, 0)
        if cn.canary_service_name(spec.rollout.service) in p.obs.services:
            p.act(Delete("v1", "Service", cn.canary_service_name(spec.rollout.service)))


def serve(p: _Planner, uri: str, checkpoint: str) -> bool:
    """Point the target at ``uri``; True when it already serves it."""
    spec, target = p.spec, dict(p.obs.target or {})
    if cn.env_value(target, spec.target.container, spec.target.checkpoint_env) == uri:
        return True
    ops = cn.set_env_patch(
        target,
        spec.target.container,
        {spec.target.checkpoint_env: uri, cn.CHECKPOINT_ID_ENV: checkpoint},
    )
    p.act(Patch("apps/v1", "Deployment", spec.target.deployment, ops))
    return False


def promote(p: _Planner, ck: dict[str, Any], records: list[dict[str, Any]]) -> Plan:
    name = meta(ck)["name"]
    if not serve(p, ck["spec"]["uri"], name) or not cn.deployment_ready(dict(p.obs.target or {})):
        p.status["canaryWeight"] = p.status.get("canaryWeight") or 0
        p.out.soon(READY_POLL_SECONDS)
        return p.finish("Promoting", f"{name}: rolling out to {p.spec.target.deployment}")
    remove_canary(p, ck)
    p.patch_checkpoint(
        ck,
        phase="Promoted",
        reason="Promoted",
        completedAt=iso(p.now),
        message=str(records[-1].get("reason") or "promoted"),
    )
    parent = (ck.get("spec") or {}).get("parent")
    previous = p.checkpoint(parent) if parent else None
    if previous is not None and (previous.get("status") or {}).get("phase") != "Superseded":
        p.act(
            PatchStatus(
                API_VERSION,
                "Checkpoint",
                str(parent),
                {"phase": "Superseded", "reason": "Superseded", "message": f"superseded by {name}"},
            )
        )
    p.status.update(lastPromoted=name, serving=name, canaryWeight=0)
    p.event("Promoted", f"{name} now serves {p.spec.target.deployment}")
    p.conditions.set("Progressing", False, "Promoted", f"{name} promoted")
    return p.end_cycle(f"cycle {p.status['cycle']}: {name} promoted")


def roll_back(p: _Planner, ck: dict[str, Any], records: list[dict[str, Any]], reason: str) -> Plan:
    name = meta(ck)["name"]
    parent = (ck.get("spec") or {}).get("parent")
    previous = p.checkpoint(parent) if parent else None
    if previous is not None:
        serve(p, previous["spec"]["uri"], parent or "")  # undo a half-done promotion
    remove_canary(p, ck)
    p.patch_checkpoint(
        ck, phase="RolledBack", reason="RolledBack", message=reason, completedAt=iso(p.now)
    )
    p.status["canaryWeight"] = 0
    p.event("RolledBack", f"{name}: {reason}", warning=True)
    p.conditions.set("Progressing", False, "RolledBack", f"{name}: {reason}")
    return p.end_cycle(f"cycle {p.status['cycle']}: {name} rolled back: {reason}")
