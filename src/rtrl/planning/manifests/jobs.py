"""The manifests of a cycle's own objects: its Checkpoint, the ConfigMap with the spec it
started with, the training step's headless Service and the step Jobs (with their
``rtrl-job`` arguments). Names and store locations come from :mod:`.names`."""

from __future__ import annotations

import copy
from datetime import datetime
from typing import Any

from rtrl.core.api.common import parse_duration
from rtrl.core.api.names import (
    ANNOTATION_DATA_SINCE,
    ANNOTATION_STARTED,
    ANNOTATION_TRIGGER,
    API_VERSION,
    LABEL_ATTEMPT,
    LABEL_CHECKPOINT,
    LABEL_CHECKPOINT_UID,
    LABEL_STEP,
)
from rtrl.core.api.rlcycle import RLCycleSpec

from ..timeutil import iso
from .names import (
    checkpoint_name,
    config_map_name,
    job_name,
    labels,
    model_uri,
    owner,
    service_name,
    step_out,
)

CONFIG_MOUNT = "/etc/rtrl"
CONFIG_FILE = "rlcycle.yaml"
SCRATCH = "/scratch"
MASTER_PORT = 29500
# Store credentials reach a step as files of the RLCycle's credentialsSecret, never as
# environment variables: the eval step runs model-written code, and a process's environment
# is copied into everything it starts and readable at /proc/<pid>/environ. The directory is
# named to the step by CREDENTIALS_DIR_ENV (read by rtrl.core.store.s3, which holds the same name).
CREDENTIALS_MOUNT = "/var/run/secrets/rtrl/storage"
CREDENTIALS_DIR_ENV = "RTRL_STORAGE_CREDENTIALS_DIR"
CREDENTIAL_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
# Owner and group read. With the pod's fsGroup the kubelet makes a Secret volume's files
# owned by root with group fsGroup, and ORs 0440 into the modes of a read-only volume's
# files anyway (pkg/volume/volume_linux.go): 0400 would name root alone as the reader while
# the step runs as uid 1000, which reads them through group 1000. 0440 is the mode the files
# really get; other users (the eval sandbox's task user, where it has one) cannot read them.
CREDENTIALS_MODE = 0o440
# Every rtrl container: non-root, read-only root filesystem, no capability, no escalation;
# every step pod: uid/gid 1000 (fsGroup 1000 for its volumes), RuntimeDefault seccomp.
CONTAINER_SECURITY: dict[str, Any] = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "runAsNonRoot": True,
    "capabilities": {"drop": ["ALL"]},
}
POD_SECURITY: dict[str, Any] = {
    "runAsNonRoot": True,
    "runAsUser": 1000,
    "runAsGroup": 1000,
    "fsGroup": 1000,
    "seccompProfile": {"type": "RuntimeDefault"},
}


def checkpoint_manifest(
    rlcycle: dict[str, Any],
    spec: RLCycleSpec,
    *,
    cycle: int,
    parent: str,
    now: datetime,
    trigger: str | None,
    since: str | None = None,
    base: str | None = None,
) -> dict[str, Any]:
    """The cycle's Checkpoint. Its annotations fix what its stage reads, so that every
    attempt (and an operator restarted mid-cycle) stages the same interactions: those that
    became ready after ``since`` (the parent's data watermark) and up to ``now``. ``base``:
    for an adapter, the base Checkpoint it is trained on (its lineage's, and where it may
    be served)."""
    meta = rlcycle["metadata"]
    name = checkpoint_name(meta["name"], cycle)
    annotations = {ANNOTATION_STARTED: iso(now)}
    if since is not None:
        annotations[ANNOTATION_DATA_SINCE] = since
    if trigger is not None:
        annotations[ANNOTATION_TRIGGER] = trigger
    return {
        "apiVersion": API_VERSION,
        "kind": "Checkpoint",
        "metadata": {
            "name": name,
            "namespace": meta["namespace"],
            "labels": labels(meta["name"]),
            "annotations": annotations,
            "ownerReferences": [owner("RLCycle", meta["name"], meta["uid"])],
        },
        "spec": {
            "uri": model_uri(spec, name, now),
            "parent": parent,
            "rlCycle": meta["name"],
            "cycle": cycle,
            **({"base": base} if base else {}),
        },
    }


def _child_metadata(
    rlcycle: dict[str, Any], checkpoint: dict[str, Any], name: str, **extra_labels: str
) -> dict[str, Any]:
    """Metadata of a cycle's child: labelled for the RLCycle, owned by the Checkpoint (so
    the API server's garbage collector removes it with the Checkpoint)."""
    ck = checkpoint["metadata"]
    return {
        "name": name,
        "namespace": ck["namespace"],
        "labels": labels(rlcycle["metadata"]["name"], ck["name"], **extra_labels),
        "ownerReferences": [owner("Checkpoint", ck["name"], ck["uid"])],
    }


