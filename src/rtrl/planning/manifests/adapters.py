"""``spec.capture.adapters``: what the sidecar needs to route organisations to LoRA adapters
in the engine (docs/operator.md, "Capture"), and what the engine must have for it.

The routing table is a ConfigMap the operator mounts into the sidecar (its own volume,
taken out with the sidecar), which the sidecar also follows through the API when the pod's
ServiceAccount may read it (faster than the kubelet refreshes the volume). The adapters'
files go through a volume of the pod's own, ``rtrl-adapters``: the sidecar downloads them
there and the engine loads them from there.
That volume, its mount in the engine and the engine's ``--enable-lora`` are the engine's,
which rtrl does not edit: it checks them (:func:`adapters_conflict`) and says what is
missing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rtrl.core.api.reasons import Reason
from rtrl.core.api.rlcycle import CaptureAdapters, RLCycleSpec

ADAPTERS_TABLE_VOLUME = "rtrl-capture-adapters"  # the routing table's ConfigMap: rtrl's
ADAPTERS_TABLE_MOUNT = "/etc/rtrl-capture/adapters"
ADAPTERS_VOLUME = "rtrl-adapters"  # the pod's own
ADAPTERS_MOUNT = "/var/lib/rtrl-adapters"


def adapters_sidecar(
    table: CaptureAdapters,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """(env, volumes, mounts) the sidecar gets for ``table``."""
    env: list[dict[str, Any]] = [
        # the directory: every key is a table file, one per writer
        {"name": "RTRL_CAPTURE_ADAPTERS", "value": ADAPTERS_TABLE_MOUNT},
        {"name": "RTRL_CAPTURE_ADAPTER_DIR", "value": ADAPTERS_MOUNT},
        # ... and the same ConfigMap through the API, a route in under a second where the
        # pod's ServiceAccount may read it (docs/adapters.md), else the mount above
        {"name": "RTRL_CAPTURE_ADAPTERS_CONFIGMAP", "value": table.config_map},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
    ]
    volumes: list[dict[str, Any]] = [
        {"name": ADAPTERS_TABLE_VOLUME, "configMap": {"name": table.config_map}}
    ]
    mounts: list[dict[str, Any]] = [
        {"name": ADAPTERS_TABLE_VOLUME, "mountPath": ADAPTERS_TABLE_MOUNT, "readOnly": True},
        {"name": ADAPTERS_VOLUME, "mountPath": ADAPTERS_MOUNT},  # the pod's, shared
    ]
    return env, volumes, mounts


def adapters_conflict(
    spec: RLCycleSpec, template: Mapping[str, Any], engine: Mapping[str, Any]
) -> tuple[str, str]:
    """``(reason, message)`` when the engine cannot serve the adapters the sidecar would
    load: no ``rtrl-adapters`` volume mounted at :data:`ADAPTERS_MOUNT`, or LoRA off;
    ``("", "")`` otherwise."""
    where = f"container {spec.target.container} of Deployment {spec.target.deployment}"
    volumes = {v.get("name") for v in (template.get("spec") or {}).get("volumes") or []}
    mounts = {(m.get("name"), m.get("mountPath")) for m in engine.get("volumeMounts") or []}
    if ADAPTERS_VOLUME not in volumes or (ADAPTERS_VOLUME, ADAPTERS_MOUNT) not in mounts:
        return (
            Reason.CAPTURE_ADAPTERS_UNSERVABLE,
            f"spec.capture.adapters: {where} must mount a pod volume named {ADAPTERS_VOLUME} "
            f"(an emptyDir) at {ADAPTERS_MOUNT}: the sidecar downloads adapters there and the "
            "engine loads them from there",
        )
    words = [str(w) for w in [*(engine.get("command") or []), *(engine.get("args") or [])]]
    if not any(w == "--enable-lora" or w.startswith("--enable-lora=") for w in words):
        return (
            Reason.CAPTURE_ADAPTERS_UNSERVABLE,
            f"spec.capture.adapters: {where} must run vLLM with --enable-lora (and "
            "--max-lora-rank at least the adapters' rank)",
        )
    return "", ""
