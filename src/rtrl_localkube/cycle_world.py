"""The namespace an RLCycle lives in, for the operator's tests (on the real control plane
and the emulated one alike): the inference Deployment, the base Checkpoint it serves, the
RLCycle (from examples/rlcycle.yaml, made small and pointed at a ``file://`` store),
scripted step results that Jobs "produce", and reading back what the operator wrote.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, cast

from rtrl.core.api.checkpoint import Decision, TrainingSummary, Verdict
from rtrl.core.api.yamlfile import load
from rtrl.core.results import RESULTS as RESULT_MODELS
from rtrl.core.results import (
    AnalysisCause,
    AnalysisMetric,
    AnalysisResult,
    CauseKind,
    EvalFailure,
    EvalGate,
    EvalResult,
    StageResult,
    TrainResult,
)
from rtrl.core.store import open_store
from rtrl_localkube.api import KubeAPI
from rtrl_localkube.outcomes import Outcome, Succeed

REPO = Path(__file__).resolve().parents[2]
RTRL = "rtrl.io/v1alpha1"
NAME = "composer"

# Step results as the steps write them: built through their contracts (rtrl.core.results).
STAGE_OK = StageResult(
    sufficient=True,
    message="2000 interactions, 90000 completion tokens, 95.0% on-policy, in 1 rank file(s)",
    interactions_used=2000,
    tokens_used=90000,
    on_policy_fraction=0.95,
    quarantined={"truncated": 3},
    quarantined_files=[],
).document()
STAGE_INSUFFICIENT = StageResult.written(
    {
        **STAGE_OK,
        "sufficient": False,
        "message": "insufficient data: 12 interactions (minimum 200)",
    }
).document()
TRAIN_OK = TrainResult(
    summary=TrainingSummary(steps=4, tokens=90000, loss=0.12, kl=0.003)
).document()
EVAL_PASS = EvalResult(
    passed=True,
    verdict=Verdict.PASSED,
    message="passed 1 gate(s) on 3 metric(s)",
    gates=[
        EvalGate(metric="replay.kl", candidate=0.01, parent=0.0, ci_low=0.005, ci_high=0.015,
                 passed=True)
    ],
).document()  # fmt: skip
EVAL_FAIL = EvalResult.written(
    {
        **EVAL_PASS,
        "passed": False,
        "verdict": Verdict.FAILED,
        "reason": EvalFailure.GATES_FAILED,
        "message": "failed gate(s): replay.kl",
    }
).document()
ANALYSIS_PROMOTE = AnalysisResult(
    decision=Decision.PROMOTE,
    cause=AnalysisCause(kind=CauseKind.PRIMARY_BETTER),
    reasons=["edit_persistence: canary 0.620 vs 0.600 (+3.3%): better"],
    baseline_samples=5000,
    canary_samples=5000,
    metrics=[
        AnalysisMetric(name="edit_persistence", kind="goal", baseline=0.6, canary=0.62,
                       difference=0.02, ci_low=0.005, ci_high=0.035, verdict="better")
    ],
).document()  # fmt: skip
# An analysis that holds the canary at its step (nothing significant yet).
ANALYSIS_CONTINUE = AnalysisResult.written(
    {
        **ANALYSIS_PROMOTE,
        "decision": Decision.CONTINUE,
        "cause": AnalysisCause(kind=CauseKind.INCONCLUSIVE, metrics=[]),
        "reasons": [str(CauseKind.INCONCLUSIVE)],
    }
).document()
ANALYSIS_ROLLBACK = AnalysisResult.written(
    {
        **ANALYSIS_PROMOTE,
        "decision": Decision.ROLLBACK,
        "cause": AnalysisCause(kind=CauseKind.GOAL_WORSE, metrics=["edit_persistence"]),
        "reasons": ["edit_persistence: canary 0.550 vs 0.600 (-8.3%): worse"],
    }
).document()
RESULTS = {"stage": STAGE_OK, "train": TRAIN_OK, "eval": EVAL_PASS, "analyze": ANALYSIS_PROMOTE}


def base_uri(root: Path) -> str:
    return (root / "models" / "base").as_uri() + "/"


# A serving container a kubelet stand-in can run: it stays up until stopped (python -c
# ignores the vLLM arguments the example passes). No model server is under test here, so
# its image is not vLLM's (which the kubelet would run as the vLLM venv), it reads no store
# credentials and has no readiness probe (nothing listens): it is ready once it runs.
SERVER_COMMAND = ["python", "-c", "import time; time.sleep(3600)"]
SERVER_IMAGE = "composer-server:test"


def deployment(root: Path, serving_uri: str | None = None) -> dict[str, Any]:
    """The example's inference Deployment with one replica, no GPUs (nothing here has one:
    its pods would stay Pending) and a container that runs on this machine."""
    doc = load((REPO / "examples" / "inference-deployment.yaml").read_text())
    doc["metadata"].pop("namespace", None)
    doc["spec"]["replicas"] = 1
    container = doc["spec"]["template"]["spec"]["containers"][0]
    container["env"] = [
        {"name": "MODEL_URI", "value": serving_uri or base_uri(root)},
        {"name": "RTRL_CHECKPOINT_ID", "value": "composer-0"},
    ]
    container["command"] = SERVER_COMMAND
    container["image"] = SERVER_IMAGE
    for unused in ("resources", "envFrom", "readinessProbe"):
        container.pop(unused, None)
    return cast(dict[str, Any], doc)


def base_checkpoint(root: Path) -> dict[str, Any]:
    doc = load((REPO / "examples" / "checkpoint-base.yaml").read_text())
    doc["metadata"].pop("namespace", None)
    doc["spec"]["uri"] = base_uri(root)
    return cast(dict[str, Any], doc)


def rlcycle(root: Path, **spec_changes: Any) -> dict[str, Any]:
    """The example RLCycle, on one CPU node, writing to ``root``'s file:// store."""
    doc = load((REPO / "examples" / "rlcycle.yaml").read_text())
    doc["metadata"].pop("namespace", None)
    spec = doc["spec"]
    spec["schedule"] = {"interval": "1h"}
    spec["storage"] = {"artifacts": (root / "artifacts").as_uri() + "/"}
    spec["training"].update(nodes=1, gpusPerNode=0, image="rtrl-trainer:test")
    spec["training"].pop("resources", None)
    spec["training"].pop("nodeSelector", None)
    spec["training"].pop("tolerations", None)
    spec["jobs"] = {"backoffLimit": 1, "backoff": "1s"}
    spec["rollout"].update(
        steps=[{"weight": 25, "minDuration": "1s"}, {"weight": 50, "minDuration": "1s"}],
        readyTimeout="30s",
    )
    spec["rollout"]["analysis"].update(maxDuration="1h", interval="1s")
    spec.update(spec_changes)
    return cast(dict[str, Any], doc)


