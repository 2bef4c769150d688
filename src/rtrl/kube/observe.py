"""Read one RLCycle's world back from the cluster and the store, every time."""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rtrl.core.api import names
from rtrl.core.api.checkpoint import CheckpointPhase
from rtrl.core.api.policy import TenancyPolicy
from rtrl.core.api.reasons import JobCondition
from rtrl.core.store import FileCredentials, read_committed_json
from rtrl.planning import (
    DeploymentState,
    JobState,
    Observed,
    SecretState,
    progress_to_read,
    results_to_read,
)
from rtrl.planning.manifests.names import canary_service_name
from rtrl.planning.manifests.seal import seal_name
from rtrl.planning.timeutil import parse_time

from .client import KubeClient, KubeError
from .index import Finder, uri_key

SECRET_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
SESSION_KEY = "AWS_SESSION_TOKEN"
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


# JobState of a Job version that has not failed, by (uid, resourceVersion): a version never
# changes, and a round reads every Job of its RLCycle (the history grows by 4 a cycle).
_JOB_STATES: dict[tuple[str, str], JobState] = {}
_JOB_STATES_MAX = 4096


def job_state(client: KubeClient, job: dict[str, Any]) -> JobState:
    meta = job.get("metadata") or {}
    key = (str(meta.get("uid") or ""), str(meta.get("resourceVersion") or ""))
    known = _JOB_STATES.get(key) if all(key) else None
    if known is not None:
        return known
    state = _job_state(client, job)
    if all(key) and not state.failed:  # a failed one carries its pod's message: read again
        if len(_JOB_STATES) >= _JOB_STATES_MAX:
            _JOB_STATES.clear()
        _JOB_STATES[key] = state
    return state


def _job_state(client: KubeClient, job: dict[str, Any]) -> JobState:
    meta = job.get("metadata") or {}
    labels = meta.get("labels") or {}
    complete = _condition(job, JobCondition.COMPLETE)
    failed = _condition(job, JobCondition.FAILED)
    status = job.get("status") or {}
    finished = parse_time(status.get("completionTime")) or parse_time(
        (complete or failed or {}).get("lastTransitionTime")
    )
    reason = message = ""
    if failed is not None:
        reason = str(failed.get("reason") or JobCondition.FAILED)
        pod = _pod_failure(client, meta["namespace"], meta["name"])
        message = pod or f"{reason}: {failed.get('message') or ''}".strip(": ")
    try:
        attempt = int(labels.get(names.LABEL_ATTEMPT, "0"))
    except ValueError:
        attempt = 0
    return JobState(
        name=meta["name"],
        checkpoint=labels.get(names.LABEL_CHECKPOINT),
        checkpoint_uid=labels.get(names.LABEL_CHECKPOINT_UID),
        step=labels.get(names.LABEL_STEP),
        attempt=attempt,
        succeeded=complete is not None,
        failed=failed is not None,
        finished_at=finished,
        reason=reason,
        message=message,
        deleting=bool(meta.get("deletionTimestamp")),
    )


def secret_state(client: KubeClient, namespace: str, name: str) -> SecretState:
    """Whether the credentials Secret exists, which keys it lacks and its labels; the
    values are never kept, logged or put in status."""
    return read_secret(client, namespace, name)[0]


def read_secret(
    client: KubeClient, namespace: str, name: str
) -> tuple[SecretState, FileCredentials | None]:
    """The credentials Secret's state, and its credentials when it holds both keys: what
    the operator reads the RLCycle's step results with (never its own). Kept in memory for
    the round only; the repr of the credentials shows none of them."""
    found = client.get("Secret", namespace, name)
    if found is None:
        return SecretState(found=False), None
    data = dict(found.get("data") or {})
    keys = set(data) | set(found.get("stringData") or {})
    labels = {
        str(k): str(v) for k, v in ((found.get("metadata") or {}).get("labels") or {}).items()
    }
    state = SecretState(True, tuple(k for k in SECRET_KEYS if k not in keys), labels)
    values = {}
    for key in (*SECRET_KEYS, SESSION_KEY):
        try:
            values[key] = base64.b64decode(str(data[key]), validate=True).decode().strip()
        except (KeyError, binascii.Error, UnicodeDecodeError):
            continue
    if not all(values.get(key) for key in SECRET_KEYS):
        return state, None
    credentials = FileCredentials(
        access_key_id=values[SECRET_KEYS[0]],
        secret_access_key=values[SECRET_KEYS[1]],
        session_token=values.get(SESSION_KEY) or None,
    )
    return state, credentials


