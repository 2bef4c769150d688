"""What ``make quickstart`` applies: the files of ``examples/``, changed only where this
machine differs from the cluster they were written for, and the chart's values.

Why a module of its own: the quick start writes these files into its directory for the
newcomer to read and ``kubectl apply`` (they are the examples, not a test fixture), and the
tests check them against the RLCycle's schema without starting anything. What changes, and
why, is listed per function; everything else is the example as written:

- one replica of everything, no GPUs (the pods would stay Pending), vLLM in eager mode
  with a short context (start-up on two CPUs), the tool-call parser of the tiny model;
- the object store is a local S3 (moto) at ``endpoint``: its address in ``spec.storage``
  and in the engine's environment (runai-model-streamer loads ``s3://`` through it);
- the RLCycle captures what the Deployment serves (``spec.capture``, commented out in the
  example), seals every minute, starts suspended (the quick start lifts ``suspend`` once
  the replayed traffic is sealed), trains a tiny model on one CPU, evaluates the replay
  suite, and canaries in one step of minutes, deciding by the inconclusive policy when the
  A/B test has too little sealed traffic to decide (live traffic is sealed only an hour
  after it was served).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

from rtrl.core.api.rlcycle import InconclusivePolicy
from rtrl.core.api.yamlfile import load

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
NAMESPACE = "ml-serving"
RLCYCLE = "composer"
DEPLOYMENT = "composer-vllm"
SERVICE = "composer"
BASE = "composer-0"
MODEL_URI = "s3://rtrl-artifacts/composer/checkpoints/composer-0/"
EVENTS = "s3://rtrl-events/composer/"
SHARDS = "s3://interactions/composer/"
BUCKETS = ("rtrl-artifacts", "rtrl-events", "interactions")
SERVING_IMAGE = "registry.example.com/rtrl-serving:0.1.0"
# The headers the simulated users send, as the example's capture section names them.
USER_HEADER, SESSION_HEADER, ORG_HEADER = "X-Rtrl-User", "X-Rtrl-Session", "X-Rtrl-Org"
# How long the canary may take to start its own vLLM on a loaded 2-core machine.
READY_TIMEOUT = "20m"
# Files in the order `kubectl apply -f DIR` takes them (by name, as for examples/).
FILES = (
    "00-namespace.yaml",
    "01-s3-secret.yaml",
    "checkpoint-base.yaml",
    "inference-deployment.yaml",
    "inference-service.yaml",
    "rlcycle.yaml",
)


def _example(name: str) -> dict[str, Any]:
    return cast(dict[str, Any], load((EXAMPLES / name).read_text()))


def namespace() -> dict[str, Any]:
    return _example("00-namespace.yaml")


def s3_secret(access_key: str, secret_key: str) -> dict[str, Any]:
    """The example's Secret with the local S3's keys instead of the placeholders."""
    doc = _example("01-s3-secret.yaml")
    doc.pop("data", None)
    doc["stringData"] = {"AWS_ACCESS_KEY_ID": access_key, "AWS_SECRET_ACCESS_KEY": secret_key}
    return doc


def inference_deployment(endpoint: str) -> dict[str, Any]:
    """The example's vLLM Deployment: one replica, no GPU and no tensor parallelism, eager
    mode and a 512-token context (start-up), the Hermes tool-call parser (the tiny model's
    chat template writes Hermes tool calls), and the local S3's endpoint."""
    doc = _example("inference-deployment.yaml")
    doc["spec"]["replicas"] = 1
    (container,) = doc["spec"]["template"]["spec"]["containers"]
    container.pop("resources", None)
    args = [a for a in container["args"] if not a.startswith("--tensor-parallel-size")]
    container["args"] = [
        *args,
        "--enforce-eager",
        "--max-model-len=512",
        "--enable-auto-tool-choice",
        "--tool-call-parser=hermes",
    ]
    env = [e for e in container["env"] if e["name"] not in ("AWS_ENDPOINT_URL",)]
    env += [
        {"name": "AWS_ENDPOINT_URL", "value": endpoint},
        {"name": "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING", "value": "0"},
    ]
    container["env"] = env
    container["readinessProbe"]["periodSeconds"] = 2
    return doc


