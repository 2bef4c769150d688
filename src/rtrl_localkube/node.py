"""The kubelet stand-in's Node: registered Ready with this machine's CPUs and memory, its
Lease renewed, so the node lifecycle controller keeps it, and whether a pod fits it."""

from __future__ import annotations

import contextlib
import datetime
import http.client
import itertools
import os
import threading
import urllib.error
from typing import Any

from rtrl_localkube.controlplane import ControlPlane

from .kinds import now_rfc3339

LEASE_SECONDS = 40
RENEW_SECONDS = 10.0


def unschedulable(pod: dict[str, Any], labels: dict[str, str]) -> str | None:
    """Why ``pod`` cannot run on a node with ``labels`` and no extended resources (GPUs), in
    the scheduler's words; None where it can."""
    spec = pod["spec"]
    problem = None
    wanted = spec.get("nodeSelector") or {}
    if any(labels.get(k) != v for k, v in wanted.items()):
        problem = "1 node(s) didn't match Pod's node affinity/selector"
    for container in spec.get("containers") or []:
        requests = {
            **((container.get("resources") or {}).get("limits") or {}),
            **((container.get("resources") or {}).get("requests") or {}),
        }
        extended = [k for k, v in requests.items() if "/" in k and _quantity_count(v) > 0]
        if extended:
            problem = f"1 Insufficient {extended[0]}"
    return problem


def _quantity_count(value: Any) -> float:
    """An extended-resource quantity as a number ("8", 8, "500m")."""
    text = str(value)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def register(cp: ControlPlane, node: str, labels: dict[str, str]) -> None:
    """Create the Node (409: it exists) and report it Ready with this machine's capacity."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    capacity = {"cpu": str(os.cpu_count() or 1), "memory": str(memory), "pods": "250"}
    with contextlib.suppress(urllib.error.HTTPError):  # 409: registered before
        cp.request(
            "POST",
            "/api/v1/nodes",
            {"apiVersion": "v1", "kind": "Node",
             "metadata": {"name": node, "labels": labels}},
        )  # fmt: skip
    now = now_rfc3339()
    conditions = [
        {"type": kind, "status": "False", "reason": f"Kubelet Has No {kind}",
         "lastHeartbeatTime": now, "lastTransitionTime": now}
        for kind in ("MemoryPressure", "DiskPressure", "PIDPressure")
    ]  # fmt: skip
    conditions.append(
        {"type": "Ready", "status": "True", "reason": "KubeletReady",
         "message": "kubelet stand-in is posting ready status",
         "lastHeartbeatTime": now, "lastTransitionTime": now}
    )  # fmt: skip
    cp.request(
        "PATCH",
        f"/api/v1/nodes/{node}/status",
        {
            "status": {
                "capacity": capacity,
                "allocatable": capacity,
                "conditions": conditions,
                "addresses": [
                    {"type": "InternalIP", "address": "127.0.0.1"},
                    {"type": "Hostname", "address": node},
                ],
                "nodeInfo": _node_info(cp),
            }
        },
        content_type="application/merge-patch+json",
    )


def _node_info(cp: ControlPlane) -> dict[str, str]:
    info = dict.fromkeys(("kernelVersion", "osImage", "machineID", "systemUUID", "bootID"), "")
    return info | {
        "kubeletVersion": cp.version,
        "kubeProxyVersion": "",
        "operatingSystem": "linux",
        "architecture": "amd64",
        "containerRuntimeVersion": "local-process://1",
    }


def heartbeat(cp: ControlPlane, node: str, stop: threading.Event) -> None:
    """Renew the Node's Lease every RENEW_SECONDS until ``stop``, as a kubelet does."""
    path = f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{node}"
    while not stop.is_set():
        renew = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        lease = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": node, "namespace": "kube-node-lease"},
            "spec": {
                "holderIdentity": node,
                "leaseDurationSeconds": LEASE_SECONDS,
                "renewTime": renew,
            },
        }
        try:
            cp.request("PATCH", path, {"spec": lease["spec"]},
                            content_type="application/merge-patch+json")  # fmt: skip
        except urllib.error.HTTPError as exc:
            if exc.code != 404:
                raise
            cp.request(
                "POST",
                "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases",
                lease,
            )
        except (urllib.error.URLError, OSError):  # the API server restarts (bench/chaos.py)
            stop.wait(0.5)
            continue
        stop.wait(RENEW_SECONDS)


def patch_pod_status(
    cp: ControlPlane, pod: dict[str, Any], status: dict[str, Any], stop: threading.Event
) -> None:
    """Send one pod status report, as a kubelet's status manager does: a timeout, a refused
    connection, 429 or 5xx is sent again until it lands or ``stop`` is set (a report lost
    there may be the pod's last: all its containers running, the pod never Ready). A 404
    (the pod deleted meanwhile) or another refusal ends it."""
    meta = pod["metadata"]
    path = f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status"
    for delay in itertools.chain((0.1, 0.2, 0.5, 1.0), itertools.repeat(2.0)):
        try:
            cp.request("PATCH", path, {"status": status},
                       content_type="application/merge-patch+json")  # fmt: skip
            return
        except urllib.error.HTTPError as exc:
            if exc.code != 429 and exc.code < 500:
                return
        except (urllib.error.URLError, OSError, http.client.HTTPException):
            pass
        if stop.wait(delay):
            return
