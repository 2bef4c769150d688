"""The operator's planning core: pure decisions, the clock passed in, no I/O.

``plan(observed, now)`` looks at what the kube layer read back from the cluster and the
store and returns what to do next (create or delete children, patch a Checkpoint's status,
post Events) and the RLCycle's new status. The same core drives the operator and the local
demo runner, so both make the same decisions.
"""

from .actions import Action, Create, Delete, Emit, Patch, PatchStatus
from .observed import DeploymentState, JobState, Observed, SecretState
from .plan import plan, plan_rejected, results_to_read
from .progress import progress_to_read
from .round import Plan

__all__ = [
    "Action",
    "Create",
    "Delete",
    "DeploymentState",
    "Emit",
    "JobState",
    "Observed",
    "Patch",
    "PatchStatus",
    "Plan",
    "SecretState",
    "plan",
    "plan_rejected",
    "progress_to_read",
    "results_to_read",
]
