"""The tenancy model on the real control plane (issue 32, docs/tenancy.md): a user who may
only write RLCycles in one namespace (a namespaced Role, acting through ``kubectl --as``)
gets the operator to do what the admin's policy allows and nothing more.

The admin's policy is the chart's ``policy`` values, rendered by ``helm template`` into the
Deployment's ``RTRL_POLICY`` and handed to the operator process as the chart would; the
operator holds its own S3 key in its environment, as the chart puts it there. The user:

- cannot read a Secret or create a Job themselves (``kubectl auth can-i``);
- gets every RLCycle that asks for more than the policy (an image of theirs, a
  ServiceAccount, a control-plane toleration, a node selector, 64Ti of memory, an
  unmarked Secret, an endpoint of theirs, a capture sidecar of their image) marked
  Invalid with the reason and the field, and no Checkpoint, Job, CronJob or sidecar made
  for it; the endpoint's listener sees no request;
- gets an RLCycle within the policy run: its step Job has the allowed image and no token,
  and the operator reads its result through the endpoint with the RLCycle's own key,
  never the operator's (a proxy in front of S3 records every request's Authorization);
- gets no webhook redirected: the webhook answers with a redirect to another address, and
  nothing arrives there; a webhook whose host the policy (webhookHosts) does not list is
  refused, its URL never shown.

Before the policy (cf54846^), each of these RLCycles started a cycle as asked, and the
result reads were signed ``Credential=<the operator's key>``.
"""

from __future__ import annotations

import base64
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from email.message import Message
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import boto3
import pytest
import yaml

from rtrl_localkube.api import KubeAPI
from rtrl_localkube.controlplane import ControlPlane
from rtrl_localkube.cycle_world import (
    RTRL,
    base_checkpoint,
    deployment,
    rlcycle,
    script_all,
)
from rtrl_localkube.kubelet import Kubelet
from rtrl_localkube.s3faults import serve_fault_proxy
from rtrl_localkube.tools import Cli, OperatorProcess

pytestmark = pytest.mark.timeout(300)

USER = "alice@example.com"
OPERATOR_KEY = "AKIAOPERATORSOWNKEY1"
RLCYCLE_KEY = "AKIARLCYCLESOWNKEY22"
LABEL = {"rtrl.io/rlcycle-secret": "true"}


class Recorder:
    """Any request, of any method, recorded with its Authorization header; answers 200, or
    a redirect to ``redirect`` when given."""

    def __init__(self, redirect: str | None = None) -> None:
        self.requests: list[tuple[str, str, str]] = []
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            def _any(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(length)
                auth = self.headers.get("Authorization") or ""
                recorder.requests.append((self.command, self.path, auth))
                self.send_response(302 if redirect else 200)
                if redirect:
                    self.send_header("Location", redirect)
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_GET = do_POST = do_PUT = do_HEAD = _any  # noqa: N815

            def log_message(self, *args: Any) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.http.serve_forever, daemon=True).start()
        self.port = int(self.http.server_address[1])

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()


def chart_policy(values: dict[str, Any], tmp_path: Path, admin: Cli) -> str:
    """RTRL_POLICY as the chart renders it for these ``policy`` values."""
    path = tmp_path / "policy-values.yaml"
    path.write_text(yaml.safe_dump({"policy": values}))
    rendered = admin.helm("template", "rtrl", "charts/rtrl-operator", "-f", str(path)).stdout
    for doc in yaml.safe_load_all(rendered):
        if doc and doc.get("kind") == "Deployment":
            (container,) = doc["spec"]["template"]["spec"]["containers"]
            env = {e["name"]: e.get("value") for e in container["env"]}
            return str(env["RTRL_POLICY"])
    raise AssertionError("the chart renders no Deployment")


def secret(name: str, data: dict[str, str], labels: dict[str, str] | None) -> dict[str, Any]:
    encoded = {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}
    meta: dict[str, Any] = {"name": name}
    if labels:
        meta["labels"] = labels
    return {"apiVersion": "v1", "kind": "Secret", "metadata": meta, "data": encoded}


