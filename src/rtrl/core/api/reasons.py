"""The words rtrl writes for a machine to read, spelled once: the condition types of an RLCycle
and the reasons of its conditions, of the Checkpoints' ``status.reason`` and of the Events.

Kubernetes gives conditions and Events a CamelCase ``reason`` that tools select on (alerts,
``kubectl get events --field-selector reason=...``, notification filters); a reason spelled
twice drifts. Every reason the operator writes is a member of ``Reason``; the ones made from a
step's name (``TrainStarted``) are members too, found with ``Reason.of``. The Kubernetes
words rtrl reads (a Job's ``Complete`` and ``Failed`` conditions, a pod's phases) are in
``JobCondition`` and ``PodPhase``: Kubernetes' words, not rtrl's, spelled once as well.
tests/rtrl/core/api/test_vocabulary.py fails on a phase, decision or reason spelled as a
literal anywhere else in the code.
"""

from __future__ import annotations

from enum import StrEnum

__all__ = ["ConditionType", "JobCondition", "PodPhase", "Reason"]


class ConditionType(StrEnum):
    """The conditions of an RLCycle (docs/operator.md, "Status, conditions, Events")."""

    READY = "Ready"
    PROGRESSING = "Progressing"
    DEGRADED = "Degraded"
    INSUFFICIENT_DATA = "InsufficientData"
    AWAITING_APPROVAL = "AwaitingApproval"
    NOTIFICATIONS_DELIVERED = "NotificationsDelivered"
    INVALID_SPEC = "InvalidSpec"


