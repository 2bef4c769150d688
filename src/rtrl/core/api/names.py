"""The API's names besides its types, spelled once: the group and version, the labels and
annotations rtrl puts on objects and reads back, its finalizer, and which phases mean a cycle
is still running. The operator, the kubectl plugin and the demo all read them from here."""

from __future__ import annotations

from .checkpoint import CheckpointPhase
from .common import API_VERSION, GROUP, VERSION
from .rlcycle import RLCyclePhase

__all__ = [
    "ANNOTATION_APPROVE",
    "ANNOTATION_CAPTURE",
    "ANNOTATION_CAPTURE_HASH",
    "ANNOTATION_DATA_SINCE",
    "ANNOTATION_PROMOTE",
    "ANNOTATION_ROLLBACK",
    "ANNOTATION_SPEC_HASH",
    "ANNOTATION_STARTED",
    "ANNOTATION_TRIGGER",
    "API_VERSION",
    "CYCLE_PHASES",
    "FINALIZER",
    "FINALIZER_RESTORE_TRAFFIC",
    "GROUP",
    "LABEL_ADAPTER_ROUTES",
    "LABEL_ARM",
    "LABEL_ATTEMPT",
    "LABEL_CHECKPOINT",
    "LABEL_CHECKPOINT_UID",
    "LABEL_RLCYCLE",
    "LABEL_SEAL",
    "LABEL_STEP",
    "MANAGED_BY",
    "PRE_CANARY_PHASES",
    "RUNNING_PHASES",
    "STEP_PHASE",
    "VERSION",
]

# Labels on every object an RLCycle owns (selectors and kubectl -l read them).
LABEL_RLCYCLE = f"{GROUP}/rlcycle"
LABEL_CHECKPOINT = f"{GROUP}/checkpoint"
LABEL_CHECKPOINT_UID = f"{GROUP}/checkpoint-uid"
LABEL_STEP = f"{GROUP}/step"
LABEL_ATTEMPT = f"{GROUP}/attempt"
LABEL_ARM = f"{GROUP}/arm"  # stable or canary, on the canary's pods
MANAGED_BY = {"app.kubernetes.io/managed-by": "rtrl"}
# On a ConfigMap: "true" lets adapter RLCycles write their organisation's route into it
# (spec.capture.adapters): no spec makes the operator write into a ConfigMap of its choice.
LABEL_ADAPTER_ROUTES = f"{GROUP}/adapter-routes"

# Annotations a user (or `kubectl rtrl`) writes to ask for something once; the value is a
# token, handled once and recorded in status.
ANNOTATION_TRIGGER = f"{GROUP}/trigger"
ANNOTATION_PROMOTE = f"{GROUP}/promote"
ANNOTATION_ROLLBACK = f"{GROUP}/rollback"
ANNOTATION_APPROVE = f"{GROUP}/approve"  # releases a manual approval gate of the canary
# Written by the operator on a Checkpoint: when its cycle started (the stage's --now).
ANNOTATION_STARTED = f"{GROUP}/started-at"
# Written by the operator on a Checkpoint: the data watermark its stage starts after (the
# stage's --since): interactions that became ready at or before it are already in the
# parent's lineage. Absent when the parent was trained on none (a base model).
ANNOTATION_DATA_SINCE = f"{GROUP}/data-since"
FINALIZER = f"{GROUP}/finalizer"
# On an RLCycle while its gatewayapi HTTPRoute (someone else's object) sends traffic to its
# canary Service: its deletion waits until the route is given back to the stable Service, so
# the garbage collector never removes a Service the route still sends requests to
# (rtrl.planning.traffic). The only finalizer rtrl puts on an RLCycle.
FINALIZER_RESTORE_TRAFFIC = f"{GROUP}/restore-traffic"
# Written by the operator on the pod template of a Deployment it injected the capture sidecar
# into: the RLCycle that did (a sidecar without it is someone else's, never overwritten), and
# the hash of the sidecar as the spec makes it (the part that is not per-checkpoint).
ANNOTATION_CAPTURE = f"{GROUP}/capture"
ANNOTATION_CAPTURE_HASH = f"{GROUP}/capture-hash"
# On an object the operator derives from the spec as a whole (the seal CronJob): the hash of
# what it wrote, so a changed spec replaces it and an unchanged one writes nothing.
ANNOTATION_SPEC_HASH = f"{GROUP}/spec-hash"
# On the seal CronJob's Jobs and pods: the RLCycle they seal for (not LABEL_RLCYCLE, which
# marks the step Jobs the reconciler reads).
LABEL_SEAL = f"{GROUP}/seal"

# The Checkpoint phase while each Job step runs.
STEP_PHASE = {
    "stage": CheckpointPhase.STAGING,
    "train": CheckpointPhase.TRAINING,
    "eval": CheckpointPhase.EVALUATING,
}
# A cycle's Checkpoint phases in order, until its decision.
CYCLE_PHASES = (
    CheckpointPhase.PENDING,
    CheckpointPhase.STAGING,
    CheckpointPhase.TRAINING,
    CheckpointPhase.EVALUATING,
    CheckpointPhase.EVALUATED,
    CheckpointPhase.CANARY,
)
# Checkpoint phases of a cycle still running (None: not yet written).
RUNNING_PHASES: frozenset[CheckpointPhase | None] = frozenset({None, *CYCLE_PHASES})
# RLCycle phases before a canary: a rollback or a pin cancels the running cycle at once.
PRE_CANARY_PHASES = (
    RLCyclePhase.PENDING,
    RLCyclePhase.STAGING,
    RLCyclePhase.TRAINING,
    RLCyclePhase.EVALUATING,
)
