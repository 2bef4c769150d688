"""Fixtures of the suites that run against the real control plane (``rtrl_localkube``).

One control plane and one kubelet serve the whole session (starting them takes ~10 s); each
test gets a namespace of its own, deleted afterwards by the real namespace controller. The
chart is installed once per session, as a user would (``helm install``), and the operator
runs as a local process with a token of the chart's ServiceAccount (``rtrl_operator``), so
the RBAC under test is the chart's.

Without the control plane's binaries (``make controlplane``; ``make test`` builds them) these
suites are skipped, and under ``CI=true`` they fail.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import kubernetes
import pytest
from kubernetes.dynamic import DynamicClient

from rtrl_localkube.api import KubeAPI
from rtrl_localkube.controlplane import ControlPlane
from rtrl_localkube.controlplane_setup import binaries_dir
from rtrl_localkube.kubelet import Kubelet
from rtrl_localkube.tools import Cli, OperatorProcess

RELEASE = "rtrl"
RELEASE_NAMESPACE = "rtrl-system"
# The chart's image is not published anywhere this machine can reach: its pod waits in
# ErrImagePull, and the operator runs as a local process instead (``rtrl_operator``).
OPERATOR_IMAGE = "*rtrl-operator*"
# What the kubelet adds to every pod's environment: DeepSpeed on CPU, no model hub.
KUBELET_ENV = {"DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}


@pytest.fixture(scope="session")
def controlplane_binaries() -> Path:
    """The built control plane's binaries; skips (fails under CI) without them."""
    binaries = binaries_dir()
    if binaries is None:
        message = "the test control plane is not built: run `make controlplane` or `make test`"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return binaries


@pytest.fixture(scope="session")
def controlplane(
    controlplane_binaries: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ControlPlane]:
    with ControlPlane(tmp_path_factory.mktemp("controlplane"), controlplane_binaries) as cp:
        admin = Cli(cp.admin_kubeconfig)
        # The Gateway API's standard channel, so the server validates the operator's routes.
        gateway_api = os.fspath(controlplane_binaries / "gateway-api")
        admin.kubectl("apply", "--server-side", "-f", gateway_api)
        admin.wait_established("crd", "--all")
        yield cp


@pytest.fixture(scope="session")
def kubelet(controlplane: ControlPlane) -> Iterator[Kubelet]:
    # Pods that run as their securityContext's user (runner.identities) must reach their
    # dirs: the kubelet's work dir is traversable by others, so it is not under pytest's
    # base dir, /tmp/pytest-of-<user>, which every pytest session that starts (another
    # run on the same machine) sets back to 0700.
    work_dir = Path(tempfile.mkdtemp(prefix="rtrl-kubelet-"))
    work_dir.chmod(0o711)
    try:
        with Kubelet(
            controlplane,
            work_dir,
            extra_env=KUBELET_ENV,
            unavailable_images=(OPERATOR_IMAGE,),
        ) as node:
            yield node
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)


@pytest.fixture
def node(kubelet: Kubelet) -> Iterator[Kubelet]:
    """The session's kubelet, with this test's scripts removed afterwards."""
    env = dict(kubelet.extra_env)
    try:
        yield kubelet
    finally:
        kubelet.reset(env)


@pytest.fixture
def admin(controlplane: ControlPlane) -> Cli:
    return Cli(controlplane.admin_kubeconfig)


@pytest.fixture
def namespace(admin: Cli, request: pytest.FixtureRequest) -> Iterator[str]:
    """A namespace of this test's own; deleted (not waited for) when it ends."""
    stem = request.node.name.split("[")[0].removeprefix("test_").replace("_", "-")[:40]
    name = f"{stem.strip('-')}-{secrets.token_hex(3)}"
    admin.kubectl("create", "namespace", name)
    try:
        yield name
    finally:
        admin.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture
def kube(controlplane: ControlPlane, namespace: str, tmp_path: Path) -> Iterator[KubeAPI]:
    """The generic test client (``src/rtrl_localkube/api.py``) on the real server, as the admin."""
    kubeconfig = controlplane.kubeconfig(tmp_path / "admin.kubeconfig", namespace=namespace)
    api_client = kubernetes.config.new_client_from_config(config_file=os.fspath(kubeconfig))
    try:
        dynamic = DynamicClient(api_client, cache_file=os.fspath(tmp_path / "discovery.json"))
        yield KubeAPI(controlplane.url, kubeconfig, namespace, api_client, dynamic)
    finally:
        api_client.close()


@pytest.fixture(scope="session")
def release(controlplane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The chart installed cluster-wide by ``helm install``, for the session: the operator's
    ServiceAccount name."""
    cli = Cli(controlplane.kubeconfig(tmp_path_factory.mktemp("helm") / "admin.kubeconfig"))
    cli.helm(
        "install", RELEASE, "charts/rtrl-operator", "-n", RELEASE_NAMESPACE, "--create-namespace"
    )
    cli.wait_established("crd/rlcycles.rtrl.io", "crd/checkpoints.rtrl.io")
    accounts = cli.get("serviceaccounts", "-n", RELEASE_NAMESPACE, "-l",
                       f"app.kubernetes.io/instance={RELEASE}")["items"]  # fmt: skip
    assert len(accounts) == 1, accounts
    return str(accounts[0]["metadata"]["name"])


@pytest.fixture
def rtrl_operator(
    controlplane: ControlPlane, release: str, namespace: str, tmp_path: Path
) -> Iterator[Callable[..., OperatorProcess]]:
    """Start ``rtrl operator`` for this test's namespace with the chart's ServiceAccount
    token (call it, optionally with other arguments); stopped (SIGTERM) at the end."""
    started: list[OperatorProcess] = []

    def start(*args: str, env: dict[str, str] | None = None) -> OperatorProcess:
        argv = list(args) or ["--namespace", namespace, "--standalone"]
        process = OperatorProcess(
            controlplane,
            tmp_path / f"operator-{len(started)}",
            service_account=(RELEASE_NAMESPACE, release),
            args=argv,
            env=env,
        )
        started.append(process)
        return process

    try:
        yield start
    finally:
        for process in started:
            process.stop()


# --- the names the scripted-step suites use (they ran on the emulator first) -----------------


@pytest.fixture
def kube_api(kube: KubeAPI) -> KubeAPI:
    return kube


@pytest.fixture
def job_runner(node: Kubelet) -> Kubelet:
    """The kubelet: it runs (or scripts, ``.script(pattern, outcome)``) the pods the real Job
    controller makes of the operator's Jobs."""
    return node


@pytest.fixture
def deployment_controller(node: Kubelet) -> Kubelet:
    """The real Deployment controller does the work; ``.never_ready`` (Deployment name
    patterns) keeps a workload's pods unready, through the kubelet."""
    return node


@pytest.fixture
def fast_operator(rtrl_operator: Callable[..., OperatorProcess], namespace: str) -> OperatorProcess:
    """The operator with a 1 s resync: "nothing is written" is seen across rounds, and what
    a round reads but does not watch (the routing ConfigMap) is read every second."""
    return rtrl_operator("--namespace", namespace, "--standalone",
                         env={"RTRL_RESYNC_SECONDS": "1"})  # fmt: skip


@pytest.fixture
def operator(rtrl_operator: Callable[..., OperatorProcess]) -> Iterator[OperatorProcess]:
    """``rtrl operator`` for the test's namespace, as a process with the chart's
    ServiceAccount token; it must stop cleanly (exit 0 on SIGTERM)."""
    process = rtrl_operator()
    yield process
    assert process.stop() == 0, process.output()[-5000:]