def config_map_manifest(
    rlcycle: dict[str, Any], checkpoint: dict[str, Any], spec_text: str
) -> dict[str, Any]:
    """The RLCycle spec as the cycle started with it: every step reads the same config."""
    name = config_map_name(checkpoint["metadata"]["name"])
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _child_metadata(rlcycle, checkpoint, name),
        "data": {CONFIG_FILE: spec_text},
    }


def service_manifest(rlcycle: dict[str, Any], checkpoint: dict[str, Any]) -> dict[str, Any]:
    """Headless Service giving training pod i the name ``<job>-<i>.<service>``."""
    ck = checkpoint["metadata"]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _child_metadata(rlcycle, checkpoint, service_name(ck["name"])),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {LABEL_CHECKPOINT: ck["name"], LABEL_STEP: "train"},
            "ports": [{"name": "rendezvous", "port": MASTER_PORT, "targetPort": MASTER_PORT}],
        },
    }


def store_env(spec: RLCycleSpec) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = []
    storage = spec.storage
    if storage.credentials_secret:
        env.append({"name": CREDENTIALS_DIR_ENV, "value": CREDENTIALS_MOUNT})
    if storage.endpoint:
        env.append({"name": "AWS_ENDPOINT_URL", "value": storage.endpoint})
    if storage.region:
        env.append({"name": "AWS_DEFAULT_REGION", "value": storage.region})
    retries = storage.retries
    if retries is not None:  # the names rtrl.core.store.retries reads
        for name, value in (
            ("AWS_RETRY_MODE", retries.mode),
            ("AWS_MAX_ATTEMPTS", retries.max_attempts),
            ("RTRL_S3_BODY_ATTEMPTS", retries.body_attempts),
        ):
            if value is not None:
                env.append({"name": name, "value": str(value)})
    return env


def credentials_volume(
    spec: RLCycleSpec, *, name: str = "storage-credentials", mode: int = CREDENTIALS_MODE
) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """(volume, volumeMount) of the credentials Secret, read-only at CREDENTIALS_MOUNT with
    one file per key; None without storage.credentialsSecret (the pod's role then)."""
    secret = spec.storage.credentials_secret
    if not secret:
        return None
    volume = {
        "name": name,
        "secret": {
            "secretName": secret,
            "items": [{"key": key, "path": key} for key in CREDENTIAL_KEYS],
            "defaultMode": mode,
        },
    }
    mount = {"name": name, "mountPath": CREDENTIALS_MOUNT, "readOnly": True}
    return volume, mount


def step_args(
    step: str,
    spec: RLCycleSpec,
    checkpoint: dict[str, Any],
    serving: dict[str, Any],
    *,
    previous: str | None,
    excluded: list[str],
) -> list[str]:
    """``rtrl-job <step> ...`` arguments (docs/train.md, docs/stage.md, docs/eval.md)."""
    uri = checkpoint["spec"]["uri"]
    config = f"--config={CONFIG_MOUNT}/{CONFIG_FILE}"
    if step == "stage":
        started = checkpoint["metadata"]["annotations"][ANNOTATION_STARTED]
        ranks = spec.training.nodes * max(1, spec.training.gpus_per_node)
        args = [
            "stage",
            f"--checkpoint={serving['metadata']['name']}",
            f"--out={step_out(uri, 'stage')}",
            # Its vocabulary bounds the token ids the stage lets through.
            f"--parent={serving['spec']['uri']}",
            config,
            f"--now={started}",
            f"--ranks={ranks}",
            f"--work-dir={SCRATCH}",
        ]
        since = checkpoint["metadata"]["annotations"].get(ANNOTATION_DATA_SINCE)
        if since:
            args.append(f"--since={since}")
        if previous:
            args.append(f"--previous-checkpoint={previous}")
        args += [f"--exclude-checkpoint={name}" for name in excluded]
        if spec.capture is not None:  # exactly the files the seal's markers list
            args.append("--sealed")
        return args
    if step == "train":
        return [
            "train",
            f"--parent={serving['spec']['uri']}",
            f"--data={step_out(uri, 'stage')}",
            f"--out={uri}",
            config,
        ]
    return [
        "eval",
        f"--candidate={uri}",
        f"--parent={serving['spec']['uri']}",
        f"--out={step_out(uri, 'eval')}",
        f"--heldout={step_out(uri, 'stage')}",
        config,
        f"--work-dir={SCRATCH}",
    ]


