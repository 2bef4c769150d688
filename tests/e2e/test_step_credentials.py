"""A step pod's store credentials on the real API server and the kubelet stand-in: the Job
the operator builds for a cycle with ``storage.credentialsSecret`` (accepted by the real
server as it is), its container running a script instead of ``rtrl-job``, writes to S3
(moto) with the Secret's files, while no credential is in its environment."""

from __future__ import annotations

import base64
from datetime import UTC, datetime
from typing import Any

import boto3
import pytest

from rtrl.core.api.rlcycle import RLCycleSpec
from rtrl.core.api.yamlfile import load
from rtrl.planning.manifests.jobs import (
    CONFIG_FILE,
    CREDENTIAL_KEYS,
    CREDENTIALS_MOUNT,
    checkpoint_manifest,
    job_manifest,
)
from rtrl_localkube.api import KubeAPI
from rtrl_localkube.kubelet import Kubelet
from tests.conftest import REPO

pytestmark = pytest.mark.timeout(120)

ACCESS_KEY = "AKIAPODFILES00000000"
SECRET = "p0d-s3cr3t-never-in-env"

SCRIPT = """
import os, stat, sys
from rtrl.core.store import open_store
store = open_store(sys.argv[1])
store.put_bytes("hello.txt", b"written with the Secret's files")
path = os.path.join(os.environ["RTRL_STORAGE_CREDENTIALS_DIR"], "AWS_SECRET_ACCESS_KEY")
print("mode", oct(stat.S_IMODE(os.stat(path).st_mode)))
print("key", store.client._get_credentials().access_key)
print("env", " ".join(sorted(os.environ)))
"""


def step_job(namespace: str, endpoint: str, bucket: str) -> dict[str, Any]:
    raw = load((REPO / "examples" / "rlcycle.yaml").read_text())["spec"]
    raw["storage"] = {
        "artifacts": f"s3://{bucket}/composer/",
        "endpoint": endpoint,
        "region": "us-east-1",
        "credentialsSecret": "s3-creds",
    }
    spec = RLCycleSpec.model_validate(raw)
    rlcycle = {"metadata": {"name": "composer", "namespace": namespace, "uid": "rlc-uid"}}
    checkpoint = checkpoint_manifest(
        rlcycle, spec, cycle=1, parent="composer-0", now=datetime.now(UTC), trigger=None
    )
    checkpoint["metadata"]["uid"] = "ck-uid"
    job = job_manifest(
        rlcycle, spec, checkpoint, step="stage", attempt=0, args=[f"s3://{bucket}/composer/"]
    )
    del job["metadata"]["ownerReferences"]  # no Checkpoint here: the collector would take it
    container = job["spec"]["template"]["spec"]["containers"][0]
    container["command"] = ["python", "-c", SCRIPT]
    # nothing from this machine's AWS configuration either
    container["env"] += [
        {"name": "AWS_CONFIG_FILE", "value": "/nonexistent"},
        {"name": "AWS_SHARED_CREDENTIALS_FILE", "value": "/nonexistent"},
        {"name": "AWS_EC2_METADATA_DISABLED", "value": "true"},
    ]
    return job


def test_a_step_reaches_the_store_with_the_secret_as_files(
    kube: KubeAPI, node: Kubelet, moto_endpoint: str
) -> None:
    s3 = boto3.session.Session(
        aws_access_key_id="testing", aws_secret_access_key="testing", region_name="us-east-1"
    ).client("s3", endpoint_url=moto_endpoint)
    bucket = f"creds-{kube.namespace}"[:63]
    s3.create_bucket(Bucket=bucket)
    kube.create({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s3-creds"},
                 "data": {"AWS_ACCESS_KEY_ID": base64.b64encode(ACCESS_KEY.encode()).decode(),
                          "AWS_SECRET_ACCESS_KEY": base64.b64encode(SECRET.encode()).decode(),
                          "unrelated": base64.b64encode(b"not mounted").decode()}})  # fmt: skip
    kube.create({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "composer-1-config"},
                 "data": {CONFIG_FILE: "{}"}})  # fmt: skip
    job = step_job(kube.namespace, moto_endpoint, bucket)
    name = job["metadata"]["name"]
    kube.create(job)
    done = kube.wait_for_job(name, 60, message=lambda: node.logs(name, kube.namespace))
    logs = node.logs(name, kube.namespace)
    assert done["type"] == "Complete", logs
    body = s3.get_object(Bucket=bucket, Key="composer/hello.txt")["Body"].read()
    assert body == b"written with the Secret's files"
    assert "mode 0o440" in logs and f"key {ACCESS_KEY}" in logs
    env_names = next(line for line in logs.splitlines() if line.startswith("env ")).split()
    assert "RTRL_STORAGE_CREDENTIALS_DIR" in env_names
    assert not {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} & set(env_names)
    # what the server stored: a read-only Secret volume, no secretKeyRef anywhere
    (pod,) = kube.list("v1", "Pod", labels={"batch.kubernetes.io/job-name": name})
    (container,) = pod["spec"]["containers"]
    assert not [e for e in container["env"] if "valueFrom" in e]
    (volume,) = [v for v in pod["spec"]["volumes"] if "secret" in v]
    assert volume["secret"]["defaultMode"] == 0o440
    assert [i["key"] for i in volume["secret"]["items"]] == list(CREDENTIAL_KEYS)
    assert {"name": volume["name"], "mountPath": CREDENTIALS_MOUNT, "readOnly": True} in [
        {k: m[k] for k in ("name", "mountPath", "readOnly") if k in m}
        for m in container["volumeMounts"]
    ]
    assert SECRET not in logs
