"""``analysis.json``: one canary analysis (``rtrl-job analyze``): the decision, why, and
the A/B numbers behind it. The operator records the decision in the Checkpoint's
``status.rollout``; a guardrail trip is known by its ``cause``, not by the wording of its
reasons; the demo reads every look's metrics.

Version 2 added ``cause``. A version-1 file (before rtrl wrote one) gets the cause its
lead reason names when that is a guardrail trip, the one cause the operator acts on
(:meth:`AnalysisResult.upgrade`); otherwise none.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, ClassVar

from pydantic import Field

from rtrl.core.api.checkpoint import Decision, MetricComparison

from .contract import ResultPart, StepResult


class CauseKind(StrEnum):
    """What the decision rests on (the rule's cause)."""

    INCONCLUSIVE = "inconclusive"  # no goal significantly better or worse yet
    SAMPLE_RATIO_MISMATCH = "sample-ratio-mismatch"  # the arms are not comparable
    GUARDRAIL = "guardrail"  # a guardrail tripped: ``metrics`` names them
    GOAL_WORSE = "goal-worse"  # ``metrics``: the goals significantly worse
    PRIMARY_BETTER = "primary-better"  # the primary goal better, nothing worse
    POLICY_ROLLBACK = "policy-rollback"  # inconclusive at maxDuration, policy rollback
    NON_INFERIOR = "non-inferior"  # ... policy promote-if-non-inferior, shown
    NOT_NON_INFERIOR = "not-non-inferior"  # ... not shown
    POLICY_HOLD = "policy-hold"  # ... policy hold
    HELD_BEYOND_BAND = "held-beyond-band"  # better, but ``metrics`` beyond their band
    HELD_SAMPLE_RATIO = "held-sample-ratio"  # better, but the sample ratio is suspect
    HELD_NOVELTY = "held-novelty"  # better, but not yet past the novelty window
    CANNOT_ANALYSE = "cannot-analyse"  # too much bad data (``ok`` false)


class AnalysisCause(ResultPart):
    """Why the analysis decided as it did, as fields: the kind and the metrics it names."""

    kind: CauseKind
    metrics: list[str] = Field(default_factory=list)


class AnalysisMetric(ResultPart):
    """One metric of the A/B test as the analysis reports it."""

    name: str
    baseline: float
    canary: float
    difference: float
    ci_low: float
    ci_high: float
    kind: str | None = None  # goal or guardrail
    relative_difference: float | None = None
    relative_ci_low: float | None = None
    relative_ci_high: float | None = None
    verdict: str | None = None
    higher_is_better: bool | None = None
    alpha: float | None = None
    tau: float | None = None
    baseline_samples: int | None = None
    canary_samples: int | None = None
    variance_reduction: float | None = None
    variance_reduction_new: float | None = None
    variance_reduction_returning: float | None = None
    boundary: float | None = None
    band: dict[str, Any] | None = None
    precision_weighted: dict[str, Any] | None = None

    def to_status(self) -> MetricComparison:
        """The metric as a Checkpoint's rollout record holds it."""
        fields = {k: getattr(self, k) for k in MetricComparison.model_fields}
        return MetricComparison.model_validate({k: v for k, v in fields.items() if v is not None})


# The lead reason of a version-1 guardrail trip, as decide.py wrote it.
_V1_TRIPPED = ("guardrail tripped: ", " moved beyond its band")


class AnalysisResult(StepResult):
    """analysis.json. ``ok`` false: too much bad data, nothing decided (the step failed)."""

    FILE: ClassVar[str] = "analysis.json"
    VERSION: ClassVar[int] = 2
    version: int = 2

    ok: bool = True
    decision: Decision = Decision.CONTINUE
    cause: AnalysisCause | None = None
    message: str = ""
    reasons: list[str] = Field(default_factory=list)
    baseline: str | None = None
    canary: str | None = None
    org: str | None = None  # one organisation's rows alone (its adapter's canary)
    baseline_samples: int = Field(0, ge=0)
    canary_samples: int = Field(0, ge=0)
    metrics: list[AnalysisMetric] = Field(default_factory=list)
    metrics_missing: list[str] = Field(default_factory=list)
    srm: dict[str, Any] | None = None
    settled: dict[str, Any] | None = None
    alpha: float | None = None
    method: dict[str, str] = Field(default_factory=dict)
    sequential: dict[str, Any] = Field(default_factory=dict)
    inconclusive_policy: str | None = None
    non_inferiority_margin: float | None = None
    max_duration_reached: bool = False
    canary_weight: float | None = None
    unit: str | None = None
    steps: list[dict[str, Any]] = Field(default_factory=list)
    variance_reduction: dict[str, Any] = Field(default_factory=dict)
    reconciliation: dict[str, Any] | None = None
    now: str | None = None
    since: str | None = None
    weight_since: str | None = None
    cutoff: str | None = None
    maturity: str | None = None
    shards: str | None = None
    rows_read: int = 0
    rows_bad: int = 0
    bad_fraction: float = 0.0
    max_bad_fraction: float | None = None
    quarantined: dict[str, int] = Field(default_factory=dict)
    quarantined_by_arm: dict[str, int] = Field(default_factory=dict)
    files_total: int = 0
    files_bad: int = 0
    quarantined_files: list[Any] = Field(default_factory=list)
    excluded: dict[str, int] = Field(default_factory=dict)
    timing: dict[str, float] = Field(default_factory=dict)

    @classmethod
    def upgrade(cls, doc: dict[str, Any], version: int) -> dict[str, Any]:
        """Version 1 -> 2: the cause, when the lead reason is a guardrail trip."""
        reasons = doc.get("reasons")
        lead = reasons[0] if isinstance(reasons, list) and reasons else None
        head, tail = _V1_TRIPPED
        if (
            doc.get("decision") == Decision.ROLLBACK
            and isinstance(lead, str)
            and lead.startswith(head)
            and lead.endswith(tail)
        ):
            names = lead.removeprefix(head).removesuffix(tail).split(", ")
            doc.setdefault("cause", {"kind": CauseKind.GUARDRAIL, "metrics": names})
        return doc

    @property
    def reason(self) -> str:
        """Every reason in one line of text, the way a rollout record carries them."""
        return "; ".join(self.reasons)[:32768] or str(self.decision)

    @property
    def guardrail_tripped(self) -> bool:
        """A rollback because a guardrail tripped."""
        return (
            self.decision == Decision.ROLLBACK
            and self.cause is not None
            and self.cause.kind == CauseKind.GUARDRAIL
        )
