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
under a version, so that a reader can refuse a layout it does not know. (This contract
belongs with the other step files' typed models once they have a room of their own.)
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .checkpoint import StepProgress
from .common import ApiModel

__all__ = ["PROGRESS_FILE", "ProgressDocument"]

PROGRESS_FILE = "progress.json"


class ProgressDocument(ApiModel):
    """What ``progress.json`` holds."""

    version: Literal[1] = Field(1, description="The layout's version.")
    progress: StepProgress = Field(description="How far the step is.")