def arg(job: dict[str, Any], flag: str) -> str:
    """The value of ``--flag=value`` in a Job's container args."""
    args = job["spec"]["template"]["spec"]["containers"][0]["args"]
    prefix = f"--{flag}="
    return str(next(a[len(prefix) :] for a in args if a.startswith(prefix)))


def commit_result(
    step: str, doc: dict[str, Any], scratch: Path
) -> Callable[[dict[str, Any]], None]:
    """A ``Succeed(before=...)`` hook: commit ``doc`` as the step's result where the Job's
    ``--out`` says, the way the real step does (manifest last)."""
    name = RESULT_MODELS[step].FILE

    def write(job: dict[str, Any]) -> None:
        out = arg(job, "out")
        scratch.mkdir(parents=True, exist_ok=True)
        path = scratch / f"{job['metadata']['name']}-{name}"
        path.write_text(json.dumps(doc))
        open_store(out).commit("", {name: path}, {"step": step})

    return write


class Scripted(Protocol):
    """A kubelet stand-in or the emulator's Job runner: both take scripts."""

    def script(self, pattern: str, outcome: Outcome) -> Any: ...


def script_all(runner: Scripted, scratch: Path, **overrides: Any) -> None:
    """Every step succeeds with its canned result unless ``overrides`` says otherwise
    (a result dict, or an Outcome such as Fail())."""
    for step in ("stage", "train", "eval", "analyze"):
        outcome = overrides.get(step, RESULTS[step])
        if isinstance(outcome, dict):
            outcome = Succeed(before=commit_result(step, outcome, scratch / "results"))
        runner.script(f"*-{step}-*", outcome)


def status(kube_api: KubeAPI, kind: str, name: str) -> dict[str, Any]:
    return (kube_api.get(RTRL, kind, name) or {}).get("status") or {}


def condition(kube_api: KubeAPI, type_: str) -> dict[str, Any]:
    conditions = status(kube_api, "RLCycle", NAME).get("conditions") or []
    return next((c for c in conditions if c["type"] == type_), {})


def events(kube_api: KubeAPI) -> list[tuple[str, str, str]]:
    return [
        (e["involvedObject"]["name"], e["reason"], e.get("message") or "")
        for e in kube_api.list("v1", "Event")
    ]


def setup_namespace(kube_api: KubeAPI, root: Path, **spec: Any) -> None:
    kube_api.create(deployment(root))
    kube_api.create(base_checkpoint(root))
    kube_api.create(rlcycle(root, **spec))


def wait_phase(kube_api: KubeAPI, kind: str, name: str, phase: str, timeout: float = 30) -> None:
    kube_api.wait_for(
        lambda: status(kube_api, kind, name).get("phase") == phase,
        timeout=timeout,
        message=lambda: f"{kind}/{name} phase {phase}; status: {status(kube_api, kind, name)}",
    )
