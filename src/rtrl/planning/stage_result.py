"""What a committed stage.json says, as the Checkpoint's ``status.data``.

The stage step's result is written by the trainer image and read here through its contract
(:class:`~rtrl.core.results.StageResult`). Only what the API type allows is copied (a
monitor undefined for the set is left out, not made a 0; reason maps are bounded), so a
document from another version of the step cannot put the status out of the CRD's schema.
"""

from __future__ import annotations

from rtrl.core.api.checkpoint import DataSummary, FidelitySummary, RewardStats
from rtrl.core.results import FidelityGate, RewardFigures, StageResult


def data_summary(doc: StageResult, uri: str) -> DataSummary:
    """The Checkpoint's ``status.data`` from the stage.json at ``uri``."""
    return DataSummary(
        manifest=doc.out or uri.rsplit("/", 1)[0] + "/",
        interactions=doc.interactions_used,
        tokens=doc.tokens_used,
        on_policy_fraction=doc.on_policy_fraction,
        quarantined=doc.quarantined or None,
        files_bad=len(doc.quarantined_files),
        refused=_refused(doc.refused),
        fidelity=_fidelity(doc.fidelity),
        since=doc.since,
        until=doc.next_since,
        reward=_reward_stats(doc.reward),
        monitors=_monitors(doc.monitors),
    )


def _reward_stats(stats: RewardFigures | None) -> RewardStats | None:
    """stage.json's reward statistics; None when no staged row had a reward (all null)."""
    if stats is None or stats.mean is None:
        return None
    return RewardStats.model_validate({k: getattr(stats, k) for k in RewardStats.model_fields})


def _refused(refused: dict[str, int]) -> dict[str, int] | None:
    """stage.json's refused rows by reason (none: unset)."""
    counts = {k: v for k, v in refused.items() if v > 0}
    return dict(sorted(counts.items())[:16]) or None


def _fidelity(gate: FidelityGate | None) -> FidelitySummary | None:
    """stage.json's fidelity gate figures, overall; None when the gate did not run."""
    if gate is None or not gate.checked:
        return None
    overall = gate.overall
    weights = (overall.is_weight if overall else None) or {}
    return FidelitySummary(
        partitions_checked=gate.partitions_checked,
        partitions_quarantined=gate.partitions_quarantined,
        rows=overall.rows if overall else 0,
        tokens=overall.tokens if overall else 0,
        mean_abs_delta=overall.mean_abs_delta if overall else None,
        max_abs_delta=overall.max_abs_delta if overall else None,
        unsupported_fraction=overall.unsupported_fraction if overall else None,
        is_weight_p01=weights.get("p01"),
        is_weight_p50=weights.get("p50"),
        is_weight_p99=weights.get("p99"),
    )


def _monitors(monitors: dict[str, float | None]) -> dict[str, float] | None:
    """stage.json's behaviour monitors that are defined for the set (a null one, e.g. a
    tool-call rate without tool calls, is not a 0)."""
    numbers = {k: float(v) for k, v in monitors.items() if v is not None}
    return dict(sorted(numbers.items())[:32]) or None
