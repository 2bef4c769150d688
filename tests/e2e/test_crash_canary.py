"""Crash coverage of the canary's paths, on the real control plane (tests/e2e/crash.py,
src/rtrl_localkube/crashrun.py): rolled back by the analysis, promoted and rolled back by
hand (``rtrl.io/promote``, ``rtrl.io/rollback``) and paused (``spec.suspend``) mid-canary.
Stage, train and eval run without kills (the happy path's sweep covers them); the operator
is killed after every write from the canary's start on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rtrl.core.api.names import ANNOTATION_PROMOTE, ANNOTATION_ROLLBACK
from rtrl_localkube.api import KubeAPI
from rtrl_localkube.crashrun import CrashSweep, Step
from rtrl_localkube.cycle_world import (
    ANALYSIS_CONTINUE,
    ANALYSIS_ROLLBACK,
    RTRL,
    base_uri,
    commit_result,
    script_all,
    setup_namespace,
)
from rtrl_localkube.outcomes import Hang, Succeed
from tests.e2e import crash
from tests.e2e.crash import (
    CANARY,
    CKPT,
    annotate,
    ended,
    exists,
    killed,
)
from tests.e2e.test_gateway import stable_service_and_route

pytestmark = pytest.mark.timeout(240)
forkserver, sweep = crash.forkserver, crash.sweep  # the fixtures


def target_uri(kube: KubeAPI) -> str:
    dep = kube.get("apps/v1", "Deployment", "composer-vllm") or {}
    env = dep["spec"]["template"]["spec"]["containers"][0]["env"]
    return str(next(e["value"] for e in env if e["name"] == "MODEL_URI"))


def sweep_from_the_canary(sweep: CrashSweep) -> Step:
    def on() -> None:
        sweep.sweeping = True
        sweep.kill_while_running()  # the run that created the canary dies first

    return Step(lambda: exists(sweep.kube, "Deployment", CANARY), on)


def test_rolled_back_by_the_analysis(
    sweep: CrashSweep, kube_api: KubeAPI, job_runner: Any, tmp_path: Path
) -> None:
    script_all(job_runner, tmp_path, analyze=ANALYSIS_ROLLBACK)
    setup_namespace(kube_api, tmp_path)
    sweep.run(lambda: ended(sweep, CKPT, "RolledBack"), steps=[sweep_from_the_canary(sweep)],
              timeout=150)  # fmt: skip
    sweep.settle()
    assert target_uri(kube_api) == base_uri(tmp_path)
    assert "worse" in sweep.status("Checkpoint", CKPT)["message"]
    assert sweep.status()["serving"] == "composer-0"
    assert ("DELETE", "deployments") in killed(sweep), sorted(killed(sweep))


@pytest.mark.parametrize(
    "decision",
    ["promote", "rollback"],
)
def test_decided_by_hand_mid_canary(
    sweep: CrashSweep, kube_api: KubeAPI, job_runner: Any, tmp_path: Path, decision: str
) -> None:
    """The analysis hangs; the annotation decides, the running analysis Job is removed."""
    script_all(job_runner, tmp_path, analyze=Hang())
    setup_namespace(kube_api, tmp_path)
    key = ANNOTATION_PROMOTE if decision == "promote" else ANNOTATION_ROLLBACK
    ask = Step(lambda: exists(kube_api, "Job", f"{CKPT}-analyze-0-0"),
               annotate(kube_api, key, "by-hand"))  # fmt: skip
    end = "Promoted" if decision == "promote" else "RolledBack"
    sweep.run(
        lambda: ended(sweep, CKPT, end) and not exists(kube_api, "Job", f"{CKPT}-analyze-0-0"),
        steps=[sweep_from_the_canary(sweep), ask],
        timeout=150,
    )
    sweep.settle()
    st = sweep.status()
    assert st["lastPromote" if decision == "promote" else "lastRollback"] == "by-hand"
    assert st["serving"] == (CKPT if decision == "promote" else "composer-0")
    ck = kube_api.get(RTRL, "Checkpoint", CKPT) or {}
    want = ck["spec"]["uri"] if decision == "promote" else base_uri(tmp_path)
    assert target_uri(kube_api) == want
    assert sweep.ledger.created("Job")[-1] == f"{CKPT}-analyze-0-0", sweep.explain()


def test_suspended_mid_canary_finishes_then_stays_suspended(
    sweep: CrashSweep, kube_api: KubeAPI, job_runner: Any, tmp_path: Path
) -> None:
    """``spec.suspend`` starts no cycle; the running canary goes on: a continue, step 2,
    promote, then the RLCycle is Suspended."""
    script_all(job_runner, tmp_path)
    wait = ANALYSIS_CONTINUE
    job_runner.script(
        f"{CKPT}-analyze-0-0", Succeed(before=commit_result("analyze", wait, tmp_path / "results"))
    )
    setup_namespace(kube_api, tmp_path)

    def suspend() -> None:
        kube_api.patch(RTRL, "RLCycle", "composer", {"spec": {"suspend": True}})

    pause = Step(lambda: exists(kube_api, "Deployment", CANARY), suspend)
    sweep.run(lambda: ended(sweep, CKPT, "Promoted", "Suspended"),
              steps=[pause, sweep_from_the_canary(sweep)], timeout=150)  # fmt: skip
    sweep.settle()
    records = sweep.status("Checkpoint", CKPT)["rollout"]
    assert [(r["weight"], r["decision"]) for r in records] == [(25, "continue"), (50, "promote")]
    assert sweep.status()["serving"] == CKPT


GATEWAY = "gateway.networking.k8s.io/v1"


def test_deleted_mid_canary_with_the_gateway_api(
    sweep: CrashSweep, kube_api: KubeAPI, job_runner: Any, tmp_path: Path
) -> None:
    """The operator killed after every write from the canary's start, the RLCycle deleted
    once the route names the canary: the route never names a canary Service that is gone
    (checked at every look after the deletion), and ends given back, the RLCycle gone."""
    script_all(job_runner, tmp_path, analyze=Hang())
    stable_service_and_route(kube_api)
    rollout = {
        "router": "gatewayapi", "httpRoute": "composer", "service": "composer",
        "steps": [{"weight": 25, "minDuration": "1h"}], "readyTimeout": "1h",
        "analysis": {"maxDuration": "2h", "interval": "1m"},
    }  # fmt: skip
    setup_namespace(kube_api, tmp_path, rollout=rollout)

    def canary_refs() -> list[str]:
        rules = (kube_api.get(GATEWAY, "HTTPRoute", "composer") or {})["spec"]["rules"]
        names = [ref["name"] for rule in rules for ref in rule.get("backendRefs") or []]
        return [name for name in names if name == "composer-canary"]

    def delete() -> None:
        kube_api.delete(RTRL, "RLCycle", "composer")

    routed = Step(canary_refs, delete)
    # From the write that creates the canary Service (the canary's first object, in the round
    # that then creates its Deployment, puts the finalizer on and weights the route): each of
    # those writes is a kill point, whatever a poll would have seen when.
    sweep.sweep_from = lambda w: (
        w.method == "POST" and w.path.endswith("/services") and w.name == "composer-canary"
    )

    def done() -> bool:
        # the Service first: once gone it never comes back, so a route read after it that
        # still names it names a Service that is gone
        service = kube_api.get("v1", "Service", "composer-canary")
        if canary_refs():
            assert service is not None, f"the route names a deleted Service{sweep.explain()}"
            return False
        return not exists(kube_api, "RLCycle", "composer") and service is None

    sweep.run(done, steps=[routed], timeout=180)
    sweep.settle(rounds=False)
    assert not canary_refs()
    assert not exists(kube_api, "Deployment", CANARY)
    # killed after each of the four: the finalizer on, the route weighted, the route given
    # back, the finalizer off
    writes = [(w.method, w.plural) for w in sweep.kills]
    assert writes.count(("PATCH", "httproutes")) >= 2, writes
    assert writes.count(("PATCH", "rlcycles")) >= 2, writes
