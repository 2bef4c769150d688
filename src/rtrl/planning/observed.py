"""What the kube layer read back from the cluster and the store for one RLCycle.

Nothing here is remembered between reconciles: every field is read again each time, which
is what lets the operator be killed at any moment and carry on where it stood.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from rtrl.core.api.policy import TenancyPolicy


@dataclass(frozen=True)
class JobState:
    """A step Job, reduced to what decisions need."""

    name: str
    checkpoint: str | None  # label rtrl.io/checkpoint
    checkpoint_uid: str | None  # label rtrl.io/checkpoint-uid: which incarnation it served
    step: str | None  # label rtrl.io/step
    attempt: int
    succeeded: bool = False
    failed: bool = False
    finished_at: datetime | None = None
    # Why it failed, in words: the Job's condition and its pod's termination reason and
    # message (the step's last output lines).
    reason: str = ""
    message: str = ""
    deleting: bool = False

    @property
    def finished(self) -> bool:
        return self.succeeded or self.failed


@dataclass(frozen=True)
class DeploymentState:
    """The target inference Deployment; ``serving_uri`` is its checkpoint env var's value."""

    found: bool
    has_container: bool = False
    serving_uri: str | None = None


@dataclass(frozen=True)
class SecretState:
    """The storage credentials Secret: found, which required keys it lacks, its labels
    (the policy may require one: rtrl.planning.tenancy); never its values."""

    found: bool
    missing_keys: tuple[str, ...] = ()
    labels: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Observed:
    rlcycle: Mapping[str, Any]
    # the Checkpoints a round may look at (its own, base models, rolled-back ones, those
    # it serves or names, and their lineage: rtrl.kube.observe), not the whole namespace
    checkpoints: Sequence[Mapping[str, Any]] = ()
    jobs: Sequence[JobState] = ()  # Jobs labelled rtrl.io/rlcycle=<name>
    services: frozenset[str] = frozenset()  # names of the RLCycle's Services
    config_maps: frozenset[str] = frozenset()  # names of the RLCycle's ConfigMaps
    deployment: DeploymentState = field(default_factory=lambda: DeploymentState(found=False))
    # The raw target Deployment, its canary (``<deployment>-canary``) and, with the
    # gatewayapi router, the HTTPRoute whose weights rtrl sets; None when absent.
    target: Mapping[str, Any] | None = None
    canary: Mapping[str, Any] | None = None
    http_route: Mapping[str, Any] | None = None
    # With the gatewayapi router, the stable Service (``rollout.service``), read only while
    # its canary Service is to be made: the canary Service copies its ports.
    stable_service: Mapping[str, Any] | None = None
    # With spec.capture.adapters: the routing table's ConfigMap, shared by the RLCycles of
    # every organisation (and read by the base's, whose canary leaves them out); None when
    # absent.
    routing: Mapping[str, Any] | None = None
    # The seal CronJob (``<rlcycle>-seal``, spec.capture), None when absent.
    seal: Mapping[str, Any] | None = None
    secret: SecretState | None = None  # None: no Secret referenced
    # Step results by URI (stage.json, train.json, eval.json): the document, or None when
    # nothing is committed there; a string is the error met reading it.
    results: Mapping[str, Mapping[str, Any] | str | None] = field(default_factory=dict)
    # While a step that reports its progress runs (rtrl.planning.progress): its progress
    # file, as results are read but without waiting for a commit.
    progress: Mapping[str, Any] | str | None = None
    # While status.awaitingApproval names a webhook gate: whether the confirm webhook
    # answered 200 (None: not asked), and why not, in words (never its URL).
    confirmed: bool | None = None
    confirm_error: str = ""
    # Notifications of status.outbox the kube layer is done with, as "<id>/<target>":
    # delivered, or given up after its retries (``undeliverable``: id, target, why).
    delivered: frozenset[str] = frozenset()
    undeliverable: tuple[tuple[str, str, str], ...] = ()
    # The admin's tenancy policy the operator runs under (its settings); the default
    # allows nothing beyond the RLCycle's own objects.
    policy: TenancyPolicy = field(default_factory=TenancyPolicy)
