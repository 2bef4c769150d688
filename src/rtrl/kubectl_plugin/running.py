"""How far a running cycle is, in the words of ``kubectl rtrl status``: its training's
progress as the train step last reported it, and the share of traffic each canary step
gave the canary (which with the replicas router is not the step's weight)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import ValidationError

from rtrl.core.api.checkpoint import CheckpointPhase, StepProgress
from rtrl.core.api.progress import duration
from rtrl.planning.progress import progress_text


def progress_line(st: dict[str, Any], now: datetime) -> str:
    """While it trains: how far, as the train step last reported (done/total, rate, ETA,
    and how long ago it said so); "" otherwise."""
    if st.get("phase") != CheckpointPhase.TRAINING or not st.get("progress"):
        return ""
    try:
        progress = StepProgress.model_validate(st["progress"])
    except ValidationError:
        return ""
    ago = duration((now - progress.updated_at).total_seconds())
    return f"{progress.step}: {progress_text(progress)} (reported {ago} ago)"


def weight_text(record: dict[str, Any]) -> str:
    """A step's share of traffic: the share the canary got, and the step's weight when that
    differs (the replicas router: weight 25 next to one stable pod is one canary pod, 50%),
    so that it reads as the RLCycle's canary weight and the canary's row do."""
    weight, share = record.get("weight", 0), record.get("share")
    if not isinstance(share, int | float) or round(share) == weight:
        return f"{weight}%"
    return f"{share:.0f}% (step: {weight}%)"
