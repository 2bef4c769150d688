"""The inference Deployment of examples/ on the real control plane: its pods run the real vLLM
(the kubelet stand-in runs the ``vllm/vllm-openai`` image as the vLLM venv), become Ready
only once ``/health`` answers (the readiness probe), and serve rtrl's checkpoint from S3.

Every pod shares this machine's network, so a pod's port is reached on 127.0.0.1."""

from __future__ import annotations

import copy
import re
import time
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml

from rtrl_localkube.api import KubeAPI
from rtrl_localkube.kubelet import Kubelet
from rtrl_localkube.processes import free_port
from tests.conftest import REPO
from tests.vllm_engine import TinyModel

EXAMPLE = REPO / "examples" / "inference-deployment.yaml"
# vLLM's start on a loaded 2-core machine: imports alone take a minute or more
VLLM_READY_SECONDS = 600


def ready(pod: dict[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def running(pod: dict[str, Any]) -> bool:
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    return bool(statuses) and all("running" in s.get("state", {}) for s in statuses)


def pods_of(kube: KubeAPI, app: str) -> list[dict[str, Any]]:
    return kube.list("v1", "Pod", labels={"app": app})


def available(kube: KubeAPI, name: str) -> int:
    status = (kube.get("apps/v1", "Deployment", name) or {}).get("status") or {}
    return int(status.get("availableReplicas") or 0)


# Serves /health on $PORT once $GATE exists: a model server still loading its model.
GATED_SERVER = """
import http.server, os, pathlib, time
while not pathlib.Path(os.environ["GATE"]).exists():
    time.sleep(0.1)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(os.environ["PORT"])), Health).serve_forever()
"""


@pytest.mark.timeout(120)
def test_a_readiness_probe_keeps_a_pod_unready_until_it_serves(
    kube: KubeAPI, node: Kubelet, tmp_path: Path
) -> None:
    gate, port = tmp_path / "loaded", free_port()
    container = {
        "name": "srv",
        "image": "srv:1",
        "command": ["python", "-c", GATED_SERVER],
        "env": [{"name": "GATE", "value": str(gate)}, {"name": "PORT", "value": str(port)}],
        "ports": [{"name": "http", "containerPort": port}],
        "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 1},
    }
    labels = {"app": "gated"}
    kube.create({
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "gated"},
        "spec": {"replicas": 1, "selector": {"matchLabels": labels},
                 "template": {"metadata": {"labels": labels}, "spec": {"containers": [container]}}},
    })  # fmt: skip
    kube.wait_for(lambda: any(running(p) for p in pods_of(kube, "gated")), timeout=60)
    # running, probed every second, not serving: never Ready
    until = time.monotonic() + 4
    while time.monotonic() < until:
        assert not any(ready(p) for p in pods_of(kube, "gated"))
        assert available(kube, "gated") == 0
        time.sleep(0.2)
    gate.touch()
    kube.wait_for(lambda: available(kube, "gated") == 1, timeout=30)
    assert all(ready(p) for p in pods_of(kube, "gated"))


def example_for_this_node(model: TinyModel, port: int) -> dict[str, Any]:
    """examples/inference-deployment.yaml with only what differs on this machine changed:
    one replica on a CPU (no GPU, no tensor parallelism, eager mode), the tiny model's URI
    and the S3 endpoint it is on, and a free port (all pods share the host's network)."""
    example = yaml.safe_load(EXAMPLE.read_text())
    doc = copy.deepcopy(example)
    doc["metadata"].pop("namespace")
    doc["spec"]["replicas"] = 1
    (container,) = doc["spec"]["template"]["spec"]["containers"]
    container.pop("resources")
    args = [a for a in container["args"] if not a.startswith(("--tensor-parallel-size", "--port"))]
    container["args"] = [*args, f"--port={port}", "--enforce-eager", "--max-model-len=512"]
    container["ports"] = [{"name": "http", "containerPort": port}]
    env = {e["name"]: e for e in container["env"]}
    env["MODEL_URI"]["value"] = model.uri
    env["RTRL_CHECKPOINT_ID"]["value"] = "tiny-0"
    for name in ("AWS_ENDPOINT_URL", "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING"):
        env[name] = {"name": name, "value": model.s3_env[name]}
    container["env"] = list(env.values())
    return doc


@pytest.mark.timeout(VLLM_READY_SECONDS + 120)
def test_the_example_deployment_serves_rtrls_checkpoint_with_real_vllm(
    kube: KubeAPI, node: Kubelet, tiny_model: TinyModel
) -> None:
    example = yaml.safe_load(EXAMPLE.read_text())
    (container,) = example["spec"]["template"]["spec"]["containers"]
    # the example as written: vLLM's image, a command valid in that image, rtrl's flags
    assert container["image"].startswith("vllm/vllm-openai:")
    assert container["command"] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
    for flag in ("--model=$(MODEL_URI)", "--dtype=float32", "--logprobs-mode=processed_logprobs"):
        assert flag in container["args"]
    secret = container["envFrom"][0]["secretRef"]["name"]
    kube.create({
        "apiVersion": "v1", "kind": "Secret", "metadata": {"name": secret},
        "stringData": {k: tiny_model.s3_env[k]
                       for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")},
    })  # fmt: skip
    port = free_port()
    doc = example_for_this_node(tiny_model, port)
    name = doc["metadata"]["name"]
    kube.create(doc)
    app = doc["spec"]["selector"]["matchLabels"]["app"]

    def logs() -> str:
        return "\n".join(node.logs(p["metadata"]["name"]) for p in pods_of(kube, app))

    def tail() -> str:
        return logs()[-6000:]

    kube.wait_for(lambda: any(running(p) for p in pods_of(kube, app)), timeout=60, message=tail)
    # Ready only once vLLM answers /health: the probe, not the process, decides
    kube.wait_for(lambda: available(kube, name) == 1, timeout=VLLM_READY_SECONDS, message=logs)
    with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused") as client:
        answer = client.completions.create(
            model="composer",  # the example's --served-model-name
            prompt=[256, *b"def add(a, b):"],
            max_tokens=8,
            temperature=1.0,
            logprobs=0,
            extra_body={"return_token_ids": True},
        )
    assert answer.model == "composer"
    choice = answer.choices[0]
    assert len((choice.model_extra or {})["token_ids"]) == 8
    assert choice.logprobs is not None and len(choice.logprobs.token_logprobs or []) == 8
    # it ran from the vLLM venv, on the checkpoint the store holds, in float32
    log = logs()
    assert re.search(r"\.venv-vllm/bin/python -m vllm\.entrypoints\.openai\.api_server", log)
    assert tiny_model.uri in log and "dtype=torch.float32" in log