def inference_service() -> dict[str, Any]:
    """The example's Service, its targetPort the capture sidecar's (as its comment says to
    do with ``spec.capture``): every request the users send is captured."""
    doc = _example("inference-service.yaml")
    (port,) = doc["spec"]["ports"]
    port["targetPort"] = "rtrl-capture"
    return doc


def base_checkpoint() -> dict[str, Any]:
    return _example("checkpoint-base.yaml")


def rlcycle(endpoint: str) -> dict[str, Any]:
    """The example's RLCycle made to run a cycle in minutes on two CPUs (module docstring)."""
    doc = _example("rlcycle.yaml")
    spec = doc["spec"]
    spec["suspend"] = True
    spec["schedule"] = {"interval": "1h"}
    spec["data"].update(
        minInteractions=100, minTokens=2000, maxBadFraction=0.05, maxOffPolicyFraction=0.1
    )
    training = spec["training"]
    for unused in ("resources", "nodeSelector", "tolerations"):
        training.pop(unused, None)
    training.update(
        image="registry.example.com/rtrl-trainer:0.1.0", nodes=1, gpusPerNode=0,
        zeroStage=0, precision="fp32", learningRate=1e-4, batchTokens=4096,
        microBatchSize=8, maxSequenceLength=512, activationCheckpointing=False,
    )  # fmt: skip
    spec["eval"] = {
        "suites": ["replay"],
        "gates": [{"metric": "replay.kl", "maxRegression": 1.0}],
        "alpha": 0.05,
    }
    rollout = spec["rollout"]
    rollout["steps"] = [{"weight": 50, "minDuration": "2m"}]
    rollout["readyTimeout"] = READY_TIMEOUT
    rollout["analysis"].update(
        interval="30s", maxDuration="4m", inconclusive=InconclusivePolicy.ROLLBACK.value
    )
    spec["storage"]["endpoint"] = endpoint
    spec["jobs"] = {"backoffLimit": 1, "backoff": "10s", "activeDeadline": "30m"}
    spec["capture"] = {
        "events": EVENTS,
        "image": SERVING_IMAGE,
        "headers": {"user": USER_HEADER, "session": SESSION_HEADER, "org": ORG_HEADER},
        "seal": {"schedule": "* * * * *", "delay": "1m"},
    }
    return doc


def manifests(endpoint: str, access_key: str, secret_key: str) -> dict[str, dict[str, Any]]:
    """Every file the quick start applies, by file name (:data:`FILES`)."""
    docs = {
        "00-namespace.yaml": namespace(),
        "01-s3-secret.yaml": s3_secret(access_key, secret_key),
        "checkpoint-base.yaml": base_checkpoint(),
        "inference-deployment.yaml": inference_deployment(endpoint),
        "inference-service.yaml": inference_service(),
        "rlcycle.yaml": rlcycle(endpoint),
    }
    assert tuple(docs) == FILES
    return docs


def policy_values(endpoint: str) -> dict[str, Any]:
    """examples/helm/policy-values.yaml (the tenancy policy the admin gives the chart) for
    this machine: the images the RLCycle names (trainer and serving), the local S3's
    endpoint, and no GPU nodes to allow."""
    values = cast(dict[str, Any], load((EXAMPLES / "helm" / "policy-values.yaml").read_text()))
    policy = values["policy"]
    trainer = rlcycle(endpoint)["spec"]["training"]["image"]
    policy["images"] = [trainer.rsplit(":", 1)[0] + ":*", SERVING_IMAGE.rsplit(":", 1)[0] + ":*"]
    policy["endpoints"] = [endpoint]
    policy["tolerations"], policy["nodeSelectors"] = [], {}
    return values


def chart_values(endpoint: str, *, credentials: str, tokens: str) -> list[str]:
    """``helm install`` flags: the store's endpoint and credentials Secret, the feedback
    service (one replica) on the events root the RLCycle's sidecars write to."""
    return [
        "--set", f"storage.credentialsSecret={credentials}",
        "--set", f"storage.endpointUrl={endpoint}",
        "--set", "storage.region=us-east-1",
        "--set", "operator.resyncSeconds=10",
        "--set", "feedback.enabled=true",
        "--set", "feedback.replicas=1",
        "--set", f"feedback.events={EVENTS}",
        "--set", f"feedback.tokenSecret={tokens}",
    ]  # fmt: skip