def author_role(kube: KubeAPI) -> None:
    """What the user may do in the namespace: write RLCycles, read Checkpoints. No Secret,
    no Job, no Pod."""
    kube.create({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
        "metadata": {"name": "rlcycle-author"},
        "rules": [
            {"apiGroups": ["rtrl.io"], "resources": ["rlcycles"],
             "verbs": ["get", "list", "watch", "create", "update", "patch", "delete"]},
            {"apiGroups": ["rtrl.io"], "resources": ["checkpoints"],
             "verbs": ["get", "list", "watch"]},
        ],
    })  # fmt: skip
    kube.create({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
        "metadata": {"name": "rlcycle-author"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                    "name": "rlcycle-author"},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": USER}],
    })  # fmt: skip


@dataclass(frozen=True)
class Namespace:
    """The test's namespace as its user sees it: the admin's clients, ``kubectl --as`` the
    user, the store the admin allows and the bucket the RLCycles use."""

    kube: KubeAPI
    admin: Cli
    as_user: tuple[str, ...]
    root: Path
    tmp: Path
    store: str
    bucket: str

    def user_applies(self, doc: dict[str, Any]) -> None:
        path = self.tmp / f"{doc['metadata']['name']}.yaml"
        path.write_text(yaml.safe_dump(doc))
        self.admin.kubectl("apply", "-f", str(path), *self.as_user)

    def storage(self, **changes: Any) -> dict[str, Any]:
        found = {"artifacts": f"s3://{self.bucket}/rl/", "endpoint": self.store,
                 "region": "us-east-1", "credentialsSecret": "s3-creds", **changes}  # fmt: skip
        return {k: v for k, v in found.items() if v is not None}


def test_a_namespace_user_makes_the_operator_do_only_what_the_policy_allows(  # noqa: PLR0917 - pytest passes fixtures by name
    controlplane: ControlPlane,
    kube: KubeAPI,
    admin: Cli,
    node: Kubelet,
    rtrl_operator: Callable[..., OperatorProcess],
    moto_endpoint: str,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    ns = kube.namespace
    as_user = ("--as", USER, "-n", ns)
    author_role(kube)
    for verb, what in (("get", "secrets"), ("create", "jobs"), ("create", "pods")):
        answer = admin.kubectl("auth", "can-i", verb, what, *as_user, check=False)
        assert answer.stdout.strip() == "no", (verb, what, answer.stdout)
    assert admin.kubectl("auth", "can-i", "create", "rlcycles.rtrl.io", *as_user).stdout.strip() \
        == "yes"  # fmt: skip
    refused = admin.kubectl("get", "secrets", *as_user, check=False)
    assert refused.returncode != 0 and "forbidden" in refused.stderr.lower(), refused.stderr

    # The store (moto) behind a proxy that records each request's Authorization header.
    bucket = f"ten-{ns}"[:63]
    s3 = boto3.session.Session(
        aws_access_key_id=RLCYCLE_KEY, aws_secret_access_key="rlcycle-secret",
        region_name="us-east-1",
    ).client("s3", endpoint_url=moto_endpoint)  # fmt: skip
    s3.create_bucket(Bucket=bucket)
    seen: list[tuple[str, str, str]] = []

    def record(method: str, path: str, headers: Message) -> bool:
        seen.append((method, path, headers.get("Authorization") or ""))
        return False

    listener = Recorder()  # an endpoint of the user's: only its requests are recorded
    landing = Recorder()  # where the webhook's redirect points
    webhook = Recorder(redirect=f"http://localhost:{landing.port}/latest/meta-data/")
    with serve_fault_proxy(moto_endpoint) as (proxy, store):
        proxy.fail(record, times=-1)
        try:
            # The admin: the namespace's Deployment and base model, a Secret marked for
            # RLCycles and one that is not, a webhook Secret; the policy; the operator.
            root = tmp_path / "local"
            kube.create(deployment(root))
            kube.create(base_checkpoint(root))
            keys = {"AWS_ACCESS_KEY_ID": RLCYCLE_KEY, "AWS_SECRET_ACCESS_KEY": "rlcycle-secret"}
            kube.create(secret("s3-creds", keys, LABEL))
            kube.create(secret("payments-creds", keys, None))
            url = f"http://127.0.0.1:{webhook.port}/hook"
            direct = f"http://localhost:{landing.port}/direct"  # a host the policy does not list
            kube.create(secret("hook", {"url": url, "direct": direct}, LABEL))
            policy = chart_policy(
                {
                    "images": ["rtrl-trainer:*"],
                    "endpoints": [store],
                    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}],
                    "maxResources": {"cpu": "4", "memory": "8Gi"},
                    "maxNodes": 1,
                    "webhookHosts": ["127.0.0.1"],
                },
                tmp_path,
                admin,
            )
            script_all(node, tmp_path)  # step Jobs succeed, committing canned results
            monkeypatch.setenv("AWS_ENDPOINT_URL", store)  # where the scripted steps write
            monkeypatch.setenv("AWS_ACCESS_KEY_ID", RLCYCLE_KEY)
            monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "rlcycle-secret")
            monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
            operator = rtrl_operator(
                "--namespace", ns, "--standalone",
                env={"RTRL_POLICY": policy, "AWS_ACCESS_KEY_ID": OPERATOR_KEY,
                     "AWS_SECRET_ACCESS_KEY": "operator-secret", "AWS_DEFAULT_REGION": "us-east-1",
                     "AWS_ENDPOINT_URL": "", "AWS_CONFIG_FILE": "/nonexistent",
                     "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent"},
            )  # fmt: skip
            scene = Namespace(kube, admin, as_user, root, tmp_path, store, bucket)
            run_the_attacks(scene, listener)
            run_within_the_policy(scene, seen, operator, webhook, landing)
        finally:
            for server in (listener, landing, webhook):
                server.close()


