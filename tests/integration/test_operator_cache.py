"""The operator's rounds read a watch cache (rtrl.kube.cache); a watch that lags behind the
operator's own writes must never make it decide on a stale view: every Job is created once
(not even a second, refused, create), every Event once, and the Checkpoint's phase only ever
moves forward."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from tests.integration.conftest import KubeAPI

from rtrl_localkube.cycle_world import (
    NAME,
    events,
    script_all,
    setup_namespace,
    status,
    wait_phase,
)
from rtrl_localkube.job_runner import JobRunner

pytestmark = pytest.mark.timeout(90)

CKPT = "composer-1"
JOBS = "/namespaces/default/jobs"
CHECKPOINTS = "/namespaces/default/checkpoints"
TARGET = "/apis/apps/v1/namespaces/default/deployments/composer-vllm"


def test_a_lagging_watch_never_makes_the_operator_act_twice(
    kube_api: KubeAPI, job_runner: JobRunner, operator: Any, tmp_path: Path
) -> None:
    # Every watch event (kopf's included) arrives 0.3 s after its write: the operator's next
    # rounds run long before they hear of their own writes, and the events of a Checkpoint's
    # creation and earlier statuses arrive after its newer statuses were written.
    kube_api.emulator.watch_delay = 0.3
    writes: list[tuple[str, str, Any]] = []
    kube_api.emulator.after_write = lambda method, path, body, _: writes.append(
        (method, path, body)
    )
    start = len(kube_api.emulator.request_log)
    script_all(job_runner, tmp_path)
    setup_namespace(kube_api, tmp_path)
    wait_phase(kube_api, "Checkpoint", CKPT, "Promoted", timeout=60)
    kube_api.wait_for(lambda: status(kube_api, "RLCycle", NAME).get("phase") == "Idle")
    time.sleep(2.0)  # more rounds (the resync is 1 s), and every late event, arrive

    log = kube_api.emulator.request_log[start:]
    # Every create the operator sent, refused ones (409) included: one per Job.
    job_creates = [path for method, path in log if method == "POST" and path.endswith(JOBS)]
    assert len(job_creates) == 4, job_creates
    # the test's base Checkpoint and the cycle's, each created once
    ck_creates = [path for method, path in log if method == "POST" and path.endswith(CHECKPOINTS)]
    assert len(ck_creates) == 2, ck_creates
    phases = [
        (body.get("status") or {}).get("phase")
        for method, path, body in writes
        if method == "PATCH" and path.endswith(f"{CHECKPOINTS}/{CKPT}/status")
    ]
    moves = [p for i, p in enumerate(phases) if p and (i == 0 or p != phases[i - 1])]
    assert len(moves) == len(set(moves)), phases  # never back to an earlier phase
    assert moves[-1] == "Promoted", phases
    posted = Counter((name, reason) for name, reason, _ in events(kube_api))
    assert posted and max(posted.values()) == 1, posted  # no Event twice
    for reason in ("CycleStarted", "Staged", "Trained", "EvalPassed", "Promoted"):
        assert reason in {r for _, r in posted}, posted
    # The rounds did read the cache: only the first read the cluster (the target Deployment
    # is read by a live round only).
    assert sum(1 for method, path in log if method == "GET" and path == TARGET) <= 2
