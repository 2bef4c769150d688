"""What a demo run did, read back from the cluster and the store: the summary behind
summary.json, the report and the printed tables (each canary look's analysis document)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rtrl.core.api.checkpoint import CheckpointPhase
from rtrl.core.results import AnalysisResult, ResultError, StageResult
from rtrl.core.store import read_committed_json
from rtrl.planning.manifests.canary import CHECKPOINT_ID_ENV, env_value
from rtrl.planning.manifests.names import result_uri
from rtrl.planning.timeutil import iso
from rtrl_localkube.cluster import LocalCluster

from .scenario import (
    CONTAINER,
    DEPLOYMENT,
    NAME,
    SCENARIOS,
    T0,
    TWO_ORGS,
    adapter_rlcycle_name,
)
from .traces import org_served, training_curves

# Of each canary step's record: metrics is the status' copy, as kubectl rtrl status shows it.
RECORD_KEYS = ("weight", "startedAt", "endedAt", "analyses", "decision", "reason", "metrics")


def summary(
    cluster: LocalCluster,
    checkpoints: list[dict[str, Any]],
    args: argparse.Namespace,
    timings: dict[str, float],
    seconds: float,
) -> dict[str, Any]:
    """What the run did, for summary.json and the report: each cycle's data, training, eval
    and canary looks, the Events, and where the time went."""
    cycles = []
    for ck in sorted(checkpoints, key=lambda c: c["metadata"]["creationTimestamp"]):
        status = ck.get("status") or {}
        records = status.get("rollout") or []
        last = records[-1] if records else {}
        analyses = [{k: record.get(k) for k in RECORD_KEYS} for record in records]
        looks = analysis_docs(ck)
        cycles.append(
            {
                "cycle": ck["spec"].get("cycle"),
                "rlcycle": ck["spec"].get("rlCycle"),
                "checkpoint": ck["metadata"]["name"],
                "parent": ck["spec"].get("parent"),
                "phase": status.get("phase"),
                "decision": last.get("decision") or status.get("phase"),
                # the decision's own line; every metric's line is in "looks" and in
                # the Checkpoint's rollout record
                "reason": (looks[-1].message if looks else None)
                or last.get("reason")
                or status.get("message")
                or "",
                "data": status.get("data"),
                "training": status.get("training"),
                "eval": {
                    k: (status.get("eval") or {}).get(k) for k in ("verdict", "message", "gates")
                },
                "training_curves": training_curves(ck["spec"]["uri"]),
                "metrics": analysis_metrics(looks[-1]) if looks else last.get("metrics") or [],
                "looks": [
                    {
                        "now": doc.now,
                        "decision": str(doc.decision),
                        "baseline_samples": doc.baseline_samples,
                        "canary_samples": doc.canary_samples,
                        "metrics": analysis_metrics(doc),
                    }
                    for doc in looks
                ],
                "samples": {
                    "baseline": last.get("baselineSamples"),
                    "canary": last.get("canarySamples"),
                },
                "monitors": stage_monitors(ck),
                "rollout": analyses,
            }
        )
    target = cluster.get("Deployment", DEPLOYMENT)
    return {
        "scenario": args.scenario,
        "scenario_description": SCENARIOS[args.scenario],
        "users": args.users,
        "seed": args.seed,
        "cycles_requested": args.cycles,
        "cycles": cycles,
        "serving": env_value(target, CONTAINER, CHECKPOINT_ID_ENV),
        "events": [
            {
                "at": iso(e.at),
                "object": f"{e.kind}/{e.name}",
                "reason": e.reason,
                "message": e.message,
                "warning": e.warning,
            }
            for e in cluster.events
        ],
        "timings_seconds": {k: round(v, 1) for k, v in timings.items()},
        "wall_seconds": round(seconds, 1),
        "simulated_hours": round((cluster.now - T0).total_seconds() / 3600, 2),
    }


def stage_monitors(ck: dict[str, Any]) -> dict[str, Any]:
    """The behaviour monitors the stage step measured on the serving checkpoint's data."""
    manifest = ((ck.get("status") or {}).get("data") or {}).get("manifest")
    if not manifest:
        return {}
    doc = read_committed_json(f"{manifest.rstrip('/')}/{StageResult.FILE}")
    try:
        stage = StageResult.read(doc)
    except ResultError:  # none committed (or not a stage result): no monitors to show
        return {}
    reward = stage.reward.model_dump(mode="json") if stage.reward is not None else None
    return {"monitors": stage.monitors, "reward": reward}


def analysis_docs(ck: dict[str, Any]) -> list[AnalysisResult]:
    """Every canary analysis of this checkpoint, in order (``analyze-<k>/analysis.json``):
    the Checkpoint's status keeps each step's last look only, and no metric's role or band;
    the documents have every look."""
    records = (ck.get("status") or {}).get("rollout") or []
    judged = sum(int(r.get("analyses") or 0) for r in records)
    docs = []
    for k in range(judged):
        doc = read_committed_json(result_uri(ck["spec"]["uri"], f"analyze-{k}"))
        try:
            docs.append(AnalysisResult.read(doc))
        except ResultError:  # none committed (the Job failed), or not an analysis result
            continue
    return docs