def run_the_attacks(scene: Namespace, listener: Recorder) -> None:
    """Each RLCycle asks one thing beyond the policy: Invalid, with the reason and field."""
    kube, admin, storage = scene.kube, scene.admin, scene.storage
    image = "rtrl-trainer:test"
    training: dict[str, Any] = {"image": image, "nodes": 1, "gpusPerNode": 0}
    attacks = {
        "evil-image": ({"training": {**training, "image": "attacker.example/steal:1"}},
                       "ImageNotAllowed", "spec.training.image"),
        "evil-account": ({"storage": storage(credentialsSecret=None,
                                             serviceAccountName="default")},
                         "ServiceAccountNotAllowed", "spec.storage.serviceAccountName"),
        "evil-toleration": ({"training": {**training, "tolerations": [
                                {"key": "node-role.kubernetes.io/control-plane",
                                 "operator": "Exists", "effect": "NoSchedule"}]}},
                            "TolerationNotAllowed", "spec.training.tolerations[0]"),
        "evil-node": ({"training": {**training,
                                    "nodeSelector": {"kubernetes.io/hostname": "node-0"}}},
                      "NodeSelectorNotAllowed", "spec.training.nodeSelector"),
        "evil-memory": ({"training": {**training,
                                      "resources": {"requests": {"memory": "64Ti"}}}},
                        "ResourcesNotAllowed", "spec.training.resources.requests.memory"),
        "evil-secret": ({"storage": storage(credentialsSecret="payments-creds")},
                        "SecretNotAllowed", "spec.storage.credentialsSecret"),
        "evil-endpoint": ({"storage": storage(endpoint=f"http://127.0.0.1:{listener.port}",
                                              credentialsSecret=None)},
                          "EndpointNotAllowed", "spec.storage.endpoint"),
        "evil-capture": ({"capture": {"events": f"s3://{scene.bucket}/events/",
                                      "image": "attacker.example/sidecar:1"}},
                         "ImageNotAllowed", "spec.capture.image"),
    }  # fmt: skip
    for name, (changes, _, _) in attacks.items():
        spec = {"training": training, "storage": storage(), **changes}
        doc = rlcycle(scene.root, **spec)
        doc["metadata"]["name"] = name
        scene.user_applies(doc)
    for name, (_, reason, field) in attacks.items():

        def invalid(name: str = name) -> dict[str, Any] | None:
            found = kube.get(RTRL, "RLCycle", name) or {}
            for condition in (found.get("status") or {}).get("conditions") or []:
                if condition["type"] == "InvalidSpec" and condition["status"] == "True":
                    return dict(condition)
            return None

        def shown(name: str = name) -> str:
            return str(kube.get(RTRL, "RLCycle", name))

        condition = kube.wait_for(invalid, timeout=60, interval=0.3, message=shown)
        assert condition["reason"] == reason, (name, condition)
        assert condition["message"].startswith(field), (name, condition)
        # what the user reads back, as themselves
        own = admin.kubectl("get", "rlcycle", name, "-o", "json", *scene.as_user).stdout
        assert json.loads(own)["status"]["phase"] == "Invalid"
    time.sleep(2)  # a few more rounds of each
    made = [
        (kind, o["metadata"]["name"])
        for api, kind in (("batch/v1", "Job"), ("batch/v1", "CronJob"), (RTRL, "Checkpoint"))
        for o in kube.list(api, kind)
        if (o["metadata"].get("labels") or {}).get("rtrl.io/rlcycle", "").startswith("evil-")
        or (o.get("spec") or {}).get("rlCycle", "").startswith("evil-")
    ]
    assert made == [], made
    assert listener.requests == [], listener.requests
    # No sidecar of the user's image was put into the target Deployment's pods.
    target = kube.get("apps/v1", "Deployment", "composer-vllm") or {}
    images = [c["image"] for c in target["spec"]["template"]["spec"]["containers"]]
    assert not [i for i in images if i.startswith("attacker.")], images


