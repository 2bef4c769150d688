"""The RLCycle resource: the declarative real-time RL loop for one inference Deployment.

This is what a platform team commits to git. RLCycle is to Checkpoint what Deployment is
to ReplicaSet: each cycle of the loop produces one Checkpoint.

Cross-field rules are written twice, side by side: as a pydantic validator (clear message
naming the field) and as a CEL rule in ``model_config`` that the generated CRD carries, so
the API server rejects what ``rtrl validate`` rejects.
"""

from __future__ import annotations

import re
from datetime import datetime
from enum import StrEnum
from typing import Annotated, Literal, Self

from pydantic import (
    AfterValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from .adapter import AdapterSpec
from .common import (
    CEL_KEY,
    DNS_LABEL_PATTERN,
    MAX_CONDITIONS,
    MAX_COUNT,
    ApiModel,
    Condition,
    DnsLabel,
    DnsSubdomain,
    Duration1d,
    Duration7d,
    Duration30d,
    Duration365d,
    EnvName,
    Image,
    MaxDuration,
    ObjectMeta,
    Probability,
    ResourceRequirements,
    StoreUri,
    Toleration,
    cel,
    parse_duration,
)
from .cron import CRON_PATTERN, never_fires, parse_cron

# Derived child names (<rlcycle>-<cycle>-train, its headless Service, pod hostnames) must
# stay within the 63 characters of a DNS label.
MAX_RLCYCLE_NAME = 40
MAX_ROLLOUT_STEPS = 10
MAX_ORGS = 1000
# Counts a spec sets: far beyond any real cycle, far below int64 (2**63, where the API
# server's integers end).
MAX_INTERACTIONS = 10**12
MAX_TOKENS = 10**15
MAX_FIDELITY_ROWS = 4096

# An endpoint URL, and the rule that keeps credentials out of it: userinfo (``user:pass@``)
# before the host. A URL with it would put a secret in the RLCycle, in every pod's
# arguments and in error messages.
ENDPOINT_PATTERN = r"^https?://[^\s/]+(/[^\s]*)?$"
ENDPOINT_CREDENTIALS_RULE = "!self.matches('^https?://[^/]*@')"
_ENDPOINT_USERINFO = re.compile(r"^https?://[^/]*@")
ENDPOINT_CREDENTIALS = (
    "must not hold credentials (user:password@host): put them in a Secret and set credentialsSecret"
)
# A label value, as core/v1 bounds it. (Keys stay unconstrained here: a structural schema
# cannot bound a map's keys, and the API server checks a pod's node selector itself.)
LabelValue = Annotated[str, Field(max_length=63)]


def _cron(expression: str) -> str:
    problem = never_fires(parse_cron(expression))
    if problem:
        raise ValueError(f"cron expression {expression!r} never fires: {problem}")
    return expression


# The pattern goes to the CRD only; pydantic runs the parser, whose message is clearer.
Cron = Annotated[
    str,
    Field(max_length=128, json_schema_extra={"pattern": CRON_PATTERN}),
    AfterValidator(_cron),
]


class TargetSpec(ApiModel):
    """The inference Deployment that serves the model, and how a checkpoint is injected."""

    deployment: DnsSubdomain = Field(
        description="Name of the inference Deployment (same namespace) that serves the model."
    )
    container: DnsLabel = Field(
        description="Name of the container in that Deployment that loads the checkpoint."
    )
    checkpoint_env: EnvName = Field(
        "MODEL_URI",
        description="Environment variable of that container that holds the checkpoint URI.",
    )


class ScheduleSpec(ApiModel):
    """When cycles start: every ``interval`` after the previous one started, or on ``cron``.

    A cycle can also be started by hand with the annotation ``rtrl.io/trigger``.
    """

    model_config = ConfigDict(
        json_schema_extra={
            CEL_KEY: [
                cel(
                    "has(self.interval) != has(self.cron)",
                    "set exactly one of interval and cron",
                )
            ]
        }
    )

    interval: Duration365d | None = Field(
        None,
        description="Start a cycle this long after the previous one started, e.g. 5h "
        "(at most 365d).",
    )
    cron: Cron | None = Field(
        None, description="Start cycles on this cron schedule (UTC), e.g. '0 */5 * * *'."
    )

    @model_validator(mode="after")
    def _one_of(self) -> Self:
        if (self.interval is None) == (self.cron is None):
            raise ValueError("set exactly one of interval and cron")
        return self


class PopulationSpec(ApiModel):
    """Which users' interactions to learn from: all by default, or some organisations
    (specialising a model for one organisation)."""

    orgs: list[Annotated[str, Field(min_length=1, max_length=253)]] | None = Field(
        None, min_length=1, max_length=MAX_ORGS, description="Only interactions of these orgs."
    )
    exclude_orgs: list[Annotated[str, Field(min_length=1, max_length=253)]] | None = Field(
        None, min_length=1, max_length=MAX_ORGS, description="Never interactions of these orgs."
    )


class FidelitySpec(ApiModel):
    """The stage's fidelity gate: per partition (checkpoint, date, hour) of the serving
    checkpoint, a few rows' log-probs are recomputed with that checkpoint under each row's
    sampling parameters and compared with what the engine logged. A partition that
    disagrees (another checkpoint served it, or its temperature or log-prob mode is not what
    its rows say) is quarantined. Defaults pass a bfloat16 engine's rounding and catch a
    wrong checkpoint or temperature."""

    sample_rows: int = Field(
        8,
        ge=0,
        le=MAX_FIDELITY_ROWS,
        description="Rows recomputed per partition (one forward pass of the serving "
        "checkpoint each); 0 turns the gate off.",
    )
    max_mean_abs_delta: float = Field(
        0.1,
        gt=0,
        le=100,
        description="Mean |recomputed - logged| log-prob per token (nats) above which a "
        "partition is quarantined.",
    )
    max_unsupported_fraction: Probability = Field(
        0.02,
        description="Share of logged tokens outside the recomputed top-p/top-k above which a "
        "partition is quarantined.",
    )


class DataSpec(ApiModel):
    """Where the interaction shards are and which of them a cycle may train on."""

    shards: StoreUri = Field(
        description="Prefix of the Hive-partitioned Parquet interaction shards "
        "(s3://bucket/prefix/ or file:///path/)."
    )
    checkpoint_partition: Annotated[str, Field(pattern=r"^[a-z_][a-z0-9_]*$")] = Field(
        "checkpoint",
        max_length=63,
        description="Hive partition key that holds the serving checkpoint id "
        "(interactions/<key>=<id>/...).",
    )
    maturity: Duration365d = Field(
        "1h",
        description="How long after an interaction its feedback is final (edit persistence is "
        "known later); younger interactions wait for a later cycle (at most 365d).",
    )
    window: Duration365d | None = Field(
        None,
        description="Only interactions created this long before the cycle starts (at most "
        "365d); unset: all since the serving checkpoint went live.",
    )
    min_interactions: int = Field(
        1000,
        ge=1,
        le=MAX_INTERACTIONS,
        description="Fewer matured interactions than this: the cycle waits.",
    )
    min_tokens: int = Field(
        0, ge=0, le=MAX_TOKENS, description="Fewer completion tokens than this: the cycle waits."
    )
    max_off_policy_fraction: Probability = Field(
        0.0,
        description="Share of the training set that may come from the previous checkpoint "
        "(importance-weighted by its logged log-probs).",
    )
    max_bad_fraction: Probability = Field(
        0.01,
        description="Share of rows that may be quarantined (unreadable or invalid) before the "
        "stage step fails instead of training.",
    )
    population: PopulationSpec | None = Field(
        None, description="Restrict learning to part of the user population."
    )
    fidelity: FidelitySpec = Field(
        default_factory=FidelitySpec,
        description="Check that the logged log-probs are the serving checkpoint's, under each "
        "row's sampling parameters.",
    )


class BaselineKind(StrEnum):
    BATCH = "batch"
    ORG = "org"


class RewardSpec(ApiModel):
    """Reward = weighted sum of the implicit-feedback signals of one interaction.

    An interaction with an invalid tool call gets the ``invalidToolCall`` weight, it is never
    dropped: dropping those taught a model to emit broken calls on tasks it expected to fail.
    """

    edit_persisted: float = Field(
        1.0, ge=-100, le=100, description="Weight of edit persistence (0..1, measured later)."
    )
    dissatisfied_followup: float = Field(
        -1.0, ge=-100, le=100, description="Weight of a dissatisfied follow-up (0 or 1)."
    )
    latency: float = Field(
        -0.1,
        ge=-100,
        le=100,
        description="Weight of latency in units of latencyScaleMs (latency_ms / latencyScaleMs).",
    )
    latency_scale_ms: float = Field(
        10_000.0, gt=0, le=3_600_000, description="Latency that counts as one unit."
    )
    invalid_tool_call: float = Field(
        -1.0,
        ge=-100,
        le=100,
        description="Reward added when any tool call of the interaction was invalid.",
    )
    asked_clarification: float = Field(
        0.0,
        ge=-100,
        le=100,
        description="Reward added when the model asked a clarifying question instead of editing.",
    )
    clip: float = Field(5.0, gt=0, le=1000, description="Rewards are clipped to [-clip, clip].")
    baseline: BaselineKind = Field(
        BaselineKind.BATCH,
        description="Advantage baseline: the batch mean, or the mean per org (stratum).",
    )

    @model_validator(mode="after")
    def _some_signal(self) -> Self:
        weights = (
            self.edit_persisted,
            self.dissatisfied_followup,
            self.latency,
            self.invalid_tool_call,
            self.asked_clarification,
        )
        if not any(weights):
            raise ValueError("at least one reward weight must be non-zero")
        return self

    model_config = ConfigDict(
        json_schema_extra={
            CEL_KEY: [
                cel(
                    # Every weight has a default, which the API server fills in first.
                    "self.editPersisted != 0.0 || self.dissatisfiedFollowup != 0.0 || "
                    "self.latency != 0.0 || self.invalidToolCall != 0.0 || "
                    "self.askedClarification != 0.0",
                    "at least one reward weight must be non-zero",
                )
            ]
        }
    )


class Precision(StrEnum):
    BF16 = "bf16"
    FP32 = "fp32"


class TrainingSpec(ApiModel):
    """The DeepSpeed policy-gradient training Job: where it runs and how it learns."""

    image: Image = Field(description="Trainer image (runs `rtrl-job train`).")
    nodes: int = Field(1, ge=1, le=512, description="Pods of the Indexed training Job.")
    gpus_per_node: int = Field(8, ge=0, le=16, description="GPUs per pod (0 trains on CPU).")
    gpu_resource: str = Field(
        "nvidia.com/gpu",
        pattern=r"^([a-z0-9.-]+/)?[a-z0-9]([-a-z0-9_.]*[a-z0-9])?$",
        max_length=253,
        description="Extended resource name that requests one GPU.",
    )
    resources: ResourceRequirements | None = Field(
        None, description="CPU and memory of each training pod (GPUs come from gpusPerNode)."
    )
    node_selector: dict[str, LabelValue] | None = Field(
        None, max_length=64, description="Node labels the training pods must run on."
    )
    tolerations: list[Toleration] | None = Field(
        None, max_length=64, description="Tolerations of the training pods (e.g. GPU taints)."
    )
    zero_stage: int = Field(2, ge=0, le=3, description="DeepSpeed ZeRO stage (0-3).")
    precision: Precision = Field(Precision.BF16, description="bf16 (default) or fp32.")
    learning_rate: float = Field(1e-6, gt=0, le=1, description="AdamW learning rate.")
    batch_tokens: int = Field(
        1_048_576,
        ge=1,
        le=2**32,
        description="Global batch in completion tokens; gradients accumulate up to it.",
    )
    micro_batch_size: int = Field(
        1, ge=1, le=1024, description="Sequences per GPU per forward pass."
    )
    micro_batch_tokens: int | None = Field(
        None,
        ge=16,
        le=16_777_216,
        description="Token budget per GPU per forward pass: a step's rows are grouped, longest "
        "first, so that rows x the longest (or, packed, the rows' lengths summed) stay within it; "
        "replaces microBatchSize. A longer row is a forward pass of its own.",
    )
    pack_sequences: bool = Field(
        False,
        description="Pack rows back to back into one sequence per forward pass, position ids "
        "restarting per row so each row attends only to itself (the loss is the unpacked one, "
        "with no padding), up to microBatchTokens tokens (default maxSequenceLength).",
    )
    max_sequence_length: int = Field(
        8192, ge=16, le=1_048_576, description="Longer interactions are truncated."
    )
    epochs: int = Field(1, ge=1, le=16, description="Passes over the staged set per cycle.")
    clip_ratio: float = Field(
        0.2,
        gt=0,
        le=1,
        description="PPO clip range of the ratio to the policy at the start of the cycle.",
    )
    is_truncation: float = Field(
        2.0,
        ge=1,
        le=100,
        description="Cap of the importance ratio to the logged serving policy (TIS).",
    )
    kl_coef: float = Field(
        0.02, ge=0, le=10, description="Weight of the k3 KL penalty to the parent checkpoint."
    )
    grad_clip: float = Field(1.0, gt=0, le=1000, description="Gradient-norm clip.")
    activation_checkpointing: bool = Field(
        False, description="Recompute activations in backward to save memory."
    )
    seed: int = Field(0, ge=0, le=2**32 - 1, description="Random seed of the training run.")


class EvalSuite(StrEnum):
    REPLAY = "replay"
    TASKS = "tasks"
    BEHAVIOUR = "behaviour"
    HUMANEVAL = "humaneval"


class RegressionMode(StrEnum):
    ABSOLUTE = "absolute"
    RELATIVE = "relative"


class EvalGate(ApiModel):
    """A candidate fails this gate when ``metric`` regresses by more than ``maxRegression``
    vs the parent, significantly at the eval ``alpha``."""

    metric: str = Field(
        pattern=r"^[a-z]+\.[a-z0-9_@.]+$",
        max_length=128,
        description="<suite>.<metric>, e.g. tasks.pass_at_1.",
    )
    max_regression: float = Field(
        ge=0,
        le=1_000_000,
        description="Largest tolerated regression, in the metric's units (absolute) or as a "
        "share of the parent's value (relative).",
    )
    mode: RegressionMode = Field(
        RegressionMode.ABSOLUTE, description="Whether maxRegression is absolute or relative."
    )


GatesSource = Literal["default", "spec"]

# The gates a candidate must pass when ``spec.eval.gates`` is unset: one per suite, on the
# metric that suite exists to protect (see EvalSpec.effective_gates). Absolute thresholds.
DEFAULT_GATES: dict[EvalSuite, tuple[tuple[str, float], ...]] = {
    # The trust region: KL(candidate || parent) in nats per token; the parent's own KL is 0.
    EvalSuite.REPLAY: (("replay.kl", 0.05),),
    # At most one point of pass@1 lost on the sandboxed coding tasks.
    EvalSuite.TASKS: (("tasks.pass_at_1", 0.01),),
    EvalSuite.HUMANEVAL: (("humaneval.pass_at_1", 0.01),),
    # Valid tool calls / tool calls: half a point; broken calls break users' sessions.
    EvalSuite.BEHAVIOUR: (("behaviour.tool_call_validity", 0.005),),
}


class EvalSpec(ApiModel):
    """Suites a candidate runs before any user sees it, and the gates it must pass.

    ``gates`` unset means the default gates of the configured suites (``DEFAULT_GATES``);
    ``gates: []`` means no gates, an explicit choice.
    """

    model_config = ConfigDict(
        json_schema_extra={
            CEL_KEY: [
                cel(
                    "!has(self.gates) || self.gates.all(g, "
                    "(has(self.suites) ? self.suites : ['replay', 'tasks', 'behaviour'])"
                    ".exists(s, g.metric.startsWith(s + '.')))",
                    "every gate metric must belong to one of the suites (<suite>.<metric>)",
                    field_path=".gates",
                ),
            ]
        }
    )

    suites: list[EvalSuite] = Field(
        default_factory=lambda: [EvalSuite.REPLAY, EvalSuite.TASKS, EvalSuite.BEHAVIOUR],
        min_length=1,
        max_length=len(EvalSuite),
        json_schema_extra={"x-kubernetes-list-type": "set"},
        description="Suites to run: replay, tasks, behaviour, humaneval "
        "(default: replay, tasks, behaviour).",
    )
    gates: list[EvalGate] | None = Field(
        None,
        max_length=64,
        description="Regression gates. Unset: the default gates of the configured suites "
        "(replay.kl 0.05, tasks.pass_at_1 0.01, humaneval.pass_at_1 0.01, "
        "behaviour.tool_call_validity 0.005, all absolute); [] for no gates.",
    )
    alpha: float = Field(
        0.05, gt=0, le=0.5, description="Significance level of the gates' bootstrap test."
    )

    @field_validator("suites")
    @classmethod
    def _unique_suites(cls, suites: list[EvalSuite]) -> list[EvalSuite]:
        if len(set(suites)) != len(suites):
            raise ValueError("each suite may appear once")
        return suites

    @field_validator("gates")
    @classmethod
    def _gates_use_suites(
        cls, gates: list[EvalGate] | None, info: ValidationInfo
    ) -> list[EvalGate] | None:
        suites = info.data.get("suites")
        if gates is None or suites is None:  # unset: the defaults; suites invalid: reported
            return gates
        for i, gate in enumerate(gates):
            suite = gate.metric.split(".", 1)[0]
            if suite not in suites:
                raise ValueError(
                    f"every gate metric must belong to one of the suites: gates[{i}].metric "
                    f"{gate.metric!r} needs suite {suite!r}, suites are "
                    f"{', '.join(map(str, suites))}"
                )
        return gates

    def effective_gates(self) -> tuple[list[EvalGate], GatesSource]:
        """The gates the eval step judges, and where they come from.

        ``gates`` unset (None) gives ``DEFAULT_GATES`` of exactly the configured suites
        (source ``"default"``); a list, even an empty one, is used as written (``"spec"``).
        Unset used to mean no gates, so an RLCycle that never thought about its gates
        passed any candidate, however far it had drifted from its parent: a safe default
        has to gate, and turning the gates off has to be written down (``gates: []``).
        """
        if self.gates is not None:
            return list(self.gates), "spec"
        gates = [
            EvalGate(metric=metric, max_regression=threshold, mode=RegressionMode.ABSOLUTE)
            for suite in self.suites
            for metric, threshold in DEFAULT_GATES[EvalSuite(suite)]
        ]
        return gates, "default"


class Approval(StrEnum):
    """Who releases an approval gate: a person (``kubectl rtrl approve``) or a confirm
    webhook (HTTP 200 releases it; any other answer holds it, asked again every interval)."""

    MANUAL = "manual"
    WEBHOOK = "webhook"


class SecretKeyRef(ApiModel):
    """A key of a Secret in the RLCycle's namespace. URLs of webhooks carry tokens (Slack's,
    Teams'), so they are read from a Secret, never written into the RLCycle."""

    name: DnsSubdomain = Field(description="Name of the Secret (same namespace).")
    key: str = Field(
        pattern=r"^[-._a-zA-Z0-9]+$",
        min_length=1,
        max_length=253,
        description="Key of the Secret whose value is the URL.",
    )


class ConfirmWebhookSpec(ApiModel):
    """The confirm webhook of ``approval: webhook`` gates (Flagger's confirm-rollout): POSTed
    a JSON document naming the gate; HTTP 200 releases it, anything else holds it."""

    url_secret: SecretKeyRef = Field(description="Secret key holding the webhook's URL.")
    interval: Duration1d = Field(
        "1m", description="How often a held gate asks the webhook again (at most 1d)."
    )


class RolloutStep(ApiModel):
    """One canary step: the canary's share of traffic and how long it holds at least."""

    weight: int = Field(ge=1, le=100, description="Canary traffic share in percent.")
    min_duration: Duration30d = Field(
        description="Stay at least this long at this weight (at most 30d)."
    )
    min_samples: int = Field(
        0,
        ge=0,
        le=MAX_INTERACTIONS,
        description="And until each arm has this many matured interactions.",
    )
    approval: Approval | None = Field(
        None,
        description="Hold the canary at the step before this one until approved: manual "
        "(kubectl rtrl approve, annotation rtrl.io/approve) or webhook (rollout."
        "confirmWebhook answers HTTP 200). The analysis goes on meanwhile; a rollback is "
        "never held. Not on the first step.",
    )


class InconclusivePolicy(StrEnum):
    ROLLBACK = "rollback"
    PROMOTE_IF_NON_INFERIOR = "promote-if-non-inferior"
    HOLD = "hold"


class SequentialTest(StrEnum):
    """How the analysis stays valid while it looks again and again."""

    GROUP_SEQUENTIAL = "group-sequential"
    MIXTURE = "mixture"


class AnalysisSpec(ApiModel):
    """The sequential A/B test that decides promotion."""

    alpha: float = Field(
        0.05, gt=0, le=0.5, description="Error rate of the always-valid sequential test."
    )
    max_duration: Duration365d = Field(
        "24h",
        description="After this long without a decision, the inconclusive policy applies "
        "(at most 365d).",
    )
    inconclusive: InconclusivePolicy = Field(
        InconclusivePolicy.ROLLBACK,
        description="At maxDuration: rollback, promote-if-non-inferior, or hold.",
    )
    non_inferiority_margin: float = Field(
        0.01, ge=0, le=1, description="Relative margin for promote-if-non-inferior."
    )
    interval: Duration1d = Field(
        "15m",
        description="How often the analysis runs again while a step waits for samples or "
        "evidence (after the step's minDuration; at most 1d).",
    )
    srm_alpha: float = Field(
        0.001,
        gt=0,
        le=0.1,
        description="Significance of the sample-ratio-mismatch check (arm shares vs weight).",
    )
    variance_reduction: bool = Field(
        True,
        description="CUPED: adjust each metric by the same unit's metric on the stable "
        "checkpoint during preExposure before the canary started.",
    )
    pre_exposure: Duration365d = Field(
        "7d",
        description="How far before the canary's start the stable arm's interactions (the "
        "baseline and the checkpoints that served before it) give each unit's "
        "pre-exposure covariates (variance reduction; at most 365d).",
    )
    sequential_test: SequentialTest = Field(
        SequentialTest.GROUP_SEQUENTIAL,
        description="group-sequential: the error is spent over the planned analyses (every "
        "interval until maxDuration; an analysis between two of them repeats the last one's "
        "answer); mixture: always-valid intervals, for any number of analyses at any time "
        "(e.g. past maxDuration with inconclusive: hold), at the price of wider intervals.",
    )
    spending_exponent: float = Field(
        3.0,
        ge=0,
        le=10,
        description="group-sequential: the share of alpha spent by a fraction t of "
        "maxDuration is t to this power (1 spends it evenly over the canary; 0: "
        "O'Brien-Fleming's shape, which saves nearly all of it for the end; larger spends "
        "later: 3 keeps most of it for the hours when a lasting effect can show).",
    )
    precision_weighting: bool = Field(
        True,
        description="With users or sessions as the unit: promotion rests on the primary "
        "goal with each unit weighted by its precision (its rows count until its own "
        "deviation from its covariate dominates them), so heavy and new units do not drown "
        "the others; harm is still judged with every interaction counted alike.",
    )
    novelty_window: Duration1d | None = Field(
        None,
        description="Promotion also needs the primary goal significantly better among the "
        "interactions of users at least this long after their first in the canary: a "
        "novelty effect is not promoted (e.g. 2h; unset: off). Set it only where canaries "
        "last well beyond it: a canary shorter than the window is never promoted.",
    )


class Band(ApiModel):
    """How far a behaviour monitor of the canary may move from the stable arm."""

    model_config = ConfigDict(
        json_schema_extra={
            CEL_KEY: [
                cel(
                    "has(self.maxRelativeDrop) || has(self.maxRelativeRise)",
                    "set maxRelativeDrop, maxRelativeRise or both",
                )
            ]
        }
    )

    max_relative_drop: float | None = Field(
        None, ge=0, le=1, description="Largest tolerated relative fall (0.05 = 5%)."
    )
    max_relative_rise: float | None = Field(
        None, ge=0, le=100, description="Largest tolerated relative rise (0.10 = 10%)."
    )

    @model_validator(mode="after")
    def _some_bound(self) -> Self:
        if self.max_relative_drop is None and self.max_relative_rise is None:
            raise ValueError("set maxRelativeDrop, maxRelativeRise or both")
        return self


class GuardrailsSpec(ApiModel):
    """Behaviour monitors that block promotion when they move too far: the reward-hacking
    tripwires (e.g. a falling edit rate with a rising clarification rate)."""

    edit_rate: Band | None = Field(
        default_factory=lambda: Band(max_relative_drop=0.05),
        description="Share of interactions with an edit proposed.",
    )
    clarification_rate: Band | None = Field(
        default_factory=lambda: Band(max_relative_rise=0.10),
        description="Share of interactions where the model asked a clarifying question.",
    )
    invalid_tool_call_rate: Band | None = Field(
        default_factory=lambda: Band(max_relative_rise=0.10),
        description="Share of tool calls that were invalid.",
    )
    mean_completion_tokens: Band | None = Field(
        None, description="Mean completion length in tokens."
    )
    latency_p95: Band | None = Field(None, description="95th percentile latency.")
    feedback_missing_rate: Band | None = Field(
        default_factory=lambda: Band(max_relative_rise=0.10),
        description="Share of interactions older than data.maturity whose feedback never "
        "arrived: a canary that suppresses feedback would otherwise look better.",
    )
    rows_per_unit: Band | None = Field(
        None,
        description="Logged interactions per unit of assignment (per request: each arm's "
        "interactions against its share): a logging fault that drops one arm's rows moves "
        "it before the rows it leaves mislead the goals.",
    )
    logged_per_served: Band | None = Field(
        default_factory=lambda: Band(max_relative_drop=0.01),
        description="Share of the requests an arm served (the capture proxy's generation "
        "events) that reached the shards, in the sealed hours of the canary: a logging "
        "fault or failing requests in one arm. Judged when the analysis has the events.",
    )


class Router(StrEnum):
    REPLICAS = "replicas"
    GATEWAY_API = "gatewayapi"


class AssignmentUnit(StrEnum):
    """What is assigned whole to one arm: each request on its own, or every request of a
    user (or a session). The analysis clusters by it; the gatewayapi router sticks it."""

    REQUEST = "request"
    USER = "user"
    SESSION = "session"


# An HTTP header name (RFC 9110 token), as Gateway API's HTTPHeaderName.
HEADER_NAME_PATTERN = r"^[A-Za-z0-9!#$%&'*+\-.^_`|~]+$"


FIRST_STEP_APPROVAL = (
    "steps[0].approval: the canary starts at the first step, there is no step before it "
    "to hold; gate the second step or the promotion (rollout.approval)"
)
WEBHOOK_NEEDS_CONFIRM = "approval webhook needs confirmWebhook (the Secret key of its URL)"


def _default_steps() -> list[RolloutStep]:
    return [
        RolloutStep(weight=5, min_duration="30m"),
        RolloutStep(weight=25, min_duration="1h"),
        RolloutStep(weight=50, min_duration="1h"),
    ]


def _increasing_weights_rule() -> str:
    """CEL for 'weights strictly increasing'. Standard CEL cannot compare list neighbours in
    a comprehension, so the rule spells out each adjacent pair up to the list's maxItems."""
    pairs = [
        f"(size(self) <= {i + 1} || self[{i}].weight < self[{i + 1}].weight)"
        for i in range(MAX_ROLLOUT_STEPS - 1)
    ]
    return " && ".join(pairs)


class RolloutSpec(ApiModel):
    """How a candidate that passed eval reaches users: canary steps, A/B analysis, guardrails."""

    model_config = ConfigDict(
        json_schema_extra={
            CEL_KEY: [
                cel(
                    "!has(self.router) || self.router != 'gatewayapi' || "
                    "(has(self.httpRoute) && has(self.service))",
                    "router gatewayapi needs httpRoute and service",
                ),
                cel(
                    "!has(self.router) || self.router != 'gatewayapi' || !has(self.unit) || "
                    "self.unit == 'request' || has(self.bucketHeader)",
                    "router gatewayapi with unit user or session needs bucketHeader",
                ),
                cel(
                    "has(self.confirmWebhook) || !((has(self.approval) && "
                    "self.approval == 'webhook') || (has(self.steps) && "
                    "self.steps.exists(s, has(s.approval) && s.approval == 'webhook')))",
                    WEBHOOK_NEEDS_CONFIRM,
                ),
            ]
        }
    )

    router: Router = Field(
        Router.REPLICAS,
        description="replicas: split by replica ratio behind the existing Service; "
        "gatewayapi: weights on an HTTPRoute's backendRefs.",
    )
    http_route: DnsSubdomain | None = Field(
        None, description="HTTPRoute whose backendRefs rtrl weights (router gatewayapi)."
    )
    service: DnsSubdomain | None = Field(
        None, description="Service of the stable arm in that HTTPRoute (router gatewayapi)."
    )
    unit: AssignmentUnit = Field(
        AssignmentUnit.REQUEST,
        description="Unit of assignment: request (the replicas router's per-connection "
        "split), user or session (each assigned whole; the analysis clusters by "
        "user_id or session_id).",
    )
    bucket_header: str | None = Field(
        None,
        pattern=HEADER_NAME_PATTERN,
        max_length=256,
        description="Router gatewayapi with unit user or session: a header the edge sets "
        "to hash(unit id) mod 100 (0..99); requests whose bucket is below the weight go "
        "to the canary, so a unit stays in one arm.",
    )
    steps: list[RolloutStep] = Field(
        default_factory=_default_steps,
        min_length=1,
        max_length=MAX_ROLLOUT_STEPS,
        description="Canary steps; weights strictly increasing within 1..100.",
        json_schema_extra={
            CEL_KEY: [
                cel(_increasing_weights_rule(), "step weights must be strictly increasing"),
                cel("!has(self[0].approval)", FIRST_STEP_APPROVAL),
            ]
        },
    )
    ready_timeout: Duration7d = Field(
        "30m",
        description="The canary must be ready (model loaded) within this, else rollback "
        "(at most 7d).",
    )
    analysis: AnalysisSpec = Field(
        default_factory=AnalysisSpec, description="The sequential A/B test."
    )
    guardrails: GuardrailsSpec = Field(
        default_factory=GuardrailsSpec, description="Behaviour bands that block promotion."
    )
    approval: Approval | None = Field(
        None,
        description="Hold a promotion the analysis decided until approved: manual (kubectl "
        "rtrl approve) or webhook (confirmWebhook answers HTTP 200). A rollback is never held.",
    )
    confirm_webhook: ConfirmWebhookSpec | None = Field(
        None, description="The confirm webhook of approval: webhook gates."
    )

    @field_validator("steps")
    @classmethod
    def _increasing(cls, steps: list[RolloutStep]) -> list[RolloutStep]:
        for i in range(1, len(steps)):
            if steps[i].weight <= steps[i - 1].weight:
                raise ValueError(
                    f"step weights must be strictly increasing: steps[{i}].weight "
                    f"{steps[i].weight} is not greater than steps[{i - 1}].weight "
                    f"{steps[i - 1].weight}"
                )
        if steps and steps[0].approval is not None:
            raise ValueError(FIRST_STEP_APPROVAL)
        return steps

    @model_validator(mode="after")
    def _router_refs(self) -> Self:
        if self.router == Router.GATEWAY_API and not (self.http_route and self.service):
            raise ValueError("router gatewayapi needs httpRoute and service")
        if (
            self.router == Router.GATEWAY_API
            and self.unit != AssignmentUnit.REQUEST
            and not self.bucket_header
        ):
            raise ValueError(
                "router gatewayapi with unit user or session needs bucketHeader (a header "
                "holding hash(unit id) mod 100, set at the edge)"
            )
        webhook = self.approval == Approval.WEBHOOK or any(
            s.approval == Approval.WEBHOOK for s in self.steps
        )
        if webhook and self.confirm_webhook is None:
            raise ValueError(WEBHOOK_NEEDS_CONFIRM)
        return self


class StorageRetries(ApiModel):
    """How hard the step pods retry a busy object store (S3's 503 SlowDown, bodies that
    break off mid-read): a step that gives up early fails a whole cycle for it. Unset
    fields take the step's defaults (standard mode, 10 tries of each kind)."""

    mode: Literal["standard", "adaptive"] | None = Field(
        None,
        description="botocore's retry mode (AWS_RETRY_MODE): adaptive also slows the "
        "client down when S3 throttles.",
    )
    max_attempts: int | None = Field(
        None,
        ge=1,
        le=50,
        description="Tries per request in all, the first included (AWS_MAX_ATTEMPTS).",
    )
    body_attempts: int | None = Field(
        None,
        ge=1,
        le=50,
        description="Tries to read an object's body that breaks off mid-read "
        "(RTRL_S3_BODY_ATTEMPTS), with backoff, for at most two minutes in all.",
    )


class StorageSpec(ApiModel):
    """Where artifacts go and how pods reach the object store. Credentials are never inline:
    a Secret reference or the pod's cloud role through its service account."""

    model_config = ConfigDict(
        json_schema_extra={
            CEL_KEY: [
                cel(
                    "!has(self.credentialsSecret) || !has(self.serviceAccountName) || "
                    "self.credentialsSecret == '' || self.serviceAccountName == ''",
                    "set credentialsSecret or serviceAccountName, not both",
                )
            ]
        }
    )

    artifacts: StoreUri = Field(
        description="Prefix under which checkpoints and step results are written."
    )
    endpoint: str | None = Field(
        None,
        pattern=ENDPOINT_PATTERN,
        max_length=1024,
        description="S3-compatible endpoint URL (MinIO, Ceph, GCS interop); unset: AWS. "
        "Never with credentials in it (user:password@): they go in credentialsSecret.",
        json_schema_extra={CEL_KEY: [cel(ENDPOINT_CREDENTIALS_RULE, ENDPOINT_CREDENTIALS)]},
    )
    region: str | None = Field(
        None, pattern=r"^[a-z0-9-]+$", max_length=64, description="S3 region."
    )
    credentials_secret: DnsSubdomain | None = Field(
        None,
        description="Secret with AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
        "mounted as read-only files (never environment) into Job pods.",
    )
    service_account_name: DnsSubdomain | None = Field(
        None, description="Service account of Job pods, for a cloud role (IRSA, Workload ID)."
    )
    retries: StorageRetries | None = Field(
        None, description="Retry budgets of the step pods' object store client."
    )

    @model_validator(mode="before")
    @classmethod
    def _no_inline_credentials(cls, data: object) -> object:
        if isinstance(data, dict):
            inline = [
                str(key)
                for key in data
                if any(
                    w in str(key).lower() for w in ("secretaccesskey", "accesskeyid", "password")
                )
            ]
            if inline:
                raise ValueError(
                    f"{', '.join(inline)}: credentials are never written into an RLCycle; "
                    "put them in a Secret and set credentialsSecret"
                )
        return data

    @field_validator("endpoint")
    @classmethod
    def _no_credentials_in_endpoint(cls, endpoint: str | None) -> str | None:
        # The message never repeats the URL: it holds a secret.
        if endpoint is not None and _ENDPOINT_USERINFO.match(endpoint):
            raise ValueError(ENDPOINT_CREDENTIALS)
        return endpoint

    @model_validator(mode="after")
    def _one_identity(self) -> Self:
        if self.credentials_secret and self.service_account_name:
            raise ValueError("set credentialsSecret or serviceAccountName, not both")
        return self


class JobPolicySpec(ApiModel):
    """How the operator retries a failed step Job (stage, train, eval).

    A failed Job is recreated as a new attempt (``<checkpoint>-<step>-<attempt>``), after a
    delay that doubles with each attempt; training resumes from its last saved step. When
    the attempts are spent, the Checkpoint is Failed with the pod's reason and the serving
    model is left as it is.
    """

    backoff_limit: int = Field(
        2, ge=0, le=10, description="Retries of a failed step Job before the cycle fails."
    )
    backoff: Duration1d = Field(
        "30s",
        description="Delay before the first retry; each further retry waits twice as long "
        "(at most 1d).",
    )
    active_deadline: Duration30d | None = Field(
        None,
        description="Wall-clock limit of one attempt of a step Job (at most 30d); unset: none.",
    )


MAX_NOTIFICATIONS = 8


class NotificationEvent(StrEnum):
    """What a notification is about: the RLCycle's phase changes and decisions."""

    CYCLE_STARTED = "CycleStarted"
    CYCLE_COMPLETED = "CycleCompleted"
    CYCLE_FAILED = "CycleFailed"
    EVAL_REJECTED = "EvalRejected"
    CANARY_STARTED = "CanaryStarted"
    CANARY_STEP = "CanaryStep"
    AWAITING_APPROVAL = "AwaitingApproval"
    APPROVED = "Approved"
    GUARDRAIL_TRIPPED = "GuardrailTripped"
    PROMOTED = "Promoted"
    ROLLED_BACK = "RolledBack"


class NotificationFormat(StrEnum):
    JSON = "json"
    CLOUDEVENTS = "cloudevents"
    SLACK = "slack"


class NotificationSpec(ApiModel):
    """One webhook told about the RLCycle's phase changes and decisions."""

    name: DnsLabel = Field(description="Name of this notification (unique in the list).")
    events: list[NotificationEvent] | None = Field(
        None,
        min_length=1,
        max_length=len(NotificationEvent),
        description="Events sent; unset: all of them.",
        json_schema_extra={"x-kubernetes-list-type": "set"},
    )
    format: NotificationFormat = Field(
        NotificationFormat.JSON,
        description="json: rtrl's JSON document; cloudevents: a CloudEvents 1.0 structured "
        'JSON event (application/cloudevents+json); slack: {"text": ...} for Slack, '
        "Mattermost, Teams workflows.",
    )
    url_secret: SecretKeyRef = Field(
        description="Secret key holding the webhook's URL (never written into the RLCycle)."
    )


MAX_COMMIT_INTERVAL = "10s"
CAPTURE_PORTS_DIFFER = (
    "port and enginePort must differ: the sidecar serves clients on port and calls the "
    "engine on enginePort, in the same pod"
)
CAPTURE_OVERLAPS_SHARDS = (
    "capture.events and data.shards must not hold one another: the sidecars write events "
    "under capture.events, the seal writes shards under data.shards"
)
ADAPTER_ONE_ORG = (
    "adapter: data.population.orgs must name exactly one organisation, the one whose rows "
    "train the adapter and whose requests it serves"
)
ADAPTER_ROUTES = (
    "adapter: capture.adapters.configMap must name the routing table the adapter's canary, "
    "promotion and rollback are written to"
)


def _with_slash(expr: str) -> str:
    """CEL: the string ``expr`` with one trailing slash (a prefix compared as a directory)."""
    return f"({expr}.endsWith('/') ? {expr} : {expr} + '/')"


def _overlap_rule(a: str, b: str) -> str:
    """CEL: store prefixes ``a`` and ``b`` are the same directory or one holds the other."""
    a, b = _with_slash(a), _with_slash(b)
    return f"{a}.startsWith({b}) || {b}.startsWith({a})"


def overlaps(a: str, b: str) -> bool:
    """Whether store prefixes ``a`` and ``b`` are the same directory or one holds the other."""
    a, b = a.rstrip("/") + "/", b.rstrip("/") + "/"
    return a.startswith(b) or b.startswith(a)


class CaptureHeaders(ApiModel):
    """The request headers the capture sidecar reads to tell whom a request is from: the
    user (the A/B analysis clusters by it), the session and the organisation."""

    user: str = Field(
        "X-Rtrl-User", pattern=HEADER_NAME_PATTERN, max_length=256, description="User id header."
    )
    session: str = Field(
        "X-Rtrl-Session",
        pattern=HEADER_NAME_PATTERN,
        max_length=256,
        description="Session id header.",
    )
    org: str = Field(
        "X-Rtrl-Org",
        pattern=HEADER_NAME_PATTERN,
        max_length=256,
        description="Organisation id header.",
    )


class SignalMaturities(ApiModel):
    """When each feedback signal is final, counted from when the interaction was served; an
    unset signal keeps its default. The seal takes each signal's last value observed before
    its maturity (later values are counted, never trained on) and seals an hour once its
    longest maturity has passed. One field per signal of ``rtrl.core.events.SIGNALS``, in
    camelCase (tests/rtrl/core/api/test_capture_spec.py checks that they agree)."""

    edit_persisted: Duration7d | None = Field(
        None, description="Share of the agent's edit still in the codebase (default 1h)."
    )
    dissatisfied_followup: Duration7d | None = Field(
        None, description="The user sent a dissatisfied follow-up (default 15m)."
    )
    asked_clarification: Duration7d | None = Field(
        None, description="The model asked a clarifying question instead of editing (default 15m)."
    )
    edits_proposed: Duration7d | None = Field(
        None, description="Edits the model proposed (default 15m)."
    )
    tool_calls: Duration7d | None = Field(None, description="Tool calls emitted (default 15m).")
    invalid_tool_calls: Duration7d | None = Field(
        None, description="Tool calls that did not parse, validate or run (default 15m)."
    )
    latency_ms: Duration7d | None = Field(
        None, description="Time to the full completion, as the client saw it (default 15m)."
    )

    def overrides(self) -> dict[str, str]:
        """``{signal: duration}`` of the signals set here (the field names are the signals')."""
        return {name: value for name, value in self if value is not None}


class SealSpec(ApiModel):
    """The seal: the CronJob ``<rlcycle>-seal`` runs ``rtrl-job seal`` in the training image,
    joining each hour's generation events with their feedback once every signal is final,
    into shards under ``data.shards``, which the stage reads."""

    schedule: Cron = Field(
        "*/10 * * * *",
        description="When the seal runs (cron, UTC); a run seals every hour that has become "
        "final and is not sealed yet, so a missed run loses nothing.",
    )
    delay: Duration1d = Field(
        "10m",
        description="How long after an hour's longest maturity its seal waits for the last "
        "events to reach the store (at most 1d).",
    )


class CaptureAdapters(ApiModel):
    """Route organisations to LoRA adapters in the engine: the sidecar follows the routing
    table in a ConfigMap (docs/writing-shards.md, "Routing organisations to LoRA
    adapters") and loads the adapters it names into the engine itself."""

    config_map: DnsSubdomain = Field(
        description="ConfigMap (same namespace) holding the routing table, one key per "
        "writer (every *.yaml key is read; an RLCycle with spec.adapter writes "
        "<its name>.yaml), mounted into the sidecar; the pod also needs a volume "
        "rtrl-adapters mounted in the engine container at /var/lib/rtrl-adapters, and the "
        "engine --enable-lora."
    )


class CaptureSpec(ApiModel):
    """Capture what the target serves: the operator injects the ``rtrl-capture`` sidecar in
    front of the engine into the pods of the target Deployment and of its canary, and runs
    the seal that turns the captured events into shards (docs/operator.md, "Capture")."""

    model_config = ConfigDict(
        json_schema_extra={
            CEL_KEY: [
                cel(
                    "!has(self.port) || !has(self.enginePort) || self.port != self.enginePort",
                    CAPTURE_PORTS_DIFFER,
                )
            ]
        }
    )

    events: StoreUri = Field(
        description="Events root: the sidecars write generation events under "
        "<events>generations/ (the feedback service, feedback under <events>feedback/)."
    )
    image: Image = Field(description="The serving image (runs `rtrl-capture`).")
    port: int = Field(
        8081,
        ge=1,
        le=65535,
        description="Port the sidecar serves clients on, named rtrl-capture in the pod: the "
        "Service's targetPort.",
    )
    engine_port: int = Field(
        8000, ge=1, le=65535, description="Port the engine serves on inside the pod."
    )
    headers: CaptureHeaders = Field(
        default_factory=CaptureHeaders, description="Headers naming user, session and org."
    )
    maturity: SignalMaturities | None = Field(
        None, description="Per-signal maturity overrides (camelCase signal names)."
    )
    commit_interval: Annotated[str, MaxDuration(MAX_COMMIT_INTERVAL)] | None = Field(
        None,
        description="The sidecar spool's group-commit window (fsync interval), e.g. 20ms: what "
        "a killed sidecar can lose at most (at most 10s); unset: the sidecar's default.",
    )
    seal: SealSpec = Field(default_factory=SealSpec, description="The seal CronJob.")
    resources: ResourceRequirements | None = Field(
        None, description="CPU and memory of the sidecar container."
    )
    adapters: CaptureAdapters | None = Field(
        None, description="Route organisations to their LoRA adapters in the engine."
    )

    @model_validator(mode="after")
    def _ports_differ(self) -> Self:
        if self.port == self.engine_port:
            raise ValueError(CAPTURE_PORTS_DIFFER)
        return self


class RLCycleSpec(ApiModel):
    """The desired real-time RL loop for one inference Deployment."""

    model_config = ConfigDict(
        json_schema_extra={
            CEL_KEY: [
                cel(
                    "!has(self.capture) || !("
                    + _overlap_rule("self.capture.events", "self.data.shards")
                    + ")",
                    CAPTURE_OVERLAPS_SHARDS,
                    field_path=".capture.events",
                ),
                cel(
                    "!has(self.adapter) || (has(self.data.population) && "
                    "has(self.data.population.orgs) && size(self.data.population.orgs) == 1)",
                    ADAPTER_ONE_ORG,
                ),
                cel(
                    "!has(self.adapter) || (has(self.capture) && has(self.capture.adapters))",
                    ADAPTER_ROUTES,
                ),
            ]
        }
    )

    target: TargetSpec = Field(description="The inference Deployment that serves the model.")
    schedule: ScheduleSpec = Field(description="When cycles start.")
    suspend: bool = Field(
        False, description="No new cycle starts while true; a running one finishes."
    )
    data: DataSpec = Field(description="Interaction shards to learn from.")
    reward: RewardSpec = Field(
        default_factory=RewardSpec, description="Reward from implicit feedback."
    )
    training: TrainingSpec = Field(description="The training Job.")
    eval: EvalSpec = Field(default_factory=EvalSpec, description="Eval suites and gates.")
    rollout: RolloutSpec = Field(
        default_factory=RolloutSpec, description="Canary rollout and A/B analysis."
    )
    storage: StorageSpec = Field(description="Object store for artifacts.")
    jobs: JobPolicySpec = Field(
        default_factory=JobPolicySpec, description="Retries of failed step Jobs."
    )
    pin: DnsSubdomain | None = Field(
        None,
        description="Serve exactly this Checkpoint and start no cycles (GitOps rollback).",
    )
    history_limit: int = Field(
        20,
        ge=1,
        le=1000,
        description="Checkpoints kept; older ones are deleted (not stored "
        "artifacts, never the serving, pinned or candidate one).",
    )
    notifications: list[NotificationSpec] | None = Field(
        None,
        max_length=MAX_NOTIFICATIONS,
        description="Webhooks told about phase changes and decisions (docs/notifications.md).",
        json_schema_extra={
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["name"],
        },
    )

    capture: CaptureSpec | None = Field(
        None,
        description="Capture what the target serves (the rtrl-capture sidecar) and seal it "
        "into shards; unset: the shards come from a pipeline of your own.",
    )
    adapter: AdapterSpec | None = Field(
        None,
        description="Train a LoRA adapter for one organisation (data.population.orgs) "
        "instead of all weights; its canary, promotion and rollback are routes in "
        "capture.adapters' ConfigMap, inside the running engine (docs/adapters.md).",
    )

    @field_validator("notifications")
    @classmethod
    def _unique_names(cls, items: list[NotificationSpec] | None) -> list[NotificationSpec] | None:
        seen: set[str] = set()
        for i, item in enumerate(items or []):
            if item.name in seen:
                raise ValueError(f"notifications[{i}].name {item.name!r} is used twice")
            seen.add(item.name)
        return items

    @model_validator(mode="after")
    def _adapter_needs_one_org_and_routes(self) -> Self:
        if self.adapter is None:
            return self
        orgs = self.data.population.orgs if self.data.population else None
        if not orgs or len(orgs) != 1:
            raise ValueError(ADAPTER_ONE_ORG)
        if self.capture is None or self.capture.adapters is None:
            raise ValueError(ADAPTER_ROUTES)
        return self

    def adapter_org(self) -> str | None:
        """The organisation an adapter RLCycle serves (None: a full-model RLCycle)."""
        if self.adapter is None or self.data.population is None:
            return None
        orgs = self.data.population.orgs
        return orgs[0] if orgs else None

    @model_validator(mode="after")
    def _capture_apart_from_shards(self) -> Self:
        if self.capture is not None and overlaps(self.capture.events, self.data.shards):
            raise ValueError(CAPTURE_OVERLAPS_SHARDS)
        return self

    @model_validator(mode="after")
    def _durations(self) -> Self:
        rollout_total = sum(parse_duration(s.min_duration) for s in self.rollout.steps)
        if rollout_total > parse_duration(self.rollout.analysis.max_duration):
            raise ValueError(
                "rollout.analysis.maxDuration must be at least the sum of the steps' minDuration"
            )
        return self


class RLCyclePhase(StrEnum):
    PENDING = "Pending"
    IDLE = "Idle"
    STAGING = "Staging"
    TRAINING = "Training"
    EVALUATING = "Evaluating"
    CANARY = "Canary"
    PROMOTING = "Promoting"
    ROLLING_BACK = "RollingBack"
    AWAITING_APPROVAL = "AwaitingApproval"
    SUSPENDED = "Suspended"
    PINNED = "Pinned"
    INVALID = "Invalid"


MAX_OUTBOX = 32


class AwaitingApproval(ApiModel):
    """An approval gate the canary waits at."""

    checkpoint: str = Field(max_length=253, description="The canary's Checkpoint.")
    gate: Literal["step", "promotion"] = Field(
        description="step: before the next canary step; promotion: before promoting."
    )
    weight: int | None = Field(
        None, ge=1, le=100, description="The next step's weight (gate step)."
    )
    mode: Approval = Field(description="manual or webhook.")
    since: datetime = Field(description="When the gate began to wait.")


class OutboxEntry(ApiModel):
    """A notification decided and not yet delivered to every webhook that wants it."""

    id: str = Field(
        max_length=64, description="Stable id: the same decision always has the same id."
    )
    event: NotificationEvent = Field(description="What happened.")
    time: datetime = Field(description="When it was decided.")
    cycle: int = Field(0, ge=0, le=MAX_COUNT, description="The cycle it belongs to.")
    checkpoint: str | None = Field(None, max_length=253, description="The Checkpoint concerned.")
    message: str = Field(max_length=1024, description="What happened, in words.")
    targets: list[DnsLabel] = Field(
        max_length=MAX_NOTIFICATIONS,
        description="Names of the notifications still to deliver it to.",
    )


class RLCycleStatus(ApiModel):
    """What the operator observed and decided; written only by the operator."""

    phase: RLCyclePhase | None = Field(None, description="Phase of the current cycle.")
    cycle: int = Field(0, ge=0, le=MAX_COUNT, description="Number of the current (or last) cycle.")
    serving: str | None = Field(
        None, max_length=253, description="Checkpoint serving the stable arm."
    )
    candidate: str | None = Field(
        None, max_length=253, description="Checkpoint of the current cycle."
    )
    last_promoted: str | None = Field(
        None, max_length=253, description="Checkpoint promoted most recently."
    )
    canary_weight: int = Field(0, ge=0, le=100, description="Canary traffic share in percent.")
    cycle_started_at: datetime | None = Field(None, description="When the current cycle began.")
    next_run: datetime | None = Field(None, description="When the next cycle is due.")
    data_watermark: datetime | None = Field(
        None,
        description=(
            "Interactions that became ready at or before this are in the serving "
            "checkpoint's lineage (the stage time of the cycle that trained it); the next "
            "cycle stages only later ones. Unset while a base model serves."
        ),
    )
    last_trigger: str | None = Field(
        None,
        max_length=253,
        description="Value of the rtrl.io/trigger annotation that last started a cycle.",
    )
    last_rollback: str | None = Field(
        None, max_length=253, description="Value of the rtrl.io/rollback annotation last handled."
    )
    last_promote: str | None = Field(
        None, max_length=253, description="Value of the rtrl.io/promote annotation last handled."
    )
    last_approve: str | None = Field(
        None, max_length=253, description="Value of the rtrl.io/approve annotation last handled."
    )
    awaiting_approval: AwaitingApproval | None = Field(
        None, description="The approval gate the canary waits at, if any."
    )
    outbox: list[OutboxEntry] | None = Field(
        None,
        max_length=MAX_OUTBOX,
        description="Notifications not yet delivered to every webhook (at-least-once; a "
        "receiver dedupes by id).",
    )
    message: str | None = Field(
        None, max_length=32768, description="What the operator is doing, in words."
    )
    observed_generation: int | None = Field(
        None, ge=0, le=MAX_COUNT, description="The metadata.generation the status reflects."
    )
    conditions: list[Condition] | None = Field(
        None,
        max_length=MAX_CONDITIONS,
        description="Ready, Progressing, Degraded, InsufficientData, InvalidSpec.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )


class RLCycleMeta(ObjectMeta):
    name: Annotated[str, Field(pattern=DNS_LABEL_PATTERN, min_length=1)] = Field(
        max_length=MAX_RLCYCLE_NAME,
        description="RLCycle name; at most 40 characters so child names stay DNS labels.",
    )


class RLCycle(ApiModel):
    """An RLCycle manifest as stored in git and in the cluster."""

    api_version: Literal["rtrl.io/v1alpha1"] = Field(
        "rtrl.io/v1alpha1", description="rtrl.io/v1alpha1"
    )
    kind: Literal["RLCycle"] = Field("RLCycle", description="RLCycle")
    metadata: RLCycleMeta = Field(description="Standard object metadata.")
    spec: RLCycleSpec = Field(description="The desired loop.")
    status: RLCycleStatus | None = Field(None, description="The observed state.")
