"""The capture sidecar the operator injects, running for real on the real control plane: the
stable and the canary pods of the inference Deployment each run the real vLLM (the kubelet
stand-in runs ``vllm/vllm-openai`` as the vLLM venv) behind the real ``rtrl-capture`` (from
this checkout, as every rtrl image is here). Requests sent through each pod's sidecar with
the official ``openai`` client become generation events in the events store that carry the
arm and the checkpoint that pod serves, checked against what the engine reports it loaded;
and the seal CronJob's real ``rtrl-job seal`` runs with the arguments, env and credentials
the operator gave it.

The cycle's steps are scripted (what is under test is serving and capture, not training):
the "trained" candidate is the base model's files committed under the candidate's URI, so
the canary's engine loads a checkpoint of its own. Two engines start at once (the stable's
and the canary's): minutes on a loaded 2-core machine."""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from rtrl.core.store import MANIFEST_NAME, open_store
from rtrl.planning.manifests.capture import SIDECAR
from rtrl_localkube.api import KubeAPI
from rtrl_localkube.cycle_world import (
    ANALYSIS_PROMOTE,
    NAME,
    RTRL,
    arg,
    base_checkpoint,
    rlcycle,
    script_all,
    status,
)
from rtrl_localkube.kubelet import Kubelet
from rtrl_localkube.outcomes import Succeed
from rtrl_localkube.tools import OperatorProcess
from tests.conftest import REPO
from tests.vllm_engine import TinyModel

# two vLLM engines starting at once on a loaded 2-core machine: imports alone take minutes
ENGINES_READY_SECONDS = 900
pytestmark = pytest.mark.timeout(ENGINES_READY_SECONDS + 300)
CKPT = "composer-1"
TARGET, CANARY = "composer-vllm", "composer-vllm-canary"


def serving_deployment(model: TinyModel) -> dict[str, Any]:
    """examples/inference-deployment.yaml with what differs on this machine changed: one
    replica on a CPU (no GPU, no tensor parallelism, eager mode), the tiny model's URI and
    the session S3 it is on."""
    doc = yaml.safe_load((REPO / "examples" / "inference-deployment.yaml").read_text())
    doc["metadata"].pop("namespace")
    doc["spec"]["replicas"] = 1
    (container,) = doc["spec"]["template"]["spec"]["containers"]
    container.pop("resources", None)
    args = [a for a in container["args"] if not a.startswith("--tensor-parallel-size")]
    container["args"] = [*args, "--enforce-eager", "--max-model-len=512"]
    env = {e["name"]: e for e in container["env"]}
    env["MODEL_URI"]["value"] = model.uri
    env["RTRL_CHECKPOINT_ID"]["value"] = "composer-0"
    for name in ("AWS_ENDPOINT_URL", "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING"):
        env[name] = {"name": name, "value": model.s3_env[name]}
    container["env"] = list(env.values())
    return dict(doc)


def copy_base_model(model: TinyModel, scratch: Path) -> Callable[[dict[str, Any]], None]:
    """A train Job's ``Succeed(before=...)``: the base model's files and a train.json
    committed where the Job's ``--out`` says, as the train step commits a checkpoint."""
    from rtrl_localkube.cycle_world import TRAIN_OK

    def write(job: dict[str, Any]) -> None:
        scratch.mkdir(parents=True, exist_ok=True)
        result = scratch / f"{job['metadata']['name']}-train.json"
        result.write_text(json.dumps(TRAIN_OK))
        files = {
            str(p.relative_to(model.directory)): p
            for p in model.directory.rglob("*")
            if p.is_file() and p.name != MANIFEST_NAME
        }
        open_store(arg(job, "out")).commit("", {**files, "train.json": result}, {"step": "train"})

    return write


def pods(kube: KubeAPI, deployment: str) -> list[dict[str, Any]]:
    found = []
    for pod in kube.list("v1", "Pod"):
        owners = pod["metadata"].get("ownerReferences") or []
        if any(o["name"].rsplit("-", 1)[0] == deployment for o in owners):
            found.append(pod)
    return found


def ready_pod_with_sidecar(kube: KubeAPI, deployment: str) -> dict[str, Any] | None:
    for pod in pods(kube, deployment):
        names = [c["name"] for c in pod["spec"]["containers"]]
        conditions = (pod.get("status") or {}).get("conditions") or []
        ready = any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)
        if SIDECAR in names and ready and not pod["metadata"].get("deletionTimestamp"):
            return pod
    return None


def events_in(root: Path) -> pa.Table | None:
    files = sorted((root / "generations").rglob("*.parquet"))
    if not files:
        return None
    return pa.concat_tables([pq.read_table(f) for f in files], promote_options="permissive")


@pytest.fixture
def model(monkeypatch: pytest.MonkeyPatch, tiny_model: TinyModel) -> TinyModel:
    """The tiny model on the session S3, which this process (the scripted steps' commits)
    reaches too."""
    for name, value in tiny_model.s3_env.items():
        monkeypatch.setenv(name, value)
    return tiny_model


