"""The seal CronJob of an RLCycle with ``spec.capture``: ``<rlcycle>-seal`` runs ``rtrl-job
seal`` in the training image on ``capture.seal.schedule`` (UTC), joining each hour's
generation events with their feedback once every signal is final, into shards under
``data.shards`` (docs/operator.md, "Capture").

Why a CronJob the RLCycle owns, and not a Job before each stage: the canary's analyses read
the interactions of both arms every ``analysis.interval`` while no stage runs, so hours must
be sealed as they become final, whatever the cycle is doing; and a seal that runs on its own
clock costs a stage nothing. A run seals every final hour not sealed yet, so a missed or
failed run loses nothing (the next one catches up), and runs never overlap
(``concurrencyPolicy: Forbid``).

The CronJob is derived from the spec as a whole; its hash (``rtrl.io/spec-hash``) tells a
round whether the stored one is still what the spec says, without comparing it field by
field against what the API server defaulted into it.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Mapping
from typing import Any

from rtrl.core.api.common import parse_duration
from rtrl.core.api.names import ANNOTATION_SPEC_HASH, LABEL_SEAL, MANAGED_BY
from rtrl.core.api.rlcycle import RLCycleSpec

from .jobs import CONTAINER_SECURITY, POD_SECURITY, credentials_volume, store_env
from .names import labels, owner

# Its Jobs' history: the last success, the last few failures (kubectl get jobs -l rtrl.io/seal).
SUCCESSFUL_HISTORY = 1
FAILED_HISTORY = 3
# A run that could not start within this of its time is skipped: the next one seals as much.
STARTING_DEADLINE_SECONDS = 300
BACKOFF_LIMIT = 2


def seal_name(rlcycle: str) -> str:
    return f"{rlcycle}-seal"


def seal_args(spec: RLCycleSpec) -> list[str]:
    """``rtrl-job seal ...``: the events root, the shards to write, the delay, and every
    maturity the spec overrides (the seal step's defaults are the contract's)."""
    capture = spec.capture
    assert capture is not None
    args = [
        "seal",
        f"--events={capture.events}",
        f"--shards={spec.data.shards}",
        f"--delay={capture.seal.delay}",
    ]
    overrides = capture.maturity.overrides() if capture.maturity is not None else {}
    args += [f"--maturity={signal}={overrides[signal]}" for signal in sorted(overrides)]
    return args


def seal_cronjob(
    rlcycle: Mapping[str, Any], spec: RLCycleSpec, service_account: str | None = None
) -> dict[str, Any]:
    """The CronJob, owned by the RLCycle (garbage-collected with it); its pods run as
    ``service_account`` (rtrl.planning.tenancy.job_service_account)."""
    capture = spec.capture
    assert capture is not None
    meta = rlcycle["metadata"]
    name = seal_name(str(meta["name"]))
    job_labels = {**MANAGED_BY, LABEL_SEAL: str(meta["name"])}
    mounts = [{"name": "tmp", "mountPath": "/tmp"}]
    volumes: list[dict[str, Any]] = [{"name": "tmp", "emptyDir": {}}]
    credentials = credentials_volume(spec)
    if credentials is not None:
        volumes.append(credentials[0])
        mounts.append(credentials[1])
    container = {
        "name": "seal",
        "image": spec.training.image,
        "command": ["rtrl-job"],
        "args": seal_args(spec),
        "env": [{"name": "TMPDIR", "value": "/tmp"}, *store_env(spec)],
        "volumeMounts": mounts,
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": copy.deepcopy(CONTAINER_SECURITY),
    }
    pod: dict[str, Any] = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "containers": [container],
        "volumes": volumes,
        "securityContext": copy.deepcopy(POD_SECURITY),
    }
    if service_account:
        pod["serviceAccountName"] = service_account
    job: dict[str, Any] = {
        "backoffLimit": BACKOFF_LIMIT,
        "template": {"metadata": {"labels": job_labels}, "spec": pod},
    }
    if spec.jobs.active_deadline:
        job["activeDeadlineSeconds"] = int(parse_duration(spec.jobs.active_deadline))
    body = {
        "schedule": capture.seal.schedule,
        "timeZone": "Etc/UTC",
        "concurrencyPolicy": "Forbid",
        "startingDeadlineSeconds": STARTING_DEADLINE_SECONDS,
        "successfulJobsHistoryLimit": SUCCESSFUL_HISTORY,
        "failedJobsHistoryLimit": FAILED_HISTORY,
        "jobTemplate": {"metadata": {"labels": job_labels}, "spec": job},
    }
    digest = hashlib.sha256(
        json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    ).hexdigest()[:16]
    return {
        "apiVersion": "batch/v1",
        "kind": "CronJob",
        "metadata": {
            "name": name,
            "namespace": meta["namespace"],
            "labels": labels(str(meta["name"])),
            "annotations": {ANNOTATION_SPEC_HASH: digest},
            "ownerReferences": [owner("RLCycle", str(meta["name"]), str(meta["uid"]))],
        },
        "spec": body,
    }


def spec_hash(obj: Mapping[str, Any] | None) -> str | None:
    return (((obj or {}).get("metadata") or {}).get("annotations") or {}).get(ANNOTATION_SPEC_HASH)


def replace_patch(stored: Mapping[str, Any], want: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A JSON patch replacing the stored CronJob's spec and hash with ``want``'s, applied
    only to the version whose hash it read (a test of the annotation)."""
    path = "/metadata/annotations/" + ANNOTATION_SPEC_HASH.replace("/", "~1")
    ops: list[dict[str, Any]] = []
    old = spec_hash(stored)
    if old is None:
        ops.append({"op": "test", "path": "/spec/schedule", "value": stored["spec"]["schedule"]})
        if not (stored.get("metadata") or {}).get("annotations"):
            ops.append({"op": "add", "path": "/metadata/annotations", "value": {}})
    else:
        ops.append({"op": "test", "path": path, "value": old})
    ops += [
        {"op": "replace", "path": "/spec", "value": want["spec"]},
        {"op": "add", "path": path, "value": spec_hash(want)},
    ]
    return ops
