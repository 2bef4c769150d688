"""``rtrl-job analyze``: judge a canary from the interactions each arm served.

The operator runs this step at every analysis of a canary (every few minutes, at every
weight) and acts on ``analysis.json``: promote, rollback or continue. One streaming pass
over the shards of the two checkpoints (only their Hive partitions are listed), through the
validating reader, so bad files and rows are quarantined and counted exactly as the stage
step does, never silently used. Per arm it accumulates the sufficient statistics of every
metric (sums and sums of squares, a latency histogram), so memory does not grow with the
number of rows; the statistics and the decision rule are in :mod:`.rule` and :mod:`.decide`.

Which rows count:

- created at or after ``--since`` (the canary's start) and served by one of the two arms
  (its ``checkpoint_id`` agreeing with its file's ``checkpoint=`` partition, else it is
  quarantined as ``checkpoint_mismatch``);
- *matured*, as the stage step defines it from ``data.maturity``: created at least
  ``maturity`` before ``--now`` and its feedback arrived (``feedback_at`` set, not after
  ``--now``). Metrics use only these.

The sample-ratio check counts assignments, not feedback: rows created in
``[--weight-since, now - maturity]`` per arm (``--weight-since``, when the canary weight
last changed, defaults to ``--since``; shares from before a weight change would otherwise
mix two expected ratios).

``analysis.json`` depends only on the inputs apart from ``timing``; it is committed at
``--out`` with the store's commit protocol (manifest last). Exit 0 when the analysis ran,
whatever the decision; 1 when it could not (store errors, more bad rows than
``data.maxBadFraction``: ``analysis.json`` is then committed with ``ok: false`` and
decision ``continue``); 2 for usage and config errors.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

from rtrl.core.api.checkpoint import Decision
from rtrl.core.results import AnalysisCause, AnalysisResult, CauseKind
from rtrl.core.store import open_store
from rtrl_trainer.analyze.config import RESULT_NAME, AnalyzeConfig, AnalyzeError
from rtrl_trainer.analyze.decide import decide
from rtrl_trainer.analyze.evaluate import evaluate
from rtrl_trainer.analyze.reconcile import NAME as LOGGED
from rtrl_trainer.analyze.rule import method_of, plan
from rtrl_trainer.analyze.scan import scan
from rtrl_trainer.analyze.srm import srm_steps
from rtrl_trainer.quarantine import MAX_BAD_FILES, quarantine, quarantine_message
from rtrl_trainer.spec_file import format_time


def analyze(config: AnalyzeConfig) -> dict[str, Any]:
    """Run the analysis; return the ``analysis.json`` document it committed.

    Raises :class:`AnalyzeError` (after committing ``ok: false``) when too much data is bad,
    :class:`StoreError` when the store fails.
    """
    clock = time.perf_counter()
    out = open_store(config.out, endpoint_url=config.endpoint_url)
    found = scan(config)
    q = quarantine(found.selection)
    limit = config.data.max_bad_fraction
    arms = found.arms
    analysis_spec = config.rollout.analysis
    plan_ = config.step_plan
    looks = config.looks
    doc: dict[str, Any] = {
        "ok": True,
        "decision": Decision.CONTINUE,
        "cause": None,
        "message": "",
        "reasons": [],
        "baseline": config.baseline,
        "canary": config.canary,
        "org": config.org,
        "baseline_samples": arms.rows[0],
        "canary_samples": arms.rows[1],
        "metrics": [],
        "metrics_missing": [],
        "srm": None,
        "alpha": analysis_spec.alpha,
        "method": method_of(analysis_spec),
        "sequential": {
            "test": str(analysis_spec.sequential_test),
            "spending_exponent": analysis_spec.spending_exponent,
            "interval": analysis_spec.interval,
            "max_duration": analysis_spec.max_duration,
            **looks.describe(),
        },
        "inconclusive_policy": str(analysis_spec.inconclusive),
        "non_inferiority_margin": analysis_spec.non_inferiority_margin,
        "max_duration_reached": config.max_duration_reached,
        "canary_weight": config.canary_weight,
        "unit": str(config.rollout.unit),
        "steps": [{"start": format_time(at), "canary_share": share} for at, share in plan_],
        "variance_reduction": {
            "enabled": analysis_spec.variance_reduction,
            "pre_exposure": analysis_spec.pre_exposure,
            "pre_exposure_from": [config.baseline, *config.pre_exposure_from],
            "pre_exposure_rows": arms.pre_rows,
        },
        "now": format_time(config.now),
        "since": format_time(config.since),
        "weight_since": format_time(config.srm_since),
        "cutoff": format_time(config.cutoff),
        "maturity": config.data.maturity,
        "shards": config.data.shards,
        "rows_read": q.rows_read,
        "rows_bad": q.rows_bad,
        "bad_fraction": q.bad_fraction,
        "max_bad_fraction": limit,
        "quarantined": q.by_reason,
        "quarantined_by_arm": {
            "baseline": found.bad_by_arm.get(config.baseline, 0),
            "canary": found.bad_by_arm.get(config.canary, 0),
        },
        "files_total": q.files_total,
        "files_bad": q.files_bad,
        "quarantined_files": q.bad_files[:MAX_BAD_FILES],
        "excluded": dict(sorted((k, v) for k, v in found.excluded.items() if v)),
    }
    if q.bad_fraction > limit:
        doc["ok"] = False
        doc["message"] = quarantine_message(q, limit)
        doc["reasons"] = [f"cannot analyse: {doc['message']}"]
        doc["cause"] = AnalysisCause(kind=CauseKind.CANNOT_ANALYSE, metrics=[])
    else:
        base_units, canary_units, both = arms.srm_counts()
        checked = [i for i, (_, share) in enumerate(plan_) if share is not None]
        srm = None
        if checked:
            srm = srm_steps(
                [base_units[i] for i in checked],
                [canary_units[i] for i in checked],
                [float(plan_[i][1] or 0) / 100 for i in checked],
                analysis_spec.srm_alpha,
            )
        served = found.served
        metrics = plan(
            analysis_spec, config.rollout.guardrails,
            unmeasured=() if served is not None else (LOGGED,),
        )  # fmt: skip
        shares = [float(share or 0) / 100 for _, share in plan_]
        ev = evaluate(
            arms, metrics, analysis_spec, config.rollout.guardrails, shares=shares,
            served=None if served is None else served.per_look(
                arms.looks, arms.logged_hours, (config.baseline, config.canary)
            ),
        )  # fmt: skip
        result = decide(
            ev.diffs,
            analysis_spec,
            config.rollout.guardrails,
            srm=srm,
            max_duration_reached=config.max_duration_reached,
            metrics=metrics,
            boundaries=ev.boundaries,
            settled=ev.settled,
            settled_boundary=ev.settled_boundary,
            promote=ev.promote,
            promote_boundary=ev.promote_boundary,
        )
        last = checked[-1] if checked else len(plan_) - 1
        result.srm.update(
            unit=str(config.rollout.unit),
            baseline_units=base_units[last],
            canary_units=canary_units[last],
            units_in_both_arms=both[last],
            steps=[
                {
                    "start": format_time(plan_[i][0]),
                    "canary_share": plan_[i][1],
                    "baseline_units": base_units[i],
                    "canary_units": canary_units[i],
                    "units_in_both_arms": both[i],
                }
                for i in range(len(plan_))
            ],
        )
        doc["variance_reduction"].update(
            units_with_covariate=ev.with_history,
            units=ev.units,
            model_users=ev.pre_users,
        )
        doc.update(
            decision=result.decision,
            cause=result.cause,
            message=result.reasons[0],
            reasons=result.reasons,
            metrics=result.metrics,
            metrics_missing=result.missing,
            srm=result.srm,
            settled=result.settled,
        )
        if served is not None:
            doc["reconciliation"] = {
                "events": config.events,
                "sealed_hours": [format_time(h) for h in sorted(served.by_hour)],
                "served": {
                    config.baseline: sum(
                        c.get(config.baseline, 0) for c in served.by_hour.values()
                    ),
                    config.canary: sum(c.get(config.canary, 0) for c in served.by_hour.values()),
                },
                "files": served.files,
            }
    doc["timing"] = {"seconds": round(time.perf_counter() - clock, 3)}
    written = AnalysisResult.written(doc)  # the contract the operator reads it by
    doc = written.document()
    with tempfile.TemporaryDirectory(prefix="rtrl-analyze-") as tmp:
        path = Path(tmp) / RESULT_NAME
        path.write_text(written.to_json())
        metadata = {
            "step": "analyze",
            "ok": doc["ok"],
            "decision": doc["decision"],
            "baseline": config.baseline,
            "canary": config.canary,
        }
        out.commit("", {RESULT_NAME: path}, metadata)
    if not doc["ok"]:
        raise AnalyzeError(doc["message"])
    return doc