def result_credentials(
    storage: dict[str, Any],
    secret: tuple[SecretState, FileCredentials | None] | None,
    policy: TenancyPolicy,
) -> tuple[bool, FileCredentials | None]:
    """Whether the operator may read the RLCycle's step results, and with which
    credentials: the RLCycle's own (its credentialsSecret) when it has them; else the
    operator's own identity (None), only from its own endpoint or one the admin's policy
    allows. A spec's endpoint never gets the operator's key (issue 32: it received it in
    the signature of every result read)."""
    endpoint = storage.get("endpoint")
    if endpoint and not policy.allows_endpoint(str(endpoint)):
        return False, None  # the plan makes the RLCycle Invalid: EndpointNotAllowed
    if storage.get("credentialsSecret"):
        credentials = secret[1] if secret is not None else None
        return credentials is not None, credentials
    return True, None


# The reads of a round are independent: issued together, a round costs about one request's
# latency instead of the sum of eight (the Job-complete -> next-action latency of the
# operator is mostly this round).
_READERS = ThreadPoolExecutor(max_workers=8, thread_name_prefix="rtrl-observe")


def _concurrently(
    reads: dict[str, Callable[[], Any]], inline: frozenset[str] = frozenset()
) -> dict[str, Any]:
    """Run ``reads``: those named in ``inline`` (served from memory) here, the others
    together on the pool, or here too when only one is left."""
    remote = [name for name in reads if name not in inline]
    if len(remote) <= 1:
        return {name: read() for name, read in reads.items()}
    futures = {name: _READERS.submit(reads[name]) for name in remote}
    got = {name: read() for name, read in reads.items() if name in inline}
    return {**got, **{name: future.result() for name, future in futures.items()}}


def _needs_stable_service(
    rollout: dict[str, Any],
    services: frozenset[str],
    checkpoints: list[dict[str, Any]],
    rlcycle: str,
) -> bool:
    """With the gatewayapi router, while a canary is about to start (or runs) without its
    canary Service: the plan copies the stable Service's ports into it."""
    if rollout.get("router") != "gatewayapi" or not rollout.get("service"):
        return False
    if canary_service_name(str(rollout["service"])) in services:
        return False
    return any(
        (c.get("spec") or {}).get("rlCycle") == rlcycle
        and (c.get("status") or {}).get("phase")
        in (CheckpointPhase.EVALUATED, CheckpointPhase.CANARY)
        for c in checkpoints
    )


def _env_value(dep: dict[str, Any] | None, target: dict[str, Any]) -> str | None:
    """The checkpoint URI a Deployment's target container serves (None: not found)."""
    containers = (((dep or {}).get("spec") or {}).get("template") or {}).get("spec") or {}
    container = next(
        (c for c in containers.get("containers") or [] if c.get("name") == target.get("container")),
        None,
    )
    env_name = target.get("checkpointEnv") or "MODEL_URI"
    env = (container or {}).get("env") or []
    return next((e.get("value") for e in env if e.get("name") == env_name), None)


def relevant_checkpoints(
    checkpoints: Finder, rlcycle: dict[str, Any], uris: list[str | None]
) -> list[dict[str, Any]]:
    """Of a namespace's Checkpoints, those a round of ``rlcycle`` can look at: its own, the
    rolled-back ones, those it names (pin, status, annotations) or serves (``uris``), and
    their lineage, by name. Found through ``checkpoints``' index (the watch cache's, or a
    live list's), so a round costs its own Checkpoints, not its namespace's: with 1,000
    RLCycles of 10 Checkpoints in a namespace, a pass over the namespace cost every round
    10,000 (bench/scale.py). A base model is seen when served, named, or in a lineage."""
    name = rlcycle["metadata"]["name"]
    named = {(rlcycle.get("spec") or {}).get("pin")}
    named |= {
        (rlcycle.get("status") or {}).get(k) for k in ("serving", "candidate", "lastPromoted")
    }
    named |= set((rlcycle["metadata"].get("annotations") or {}).values())
    kept: dict[str, dict[str, Any]] = {}
    for ck in checkpoints.find("rlCycle", name) + checkpoints.find(
        "phase", CheckpointPhase.ROLLED_BACK
    ):
        kept[ck["metadata"]["name"]] = ck
    for uri in {uri_key(uri) for uri in uris} - {None}:
        for ck in checkpoints.find("uri", str(uri)):
            kept[ck["metadata"]["name"]] = ck
    for wanted in named - set(kept):
        found = checkpoints.named(str(wanted)) if isinstance(wanted, str) and wanted else None
        if found is not None:
            kept[str(wanted)] = found
    parents = {(c.get("spec") or {}).get("parent") for c in kept.values()}
    while parents:  # up each lineage
        parent = parents.pop()
        if not parent or parent in kept:
            continue
        found = checkpoints.named(str(parent))
        if found is not None:
            kept[str(parent)] = found
            parents.add((found.get("spec") or {}).get("parent"))
    return [kept[n] for n in sorted(kept)]  # in a live list's order


