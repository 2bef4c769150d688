"""A running step's ``progress.json`` (:mod:`rtrl.core.api.progress`) in its Checkpoint's
``status.progress``: which file a round asks the kube layer to read (only while the train
Job runs: one small GET per round of a training cycle, no pod logs), and what the round
writes from it. The step writes the file about every 30 seconds; the round that reads it
is the resync's, so the status follows within a resync period."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from rtrl.core.api.checkpoint import StepProgress
from rtrl.core.api.progress import PROGRESS_FILE, ProgressDocument, duration

from .manifests.names import step_out
from .observed import Observed
from .reading import STEP_RUNNING, active, current_step, fresh, meta, owned, step_jobs
from .round import Round

REPORTING_STEPS = ("train",)


def progress_to_read(observed: Observed) -> str | None:
    """The URI of the running step's progress file, while a step that writes one runs."""
    ck = active(owned(observed, str(meta(observed.rlcycle).get("name"))))
    step = current_step(ck) if ck is not None else None
    if ck is None or step not in REPORTING_STEPS:
        return None
    jobs = [j for j in step_jobs(observed, ck, step) if fresh(j, ck)]
    if not jobs or jobs[-1].finished:
        return None
    return f"{step_out(ck['spec']['uri'], step)}{PROGRESS_FILE}"


def read_progress(doc: Mapping[str, Any] | str | None) -> StepProgress | None:
    """The progress a file holds; None when there is none yet, it could not be read, or it
    is not one (a newer layout): progress is for watching, the cycle never waits on it."""
    if not isinstance(doc, Mapping):
        return None
    try:
        return ProgressDocument.model_validate(dict(doc)).progress
    except ValidationError:
        return None


def progress_text(progress: StepProgress) -> str:
    """``12/40 steps (30%), 0.52 steps/s, ETA 1m09s``."""
    if progress.total:
        done = f"{progress.done}/{progress.total} {progress.unit}"
        done += f" ({100 * progress.done / progress.total:.0f}%)"
    else:
        done = f"{progress.done} {progress.unit}"
    if progress.rate:
        done += f", {progress.rate:.3g} {progress.unit}/s"
    if progress.eta_seconds is not None:
        done += f", ETA {duration(progress.eta_seconds)}"
    return done


def record_progress(r: Round, ck: dict[str, Any], step: str) -> str:
    """Copy what the running step last reported into the Checkpoint's status (when it
    changed); the text for the RLCycle's message, "" when there is none."""
    if step not in REPORTING_STEPS:
        return ""
    progress = read_progress(r.obs.progress)
    if progress is None:
        return ""
    text = progress_text(progress)
    dumped = progress.model_dump(mode="json", by_alias=True, exclude_none=True)
    if (ck.get("status") or {}).get("progress") != dumped:
        message = f"{step} step running: {text}"
        r.patch_summary(ck, "progress", progress, reason=STEP_RUNNING[step], message=message)
    return text
