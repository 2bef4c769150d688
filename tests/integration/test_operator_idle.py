"""An idle operator sends no request but its watches: not when it starts with RLCycles that
exist already (kopf's listing filled the watch cache), and not at each resync (idle rounds
read that cache); a new RLCycle reads only its Deployment, by name. With 1,000 RLCycles of
10 Checkpoints in a namespace, one live round each is 1,000 lists of 10,000 Checkpoints
(bench/scale.py, docs/benchmarks.md)."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Any

import kopf.testing
import pytest
from tests.integration.conftest import KubeAPI

from rtrl import handlers
from rtrl_localkube.cycle_world import RTRL, base_checkpoint, deployment, rlcycle, status

pytestmark = pytest.mark.timeout(60)

RLCYCLES = ("idle-a", "idle-b", "idle-c")
CRON = "0 0 1 1 *"  # never due during the test


def idle_world(root: Path, name: str) -> list[dict[str, Any]]:
    uri = (root / "models" / name).as_uri() + "/"
    dep = deployment(root, serving_uri=uri)
    dep["metadata"]["name"] = f"{name}-vllm"
    ckpt = base_checkpoint(root)
    ckpt["metadata"]["name"] = f"{name}-0"
    ckpt["spec"]["uri"] = uri
    rlc = rlcycle(root, schedule={"cron": CRON})
    rlc["metadata"]["name"] = name
    rlc["spec"]["target"]["deployment"] = f"{name}-vllm"
    return [dep, ckpt, rlc]


def reconciler_reads(log: list[tuple[str, str]], namespace: str) -> list[str]:
    """GETs of one object by name: only a reconcile round reading live sends them (kopf lists
    and watches whole kinds)."""
    named = (f"/namespaces/{namespace}/deployments/", f"/namespaces/{namespace}/rlcycles/")
    return [path for method, path in log if method == "GET" and any(n in path for n in named)]


def collection_gets(log: list[tuple[str, str]], namespace: str) -> Counter[str]:
    """GETs of a whole kind (a list or a watch) in the namespace, by kind."""
    prefix = f"/namespaces/{namespace}/"
    return Counter(
        path.split(prefix, 1)[1] for method, path in log
        if method == "GET" and prefix in path and "/" not in path.split(prefix, 1)[1]
    )  # fmt: skip


def run_operator(seconds: float, until: Any = None) -> None:
    args = ["run", "--standalone", "--namespace", "default"]
    with kopf.testing.KopfRunner(args, timeout=60, registry=handlers.registry) as runner:
        deadline = time.monotonic() + 30
        while until is not None and not until() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(seconds)
    assert runner.exception is None, runner.output
    assert runner.exit_code == 0, runner.output


def test_an_idle_operator_sends_no_request_at_start_or_resync(
    kube_api: KubeAPI, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("RTRL_RESYNC_SECONDS", "0.5")  # several resyncs in the window
    monkeypatch.delenv("RTRL_LIVE_READ_SECONDS", raising=False)  # the default
    for name in RLCYCLES:
        for obj in idle_world(tmp_path, name):
            kube_api.create(obj)

    # A first operator meets them new: each one's first round reads its Deployment live (its
    # event may not have reached the cache yet), and writes its status ...
    def all_idle() -> bool:
        return all(status(kube_api, "RLCycle", n).get("phase") == "Idle" for n in RLCYCLES)

    run_operator(0.5, until=all_idle)
    assert all_idle(), [status(kube_api, "RLCycle", n) for n in RLCYCLES]
    assert reconciler_reads(kube_api.emulator.request_log, kube_api.namespace)
    # ... by name: no round lists a kind, as applying many RLCycles at once would make each
    # list every Checkpoint of the namespace. Only the watches list them (kopf's, and the
    # Checkpoints' informer), as they list Deployments, which no round lists.
    gets = collection_gets(kube_api.emulator.request_log, kube_api.namespace)
    for plural in ("checkpoints", "jobs", "services", "configmaps"):
        assert gets[plural] == gets["deployments"], gets

    # The operator restarts: nothing changed, so over 2.5 s (5 resyncs each) its rounds read
    # only the cache its listing filled.
    start = len(kube_api.emulator.request_log)
    run_operator(2.5)
    log = kube_api.emulator.request_log[start:]
    assert reconciler_reads(log, kube_api.namespace) == []
    writes = [(m, p) for m, p in log if m not in ("GET", "HEAD")]
    assert writes == [], writes
    assert all(kube_api.get(RTRL, "RLCycle", n) for n in RLCYCLES)