class Reason(StrEnum):
    """Every reason of a condition, a Checkpoint's status or an Event that rtrl writes, but
    a rejected candidate's: that is the eval's ``EvalFailure`` (``EvalGatesFailed``,
    ``SandboxUnsafe``; rtrl/core/results/evaluation.py), read from its eval.json."""

    # a cycle and its steps
    CYCLE_STARTED = "CycleStarted"
    CYCLE_COMPLETED = "CycleCompleted"
    CYCLE_FAILED = "CycleFailed"
    CYCLE_CANCELLED = "CycleCancelled"
    CANCELLED = "Cancelled"
    STAGE_STARTED = "StageStarted"
    STAGE_RUNNING = "StageRunning"
    STAGE_RETRYING = "StageRetrying"
    STAGE_FAILED = "StageFailed"
    STAGED = "Staged"
    TRAIN_STARTED = "TrainStarted"
    TRAIN_RUNNING = "TrainRunning"
    TRAIN_RETRYING = "TrainRetrying"
    TRAIN_FAILED = "TrainFailed"
    TRAINED = "Trained"
    EVAL_STARTED = "EvalStarted"
    EVAL_RUNNING = "EvalRunning"
    EVAL_RETRYING = "EvalRetrying"
    EVAL_FAILED = "EvalFailed"
    EVAL_PASSED = "EvalPassed"
    ANALYSIS_STARTED = "AnalysisStarted"
    ANALYSIS_CONTINUE = "AnalysisContinue"
    ANALYSIS_PROMOTE = "AnalysisPromote"
    ANALYSIS_ROLLBACK = "AnalysisRollback"
    RESULT_MISSING = "ResultMissing"
    RESULT_INVALID = "ResultInvalid"
    INSUFFICIENT_DATA = "InsufficientData"
    DATA_SUFFICIENT = "DataSufficient"
    NOT_STAGED = "NotStaged"
    CHECKPOINT_PRUNED = "CheckpointPruned"
    # the canary and serving
    CANARY = "Canary"
    CANARY_STARTED = "CanaryStarted"
    CANARY_STEP = "CanaryStep"
    ROLLOUT_RESTARTED = "RolloutRestarted"
    AWAITING_APPROVAL = "AwaitingApproval"
    APPROVED = "Approved"
    APPROVAL_IGNORED = "ApprovalIgnored"
    RELEASED = "Released"
    PROMOTED = "Promoted"
    ROLLED_BACK = "RolledBack"
    SUPERSEDED = "Superseded"
    MANUAL_ROLLBACK = "ManualRollback"
    ROLLBACK_IMPOSSIBLE = "RollbackImpossible"
    SERVING = "Serving"
    SERVING_AGAIN = "ServingAgain"
    TRAFFIC_TOO_LOW = "TrafficTooLow"  # a canary cannot pass its steps in maxDuration
    BASE_CHANGED = "BaseChanged"  # an adapter's base no longer served: it is stale
    TRAFFIC_RESTORED = "TrafficRestored"
    PINNED = "Pinned"
    SUSPENDED = "Suspended"
    IDLE = "Idle"
    AS_EXPECTED = "AsExpected"
    # notifications
    DELIVERED = "Delivered"
    DELIVERY_FAILED = "DeliveryFailed"
    NOTIFICATION_FAILED = "NotificationFailed"
    NOTIFICATION_DROPPED = "NotificationDropped"
    # capture and seal
    CAPTURE_INJECTED = "CaptureInjected"
    CAPTURE_UPDATED = "CaptureUpdated"
    CAPTURE_REMOVED = "CaptureRemoved"
    SEAL_SCHEDULED = "SealScheduled"
    SEAL_UPDATED = "SealUpdated"
    SEAL_REMOVED = "SealRemoved"
    # the spec (InvalidSpec and its way out)
    INVALID_SPEC = "InvalidSpec"
    SPEC_VALID = "SpecValid"
    SPEC_INVALID = "SpecInvalid"
    NAME_INVALID = "NameInvalid"
    DEPLOYMENT_NOT_FOUND = "DeploymentNotFound"
    CONTAINER_NOT_FOUND = "ContainerNotFound"
    CHECKPOINT_ENV_MISSING = "CheckpointEnvMissing"
    SERVING_CHECKPOINT_UNKNOWN = "ServingCheckpointUnknown"
    SECRET_NOT_FOUND = "SecretNotFound"
    SECRET_INCOMPLETE = "SecretIncomplete"
    PINNED_CHECKPOINT_NOT_FOUND = "PinnedCheckpointNotFound"
    REJECTED_BY_API_SERVER = "RejectedByAPIServer"
    CAPTURE_CONTAINER_CONFLICT = "CaptureContainerConflict"
    CAPTURE_PORT_CONFLICT = "CapturePortConflict"
    CAPTURE_ADAPTERS_UNSERVABLE = "CaptureAdaptersUnservable"
    ADAPTER_ROUTE_TAKEN = "AdapterRouteTaken"
    ADAPTER_ROUTES_UNLABELLED = "AdapterRoutesUnlabelled"
    CHECKPOINT_INCONSISTENT = "CheckpointInconsistent"
    IMAGE_NOT_ALLOWED = "ImageNotAllowed"
    SERVICE_ACCOUNT_NOT_ALLOWED = "ServiceAccountNotAllowed"
    TOLERATION_NOT_ALLOWED = "TolerationNotAllowed"
    NODE_SELECTOR_NOT_ALLOWED = "NodeSelectorNotAllowed"
    RESOURCES_NOT_ALLOWED = "ResourcesNotAllowed"
    ENDPOINT_NOT_ALLOWED = "EndpointNotAllowed"
    SECRET_NOT_ALLOWED = "SecretNotAllowed"

    @classmethod
    def of(cls, subject: str, what: str) -> Reason:
        """The reason made of a step's (or the analysis's) name and what happened to it:
        ``Reason.of("train", "Started")`` is ``TrainStarted``. A ValueError for a pair that is
        not a member: a new step or verb is added here first."""
        return cls(f"{subject[:1].upper()}{subject[1:].lower()}{what}")


class JobCondition(StrEnum):
    """The condition types of a finished Kubernetes Job."""

    COMPLETE = "Complete"
    FAILED = "Failed"
    # set before Complete / Failed while the Job's pods terminate (Kubernetes 1.31+)
    SUCCESS_CRITERIA_MET = "SuccessCriteriaMet"
    FAILURE_TARGET = "FailureTarget"


class PodPhase(StrEnum):
    """The phases of a Kubernetes pod."""

    PENDING = "Pending"
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
