"""``train.json``: the train step's (``rtrl-job train``) summary, published inside the
checkpoint it trained. The operator puts ``summary`` on the Checkpoint's
``status.training`` as it is (the API's :class:`~rtrl.core.api.checkpoint.TrainingSummary`);
the rest is the run's account (inputs, config, per-step history, the logits probe)."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field

from rtrl.core.api.checkpoint import TrainingSummary

from .contract import StepResult


class TrainResult(StepResult):
    """train.json; ``version`` 1 is the first format (it always carried one)."""

    FILE: ClassVar[str] = "train.json"
    VERSION: ClassVar[int] = 1
    version: int = 1

    summary: TrainingSummary
    parent: dict[str, Any] = Field(default_factory=dict)
    data: dict[str, Any] = Field(default_factory=dict)
    config: dict[str, Any] = Field(default_factory=dict)
    run: dict[str, Any] = Field(default_factory=dict)
    history: list[dict[str, Any]] = Field(default_factory=list)
    probe: dict[str, Any] = Field(default_factory=dict)
    # a LoRA adapter's shape, trained parameters and base (None: all weights were trained)
    adapter: dict[str, Any] | None = None
    finished_at: str | None = None

    def document(self) -> dict[str, Any]:
        """As written: the summary's keys in snake_case, its unset figures left out."""
        doc = super().document()
        doc["summary"] = self.summary.model_dump(mode="json", exclude_none=True)
        return doc
