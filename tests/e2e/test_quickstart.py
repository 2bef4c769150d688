"""The quick start of docs/helm.md, run as written, command by command, on a control plane of
its own: from a clone to a cycle that trains, evaluates, canaries and promotes a checkpoint.

The commands are read from the doc's ``sh`` blocks, so the doc and this test cannot drift: a
command this test does not know fails it, and so does a step it expects that the doc lost.
Every command runs for real (bash, in a clone of this repository, with helm and kubectl
against the real kube-apiserver) except where this machine cannot, and says so:

- ``make images`` / ``make push-images``: there is no Docker engine here. The test runs
  ``make -n`` (the docker commands, tagged with the chart's appVersion) and ``make images``
  with no engine reachable (its message).
- ``kubectl rollout status deployment/rtrl-operator``: the image was never pushed, so its pod
  waits in ErrImagePull (checked, with the tag the chart chose). The operator runs instead as
  a local process with exactly the Deployment's arguments and environment (its Secret
  resolved), under the chart's ServiceAccount token; its liveness endpoint must answer.
- Step 3's edits, made to the clone's ``examples/``: the Secret's credentials and
  ``spec.storage.endpoint`` point at a local S3 (moto), which holds the base model (as plain
  files, as a user uploads it) and interactions in the buckets the examples name. What this
  machine needs besides (no GPU, two CPUs): one replica of a stand-in server, one CPU
  training node, a tiny model, a few hundred interactions, seconds-long canary steps.

Pods run on the kubelet stand-in (``rtrl_localkube.kubelet``): every image but the
operator's is this machine's environment, so the trainer image the example names runs the
real ``rtrl-job`` steps (DeepSpeed on CPU).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import boto3
import kubernetes
import pytest
import yaml
from kubernetes.dynamic import DynamicClient

from rtrl.core.api.yamlfile import load, load_all
from rtrl.core.store import open_store
from rtrl_localkube.api import KubeAPI
from rtrl_localkube.controlplane import ControlPlane
from rtrl_localkube.cycle_world import deployment, rlcycle
from rtrl_localkube.kubelet import Kubelet
from rtrl_localkube.tools import Cli, OperatorProcess
from tests.conftest import REPO
from tests.e2e.conftest import KUBELET_ENV, OPERATOR_IMAGE
from tests.e2e.world import (
    add_interactions,
    canary_counted_from,
    phase,
    save_base_model,
    serve_arms,
    served,
    small,
)

pytestmark = pytest.mark.timeout(420)

DOC = REPO / "docs" / "helm.md"
SECTION = "## Quick start"
NAMESPACE = "ml-serving"
# What the reader of the quick start has in their shell (moto checks no credentials).
SHELL = {"AWS_ACCESS_KEY_ID": "AKIAQUICKSTARTOPERATR", "AWS_SECRET_ACCESS_KEY": "qs-operator-key"}
STEP_KEYS = {"AWS_ACCESS_KEY_ID": "AKIAQUICKSTARTSTEPSS", "AWS_SECRET_ACCESS_KEY": "qs-steps-key"}


def quick_start_commands(text: str) -> list[str]:
    """The commands of the ``sh`` blocks of the quick start section, continuation lines
    joined, comment-only and blank lines left out (a trailing comment stays: bash skips it)."""
    section = text[text.index(SECTION) :]
    section = section[: section.index("\n## ", 1)]
    commands: list[str] = []
    for block in re.findall(r"```sh\n(.*?)```", section, flags=re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        for raw in joined.splitlines():
            line = raw.strip()
            if line and not line.startswith("#"):
                commands.append(line)
    return commands


def app_version() -> str:
    return str(load((REPO / "charts" / "rtrl-operator" / "Chart.yaml").read_text())["appVersion"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class QuickStart:
    """A reader of the quick start: a shell's environment, a clone, a cluster."""

    cp: ControlPlane
    clone: Path
    moto: str
    work: Path
    shell: dict[str, str] = field(default_factory=lambda: dict(SHELL))
    operator: OperatorProcess | None = None
    done: list[str] = field(default_factory=list)

    @property
    def cli(self) -> Cli:
        return Cli(self.cp.admin_kubeconfig)

    def sh(
        self, command: str, *, check: bool = True, **env: str
    ) -> subprocess.CompletedProcess[str]:
        """``command`` in bash, in the clone, with the reader's shell variables."""
        result = subprocess.run(
            ["bash", "-c", command], cwd=self.clone, capture_output=True, text=True,
            env=self.cli.env({**self.shell, **env}), timeout=180,
        )  # fmt: skip
        if check and result.returncode != 0:
            raise AssertionError(f"$ {command}\nexit {result.returncode}\n{result.stdout}\n"
                                 f"{result.stderr}")  # fmt: skip
        return result

    # --- the steps, by the command that starts each -----------------------------------

    def export(self, command: str) -> None:
        name = command.split()[1].split("=", maxsplit=1)[0]
        self.shell[name] = self.sh(f'{command}\nprintf %s "${name}"').stdout

    def make_images(self, command: str) -> None:
        tag, registry = app_version(), self.shell["REGISTRY"]
        planned = self.sh(command.replace("make ", "make -n ", 1)).stdout.splitlines()
        for image in ("operator", "trainer"):
            wanted = f"docker build -f images/{image}/Dockerfile -t {registry}/rtrl-{image}:{tag} ."
            assert wanted in planned, planned
        # No Docker engine here (nor, in the test, anywhere DOCKER_HOST points).
        refused = self.sh(command, check=False, DOCKER_HOST="unix:///nonexistent/docker.sock")
        assert refused.returncode != 0
        assert "make images: no Docker engine is reachable" in refused.stderr or (
            "make images: docker is not installed" in refused.stderr
        ), refused.stderr

    def make_push_images(self, command: str) -> None:
        planned = self.sh(command.replace("make ", "make -n ", 1)).stdout
        for image in ("operator", "trainer"):
            assert f"docker push {self.shell['REGISTRY']}/rtrl-{image}:{app_version()}" in planned

    def run(self, command: str) -> None:
        self.sh(command)

    def helm_install(self, command: str) -> None:
        out = self.sh(command).stdout
        assert "STATUS: deployed" in out, out
        self.cli.wait_established("crd/rlcycles.rtrl.io", "crd/checkpoints.rtrl.io")

    def rollout_status(self, command: str) -> None:
        """The operator's pod cannot pull the image (never pushed); the operator runs as a
        process with the Deployment's arguments, environment and ServiceAccount."""
        namespace, name = "rtrl-system", command.rsplit("/", 1)[1]
        dep = self.cli.get("deployment", name, "-n", namespace)
        pod_spec = dep["spec"]["template"]["spec"]
        (container,) = pod_spec["containers"]
        image = f"{self.shell['REGISTRY']}/rtrl-operator:{app_version()}"
        assert container["image"] == image, container["image"]

        def waiting() -> str | None:
            for pod in self.cli.get("pods", "-n", namespace)["items"]:
                for status in (pod.get("status") or {}).get("containerStatuses") or []:
                    reason = ((status.get("state") or {}).get("waiting") or {}).get("reason")
                    if reason in ("ErrImagePull", "ImagePullBackOff"):
                        return str(reason)
            return None

        def pods() -> str:
            return json.dumps(self.cli.get("pods", "-n", namespace)["items"])[-4000:]

        KubeAPI.wait_for(waiting, timeout=60, interval=0.5, message=pods)
        health, metrics = free_port(), free_port()
        args = [
            re.sub(r"^--liveness=http://[^/]+/", f"--liveness=http://127.0.0.1:{health}/", a)
            .replace("--metrics-port=9090", f"--metrics-port={metrics}")
            for a in container["args"]
        ]  # fmt: skip
        assert f"--metrics-port={metrics}" in args and "--all-namespaces" in args, args
        env = {e["name"]: self.env_value(namespace, e) for e in container.get("env") or []}
        # The test's resync (1 s, as in every e2e test) instead of the chart's 30 s.
        env.pop("RTRL_RESYNC_SECONDS")
        # Credentials from the chart's Secret only: nothing of this machine's AWS setup.
        env |= {"AWS_CONFIG_FILE": "/nonexistent", "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
                "AWS_EC2_METADATA_DISABLED": "true"}  # fmt: skip
        assert env["AWS_ACCESS_KEY_ID"] == SHELL["AWS_ACCESS_KEY_ID"], sorted(env)
        self.operator = OperatorProcess(
            self.cp,
            self.work / "operator",
            service_account=(namespace, pod_spec["serviceAccountName"]),
            args=args,
            env=env,
        )

        def healthy() -> bool:
            assert self.operator is not None and self.operator.proc.poll() is None, (
                self.operator.output() if self.operator else ""
            )
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{health}/healthz", timeout=2) as r:
                    return r.status == 200
            except OSError:
                return False

        KubeAPI.wait_for(healthy, timeout=60, interval=0.3, message=self.operator.output)

    def env_value(self, namespace: str, entry: dict[str, Any]) -> str:
        """An env entry's value as the kubelet would resolve it (value or secretKeyRef)."""
        if "value" in entry:
            return str(entry["value"])
        ref = entry["valueFrom"]["secretKeyRef"]
        secret = self.cli.get("secret", ref["name"], "-n", namespace)
        return base64.b64decode(secret["data"][ref["key"]]).decode()

    def apply_examples(self, command: str) -> None:
        out = self.sh(command).stdout
        for created in ("namespace/ml-serving", "secret/s3-creds created",
                        "deployment.apps/composer-vllm created",
                        "checkpoint.rtrl.io/composer-0 created",
                        "rlcycle.rtrl.io/composer created"):  # fmt: skip
            assert created in out, out

    def get_rlc_ckpt(self, command: str) -> None:
        """What the reader sees once the operator has looked: the RLCycle valid, serving the
        base Checkpoint, a cycle begun."""

        def begun() -> dict[str, Any] | None:
            """The RLCycle once its first cycle's Checkpoint has a phase (and so every
            column a value)."""
            items = self.cli.get("rlc,ckpt", "-n", NAMESPACE)["items"]
            status = {i["metadata"]["name"]: i.get("status") or {} for i in items}
            if (status.get("composer-1") or {}).get("phase") and status["composer"].get("phase"):
                return next(i for i in items if i["kind"] == "RLCycle")
            return None

        rlc = KubeAPI.wait_for(begun, timeout=90, interval=0.5, message=self.why)
        conditions = {c["type"]: c for c in rlc["status"].get("conditions") or []}
        assert conditions.get("InvalidSpec", {}).get("status") != "True", conditions
        out = self.sh(command).stdout
        tables = [t.splitlines() for t in out.strip().split("\n\n")]
        assert [t[0].split() for t in tables] == [
            ["NAME", "PHASE", "SERVING", "CANDIDATE", "CANARY", "CYCLE", "NEXT", "RUN", "AGE"],
            ["NAME", "PHASE", "CYCLE", "PARENT", "EVAL", "DECISION", "AGE"],
        ], out
        (rlc_row,) = tables[0][1:]
        cells = rlc_row.split()
        assert cells[0] == "rlcycle.rtrl.io/composer" and cells[2] == "composer-0", out
        assert cells[1] not in ("Invalid", "Pending"), out
        ckpts = {row.split()[0]: row.split() for row in tables[1][1:]}
        assert set(ckpts) == {"checkpoint.rtrl.io/composer-0", "checkpoint.rtrl.io/composer-1"}
        assert ckpts["checkpoint.rtrl.io/composer-1"][2:4] == ["1", "composer-0"], out

    def rtrl_status(self, command: str) -> None:
        out = self.sh(command).stdout
        assert re.search(r"Serving:\s+composer-0", out), out

    def why(self) -> str:
        rlc = self.cli.get("rlc,ckpt,jobs,pods", "-n", NAMESPACE)
        statuses = [(i["kind"], i["metadata"]["name"], i.get("status")) for i in rlc["items"]]
        operator = self.operator.output()[-6000:] if self.operator else "(not started)"
        return f"{json.dumps(statuses, indent=1, default=str)[-8000:]}\n--- operator\n{operator}"


