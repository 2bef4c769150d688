"""Run a Job's pod on this machine: the kubelet of :class:`~rtrl_localkube.cluster.LocalCluster`.

The pod template's first container runs as a local subprocess, once per completion index
(one after the other), with the container's environment: ``value`` entries with Kubernetes
``$(VAR)`` expansion, ConfigMap volumes written to a directory, ``emptyDir`` volumes as
empty directories, and every mount path rewritten to its local directory wherever it
starts an argument or env value or follows ``=`` (``--config=/etc/rtrl/spec.json``). An
Indexed Job's pod hostnames (``<job>-0.<service>``) become ``127.0.0.1``. Secrets, other
volume kinds and ``valueFrom`` are not needed by the demo and fail the pod with a message.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .processes import free_port

BIN = Path(sys.executable).parent


@dataclass(frozen=True)
class PodResult:
    exit_code: int
    log: Path
    seconds: float
    message: str = ""


def expand_vars(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes ``$(VAR)`` expansion: known variables expand, ``$$`` escapes."""

    def replace(match: re.Match[str]) -> str:
        if match.group(0).startswith("$$"):
            return match.group(0)[1:]
        name = match.group(1)
        return env[name] if name in env else match.group(0)

    return re.sub(r"\$\$\(?|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)", replace, text)


def rewrite(value: str, mounts: list[tuple[str, str]], job: str) -> str:
    """Mount paths (at the start or after ``=``) to local dirs; pod hostnames to loopback."""
    if mounts:
        local_of = dict(mounts)
        alternatives = "|".join(re.escape(path) for path, _ in mounts)
        pattern = rf"(^|=)({alternatives})(?=/|$|\s|,|:)"
        value = re.sub(pattern, lambda m: m.group(1) + local_of[m.group(2)], value)
    if not job:  # not a Job's pod (or one whose names resolve): no hostname of it to rewrite
        return value
    return re.sub(
        rf"\b{re.escape(job)}-\d+\.[A-Za-z0-9-]+(\.[A-Za-z0-9.-]*)?\b", "127.0.0.1", value
    )


def tail(path: Path, lines: int = 20, limit: int = 4096) -> str:
    """The end of a log: a failed step's message, and FallbackToLogsOnError's termination
    message (the last 20 lines, at most 4096 bytes)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return ""
    return b"".join(data.splitlines(keepends=True)[-lines:])[-limit:].decode(errors="replace")


def pod_env(extra_env: Mapping[str, str] | None = None) -> dict[str, str]:
    """What a pod's process inherits from this one, plus ``extra_env``."""
    env = {k: os.environ[k] for k in ("PATH", "HOME", "TORCH_EXTENSIONS_DIR") if k in os.environ}
    return env | dict(extra_env or {})


def run_pod(
    job: dict[str, Any],
    config_maps: Callable[[str], dict[str, str] | None],
    work: Path,
    *,
    extra_env: Mapping[str, str] | None = None,
    extra_args: list[str] | None = None,
    index: int = 0,
    on_tick: Callable[[float], None] | None = None,
) -> PodResult:
    """Run completion ``index`` of ``job``; its output goes to ``work/<job>-<index>.log``."""
    name = job["metadata"]["name"]
    spec = job["spec"]["template"]["spec"]
    container = spec["containers"][0]
    log = work / f"{name}-{index}.log"
    work.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f"{name}-", dir=work) as pod_dir:
        root = Path(pod_dir)
        local: dict[str, Path] = {}
        for volume in spec.get("volumes") or []:
            path = root / "volumes" / volume["name"]
            path.mkdir(parents=True)
            if "configMap" in volume:
                data = config_maps(volume["configMap"]["name"])
                if data is None:
                    return PodResult(
                        1, log, 0.0, f"ConfigMap {volume['configMap']['name']} not found"
                    )
                for key, text in data.items():
                    (path / key).write_text(text)
            elif "emptyDir" not in volume:
                return PodResult(1, log, 0.0, f"volume {volume['name']!r} is not emulated")
            local[volume["name"]] = path
        mounts = sorted(
            (
                (
                    m["mountPath"].rstrip("/") or "/",
                    os.fspath(local[m["name"]] / m.get("subPath", "")),
                )
                for m in container.get("volumeMounts") or []
                if m["name"] in local
            ),
            key=lambda m: len(m[0]),
            reverse=True,
        )
        env = pod_env(extra_env)
        if job["spec"].get("completionMode") == "Indexed":
            env["JOB_COMPLETION_INDEX"] = str(index)
        for var in container.get("env") or []:
            if "valueFrom" in var:
                return PodResult(1, log, 0.0, f"env {var['name']}: valueFrom is not emulated")
            env[var["name"]] = rewrite(expand_vars(str(var.get("value", "")), env), mounts, name)
        if "MASTER_PORT" in env:
            # A pod has its own network namespace; here all share one, so the rendezvous
            # port of two trainings (two demos at once) must differ.
            env["MASTER_PORT"] = str(free_port())
        words = [*(container.get("command") or []), *(container.get("args") or [])]
        argv = [rewrite(expand_vars(str(w), env), mounts, name) for w in words]
        argv += list(extra_args or [])
        if argv and "/" not in argv[0] and (BIN / argv[0]).exists():
            argv[0] = os.fspath(BIN / argv[0])
        started = time.monotonic()
        with log.open("wb") as out:
            proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=root)
            while proc.poll() is None:
                time.sleep(0.2)
                if on_tick is not None:
                    on_tick(time.monotonic() - started)
        seconds = time.monotonic() - started
        code = proc.returncode
    return PodResult(code, log, seconds, tail(log) if code else "")
