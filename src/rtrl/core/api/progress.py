"""``progress.json``: the file through which a running step tells the operator how far it
is, so that ``kubectl get``/``kubectl rtrl status`` show more than "Training" without the
operator reading pod logs.

The train step (rank 0) writes it under its output prefix, beside train.json, each time it
uploads its TensorBoard events (after the first optimizer step, after each saved state, at
the end, and at most every ``RTRL_TENSORBOARD_SECONDS``); the operator reads it on the
rounds of a Checkpoint whose train Job runs (its resync, 30 s by default) and copies it
into ``status.progress``. It is not part of the committed checkpoint (its manifest lists
only what publishing commits), and a newer run of the step overwrites it.

The body is :class:`~rtrl.core.api.checkpoint.StepProgress`, the status field it becomes,
under a version, so that a reader can refuse a layout it does not know. (The other step
files' contracts are in :mod:`rtrl.core.results`; this one stays beside the status field
its body is.)
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .checkpoint import StepProgress
from .common import ApiModel

__all__ = ["PROGRESS_FILE", "ProgressDocument", "duration"]

PROGRESS_FILE = "progress.json"


class ProgressDocument(ApiModel):
    """What ``progress.json`` holds."""

    version: Literal[1] = Field(1, description="The layout's version.")
    progress: StepProgress = Field(description="How far the step is.")


def duration(seconds: float) -> str:
    """``37s``, ``3m05s``, ``2h04m``: how a step's progress lines and the status say a time."""
    whole = max(0, round(seconds))
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
