"""The Checkpoint resource: one model version and everything known about it.

A cycle of an RLCycle creates one Checkpoint and records in its status what it was trained
on, how training went, what eval said and what the A/B test decided, so ``kubectl describe
ckpt`` answers "why is this model serving (or not)?". A user may create one by hand to
register a base model.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Literal

from pydantic import Field

from .common import (
    MAX_CONDITIONS,
    MAX_COUNT,
    ApiModel,
    Condition,
    Count,
    DnsLabel,
    DnsSubdomain,
    ObjectMeta,
    Probability,
    StoreUri,
)


class CheckpointSpec(ApiModel):
    """Identity of a model version: where it is stored and where it came from."""

    uri: StoreUri = Field(
        description="Hugging Face checkpoint directory (config.json, model.safetensors), "
        "or a LoRA adapter's (adapter_config.json, adapter_model.safetensors).",
    )
    parent: DnsSubdomain | None = Field(
        None, description="Checkpoint this one was trained from; unset for a base model."
    )
    base: DnsSubdomain | None = Field(
        None,
        description="For a LoRA adapter: the base Checkpoint it was trained on, the only "
        "one it is served on; unset for a full model.",
    )
    rl_cycle: DnsLabel | None = Field(
        None, description="RLCycle that produced it; unset for one registered by hand."
    )
    cycle: int | None = Field(
        None, ge=0, le=MAX_COUNT, description="Cycle number within that RLCycle."
    )


class CheckpointPhase(StrEnum):
    PENDING = "Pending"
    STAGING = "Staging"
    TRAINING = "Training"
    EVALUATING = "Evaluating"
    EVALUATED = "Evaluated"
    REJECTED = "Rejected"
    CANARY = "Canary"
    PROMOTED = "Promoted"
    ROLLED_BACK = "RolledBack"
    SUPERSEDED = "Superseded"
    FAILED = "Failed"


class RewardStats(ApiModel):
    """The reward of the staged interactions (from the stage's stage.json)."""

    mean: float = Field(description="Mean reward.")
    std: float = Field(ge=0, description="Standard deviation of the reward.")
    min: float = Field(description="Lowest reward.")
    max: float = Field(description="Highest reward.")


class FidelitySummary(ApiModel):
    """The stage's fidelity gate over the serving checkpoint's partitions: the logged
    log-probs of sampled rows against the serving checkpoint's, recomputed under each row's
    sampling (stage.json ``fidelity.overall``)."""

    partitions_checked: Count = Field(0, description="Partitions with rows checked.")
    partitions_quarantined: Count = Field(0, description="Partitions quarantined.")
    rows: Count = Field(0, description="Rows recomputed.")
    tokens: Count = Field(0, description="Completion tokens compared.")
    mean_abs_delta: float | None = Field(
        None, ge=0, description="Mean |recomputed - logged| log-prob per token (nats)."
    )
    max_abs_delta: float | None = Field(None, ge=0, description="Largest |delta| of a token.")
    unsupported_fraction: Probability | None = Field(
        None, description="Share of tokens outside the recomputed top-p/top-k."
    )
    is_weight_p01: float | None = Field(
        None, ge=0, description="1st percentile of the importance weights exp(delta)."
    )
    is_weight_p50: float | None = Field(None, ge=0, description="Their median.")
    is_weight_p99: float | None = Field(None, ge=0, description="Their 99th percentile.")


class DataSummary(ApiModel):
    """What the stage step selected for training."""

    manifest: StoreUri | None = Field(None, description="The staged training set.")
    interactions: Count = Field(0, description="Interactions used.")
    tokens: Count = Field(0, description="Completion tokens used.")
    on_policy_fraction: Probability | None = Field(
        None, description="Share served by the parent checkpoint itself."
    )
    quarantined: dict[str, Count] | None = Field(
        None, max_length=64, description="Rows skipped, by reason (never silently trained on)."
    )
    files_bad: Count = Field(0, description="Shard files that could not be read.")
    refused: dict[str, Count] | None = Field(
        None,
        max_length=16,
        description="Valid rows not trained on because their logged log-probs are not "
        "those of the distribution they were sampled from, by reason.",
    )
    fidelity: FidelitySummary | None = Field(
        None, description="The fidelity gate's figures; unset when it did not run."
    )
    since: datetime | None = Field(
        None, description="Interactions that became ready after this were read (the watermark)."
    )
    until: datetime | None = Field(
        None, description="... and at or before this (the stage's time, the next watermark)."
    )
    reward: RewardStats | None = Field(
        None, description="The reward of the staged interactions; unset when none had one."
    )
    monitors: dict[str, float] | None = Field(
        None,
        max_length=32,
        description="Behaviour monitors of the staged set (edit_rate, clarification_rate, "
        "invalid_tool_call_rate, mean_completion_tokens, latency_p95_ms, ...); a monitor "
        "undefined for the set (no rows, no tool calls) is left out.",
    )


class TrainingSummary(ApiModel):
    """Metrics of the training step (from its train.json)."""

    steps: Count = Field(0, description="Optimizer steps taken.")
    tokens: Count = Field(0, description="Completion tokens trained on.")
    loss: float | None = Field(None, description="Final policy loss.")
    kl: float | None = Field(None, description="Mean k3 KL to the parent.")
    clip_fraction: Probability | None = Field(None, description="Share of clipped tokens.")
    truncation_fraction: Probability | None = Field(
        None, description="Share of tokens whose importance ratio was truncated."
    )
    mean_advantage: float | None = Field(None, description="Mean advantage of the batch.")
    grad_norm: float | None = Field(None, ge=0, description="Last gradient norm.")
    tokens_per_second: float | None = Field(None, ge=0, description="Training throughput.")
    wall_seconds: float | None = Field(None, ge=0, description="Wall time of the step.")


class StepProgress(ApiModel):
    """How far the running step is, as it last said: the train step writes it to the store
    (``progress.json`` beside its result, :mod:`rtrl.core.api.progress`) about every 30
    seconds, and the operator copies it here on its next round."""

    step: Literal["train"] = Field(description="The step reporting.")
    done: Count = Field(description="How many units are done (optimizer steps for train).")
    total: Count | None = Field(None, description="How many there are; unset when unknown.")
    unit: str = Field(max_length=32, description="What is counted, e.g. steps.")
    rate: float | None = Field(
        None, ge=0, description="Units per second since the step's run began (or resumed)."
    )
    eta_seconds: float | None = Field(
        None, ge=0, description="Seconds left at that rate; unset before the first unit."
    )
    elapsed_seconds: float = Field(ge=0, description="Seconds since the run began (or resumed).")
    updated_at: datetime = Field(description="When the step wrote it.")


class Verdict(StrEnum):
    PASSED = "Passed"
    FAILED = "Failed"


class GateResult(ApiModel):
    """One eval gate: candidate vs parent, with the bootstrap interval of the difference."""

    metric: str = Field(max_length=128, description="<suite>.<metric>.")
    candidate: float = Field(description="Candidate's value.")
    parent: float = Field(description="Parent's value.")
    ci_low: float = Field(description="Lower bound of the difference's confidence interval.")
    ci_high: float = Field(description="Upper bound of the difference's confidence interval.")
    passed: bool = Field(description="False when the regression is significant.")


class EvalSummary(ApiModel):
    """The eval step's verdict (from its eval.json)."""

    verdict: Verdict = Field(description="Passed or Failed.")
    report: StoreUri | None = Field(None, description="Full eval.json.")
    gates: list[GateResult] | None = Field(None, max_length=64, description="Per-gate results.")


class Decision(StrEnum):
    PROMOTE = "promote"
    ROLLBACK = "rollback"
    CONTINUE = "continue"


class MetricComparison(ApiModel):
    """One metric of the A/B test: both arms, their difference and its always-valid interval."""

    name: str = Field(max_length=128, description="Metric name, e.g. edit_persistence.")
    baseline: float = Field(description="Stable arm's estimate.")
    canary: float = Field(description="Canary arm's estimate.")
    difference: float = Field(description="Canary minus baseline.")
    ci_low: float = Field(description="Lower bound of the always-valid interval.")
    ci_high: float = Field(description="Upper bound of the always-valid interval.")
    relative_difference: float | None = Field(
        None, description="Canary over baseline minus 1 (0.023 = +2.3%)."
    )
    relative_ci_low: float | None = Field(
        None, description="Lower bound of the always-valid interval of the relative difference."
    )
    relative_ci_high: float | None = Field(
        None, description="Upper bound of the always-valid interval of the relative difference."
    )
    verdict: str | None = Field(
        None,
        max_length=32,
        description="better, worse or inconclusive (goals); ok, beyond, tripped (guardrails); "
        "too-few-events.",
    )


class RolloutRecord(ApiModel):
    """One canary step as it happened."""

    weight: int = Field(ge=0, le=100, description="Canary traffic share in percent.")
    share: float | None = Field(
        None,
        ge=0,
        le=100,
        description="The share of traffic (percent) the canary got at this step: the weight "
        "with the gatewayapi router; with replicas, its replicas' share next to the stable "
        "ones (weight 25 next to one stable replica is one canary replica: 50).",
    )
    started_at: datetime = Field(description="When the step began.")
    ready_at: datetime | None = Field(
        None,
        description="When the canary was first ready at this step's weight: the analysis "
        "counts the step's interactions, and its sample ratio, from then.",
    )
    ended_at: datetime | None = Field(None, description="When the step ended.")
    decision: Decision | None = Field(None, description="promote, rollback or continue.")
    held: Decision | None = Field(
        None,
        description="The analysis's decision an approval gate holds (promote, held by "
        "rollout.approval): decision says what happens meanwhile (continue) until released.",
    )
    reason: str | None = Field(None, max_length=32768, description="Why, in words.")
    baseline_samples: Count | None = Field(None, description="Matured interactions, stable.")
    canary_samples: Count | None = Field(None, description="Matured interactions, canary.")
    metrics: list[MetricComparison] | None = Field(
        None, max_length=64, description="The A/B numbers at the end of the step."
    )
    analyses: Count = Field(0, description="Analyses judged during this step.")
    awaiting_approval: datetime | None = Field(
        None,
        description="Since when the canary waits at this step for an approval gate.",
    )
    gate: Literal["step", "promotion"] | None = Field(
        None, description="The gate it waits at: the next step's, or the promotion's."
    )
    approved: str | None = Field(
        None,
        max_length=1024,
        description="What released that gate: rtrl.io/approve=<token> or the confirm webhook.",
    )
    step: Count | None = Field(
        None, description="The index in spec.rollout.steps this record runs (0: the first)."
    )
    steps_hash: str | None = Field(
        None,
        max_length=64,
        description="A hash of spec.rollout.steps when the step started: an edit of the steps "
        "mid-canary restarts them at the first step.",
    )
    restarted: str | None = Field(
        None,
        max_length=1024,
        description="Set on the first step of restarted steps: what changed, and where the "
        "canary stood.",
    )


class CarriedRequest(ApiModel):
    """A request made by annotating the RLCycle, carried out by a write of this Checkpoint's
    status (that write is what takes its token: the RLCycle's ``status.last*`` follows in a
    later write, which a crash can lose, and a request must never be carried out twice)."""

    annotation: str = Field(
        max_length=253,
        description="The annotation: rtrl.io/rollback, rtrl.io/promote or rtrl.io/approve.",
    )
    value: str = Field(max_length=253, description="Its value: the request's token.")


class CheckpointStatus(ApiModel):
    """What happened to this model version; written only by the operator."""

    phase: CheckpointPhase | None = Field(None, description="Where in its life it is.")
    reason: str | None = Field(None, max_length=1024, description="CamelCase reason of phase.")
    message: str | None = Field(None, max_length=32768, description="Details, in words.")
    started_at: datetime | None = Field(None, description="When its cycle started.")
    completed_at: datetime | None = Field(None, description="When it reached a final phase.")
    data: DataSummary | None = Field(None, description="What it was trained on.")
    training: TrainingSummary | None = Field(None, description="Training metrics.")
    progress: StepProgress | None = Field(
        None,
        description="The running step's progress (done/total, rate, ETA), as it last "
        "reported it; the last report stays once the step is done.",
    )
    eval: EvalSummary | None = Field(None, description="Eval results and verdict.")
    rollout: list[RolloutRecord] | None = Field(
        None, max_length=64, description="Canary steps and their A/B results."
    )
    requests: list[CarriedRequest] | None = Field(
        None,
        max_length=16,
        description="The annotation requests of the RLCycle its writes carried out, newest "
        "last (a manual rollback, promotion or approval).",
    )
    observed_generation: Count | None = Field(
        None, description="The metadata.generation the status reflects."
    )
    conditions: list[Condition] | None = Field(
        None,
        max_length=MAX_CONDITIONS,
        description="Conditions with reasons.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )


class Checkpoint(ApiModel):
    """A Checkpoint manifest."""

    api_version: Literal["rtrl.io/v1alpha1"] = Field(
        "rtrl.io/v1alpha1", description="rtrl.io/v1alpha1"
    )
    kind: Literal["Checkpoint"] = Field("Checkpoint", description="Checkpoint")
    metadata: ObjectMeta = Field(description="Standard object metadata.")
    spec: CheckpointSpec = Field(description="Identity of the model version.")
    status: CheckpointStatus | None = Field(None, description="The observed state.")