STEPS: list[tuple[str, Callable[[QuickStart, str], None]]] = [
    (r"export REGISTRY=", QuickStart.export),
    (r"make images$", QuickStart.make_images),
    (r"make push-images$", QuickStart.make_push_images),
    (r"kubectl create namespace rtrl-system$", QuickStart.run),
    (r"kubectl -n rtrl-system create secret generic ", QuickStart.run),
    (r"helm install rtrl charts/rtrl-operator ", QuickStart.helm_install),
    (r"kubectl -n rtrl-system rollout status deployment/", QuickStart.rollout_status),
    (r"kubectl apply -f examples/$", QuickStart.apply_examples),
    (r"kubectl get rlc,ckpt -n ml-serving$", QuickStart.get_rlc_ckpt),
    (r"kubectl rtrl status composer -n ml-serving$", QuickStart.rtrl_status),
]


def step_for(command: str) -> Callable[[QuickStart, str], None]:
    bare = re.sub(r"\s+#.*$", "", command)
    found = [step for pattern, step in STEPS if re.match(pattern, bare)]
    assert len(found) == 1, f"the quick start has a command this test does not run: {command}"
    return found[0]


def test_every_quick_start_command_has_a_step() -> None:
    commands = quick_start_commands(DOC.read_text())
    steps = [step_for(c) for c in commands]
    assert len(set(steps)) == len(STEPS) - 1  # QuickStart.run serves two commands
    assert commands[0].startswith("export REGISTRY=") and "kubectl apply" in commands[-3]