def job_manifest(
    rlcycle: dict[str, Any],
    spec: RLCycleSpec,
    checkpoint: dict[str, Any],
    *,
    step: str,
    attempt: int,
    args: list[str],
    service_account: str | None = None,
) -> dict[str, Any]:
    """A step Job: non-root, read-only root filesystem, scratch and config mounted, store
    credentials as files (never env); the training step as an Indexed Job behind the
    headless Service (docs/train.md)."""
    ck = checkpoint["metadata"]
    name = job_name(ck["name"], step, attempt)
    training = spec.training
    step_labels = {LABEL_STEP: step, LABEL_CHECKPOINT_UID: ck["uid"], LABEL_ATTEMPT: str(attempt)}
    pod_labels = labels(rlcycle["metadata"]["name"], ck["name"], **step_labels)
    gpus = training.gpus_per_node if step in ("train", "eval") else 0
    if step == "eval":
        gpus = min(gpus, 1)
    env: list[dict[str, Any]] = [
        {"name": "HF_HUB_OFFLINE", "value": "1"},
        {"name": "RTRL_SCRATCH", "value": SCRATCH},
        {"name": "TMPDIR", "value": "/tmp"},
        *store_env(spec),
    ]
    if gpus == 0:
        env.append({"name": "DS_ACCELERATOR", "value": "cpu"})
    command = ["rtrl-job"]
    pod_args = list(args)
    mounts = [
        {"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True},
        {"name": "scratch", "mountPath": SCRATCH},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    volumes: list[dict[str, Any]] = [
        {"name": "config", "configMap": {"name": config_map_name(ck["name"])}},
        {"name": "scratch", "emptyDir": {}},
        {"name": "tmp", "emptyDir": {}},
    ]
    credentials = credentials_volume(spec)
    if credentials is not None:
        volumes.append(credentials[0])
        mounts.append(credentials[1])
    resources: dict[str, Any] = {}
    if training.resources is not None and step in ("train", "eval"):
        resources = training.resources.model_dump(mode="json", by_alias=True, exclude_none=True)
    if gpus:
        resources.setdefault("limits", {})[training.gpu_resource] = gpus
    job_spec: dict[str, Any] = {"backoffLimit": 0}
    # Steps read and write the object store only; the API server's token is not theirs
    # (a cloud role through storage.serviceAccountName comes from its own webhook volume).
    pod_spec: dict[str, Any] = {"restartPolicy": "Never", "automountServiceAccountToken": False}
    if step == "train":
        service = service_name(ck["name"])
        env += [
            {"name": "NODES", "value": str(training.nodes)},
            {"name": "GPUS", "value": str(training.gpus_per_node)},
            {"name": "MASTER_ADDR", "value": f"{name}-0.{service}"},
            {"name": "MASTER_PORT", "value": str(MASTER_PORT)},
        ]
        if training.gpus_per_node > 1:
            command = ["torchrun"]
            pod_args = [
                "--nnodes=$(NODES)",
                "--node-rank=$(JOB_COMPLETION_INDEX)",
                "--nproc-per-node=$(GPUS)",
                "--master-addr=$(MASTER_ADDR)",
                "--master-port=$(MASTER_PORT)",
                "--no-python",
                "rtrl-job",
                *args,
            ]
        else:
            env.append({"name": "WORLD_SIZE", "value": str(training.nodes)})
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory"}})
        job_spec.update(
            completionMode="Indexed",
            completions=training.nodes,
            parallelism=training.nodes,
        )
        pod_spec["subdomain"] = service
    if step in ("train", "eval"):
        if training.node_selector:
            pod_spec["nodeSelector"] = dict(training.node_selector)
        if training.tolerations:
            pod_spec["tolerations"] = [
                t.model_dump(mode="json", by_alias=True, exclude_none=True)
                for t in training.tolerations
            ]
    if service_account:  # the spec's once the policy allowed it, else the admin's
        pod_spec["serviceAccountName"] = service_account
    if spec.jobs.active_deadline:
        job_spec["activeDeadlineSeconds"] = int(parse_duration(spec.jobs.active_deadline))
    container: dict[str, Any] = {
        "name": "step",
        "image": training.image,
        "command": command,
        "args": pod_args,
        "env": env,
        "volumeMounts": mounts,
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": copy.deepcopy(CONTAINER_SECURITY),
    }
    if resources:
        container["resources"] = resources
    pod_spec.update(
        containers=[container], volumes=volumes, securityContext=copy.deepcopy(POD_SECURITY)
    )
    job_spec["template"] = {"metadata": {"labels": pod_labels}, "spec": pod_spec}
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": _child_metadata(rlcycle, checkpoint, name, **step_labels),
        "spec": job_spec,
    }
