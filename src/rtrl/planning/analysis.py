"""The canary's analysis Jobs (``rtrl-job analyze``): when the next one is due, the
arguments that make every attempt of one analysis judge the same data, and forgetting the
Jobs of analyses already judged, and reading a verdict back (checked). :mod:`.rollout`
decides when to run them and what their verdicts mean."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from rtrl.core.api.checkpoint import RolloutRecord
from rtrl.core.api.common import parse_duration
from rtrl.core.results import AnalysisResult

from .actions import Delete
from .adapter_routes import routed_orgs
from .manifests import canary as cn
from .manifests.jobs import CONFIG_FILE, CONFIG_MOUNT
from .manifests.names import step_out
from .reading import meta, step_jobs
from .records import Record
from .round import Round
from .timeutil import iso, parse_time


def forget_analyses(r: Round, ck: dict[str, Any], judged: int) -> None:
    """Delete the Jobs of analyses judged before the last one: an analysis runs every few
    minutes for hours, its verdict is in ``status.rollout`` and its analysis.json in the
    store. The last judged one stays (its logs, and its end time schedules the next)."""
    for job in r.obs.jobs:
        step = job.step or ""
        if job.checkpoint != meta(ck)["name"] or job.deleting or not job.finished:
            continue
        index = step.removeprefix("analyze-")
        if step.startswith("analyze-") and index.isdigit() and int(index) < judged - 1:
            r.act(Delete("batch/v1", "Job", job.name))


def analysis_due(
    r: Round, ck: dict[str, Any], record: Record, min_duration: str, judged: int
) -> datetime:
    due = record.started_at + timedelta(seconds=parse_duration(min_duration))
    if record.analyses > 0 and judged > 0:
        previous = [j for j in step_jobs(r.obs, ck, f"analyze-{judged - 1}") if j.finished]
        last = max((j.finished_at for j in previous if j.finished_at), default=None)
        if last is not None:
            interval = parse_duration(r.spec.rollout.analysis.interval)
            due = max(due, last + timedelta(seconds=interval))
    return due


def share_args(r: Round, records: list[Record], share: float) -> list[str]:
    """``--step START=SHARE`` for every step so far (``records``: the canary's, as the
    round read them): the analysis stratifies by step and its sample-ratio test spans them
    all. Earlier steps' shares are what their weights give with today's stable replicas
    (the current step's is the share just reached)."""
    if not records:
        return [f"--weight-since={iso(r.now)}"]
    args = []
    for i, record in enumerate(records):
        reached = (
            share
            if i == len(records) - 1
            else cn.canary_weight(r.spec, r.obs.target, record.weight)[1]
        )
        start = iso(record.ready_at or record.started_at)
        args.append(f"--step={start}={reached:.2f}")
    return args


def lineage(r: Round, name: str, limit: int = 20) -> list[str]:
    """The checkpoints that served before ``name``, newest first: its parent, that one's
    parent, ... (the stable arm's history, for pre-exposure covariates)."""
    by_name = {meta(dict(c))["name"]: c for c in r.obs.checkpoints}
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
    r: Round,
    ck: dict[str, Any],
    records: list[Record],
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
        f"--shards={r.spec.data.shards}",
        f"--baseline={baseline}",
        f"--canary={meta(ck)['name']}",
        f"--out={step_out(ck['spec']['uri'], analysis)}",
        f"--canary-weight={share:.2f}",
        f"--since={iso(since)}",
        *share_args(r, records, share),
        *[f"--pre-exposure-from={a}" for a in lineage(r, str(baseline))],
        f"--config={CONFIG_MOUNT}/{CONFIG_FILE}",
        f"--now={iso(r.now)}",
    ]
    if r.spec.capture is not None:  # each arm's served requests, against the rows it logged
        args.append(f"--events={r.spec.capture.events}")
    org = r.spec.adapter_org()
    if org is not None:  # an adapter's canary: its organisation's users alone see it
        args.append(f"--org={org}")
    else:  # the base's canary: not the organisations its pods route to adapters
        args += [f"--exclude-org={other}" for other in routed_orgs(r)]
    if max_reached:
        args.append("--max-duration-reached")
    return args


def read_verdict(doc: Any) -> AnalysisResult:
    """An analysis.json through its contract: :class:`~rtrl.core.results.ResultError` (a
    ValueError) when it is not an analysis result (a decision it does not know, a
    non-finite metric, a newer version...)."""
    return AnalysisResult.read(doc)


def record_verdict(record: RolloutRecord, result: AnalysisResult) -> None:
    """What a canary step's record keeps of an analysis: the decision, its reasons in one
    line, the samples and the metrics (bounded as the CRD bounds them)."""
    record.decision = result.decision
    record.reason = result.reason
    record.baseline_samples = result.baseline_samples
    record.canary_samples = result.canary_samples
    record.metrics = [m.to_status() for m in result.metrics][:64] or None


def hours_to_decide(r: Round, ck: dict[str, Any]) -> tuple[float, float] | None:
    """``(interactions per hour, hours)``: the traffic the candidate's stage found (its
    interactions over the span it staged: the organisation's alone in an adapter RLCycle)
    and the least time its canary needs to pass every step, each step at least its
    ``minDuration`` and until both arms have its ``minSamples`` at its weight, plus the
    maturity an interaction waits before it counts. None when the stage says too little
    to tell (no span, no interactions)."""
    data = (ck.get("status") or {}).get("data") or {}
    interactions = int(data.get("interactions") or 0)
    end, start = parse_time(data.get("until")), parse_time(data.get("since"))
    if not interactions or end is None:
        return None
    if start is None and r.spec.data.window:
        start = end - timedelta(seconds=parse_duration(r.spec.data.window))
    if start is None:
        return None
    span_h = (end - start).total_seconds() / 3600
    if span_h <= 0:
        return None
    rate = interactions / span_h
    hours = parse_duration(r.spec.data.maturity) / 3600
    for step in r.spec.rollout.steps:
        smaller_arm = min(step.weight, 100 - step.weight) / 100 or 1.0
        needed = step.min_samples / (rate * smaller_arm) if step.min_samples else 0.0
        hours += max(parse_duration(step.min_duration) / 3600, needed)
    return rate, hours
