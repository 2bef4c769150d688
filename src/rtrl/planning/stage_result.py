"""What a committed stage.json says, as the Checkpoint's ``status.data``.

The stage step's result document is written by the trainer image; the operator reads it
back as plain JSON. Only what the API type allows is copied (a monitor undefined for the
set is left out, not made a 0; reason maps are bounded), so a document from another
version of the step cannot put the status out of the CRD's schema.
"""

from __future__ import annotations

from typing import Any

from rtrl.core.api.checkpoint import DataSummary, FidelitySummary, RewardStats


def data_summary(doc: dict[str, Any], uri: str) -> DataSummary:
    """The Checkpoint's ``status.data`` from the stage.json at ``uri``."""
    quarantined = doc.get("quarantined") or None
    return DataSummary(
        manifest=doc.get("out") or uri.rsplit("/", 1)[0] + "/",
        interactions=int(doc["interactions_used"]),
        tokens=int(doc["tokens_used"]),
        on_policy_fraction=doc.get("on_policy_fraction"),
        quarantined=quarantined if isinstance(quarantined, dict) else None,
        files_bad=len(doc.get("quarantined_files") or []),
        refused=_refused(doc.get("refused")),
        fidelity=_fidelity(doc.get("fidelity")),
        since=doc.get("since"),
        until=doc.get("next_since"),
        reward=_reward_stats(doc.get("reward")),
        monitors=_monitors(doc.get("monitors")),
    )


def _reward_stats(stats: Any) -> RewardStats | None:
    """stage.json's reward statistics; None when no staged row had a reward (all null)."""
    if not isinstance(stats, dict) or stats.get("mean") is None:
        return None
    return RewardStats.model_validate({k: stats[k] for k in RewardStats.model_fields})


def _refused(refused: Any) -> dict[str, int] | None:
    """stage.json's refused rows by reason (none: unset)."""
    if not isinstance(refused, dict):
        return None
    counts = {str(k): int(v) for k, v in refused.items() if isinstance(v, int) and v > 0}
    return dict(sorted(counts.items())[:16]) or None


def _fidelity(gate: Any) -> FidelitySummary | None:
    """stage.json's fidelity gate figures, overall; None when the gate did not run."""
    if not isinstance(gate, dict) or not gate.get("checked"):
        return None
    overall = gate.get("overall") or {}
    weights = overall.get("is_weight") or {}
    return FidelitySummary(
        partitions_checked=int(gate.get("partitions_checked") or 0),
        partitions_quarantined=int(gate.get("partitions_quarantined") or 0),
        rows=int(overall.get("rows") or 0),
        tokens=int(overall.get("tokens") or 0),
        mean_abs_delta=overall.get("mean_abs_delta"),
        max_abs_delta=overall.get("max_abs_delta"),
        unsupported_fraction=overall.get("unsupported_fraction"),
        is_weight_p01=weights.get("p01"),
        is_weight_p50=weights.get("p50"),
        is_weight_p99=weights.get("p99"),
    )


def _monitors(monitors: Any) -> dict[str, float] | None:
    """stage.json's behaviour monitors that are defined for the set (a null one, e.g. a
    tool-call rate without tool calls, is not a 0)."""
    if not isinstance(monitors, dict):
        return None
    numbers = {
        str(k): float(v)
        for k, v in monitors.items()
        if isinstance(v, int | float) and not isinstance(v, bool)
    }
    return dict(sorted(numbers.items())[:32]) or None
