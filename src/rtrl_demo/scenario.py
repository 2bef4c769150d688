"""The world the demo sets up: its RLCycle (a real one, scaled down), the serving Deployment,
the simulated clock's start and the scenarios (which reward the users' feedback feeds)."""

from __future__ import annotations

import copy
from datetime import UTC, datetime, timedelta
from typing import Any

from rtrl.core.api.checkpoint import CheckpointPhase
from rtrl.core.api.rlcycle import InconclusivePolicy
from rtrl.planning.manifests.canary import CHECKPOINT_ID_ENV

NAME = "demo"
DEPLOYMENT = "demo-serve"
CONTAINER = "server"
T0 = datetime(2026, 1, 5, 8, 0, tzinfo=UTC)
TICK_MINUTES = 20
# When the users' feedback is final (spec.capture.maturity, every signal): past the sim's
# longest feedback delay (rtrl_demo.sim.FEEDBACK_DELAY_MAX_S, 40 minutes), so no reaction is
# late. The seal waits SEAL_DELAY more (the sidecars ship each tick's events before the
# tick ends, so a minute is plenty), and an hour is sealed SEAL_LAG after it began.
SIGNAL_MATURITY = timedelta(minutes=45)
SEAL_DELAY = timedelta(minutes=1)
SEAL_LAG = timedelta(hours=1) + SIGNAL_MATURITY + SEAL_DELAY
SIGNALS = ("editPersisted", "dissatisfiedFollowup", "askedClarification", "editsProposed",
           "toolCalls", "invalidToolCalls", "latencyMs")  # fmt: skip
# Served before the first cycle: the seal makes an hour trainable SEAL_LAG after it began,
# so three hours give the first cycle two sealed hours (before the inlet: two hours, ~1.5
# of them matured).
HISTORY = timedelta(hours=3)
# The final head-to-head: the base model against the last promoted checkpoint, 50/50.
HEAD_TO_HEAD = timedelta(hours=2)
# Superseded: promoted, then replaced by a later promotion
FINAL = {
    CheckpointPhase.PROMOTED,
    CheckpointPhase.SUPERSEDED,
    CheckpointPhase.ROLLED_BACK,
    CheckpointPhase.REJECTED,
    CheckpointPhase.FAILED,
}
SCENARIOS = {
    "default": "the correct reward: invalid tool calls are penalised, questions cost a little",
    "drop-invalid-tool-calls": "the blog's first reward: interactions with an invalid tool call "
    "are dropped before staging (never penalised)",
    "clarify-dodge": "asking a clarifying question costs nothing (askedClarification: 0)",
    "two-orgs": "two organisations whose users keep opposite conventions share one base; "
    "each learns its own LoRA adapter (the base's RLCycle suspended)",
    "two-orgs-shared": "the users of two-orgs with one shared model retrained on everyone's "
    "rows and no adapter: what a single model learns of two opposite conventions",
}
# Scenario two-orgs: the organisations (rtrl_demo.sim.CONVENTIONS), each with an adapter
# RLCycle <NAME>-<org> writing its key of the routing ConfigMap the base's sidecar follows.
TWO_ORGS = ("org-a", "org-b")
ROUTING = f"{NAME}-adapters"
ADAPTERS_MOUNT = "/var/lib/rtrl-adapters"


def adapter_rlcycle_name(org: str) -> str:
    return f"{NAME}-{org}"


