"""The crash suite's fixtures and helpers (tests/e2e/test_crash_*.py): a fork server of
operator runs per module, and per test a :class:`~rtrl_localkube.crashrun.CrashSweep` over the
test's namespace, its operator behind a kill proxy, a ledger watching the namespace."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from rtrl_localkube.api import KubeAPI
from rtrl_localkube.controlplane import ControlPlane
from rtrl_localkube.crashrun import OPERATOR_MODULES, CrashSweep
from rtrl_localkube.cycle_world import RTRL
from rtrl_localkube.forkserver import ForkServer
from rtrl_localkube.invariants import Ledger, watching
from rtrl_localkube.killproxy import KillProxy
from tests.e2e.conftest import RELEASE_NAMESPACE

CKPT = "composer-1"
CANARY = "composer-vllm-canary"


@pytest.fixture(scope="module")
def forkserver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ForkServer, Path]]:
    """The fork server of the operator's runs, and the kubeconfig path they read (the
    ``kubernetes`` package reads $KUBECONFIG when imported: each test writes its own there)."""
    kubeconfig = tmp_path_factory.mktemp("crash") / "operator.kubeconfig"
    env = {**os.environ, "KUBECONFIG": os.fspath(kubeconfig)}
    with ForkServer(OPERATOR_MODULES, env=env) as server:
        yield server, kubeconfig


@pytest.fixture
def sweep(
    controlplane: ControlPlane, release: str, kube: KubeAPI,
    forkserver: tuple[ForkServer, Path], tmp_path: Path,
) -> Iterator[CrashSweep]:  # fmt: skip
    """The test's sweep (not started: ``sweep.run(done)``), its operator with the chart's
    ServiceAccount token."""
    token = controlplane.service_account_token(RELEASE_NAMESPACE, release)
    work = tmp_path / "operator"
    work.mkdir()
    ledger = Ledger()
    with (
        KillProxy(controlplane.url, controlplane.ca_file) as proxy,
        watching(ledger, controlplane, kube.namespace),
    ):
        server, path = forkserver
        kubeconfig = proxy.kubeconfig(path, token, kube.namespace)
        crash = CrashSweep(server, proxy, kube, ledger, work, kubeconfig)
        try:
            yield crash
        finally:
            crash.stop()
            print(f"{crash.runs} runs, {len(crash.kills)} kills after writes, "
                  f"{crash.kills_while_running} while Jobs ran, {crash.settled_checks} "
                  "settled status checks")  # fmt: skip


def phase(sweep: CrashSweep, kind: str, name: str) -> str | None:
    return sweep.status(kind, name).get("phase")


def exists(kube: KubeAPI, kind: str, name: str) -> bool:
    api = {"Deployment": "apps/v1", "Job": "batch/v1", "ConfigMap": "v1", "Service": "v1"}
    return kube.get(api.get(kind, RTRL), kind, name) is not None


def phase_is(sweep: CrashSweep, kind: str, name: str, *phases: str) -> Callable[[], bool]:
    return lambda: phase(sweep, kind, name) in phases


def annotate(kube: KubeAPI, key: str, value: str) -> Callable[[], None]:
    def do() -> None:
        kube.patch(RTRL, "RLCycle", "composer", {"metadata": {"annotations": {key: value}}})

    return do


def killed(sweep: CrashSweep) -> set[tuple[str, str]]:
    """(method, resource) of the writes the operator was killed after."""
    return {(w.method, w.plural) for w in sweep.kills}


def ended(sweep: CrashSweep, checkpoint: str, ck_phase: str, rlc_phase: str = "Idle") -> bool:
    return (
        phase(sweep, "Checkpoint", checkpoint) == ck_phase
        and phase(sweep, "RLCycle", "composer") == rlc_phase
        and not exists(sweep.kube, "Deployment", CANARY)
    )
