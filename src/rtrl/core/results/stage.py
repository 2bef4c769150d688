"""``stage.json``: what the stage step (``rtrl-job stage``) selected, and its verdict.

The operator copies part of it into the Checkpoint's ``status.data``
(:mod:`rtrl.planning.stage_result`); the train step reads ``sufficient`` and
``max_bad_fraction``; the demo its monitors and reward. The rest is the step's account of
every row it did not use, for a person reading the file (docs/stage.md).
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field

from .contract import ResultPart, StepResult


class RewardFigures(ResultPart):
    """The reward (or advantage) of the staged rows; all None when no row had one."""

    mean: float | None = None
    std: float | None = None
    min: float | None = None
    max: float | None = None


class FidelityFigures(ResultPart):
    """The fidelity gate's figures over some rows: logged against recomputed log-probs."""

    rows: int = 0
    tokens: int = 0
    mean_abs_delta: float | None = None
    max_abs_delta: float | None = None
    mean_delta: float | None = None
    unsupported: int = 0
    unsupported_fraction: float | None = None
    # importance-weight quantiles by name (p01, p05, p50, p95, p99)
    is_weight: dict[str, float] | None = None
    serving_dtype: dict[str, int] = Field(default_factory=dict)


class FidelityGate(ResultPart):
    """The fidelity gate: whether it ran (``reason`` why not), its bounds and figures."""

    checked: bool = False
    reason: str | None = None
    sample_rows: int | None = None
    max_mean_abs_delta: float | None = None
    max_unsupported_fraction: float | None = None
    checkpoint: str | None = None
    partitions: int = 0
    partitions_checked: int = 0
    partitions_quarantined: int = 0
    overall: FidelityFigures | None = None
    by_partition: list[dict[str, Any]] = Field(default_factory=list)
    seconds: float | None = None


class StageResult(StepResult):
    """stage.json. ``ok`` false: too much bad data (the step failed); ``sufficient`` false:
    too little data, no training set (the step ran). Times are ISO 8601 UTC text, as
    written."""

    FILE: ClassVar[str] = "stage.json"
    VERSION: ClassVar[int] = 1
    version: int = 1

    ok: bool = True
    sufficient: bool = False
    message: str = ""
    interactions_used: int = Field(ge=0)
    tokens_used: int = Field(ge=0)
    on_policy_fraction: float | None = Field(None, ge=0, le=1)
    # what was read, and from where
    checkpoint: str | None = None
    previous_checkpoint: str | None = None
    excluded_checkpoints: list[str] = Field(default_factory=list)
    parent: str | None = None
    shards: str | None = None
    out: str | None = None
    now: str | None = None
    since: str | None = None
    cutoff: str | None = None
    window_start: str | None = None
    next_since: str | None = None
    maturity: str | None = None
    vocab_size: int | None = None
    token_ids: str | None = None
    # bad data: quarantined rows by reason and files that could not be read
    rows_read: int = 0
    rows_bad: int = 0
    bad_fraction: float = 0.0
    max_bad_fraction: float | None = Field(None, ge=0, le=1)
    files_total: int = 0
    files_bad: int = 0
    quarantined: dict[str, int] = Field(default_factory=dict)
    files_by_reason: dict[str, int] = Field(default_factory=dict)
    quarantined_files: list[Any] = Field(default_factory=list)
    # valid rows not used, by why
    immature: int = 0
    too_recent: int = 0
    refused: dict[str, int] = Field(default_factory=dict)
    excluded: dict[str, int] = Field(default_factory=dict)
    eligible: dict[str, int] = Field(default_factory=dict)
    fidelity: FidelityGate | None = None
    # the set
    on_policy_interactions: int = 0
    off_policy_interactions: int = 0
    heldout_fraction: float | None = None
    heldout_interactions: int = 0
    heldout_file: str | None = None
    min_interactions: int | None = None
    min_tokens: int | None = None
    reward_spec: dict[str, Any] | None = None
    reward: RewardFigures | None = None
    advantage: RewardFigures | None = None
    baselines: list[dict[str, Any]] = Field(default_factory=list)
    missing_signals: dict[str, int] = Field(default_factory=dict)
    # behaviour monitors of the set; None: undefined for it (no rows, no tool calls)
    monitors: dict[str, float | None] = Field(default_factory=dict)
    ranks: list[dict[str, Any]] = Field(default_factory=list)
    files: list[str] = Field(default_factory=list)
    timing: dict[str, float | None] = Field(default_factory=dict)
