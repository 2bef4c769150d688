"""Read one RLCycle's world back from the cluster and the store, every time."""

from __future__ import annotations

import json
from typing import Any

from rtrl.planning import DeploymentState, JobState, Observed, SecretState, results_to_read
from rtrl.planning import children as ch
from rtrl.planning.timeutil import parse_time
from rtrl.store import open_store, split_uri
from rtrl.store.base import StoreError

from .client import KubeClient, KubeError

SECRET_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
MAX_MESSAGE = 1024


def _condition(obj: dict[str, Any], type_: str) -> dict[str, Any] | None:
    for cond in (obj.get("status") or {}).get("conditions") or []:
        if cond.get("type") == type_ and cond.get("status") == "True":
            return dict(cond)
    return None


def _pod_failure(client: KubeClient, namespace: str, job: str) -> str:
    """The newest pod's termination: reason, exit code and the step's last output."""
    pods = client.list("Pod", namespace, {"job-name": job})
    pods.sort(key=lambda p: (p.get("metadata") or {}).get("creationTimestamp") or "")
    for pod in reversed(pods):
        for status in (pod.get("status") or {}).get("containerStatuses") or []:
            term = (status.get("state") or {}).get("terminated") or {}
            if term:
                text = f"{term.get('reason') or 'Error'} (exit {term.get('exitCode')})"
                tail = " ".join(str(term.get("message") or "").split())
                if tail:
                    text += f": {tail[-MAX_MESSAGE:]}"
                return f"pod {pod['metadata']['name']}: {text}"
    return ""


def job_state(client: KubeClient, job: dict[str, Any]) -> JobState:
    meta = job.get("metadata") or {}
    labels = meta.get("labels") or {}
    complete = _condition(job, "Complete")
    failed = _condition(job, "Failed")
    status = job.get("status") or {}
    finished = parse_time(status.get("completionTime")) or parse_time(
        (complete or failed or {}).get("lastTransitionTime")
    )
    reason = message = ""
    if failed is not None:
        reason = str(failed.get("reason") or "Failed")
        pod = _pod_failure(client, meta["namespace"], meta["name"])
        message = pod or f"{reason}: {failed.get('message') or ''}".strip(": ")
    try:
        attempt = int(labels.get(ch.LABEL_ATTEMPT, "0"))
    except ValueError:
        attempt = 0
    return JobState(
        name=meta["name"],
        checkpoint=labels.get(ch.LABEL_CHECKPOINT),
        checkpoint_uid=labels.get(ch.LABEL_CHECKPOINT_UID),
        step=labels.get(ch.LABEL_STEP),
        attempt=attempt,
        succeeded=complete is not None,
        failed=failed is not None,
        finished_at=finished,
        reason=reason,
        message=message,
        deleting=bool(meta.get("deletionTimestamp")),
    )


def read_result(uri: str, endpoint: str | None, region: str | None) -> dict[str, Any] | str | None:
    """A step's result document, if its output prefix is committed (manifest written last);
    a string says why it could not be read."""
    prefix, name = split_uri(uri)
    try:
        store = open_store(prefix, endpoint_url=endpoint, region=region)
        if store.committed("") is None:
            return None
        doc = json.loads(store.get_bytes(name))
    except (StoreError, ValueError, OSError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return doc if isinstance(doc, dict) else f"{name} is not a JSON object"


def observe(client: KubeClient, rlcycle: dict[str, Any]) -> Observed:
    meta = rlcycle["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    spec = rlcycle.get("spec") or {}
    mine = {ch.LABEL_RLCYCLE: name}
    checkpoints = client.list("Checkpoint", namespace)
    jobs = [job_state(client, j) for j in client.list("Job", namespace, mine)]
    services = frozenset(s["metadata"]["name"] for s in client.list("Service", namespace, mine))
    config_maps = frozenset(
        c["metadata"]["name"] for c in client.list("ConfigMap", namespace, mine)
    )
    target = spec.get("target") or {}
    deployment = DeploymentState(found=False)
    dep = canary = route = None
    if target.get("deployment"):
        dep = client.get("Deployment", namespace, str(target["deployment"]))
        canary = client.get("Deployment", namespace, f"{target['deployment']}-canary")
        if dep is not None:
            containers = (((dep.get("spec") or {}).get("template") or {}).get("spec") or {}).get(
                "containers"
            ) or []
            container = next(
                (c for c in containers if c.get("name") == target.get("container")), None
            )
            env_name = target.get("checkpointEnv") or "MODEL_URI"
            value = None
            if container is not None:
                value = next(
                    (
                        e.get("value")
                        for e in container.get("env") or []
                        if e.get("name") == env_name
                    ),
                    None,
                )
            deployment = DeploymentState(True, container is not None, value)
    rollout = spec.get("rollout") or {}
    if rollout.get("router") == "gatewayapi" and rollout.get("httpRoute"):
        route = client.get("HTTPRoute", namespace, str(rollout["httpRoute"]))
    storage = spec.get("storage") or {}
    secret = None
    if storage.get("credentialsSecret"):
        found = client.get("Secret", namespace, str(storage["credentialsSecret"]))
        if found is None:
            secret = SecretState(found=False)
        else:
            keys = set(found.get("data") or {}) | set(found.get("stringData") or {})
            secret = SecretState(True, tuple(k for k in SECRET_KEYS if k not in keys))
        del found  # the values are never kept, logged or put in status
    observed = Observed(
        rlcycle=rlcycle,
        checkpoints=checkpoints,
        jobs=jobs,
        services=services,
        config_maps=config_maps,
        deployment=deployment,
        secret=secret,
        target=dep,
        canary=canary,
        http_route=route,
    )
    wanted = results_to_read(observed)
    if not wanted:
        return observed
    results = {
        uri: read_result(uri, storage.get("endpoint"), storage.get("region")) for uri in wanted
    }
    return Observed(**{**observed.__dict__, "results": results})


__all__ = ["KubeError", "observe"]
