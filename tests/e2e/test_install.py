"""Installing, upgrading and uninstalling rtrl as a platform team does, each test on a fresh
control plane of its own (the CRDs are cluster-wide): ``kubectl apply -f crds/``, and
``helm install`` / ``upgrade`` / ``uninstall`` of charts/rtrl-operator with the operator
running under the release's ServiceAccount."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from rtrl.core.api.yamlfile import load
from rtrl_localkube.api import KubeAPI
from rtrl_localkube.controlplane import ControlPlane
from rtrl_localkube.controlplane_setup import binaries_dir
from rtrl_localkube.tools import Cli, OperatorProcess
from tests.conftest import REPO

pytestmark = pytest.mark.timeout(300)

CRDS = ("crd/rlcycles.rtrl.io", "crd/checkpoints.rtrl.io")


@pytest.fixture
def fresh(controlplane: ControlPlane, tmp_path: Path) -> Iterator[tuple[ControlPlane, Cli]]:
    """A control plane of this test's own (after the session's, which checks the build)."""
    binaries = binaries_dir()
    assert binaries is not None
    with ControlPlane(tmp_path / "controlplane", binaries) as cp:
        yield cp, Cli(cp.admin_kubeconfig)


def test_kubectl_apply_crds(fresh: tuple[ControlPlane, Cli]) -> None:
    _, cli = fresh
    out = cli.kubectl("apply", "-f", "crds/").stdout
    assert "rlcycles.rtrl.io created" in out and "checkpoints.rtrl.io created" in out
    cli.wait_established(*CRDS)


def test_helm_install_upgrade_uninstall(fresh: tuple[ControlPlane, Cli], tmp_path: Path) -> None:
    cp, cli = fresh
    install = cli.helm("install", "rtrl", "charts/rtrl-operator", "-n", "rtrl-system",
                       "--create-namespace")  # fmt: skip
    assert "STATUS: deployed" in install.stdout, install.stdout
    cli.wait_established(*CRDS)
    cli.kubectl("create", "namespace", "ml-serving")
    cli.kubectl("apply", "-f", "examples/")
    # An RLCycle an earlier rtrl left its finalizer on.
    legacy = load((REPO / "examples" / "rlcycle.yaml").read_text())
    legacy["metadata"].update(name="legacy", finalizers=["rtrl.io/finalizer"])
    cli.kubectl("create", "-f", "-", input=json.dumps(legacy))
    (account,) = cli.get("serviceaccounts", "-n", "rtrl-system", "-l",
                         "app.kubernetes.io/instance=rtrl")["items"]  # fmt: skip
    operator = OperatorProcess(
        cp,
        tmp_path / "operator",
        service_account=("rtrl-system", account["metadata"]["name"]),
        args=["--all-namespaces", "--standalone"],
    )
    try:

        def reconciled() -> bool:
            items = cli.get("rlc", "-n", "ml-serving")["items"]
            return len(items) == 2 and all(
                (i.get("status") or {}).get("observedGeneration") for i in items
            ) and not any(i["metadata"].get("finalizers") for i in items)  # fmt: skip

        KubeAPI.wait_for(reconciled, timeout=60, interval=0.2, message=operator.output)
        upgrade = cli.helm("upgrade", "rtrl", "charts/rtrl-operator", "-n", "rtrl-system",
                           "--reuse-values")  # fmt: skip
        assert "STATUS: deployed" in upgrade.stdout
    finally:
        assert operator.stop() == 0, operator.output()
    # With the examples' Secret in place the cycles may already have begun (composer-1, ...).
    before = sorted(i["metadata"]["name"] for i in cli.get("rlc,ckpt", "-n", "ml-serving")["items"])
    assert {"composer", "composer-0", "legacy"} <= set(before), before
    uninstall = cli.helm("uninstall", "rtrl", "-n", "rtrl-system")
    assert "uninstalled" in uninstall.stdout
    # The CRDs, and so every RLCycle and Checkpoint, survive the release.
    cli.kubectl("get", *CRDS)
    names = [i["metadata"]["name"] for i in cli.get("rlc,ckpt", "-n", "ml-serving")["items"]]
    assert sorted(names) == before
    # With no operator left, deleting the CRDs (as the chart's notes say) does not hang.
    notes = install.stdout
    assert "kubectl delete crd rlcycles.rtrl.io checkpoints.rtrl.io" in notes
    cli.kubectl("delete", "crd", "rlcycles.rtrl.io", "checkpoints.rtrl.io", "--timeout=60s")
    assert cli.kubectl("get", "crd", "-o", "name").stdout.count("rtrl.io") == 0