# --- the clone and the reader's edits -----------------------------------------------------


def clone_with_edits(clone: Path, moto: str, root: Path) -> None:
    """The repository as a reader has it after step 3: everything as it is, except
    examples/, edited."""
    clone.mkdir()
    for entry in REPO.iterdir():
        if entry.name not in ("examples", ".git"):
            (clone / entry.name).symlink_to(entry)
    examples = clone / "examples"
    shutil.copytree(REPO / "examples", examples)

    # The reader's edits: the credentials, and the store's endpoint (the buckets and the
    # base model's URI stay as the examples have them).
    (secret,) = load_all((examples / "01-s3-secret.yaml").read_text())
    assert set(secret["stringData"]) == set(STEP_KEYS)
    secret["stringData"] = dict(STEP_KEYS)
    (examples / "01-s3-secret.yaml").write_text(yaml.safe_dump(secret))
    example = load((REPO / "examples" / "rlcycle.yaml").read_text())
    assert (
        example["spec"]["training"]["image"] == f"registry.example.com/rtrl-trainer:{app_version()}"
    )
    # This machine's: one CPU node, a tiny model and little data (world.small).
    doc = rlcycle(root, storage={**example["spec"]["storage"], "endpoint": moto})
    small(doc["spec"], example["spec"]["data"]["shards"])
    doc["spec"]["training"]["image"] = example["spec"]["training"]["image"]
    doc["metadata"]["namespace"] = NAMESPACE
    (examples / "rlcycle.yaml").write_text(yaml.safe_dump(doc))
    # The admin's edit of the policy: the store the RLCycle names is theirs.
    values = load((examples / "helm" / "policy-values.yaml").read_text())
    values["policy"]["endpoints"] = [moto]
    (examples / "helm" / "policy-values.yaml").write_text(yaml.safe_dump(values))
    # A server that runs here (no GPU, no vLLM), serving the example's model URI.
    served_uri = load((REPO / "examples" / "checkpoint-base.yaml").read_text())["spec"]["uri"]
    server = deployment(root, serving_uri=served_uri)
    server["metadata"]["namespace"] = NAMESPACE
    (examples / "inference-deployment.yaml").write_text(yaml.safe_dump(server))