def observe(
    client: KubeClient, rlcycle: dict[str, Any], policy: TenancyPolicy | None = None
) -> Observed:
    """What one round of ``rlcycle`` decides from, under the admin's ``policy`` (the
    operator's settings; None: the default, which allows nothing beyond its own objects)."""
    policy = policy if policy is not None else TenancyPolicy()
    meta = rlcycle["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    spec = rlcycle.get("spec") or {}
    mine = {names.LABEL_RLCYCLE: name}
    target = spec.get("target") or {}
    rollout = spec.get("rollout") or {}
    storage = spec.get("storage") or {}
    reads: dict[str, Callable[[], Any]] = {
        "checkpoints": lambda: client.finder("Checkpoint", namespace),
        "jobs": lambda: [job_state(client, j) for j in client.list("Job", namespace, mine)],
        "services": lambda: client.list("Service", namespace, mine),
        "config_maps": lambda: client.list("ConfigMap", namespace, mine),
        "seal": lambda: client.get("CronJob", namespace, seal_name(name)),
    }
    if target.get("deployment"):
        deployment_name = str(target["deployment"])
        reads["target"] = lambda: client.get("Deployment", namespace, deployment_name)
        reads["canary"] = lambda: client.get("Deployment", namespace, f"{deployment_name}-canary")
    if rollout.get("router") == "gatewayapi" and rollout.get("httpRoute"):
        reads["route"] = lambda: client.get("HTTPRoute", namespace, str(rollout["httpRoute"]))
    if storage.get("credentialsSecret"):
        reads["secret"] = lambda: read_secret(client, namespace, str(storage["credentialsSecret"]))
    kinds = {
        "checkpoints": "Checkpoint",
        "jobs": "Job",
        "services": "Service",
        "config_maps": "ConfigMap",
        "target": "Deployment",
        "canary": "Deployment",
        "seal": "CronJob",
    }
    inline = frozenset(
        read for read, kind in kinds.items() if not client.reads_remotely(kind, namespace)
    )
    got = _concurrently(reads, inline)
    uris = [_env_value(got.get(d), target) for d in ("target", "canary")]
    checkpoints = relevant_checkpoints(got["checkpoints"], rlcycle, uris)
    jobs = got["jobs"]
    services = frozenset(s["metadata"]["name"] for s in got["services"])
    config_maps = frozenset(c["metadata"]["name"] for c in got["config_maps"])
    dep, canary, route = got.get("target"), got.get("canary"), got.get("route")
    secret = got.get("secret")
    deployment = DeploymentState(found=False)
    if dep is not None:
        containers = (((dep.get("spec") or {}).get("template") or {}).get("spec") or {}).get(
            "containers"
        ) or []
        container = next((c for c in containers if c.get("name") == target.get("container")), None)
        env_name = target.get("checkpointEnv") or "MODEL_URI"
        value = None
        if container is not None:
            value = next(
                (e.get("value") for e in container.get("env") or [] if e.get("name") == env_name),
                None,
            )
        deployment = DeploymentState(True, container is not None, value)
    routing = None
    table = ((spec.get("capture") or {}).get("adapters") or {}).get("configMap")
    if table:
        # Not a child (every organisation's RLCycle writes its own key): read, not cached.
        routing = KubeClient.get(client, "ConfigMap", namespace, str(table))
    stable_service = None
    if _needs_stable_service(rollout, services, checkpoints, name):
        # Not a child: the cache does not keep it. Read once per canary, before its Service.
        stable_service = KubeClient.get(client, "Service", namespace, str(rollout["service"]))
    observed = Observed(
        rlcycle=rlcycle,
        checkpoints=checkpoints,
        jobs=jobs,
        services=services,
        config_maps=config_maps,
        deployment=deployment,
        secret=secret[0] if secret is not None else None,
        target=dep,
        canary=canary,
        http_route=route,
        stable_service=stable_service,
        routing=routing,
        seal=got.get("seal"),
        policy=policy,
    )
    wanted = results_to_read(observed)
    progress = progress_to_read(observed)
    readable, credentials = result_credentials(storage, secret, policy)
    if not (wanted or progress) or not readable:
        return observed
    results = {
        uri: read_committed_json(
            uri,
            endpoint_url=storage.get("endpoint"),
            region=storage.get("region"),
            credentials=credentials,
        )
        for uri in wanted
    }
    reported = None
    if progress is not None:
        reported = read_committed_json(
            progress,
            endpoint_url=storage.get("endpoint"),
            region=storage.get("region"),
            credentials=credentials,
            committed_only=False,
        )
    return Observed(**{**observed.__dict__, "results": results, "progress": reported})


__all__ = ["KubeError", "observe"]