ANALYSIS_KEYS = (
    "name", "kind", "baseline", "canary", "difference", "ci_low", "ci_high",
    "relative_difference", "relative_ci_low", "relative_ci_high", "verdict",
    "baseline_samples", "canary_samples", "band",
)  # fmt: skip


def analysis_metrics(doc: AnalysisResult) -> list[dict[str, Any]]:
    return [{k: getattr(m, k) for k in ANALYSIS_KEYS} for m in doc.metrics]


GOAL = "edit_persistence"


def organisations(
    cluster: LocalCluster, result: dict[str, Any], shards: Path, routes: list[dict[str, Any]]
) -> dict[str, Any]:
    """two-orgs: per organisation, its RLCycle's cycles (each canary's edit persistence on
    the org's users: the adapter against its parent, and the base's on the same users), what
    each checkpoint served the org (from the sealed shards: interactions, edit persistence,
    the share of hidden-preference answers in the org's convention), whom the last tick's
    routes served, and whether the org's adapter improved its own metric."""
    served = org_served(shards)
    out: dict[str, Any] = {}
    base = "demo-0"
    for org in TWO_ORGS:
        name = adapter_rlcycle_name(org)
        rlc = cluster.get("RLCycle", name) or {}
        mine = served.get(org, {})
        on_base = mine.get(base, {})
        cycles = []
        for c in result.get("cycles") or []:
            if c.get("rlcycle") != name:
                continue
            goal: dict[str, Any] = next(
                (m for m in c.get("metrics") or [] if m.get("name") == GOAL), {}
            )
            adapter = mine.get(str(c.get("checkpoint")), {})
            cycles.append(
                {
                    "cycle": c.get("cycle"),
                    "checkpoint": c.get("checkpoint"),
                    "parent": c.get("parent"),
                    "phase": c.get("phase"),
                    "decision": c.get("decision"),
                    "reason": c.get("reason"),
                    # the canary analysis of the org's users: parent's arm vs the adapter's
                    "parent_value": goal.get("baseline"),
                    "adapter_value": goal.get("canary"),
                    "relative_difference": goal.get("relative_difference"),
                    "relative_ci_low": goal.get("relative_ci_low"),
                    "relative_ci_high": goal.get("relative_ci_high"),
                    "verdict": goal.get("verdict"),
                    # every interaction of the org each served (the sealed shards)
                    "base_persistence": on_base.get("edit_persistence"),
                    "adapter_persistence": adapter.get("edit_persistence"),
                    "base_convention": on_base.get("convention"),
                    "adapter_convention": adapter.get("convention"),
                }
            )
        serving = (rlc.get("status") or {}).get("serving") or base
        final = mine.get(serving, {})
        others = {o for o in TWO_ORGS if o != org}
        foreign = {
            ck: row["n"]
            for ck, row in mine.items()
            if any(ck.startswith(adapter_rlcycle_name(o) + "-") for o in others)
        }
        last = (routes[-1]["orgs"].get(org) or {}) if routes else {}
        improved = (
            serving != base
            and final.get("edit_persistence") is not None
            and on_base.get("edit_persistence") is not None
            and final["edit_persistence"] > on_base["edit_persistence"]
            and any(
                c["phase"] in (CheckpointPhase.PROMOTED, CheckpointPhase.SUPERSEDED) for c in cycles
            )
        )
        out[org] = {
            "rlcycle": name,
            "serving": serving,
            "route": last,
            "cycles": cycles,
            "served": mine,
            "served_by_other_orgs_adapters": foreign,
            "base": {k: on_base.get(k) for k in ("n", "edit_persistence", "convention")},
            "adapter": {k: final.get(k) for k in ("n", "edit_persistence", "convention")},
            "improved": bool(improved),
        }
    return out


def shared_model(cluster: Any, shards: Path) -> dict[str, Any]:
    """two-orgs-shared: per organisation, the one shared model the base's RLCycle serves
    after its cycles against the base, on that organisation's users (every interaction
    each served it): what a single model learns of two opposite conventions."""
    served = org_served(shards)
    rlc = cluster.get("RLCycle", NAME) or {}
    serving = (rlc.get("status") or {}).get("serving") or "demo-0"
    out: dict[str, Any] = {}
    for org in TWO_ORGS:
        mine = served.get(org, {})
        on_base, final = mine.get("demo-0", {}), mine.get(serving, {})
        keys = ("n", "edit_persistence", "convention")
        before, after = on_base.get("convention"), final.get("convention")
        out[org] = {
            "rlcycle": NAME,
            "shared": True,
            "serving": serving,
            "route": {},
            "cycles": [],
            "served": mine,
            "served_by_other_orgs_adapters": {},
            "base": {k: on_base.get(k) for k in keys},
            "adapter": {k: final.get(k) for k in keys},
            # its own convention followed more than under the base (by 0.05)
            "improved": serving != "demo-0"
            and before is not None
            and after is not None
            and after > before + 0.05,
        }
    return out


def by_org(
    cluster: Any, result: dict[str, Any], shards: Path, routes: list[dict[str, Any]] | None
) -> dict[str, Any]:
    """The summary's per-organisation part: with ``routes`` (two-orgs) each organisation's
    adapter and the routes each tick served; without (two-orgs-shared) the shared model."""
    if routes is None:
        return {"organisations": shared_model(cluster, shards)}
    return {"organisations": organisations(cluster, result, shards, routes), "routes": routes}
