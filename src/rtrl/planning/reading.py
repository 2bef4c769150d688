"""Reading an observation: which Checkpoints an RLCycle owns, which one is running, which
step it waits for and that step's Jobs. Shared by the plan and the canary rollout."""

from __future__ import annotations

from typing import Any

from rtrl.core.api.checkpoint import CheckpointPhase
from rtrl.core.api.names import ANNOTATION_STARTED
from rtrl.core.api.names import RUNNING_PHASES as RUNNING
from rtrl.core.api.reasons import Reason

from .manifests.names import STEPS
from .observed import JobState, Observed
from .records import RecordError, read_records

STEP_SUMMARY = {"stage": "data", "train": "training", "eval": "eval"}
# A step's reasons whose verb is also a pod phase, as members: Reason.of(step, "Running")
# would spell PodPhase.RUNNING a second time.
STEP_RUNNING = {
    "stage": Reason.STAGE_RUNNING,
    "train": Reason.TRAIN_RUNNING,
    "eval": Reason.EVAL_RUNNING,
}
STEP_FAILED = {
    "stage": Reason.STAGE_FAILED,
    "train": Reason.TRAIN_FAILED,
    "eval": Reason.EVAL_FAILED,
}
# The Checkpoint phases in which its canary runs (eval passed).
CANARY_PHASES = (CheckpointPhase.EVALUATED, CheckpointPhase.CANARY)


def meta(obj: Any) -> dict[str, Any]:
    return dict(obj.get("metadata") or {})


def owned(observed: Observed, name: str) -> list[dict[str, Any]]:
    """Checkpoints this RLCycle created, oldest cycle first."""
    out = [
        dict(c)
        for c in observed.checkpoints
        if (c.get("spec") or {}).get("rlCycle") == name and not meta(c).get("deletionTimestamp")
    ]
    return sorted(out, key=lambda c: int((c.get("spec") or {}).get("cycle") or 0))


def data_watermark(checkpoint: dict[str, Any] | None, rlcycle: str) -> str | None:
    """Through when the interactions are in ``checkpoint``'s lineage: the ``--now`` of the
    stage that trained it (its started-at), for a Checkpoint this RLCycle trained; None for
    a base model (or one trained elsewhere), whose lineage holds none of these shards.

    The watermark follows the *serving* checkpoint, not the last stage: a promoted cycle
    moves it forward; a candidate that is rolled back, rejected or fails never becomes
    serving, so the data it trained on is staged again by the next cycle from the same
    parent (the serving model never learned from it); a manual rollback moves it back with
    serving. So along the lineage that serves, each interaction is trained on once."""
    if checkpoint is None:
        return None
    spec = checkpoint.get("spec") or {}
    if spec.get("rlCycle") != rlcycle or "data" not in (checkpoint.get("status") or {}):
        return None
    started = (meta(checkpoint).get("annotations") or {}).get(ANNOTATION_STARTED)
    return str(started) if started else None


def phase(checkpoint: dict[str, Any]) -> str | None:
    return (checkpoint.get("status") or {}).get("phase")


def active(owned: list[dict[str, Any]]) -> dict[str, Any] | None:
    running = [c for c in owned if phase(c) in RUNNING]
    return running[-1] if running else None


def current_step(checkpoint: dict[str, Any]) -> str | None:
    """The step whose Job the cycle waits for: stage, train, eval, then ``analyze-<k>`` (the
    k-th canary analysis, k = the analyses judged so far) while the canary runs."""
    status = checkpoint.get("status") or {}
    for step in STEPS:
        if STEP_SUMMARY[step] not in status:
            return step
    if status.get("phase") in CANARY_PHASES:
        try:
            judged = sum(r.analyses for r in read_records(checkpoint))
        except RecordError:  # no analysis is judged: the canary is rolled back (rollout)
            judged = 0
        return f"analyze-{judged}"
    return None


def step_jobs(observed: Observed, checkpoint: dict[str, Any], step: str) -> list[JobState]:
    name = meta(checkpoint).get("name")
    jobs = [j for j in observed.jobs if j.checkpoint == name and j.step == step and not j.deleting]
    return sorted(jobs, key=lambda j: j.attempt)


def fresh(job: JobState, checkpoint: dict[str, Any]) -> bool:
    """False for a Job left by an earlier Checkpoint of the same name."""
    return job.checkpoint_uid in (None, meta(checkpoint).get("uid"))