def rlcycle_manifests(store: str, scenario: str, users: int) -> list[dict[str, Any]]:
    """The scenario's RLCycles, the base's first. two-orgs: the base's, suspended (it keeps
    the base serving everyone, injects the sidecar following the routing table, and runs
    the seal), and one adapter RLCycle per organisation."""
    base = rlcycle_manifest(store, scenario, users)
    if scenario != "two-orgs":  # (two-orgs-shared: the base's RLCycle alone, cycling)
        return [base]
    base["spec"]["suspend"] = True
    base["spec"]["capture"]["adapters"] = {"configMap": ROUTING}
    out = [base]
    for org in TWO_ORGS:
        rlc = copy.deepcopy(base)
        rlc["metadata"]["name"] = adapter_rlcycle_name(org)
        spec = rlc["spec"]
        spec.pop("suspend")
        spec["data"]["population"] = {"orgs": [org]}
        # every linear layer of the tiny GPT-2 (PEFT's all-linear), rank 8
        spec["adapter"] = {"rank": 8, "alpha": 16}
        # a LoRA learns at a higher rate than the full weights do
        spec["training"]["learningRate"] = 5e-3
        # the org's half of the users, half of them in the canary
        for step in spec["rollout"]["steps"]:
            step["minSamples"] = max(100, users // 4)
        out.append(rlc)
    return out


def rlcycle_manifest(store: str, scenario: str, users: int) -> dict[str, Any]:
    """A realistic RLCycle (examples/rlcycle.yaml's shape) scaled to one CPU and minutes."""
    reward = {
        "editPersisted": 1.0,
        "dissatisfiedFollowup": -1.0,
        "latency": -0.1,
        "latencyScaleMs": 10000,
        "invalidToolCall": -1.0,
        "askedClarification": 0.0 if scenario == "clarify-dodge" else -0.5,
        "clip": 5,
        "baseline": "batch",
    }
    min_samples = max(100, users)
    return {
        "apiVersion": "rtrl.io/v1alpha1",
        "kind": "RLCycle",
        "metadata": {"name": NAME, "namespace": "default"},
        "spec": {
            "target": {
                "deployment": DEPLOYMENT,
                "container": CONTAINER,
                "checkpointEnv": "MODEL_URI",
            },
            "schedule": {"interval": "1h"},
            "data": {
                "shards": f"{store}interactions/",
                "maturity": "30m",
                "window": "3h",
                "minInteractions": 100,
                "maxOffPolicyFraction": 0.0,
                "maxBadFraction": 0.01,
            },
            "reward": reward,
            "training": {
                "image": "rtrl-trainer:demo",
                "nodes": 1,
                "gpusPerNode": 0,
                "zeroStage": 0,
                "precision": "fp32",
                "learningRate": 1e-3,
                "batchTokens": 1024,
                "microBatchSize": 256,
                "maxSequenceLength": 32,
                "epochs": 2,
                "klCoef": 0.02,
                "clipRatio": 1.0,
            },
            "eval": {
                "suites": ["replay"],
                "gates": [{"metric": "replay.kl", "maxRegression": 2.0}],
                "alpha": 0.05,
            },
            "rollout": {
                "router": "replicas",
                # the simulated fleet assigns each user whole to one arm, by a hash of the
                # user id (rtrl_demo/serve.py)
                "unit": "user",
                "steps": [{"weight": 50, "minDuration": "2h", "minSamples": min_samples}],
                "readyTimeout": "30m",
                "analysis": {
                    "alpha": 0.05,
                    "maxDuration": "4h",
                    "interval": "20m",
                    "inconclusive": InconclusivePolicy.ROLLBACK.value,
                },
                "guardrails": {
                    "clarificationRate": {"maxRelativeRise": 0.10},
                    "invalidToolCallRate": {"maxRelativeRise": 0.10},
                },
            },
            # rtrl's inlet: the capture sidecar in each serving pod, the feedback service on
            # the same events root, and the seal CronJob writing data.shards (the stage
            # then reads --sealed)
            "capture": {
                "events": f"{store}events/",
                "image": "rtrl-serving:demo",
                "maturity": {name: _minutes(SIGNAL_MATURITY) for name in SIGNALS},
                "seal": {"delay": _minutes(SEAL_DELAY)},
            },
            "storage": {"artifacts": f"{store}artifacts/"},
            "jobs": {"backoffLimit": 0, "backoff": "1s"},
            "historyLimit": 20,
        },
    }


def _minutes(span: timedelta) -> str:
    return f"{int(span.total_seconds() // 60)}m"


def deployment_manifest(uri: str, checkpoint: str, lora: bool = False) -> dict[str, Any]:
    """The serving Deployment; ``lora``: its engine serves LoRA adapters, as
    ``spec.capture.adapters`` needs (``--enable-lora``, the ``rtrl-adapters`` volume)."""
    manifest = _deployment(uri, checkpoint)
    if lora:
        pod = manifest["spec"]["template"]["spec"]
        pod["volumes"] = [{"name": "rtrl-adapters", "emptyDir": {}}]
        engine = pod["containers"][0]
        engine["args"] = ["--enable-lora", "--max-lora-rank", "16"]
        engine["volumeMounts"] = [{"name": "rtrl-adapters", "mountPath": ADAPTERS_MOUNT}]
    return manifest


def _deployment(uri: str, checkpoint: str) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": DEPLOYMENT, "namespace": "default", "labels": {"app": "demo"}},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": "demo"}},
            "template": {
                "metadata": {"labels": {"app": "demo"}},
                "spec": {
                    "containers": [
                        {
                            "name": CONTAINER,
                            "image": "simulated-users",
                            "env": [
                                {"name": "MODEL_URI", "value": uri},
                                {"name": CHECKPOINT_ID_ENV, "value": checkpoint},
                            ],
                        }
                    ]
                },
            },
        },
    }


def base_checkpoint_manifest(uri: str) -> dict[str, Any]:
    """The base model's Checkpoint, registered by hand as a user would (no status)."""
    return {
        "apiVersion": "rtrl.io/v1alpha1",
        "kind": "Checkpoint",
        "metadata": {"name": "demo-0", "namespace": "default", "labels": {"rtrl.io/rlcycle": NAME}},
        "spec": {"uri": uri},
    }
