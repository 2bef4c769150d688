"""``eval.json``: the eval step's (``rtrl-job eval``) verdict on a candidate against its
parent. The operator reads ``passed``, ``reason``, ``message``, ``gates`` and
``gates_source`` into the Checkpoint's ``status.eval``; the rest is the suites' detail."""

from __future__ import annotations

from enum import StrEnum
from typing import Any, ClassVar

from pydantic import Field

from rtrl.core.api.checkpoint import GateResult, Verdict

from .contract import ResultPart, StepResult


class EvalFailure(StrEnum):
    """Why a candidate failed eval: the Checkpoint's reason when it is Rejected."""

    GATES_FAILED = "EvalGatesFailed"
    # the code suites were not scored: a sandbox guarantee is missing
    SANDBOX_UNSAFE = "SandboxUnsafe"


class GatesSource(StrEnum):
    """Which gates were judged: the RLCycle's ``spec.eval.gates``, or the suites'
    defaults (the field unset)."""

    SPEC = "spec"
    DEFAULT = "default"


class EvalGate(ResultPart):
    """One gate judged: the figures the Checkpoint shows and how the gate was set."""

    metric: str
    candidate: float
    parent: float
    ci_low: float
    ci_high: float
    passed: bool
    mode: str | None = None
    max_regression: float | None = None
    threshold: float | None = None
    regression_excess_lower_bound: float | None = None

    def to_status(self) -> GateResult:
        """The gate as the Checkpoint's ``status.eval.gates`` holds it."""
        return GateResult.model_validate({k: getattr(self, k) for k in GateResult.model_fields})


class EvalResult(StepResult):
    """eval.json. ``passed`` false: rejected, ``reason`` says why."""

    FILE: ClassVar[str] = "eval.json"
    VERSION: ClassVar[int] = 1
    version: int = 1

    passed: bool
    verdict: Verdict | None = None
    message: str = ""
    reason: EvalFailure | None = None
    candidate: str | None = None
    parent: str | None = None
    heldout: str | None = None
    suites: dict[str, Any] = Field(default_factory=dict)
    alpha: float | None = None
    resamples: int | None = None
    evaluator: dict[str, Any] = Field(default_factory=dict)
    metrics: list[dict[str, Any]] = Field(default_factory=list)
    gates: list[EvalGate] = Field(default_factory=list)
    gates_not_judged: list[dict[str, Any]] = Field(default_factory=list)
    gates_source: GatesSource | None = None
    gates_effective: list[dict[str, Any]] = Field(default_factory=list)
    parent_cache: dict[str, Any] = Field(default_factory=dict)
    timing: dict[str, float] = Field(default_factory=dict)
