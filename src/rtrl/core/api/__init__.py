"""The rtrl API (group ``rtrl.io``, version ``v1alpha1``): pydantic types that are the single
source of truth for the CRDs, ``rtrl validate`` and the operator.

``RESOURCES`` lists each kind with what the CRD needs besides the schema (names, printer
columns), the way kubebuilder markers sit next to Go types.
"""

from __future__ import annotations

from dataclasses import dataclass

from .checkpoint import Checkpoint, CheckpointPhase, CheckpointSpec, CheckpointStatus
from .common import API_VERSION, GROUP, VERSION, ApiModel, Condition
from .rlcycle import RLCycle, RLCyclePhase, RLCycleSpec, RLCycleStatus


@dataclass(frozen=True)
class PrinterColumn:
    name: str
    type: str
    json_path: str
    description: str
    priority: int = 0
    format: str | None = None


@dataclass(frozen=True)
class Resource:
    """A kind of the API and the CRD facts that are not in its schema."""

    kind: str
    plural: str
    singular: str
    short_names: tuple[str, ...]
    model: type[ApiModel]
    spec: type[ApiModel]
    status: type[ApiModel]
    columns: tuple[PrinterColumn, ...]
    categories: tuple[str, ...] = ("rtrl",)

    @property
    def crd_name(self) -> str:
        return f"{self.plural}.{GROUP}"


_AGE = PrinterColumn(
    "Age", "date", ".metadata.creationTimestamp", "Time since the object was created."
)

RLCYCLE = Resource(
    kind="RLCycle",
    plural="rlcycles",
    singular="rlcycle",
    short_names=("rlc",),
    model=RLCycle,
    spec=RLCycleSpec,
    status=RLCycleStatus,
    columns=(
        PrinterColumn("Phase", "string", ".status.phase", "Phase of the current cycle."),
        PrinterColumn("Serving", "string", ".status.serving", "Checkpoint serving stable."),
        PrinterColumn("Candidate", "string", ".status.candidate", "Checkpoint of this cycle."),
        PrinterColumn("Canary", "integer", ".status.canaryWeight", "Canary traffic percent."),
        PrinterColumn("Cycle", "integer", ".status.cycle", "Current cycle number."),
        # A string, not a date: kubectl prints a date as an age, and a future one as
        # "<invalid>".
        PrinterColumn("Next Run", "string", ".status.nextRun", "When the next cycle is due."),
        PrinterColumn(
            "Message", "string", ".status.message", "What the operator is doing.", priority=1
        ),
        _AGE,
    ),
)

CHECKPOINT = Resource(
    kind="Checkpoint",
    plural="checkpoints",
    singular="checkpoint",
    short_names=("ckpt",),
    model=Checkpoint,
    spec=CheckpointSpec,
    status=CheckpointStatus,
    columns=(
        PrinterColumn("Phase", "string", ".status.phase", "Where in its life it is."),
        PrinterColumn("Cycle", "integer", ".spec.cycle", "Cycle that produced it."),
        PrinterColumn("Parent", "string", ".spec.parent", "Checkpoint it was trained from."),
        PrinterColumn("Eval", "string", ".status.eval.verdict", "Eval verdict."),
        # The last canary step's decision: continue while it runs, then promote or rollback
        # (the A/B test's or a manual one); the Phase says where that left it.
        PrinterColumn(
            "Decision", "string", ".status.rollout[-1:].decision", "Last canary decision."
        ),
        PrinterColumn("URI", "string", ".spec.uri", "Where it is stored.", priority=1),
        PrinterColumn(
            "Base", "string", ".spec.base", "An adapter's base, the one it runs on.", priority=1
        ),
        _AGE,
    ),
)

RESOURCES: dict[str, Resource] = {r.kind: r for r in (RLCYCLE, CHECKPOINT)}

__all__ = [
    "API_VERSION",
    "CHECKPOINT",
    "GROUP",
    "RESOURCES",
    "RLCYCLE",
    "VERSION",
    "ApiModel",
    "Checkpoint",
    "CheckpointPhase",
    "CheckpointSpec",
    "CheckpointStatus",
    "Condition",
    "PrinterColumn",
    "RLCycle",
    "RLCyclePhase",
    "RLCycleSpec",
    "RLCycleStatus",
    "Resource",
]
