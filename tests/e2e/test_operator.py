"""The operator process on the real control plane, under the chart's RBAC: how it runs,
what it creates and what it refuses, beyond the whole cycles of test_cycle.py."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.api import KubeAPI
from tests.cluster.kubelet import Kubelet
from tests.cluster.tools import OperatorProcess
from tests.e2e.world import set_up
from tests.integration.cycle_world import NAME, RTRL

pytestmark = pytest.mark.timeout(300)


def rlcycle_status(kube: KubeAPI) -> dict[str, Any]:
    return (kube.get(RTRL, "RLCycle", NAME) or {}).get("status") or {}


def test_one_namespace_under_the_clusterwide_chart(
    kube: KubeAPI,
    node: Kubelet,
    rtrl_operator: Callable[..., OperatorProcess],
    tmp_path: Path,
) -> None:
    """``rtrl operator --namespace NS``, as the README runs it, with the ServiceAccount of
    the default (cluster-wide) chart: no permission is missing."""
    set_up(kube, tmp_path / "store", tmp_path)
    operator = rtrl_operator("--namespace", kube.namespace, "--standalone")
    kube.wait_for(lambda: rlcycle_status(kube).get("cycle"), timeout=60, message=operator.output)
    forbidden = [
        line for line in operator.output().splitlines()
        if "403" in line or "Forbidden" in line or "permission" in line.lower()
    ]  # fmt: skip
    assert forbidden == [], "\n".join(forbidden)