def run_within_the_policy(
    scene: Namespace,
    seen: list[tuple[str, str, str]],
    operator: OperatorProcess,
    webhook: Recorder,
    landing: Recorder,
) -> None:
    """An RLCycle within the policy runs; its results are read with its own key."""
    kube = scene.kube
    doc = rlcycle(
        scene.root,
        training={"image": "rtrl-trainer:test", "nodes": 1, "gpusPerNode": 0,
                  "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}],
                  "resources": {"requests": {"cpu": "1", "memory": "1Gi"}}},
        storage=scene.storage(),
        notifications=[{"name": "ops", "urlSecret": {"name": "hook", "key": "url"}},
                       {"name": "elsewhere", "urlSecret": {"name": "hook", "key": "direct"}}],
    )  # fmt: skip
    doc["metadata"]["name"] = "composer"
    scene.user_applies(doc)

    def trained() -> bool:
        ck = kube.get(RTRL, "Checkpoint", "composer-1") or {}
        return (ck.get("status") or {}).get("phase") in ("Training", "Evaluating", "Evaluated",
                                                          "Canary", "Promoted")  # fmt: skip

    kube.wait_for(trained, timeout=120, interval=0.3,
                  message=lambda: f"{kube.get(RTRL, 'RLCycle', 'composer')}\n"
                                  f"{operator.output()[-4000:]}")  # fmt: skip
    (job,) = [j for j in kube.list("batch/v1", "Job")
              if j["metadata"]["name"].startswith("composer-1-stage-")]  # fmt: skip
    pod = job["spec"]["template"]["spec"]
    assert pod["containers"][0]["image"] == "rtrl-trainer:test"
    assert pod["automountServiceAccountToken"] is False
    assert "serviceAccountName" not in pod or pod["serviceAccountName"] == "default"
    # The operator read stage.json (the stage's result) through the proxy: with the
    # RLCycle's key. No request there ever carried the operator's own.
    reads = [(m, p, a) for m, p, a in seen if "stage" in p and m in ("GET", "HEAD")]
    assert reads, seen
    assert all(f"Credential={RLCYCLE_KEY}/" in a for _, _, a in reads), reads
    assert not [a for _, _, a in seen if OPERATOR_KEY in a]
    # The webhook heard of the cycle, answered with a redirect, and nothing followed it;
    # the one whose host the policy does not list was refused, its URL never shown.
    kube.wait_for(lambda: webhook.requests, timeout=60, message=operator.output)
    refused = "key direct: the URL's host is not one the operator's policy lets webhooks reach"
    kube.wait_for(lambda: refused in operator.output(), timeout=60, message=operator.output)
    time.sleep(1)
    assert landing.requests == [], landing.requests
    assert f":{landing.port}" not in operator.output()