def test_each_arms_requests_are_captured_with_its_checkpoint_and_the_seal_runs(
    kube: KubeAPI,
    node: Kubelet,
    rtrl_operator: Callable[..., OperatorProcess],
    model: TinyModel,
    tmp_path: Path,
) -> None:
    tiny_model, aws = model, model.s3_env
    hold = {**ANALYSIS_PROMOTE, "decision": "continue", "reasons": ["inconclusive"]}
    script_all(node, tmp_path, analyze=hold)
    node.script("*-train-*", Succeed(before=copy_base_model(tiny_model, tmp_path / "train")))
    kube.create({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s3-creds"},
                 "stringData": {k: aws[k] for k in ("AWS_ACCESS_KEY_ID",
                                                    "AWS_SECRET_ACCESS_KEY")}})  # fmt: skip
    kube.create(serving_deployment(tiny_model))
    base = base_checkpoint(tmp_path)
    base["spec"]["uri"] = tiny_model.uri
    kube.create(base)
    prefix = f"s3://rtrl-models/e2e-capture-{secrets.token_hex(4)}"
    events = tmp_path / "events"
    doc = rlcycle(tmp_path)
    spec = doc["spec"]
    spec["storage"] = {"artifacts": f"{prefix}/artifacts/", "endpoint": aws["AWS_ENDPOINT_URL"],
                       "region": "us-east-1", "credentialsSecret": "s3-creds"}  # fmt: skip
    spec["data"]["shards"] = f"{prefix}/shards/"
    spec["rollout"].update(  # one step, held by the analyses: the canary stays up
        steps=[{"weight": 50, "minDuration": "1s"}], readyTimeout=f"{ENGINES_READY_SECONDS}s"
    )
    spec["capture"] = {
        "events": events.as_uri() + "/",
        "image": "rtrl-serving:test",
        "headers": {"user": "X-User", "session": "X-Session", "org": "X-Org"},
        "seal": {"schedule": "* * * * *"},
    }
    kube.create(doc)
    operator = rtrl_operator(env=aws)

    def logs() -> str:
        found = [p["metadata"]["name"] for d in (TARGET, CANARY) for p in pods(kube, d)]
        return "\n".join(node.logs(n) for n in found)[-8000:] + "\n" + operator.output()[-3000:]

    stable = kube.wait_for(lambda: ready_pod_with_sidecar(kube, TARGET),
                           timeout=ENGINES_READY_SECONDS, message=logs)  # fmt: skip
    canary = kube.wait_for(lambda: ready_pod_with_sidecar(kube, CANARY),
                           timeout=ENGINES_READY_SECONDS, message=logs)  # fmt: skip
    candidate = kube.get(RTRL, "Checkpoint", CKPT) or {}
    assert status(kube, "Checkpoint", CKPT)["phase"] == "Canary"

    served: dict[str, list[str]] = {}
    for arm, pod in (("stable", stable), ("canary", canary)):
        port = node.runner.network.host_port(pod, SIDECAR)  # type: ignore[union-attr]
        # closed here: an open pool is an unclosed socket that fails a later test at GC
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused") as client:
            ids = []
            for user in range(3):
                raw = client.completions.with_raw_response.create(
                    model="composer",
                    prompt=[256, *b"def add(a, b):"],
                    max_tokens=4,
                    temperature=1.0,
                    extra_headers={
                        "X-User": f"{arm}-user-{user}",
                        "X-Session": "s1",
                        "X-Org": "acme",
                    },
                )
                answer = raw.parse()
                assert len(answer.choices) == 1 and answer.choices[0].logprobs is None  # not asked
                ids.append(raw.headers["X-Rtrl-Interaction-Id"])
        served[arm] = ids

    def shipped() -> pa.Table | None:
        table = events_in(events)
        if table is None:
            return None
        have = set(table.column("interaction_id").to_pylist())
        return table if all(i in have for ids in served.values() for i in ids) else None

    table = kube.wait_for(shipped, timeout=180, message=logs)  # a segment ships within 60 s
    rows = {r["interaction_id"]: r for r in table.to_pylist()}
    expected = {
        "stable": ("composer-0", tiny_model.uri),
        "canary": (CKPT, candidate["spec"]["uri"]),
    }
    for arm, ids in served.items():
        checkpoint = expected[arm][0]
        for i, interaction in enumerate(ids):
            row = rows[interaction]
            assert row["arm"] == arm, row
            assert row["checkpoint_id"] == checkpoint, row
            assert row["checkpoint_verified"] is True, row  # the engine loaded that checkpoint
            assert row["user_id"] == f"{arm}-user-{i}" and row["org"] == "acme", row
            assert row["model_uri"] == expected[arm][1] and row["rlcycle"] == NAME, row
            assert row["session_id"] == "s1" and row["pod"], row
            assert len(row["completion_ids"]) == 4 and len(row["completion_logprobs"]) == 4, row

    # the seal: the CronJob's real rtrl-job seal ran to completion with what it was given
    def sealed() -> dict[str, Any] | None:
        for job in kube.list("batch/v1", "Job", {"rtrl.io/seal": NAME}):
            for cond in (job.get("status") or {}).get("conditions") or []:
                if cond["type"] in ("Complete", "Failed") and cond["status"] == "True":
                    return dict(job)
        return None

    job = kube.wait_for(sealed, timeout=120, message=logs)
    done = {c["type"] for c in job["status"]["conditions"] if c["status"] == "True"}
    assert "Complete" in done, node.logs(job["metadata"]["name"])
    output = node.logs(job["metadata"]["name"])
    assert "--events=" + events.as_uri() in output, output  # what the operator passed