@contextlib.contextmanager
def writing_to_moto() -> Iterator[None]:
    """Credentials for the test's own writes to moto (the model, the users' interactions),
    set only while it writes: the operator and the reader's shell must not inherit them."""
    with pytest.MonkeyPatch.context() as m:
        for name, value in {**STEP_KEYS, "AWS_DEFAULT_REGION": "us-east-1",
                            "AWS_CONFIG_FILE": "/nonexistent",
                            "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent"}.items():  # fmt: skip
            m.setenv(name, value)
        yield


@pytest.fixture
def cluster(controlplane_binaries: Path, tmp_path: Path) -> Iterator[tuple[ControlPlane, Kubelet]]:
    """A control plane of this test's own (the chart's release and ml-serving are cluster
    objects the session's tests also create), with a kubelet stand-in."""
    with (
        ControlPlane(tmp_path / "controlplane", controlplane_binaries) as cp,
        Kubelet(
            cp, tmp_path / "kubelet", extra_env=KUBELET_ENV, unavailable_images=(OPERATOR_IMAGE,)
        ) as node,
    ):
        yield cp, node


def test_the_quick_start_runs_a_cycle(
    cluster: tuple[ControlPlane, Kubelet], moto_endpoint: str, tmp_path: Path
) -> None:
    cp, node = cluster
    example = load((REPO / "examples" / "rlcycle.yaml").read_text())["spec"]
    keys = {k.lower(): v for k, v in STEP_KEYS.items()}
    s3 = boto3.session.Session(**keys, region_name="us-east-1")
    for bucket in ("rtrl-artifacts", "interactions"):
        s3.client("s3", endpoint_url=moto_endpoint).create_bucket(Bucket=bucket)
    with writing_to_moto():
        shards = open_store(example["data"]["shards"], endpoint_url=moto_endpoint)
        # The base model uploaded as plain files (no rtrl manifest), where the example says.
        artifacts = open_store("s3://rtrl-artifacts/", endpoint_url=moto_endpoint)
        save_base_model(artifacts, "composer/checkpoints/composer-0", tmp_path, commit=False)
        add_interactions(shards, served())
    clone = tmp_path / "clone"
    clone_with_edits(clone, moto_endpoint, tmp_path / "local")

    reader = QuickStart(cp, clone, moto_endpoint, tmp_path)
    kubeconfig = cp.kubeconfig(tmp_path / "admin.kubeconfig", namespace=NAMESPACE)
    api_client = kubernetes.config.new_client_from_config(config_file=os.fspath(kubeconfig))
    discovery = DynamicClient(api_client, cache_file=os.fspath(tmp_path / "discovery.json"))
    kube = KubeAPI(cp.url, kubeconfig, NAMESPACE, api_client, discovery)
    phases: list[str] = []

    def why() -> str:
        jobs = "\n".join(f"=== {j}\n{node.logs(j, NAMESPACE)[-3000:]}" for j in node.jobs_seen)
        return f"phases of composer-1: {phases}\n{reader.why()}\n{jobs}"

    def reaches(wanted: str, timeout: float = 240) -> None:
        def seen() -> bool:
            now = phase(kube, "composer-1")
            if now and (not phases or phases[-1] != now):
                phases.append(now)
            return now == wanted

        kube.wait_for(seen, timeout=timeout, interval=0.2, message=why)

    try:
        for command in quick_start_commands(DOC.read_text()):
            step_for(command)(reader, command)
        # The first cycle, with the real steps: its stage Job, training, eval, the canary.
        kube.wait_for(lambda: any(j.startswith("composer-1-stage-") for j in node.jobs_seen),
                      timeout=60, message=why)  # fmt: skip
        reaches("Canary")
        # watched from the stage Job's appearance: a quick stage may be over by then
        assert phases[0] in ("Pending", "Staging", "Training") and "Training" in phases, phases
        since = kube.wait_for(lambda: canary_counted_from(kube, "composer-1"), timeout=60)
        # Its users keep more of the canary's edits: promoted.
        with writing_to_moto():
            shards = open_store(example["data"]["shards"], endpoint_url=moto_endpoint)
            serve_arms(shards, "composer-0", "composer-1", since=since,
                       canary_edit_persistence=0.8)  # fmt: skip
        reaches("Promoted", timeout=150)
        rows = reader.sh("kubectl get ckpt -n ml-serving").stdout.splitlines()
        promoted = next(r.split() for r in rows if r.startswith("composer-1 "))
        assert promoted[:6] == ["composer-1", "Promoted", "1", "composer-0", "Passed", "promote"]
    finally:
        api_client.close()
        if reader.operator is not None:
            assert reader.operator.stop() == 0, reader.operator.output()[-5000:]
