"""What the demo runs of a deployment's pipeline around the operator's plan: the capture
sidecar's env as the operator injects it, the seal CronJob's Job, and the blog's broken
reward pipeline (scenario drop-invalid-tool-calls)."""

from __future__ import annotations

import copy
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rtrl.core.api.rlcycle import RLCycleSpec
from rtrl.planning.manifests import capture as cap
from rtrl.planning.manifests.canary import CHECKPOINT_ID_ENV, env_value
from rtrl.planning.manifests.seal import seal_args
from rtrl_localkube.cluster import LocalCluster
from rtrl_localkube.configmapvolume import project

from .inlet import adapters_table_dir, sidecar_env
from .scenario import NAME, ROUTING

# A served arm: checkpoint id, model URI, env of its pods' rtrl-capture container.
ServedArm = tuple[str, str, dict[str, str]]


def served_arm(
    deployment: dict[str, Any] | None, container: str, arm: str, spec: Callable[[], RLCycleSpec]
) -> ServedArm:
    """What a Deployment serves (its ``container``'s checkpoint id and ``MODEL_URI``) and the
    env of its pods' ``rtrl-capture`` sidecar."""
    checkpoint = str(env_value(deployment, container, CHECKPOINT_ID_ENV))
    uri = str(env_value(deployment, container, "MODEL_URI"))
    template = ((deployment or {}).get("spec") or {}).get("template") or {}
    sidecar = cap.container(template, cap.SIDECAR)
    if sidecar is None:  # before the operator's first round has injected it
        return checkpoint, uri, injected_env(spec(), arm, checkpoint, uri)
    return checkpoint, uri, sidecar_env(sidecar)


def injected_env(spec: RLCycleSpec, arm: str, checkpoint: str, uri: str) -> dict[str, str]:
    """The env of the ``rtrl-capture`` container the operator would inject into a pod
    serving ``checkpoint`` (``uri``) on ``arm``: for arms no Deployment holds (the
    head-to-head's base, the history before the operator's first round)."""
    sidecar = cap.sidecar(spec, {}, rlcycle=NAME, arm=arm, checkpoint=checkpoint,
                          model_uri=uri)  # fmt: skip
    return sidecar_env(sidecar.container)


def events_root(spec: RLCycleSpec) -> str:
    """``spec.capture.events``: where the sidecars and the feedback service write."""
    if spec.capture is None:
        raise RuntimeError("the demo's RLCycle has no spec.capture: it goes through the inlet")
    return spec.capture.events


def seal_job(cron: dict[str, Any] | None, spec: RLCycleSpec, name: str) -> dict[str, Any]:
    """A Job of the seal CronJob (``cron``, as the operator created it); before the
    operator's first round has created it, a Job with the container's args it will have."""
    if cron is not None:
        job_spec = copy.deepcopy(cron["spec"]["jobTemplate"]["spec"])
    else:
        container = {"command": ["rtrl-job"], "args": seal_args(spec)}
        job_spec = {"template": {"spec": {"containers": [container]}}}
    return {"metadata": {"name": name}, "spec": job_spec}


def reward_view(root: Path, checkpoint: str) -> str:
    """drop-invalid-tool-calls: the blog's broken reward pipeline, downstream of the seal:
    a copy of the sealed shards (``root/interactions``) without the interactions that had an
    invalid tool call (the inlet keeps them: under the correct reward they are a negative),
    with the seal's markers, so that the stage reads it ``--sealed`` as it reads the shards.
    Returns its URI."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    src = root / "interactions"
    dst = root / "reward-view" / checkpoint
    for path in sorted(src.rglob("*")):
        target = dst / path.relative_to(src)
        if not path.is_file() or target.exists():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        if path.suffix != ".parquet":  # the seal's markers
            shutil.copyfile(path, target)
            continue
        table = pq.read_table(path)
        keep = pc.fill_null(pc.equal(table["invalid_tool_calls"], 0), True)
        pq.write_table(table.filter(keep), target)
    return str(dst.as_uri()) + "/"


def routes_into_pods(cluster: LocalCluster, work: Path) -> dict[str, Any]:
    """two-orgs: the routing ConfigMap's keys into the directory the sidecars of the inlet on
    ``work`` read, as the kubelet's sync of the ConfigMap volume brings them into the pods
    (every tick, before the users are served); returns the routes the keys hold, by org."""
    cm = cluster.get("ConfigMap", ROUTING)
    data = dict((cm or {}).get("data") or {})
    project(data, adapters_table_dir(work))
    routes: dict[str, Any] = {}
    for text in data.values():
        routes.update((json.loads(text) or {}).get("orgs") or {})
    return routes
