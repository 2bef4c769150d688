"""What the quick start (``rtrl_localkube.quickstart``) stands on besides the cluster: a
local S3 with the examples' buckets, the Services reached as kube-proxy would route to them
(the kubelet stand-in gives each pod's ports host ports of their own), and waiting with a
progress line, so that the run itself reads as the steps a user follows."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
import time
import urllib.error
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rtrl.core.api.names import RUNNING_PHASES

from . import quickstart_manifests as qm
from .controlplane import ControlPlane
from .controlplane_setup import binaries_dir
from .engine import EngineError, check_installed
from .kubelet import Kubelet
from .tools import tool

PID_FILE = "quickstart.pid"  # `make quickstart-down` signals this process
MARKER = ".rtrl-quickstart"
# moto takes any keys: these are the quick start's own, never the machine's
ACCESS_KEY, SECRET_KEY, REGION = "quickstart", "quickstart-secret", "us-east-1"


class QuickstartError(RuntimeError):
    """A step of the quick start failed; the message says which and what to look at."""


def say(text: str) -> None:
    print(f"[{datetime.now(UTC):%H:%M:%S}] {text}", flush=True)


def prerequisites() -> Path:
    """The control plane's binaries; every other missing piece raises with its make target."""
    binaries = binaries_dir()
    if binaries is None:
        raise QuickstartError("the control plane is not built: run `make controlplane`")
    for name in ("helm", "kubectl"):
        tool(name)  # FileNotFoundError: run `make tools`
    try:
        check_installed()
    except EngineError as exc:
        raise QuickstartError(str(exc)) from None
    return binaries


@contextlib.contextmanager
def local_s3() -> Iterator[str]:
    """moto's S3 server on a free port, with the examples' buckets; its endpoint URL. This
    process's store clients (publishing the model, reading seal markers) use it too."""
    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        os.environ.update(
            AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY,
            AWS_DEFAULT_REGION=REGION, AWS_ENDPOINT_URL=endpoint,
            AWS_EC2_METADATA_DISABLED="true",
        )  # fmt: skip
        s3 = boto3.client("s3", endpoint_url=endpoint, region_name=REGION)
        for bucket in qm.BUCKETS:
            s3.create_bucket(Bucket=bucket)
        yield endpoint
    finally:
        server.stop()


# --- the Services, as kube-proxy would route to them --------------------------------------


def service_urls(cp: ControlPlane, kubelet: Kubelet, namespace: str, service: str) -> list[str]:
    """``http://127.0.0.1:<port>`` of each ready endpoint of ``service``: the Service's
    EndpointSlices (written by the real controller from the pods' readiness) name the pods
    and the target port; the kubelet knows which host port that pod's port is here."""
    network = kubelet.runner.network
    assert network is not None
    query = f"labelSelector=kubernetes.io/service-name%3D{service}"
    slices = cp.request(
        "GET", f"/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices?{query}"
    )
    urls = []
    for item in slices["items"]:
        ports = [p["port"] for p in item.get("ports") or [] if p.get("port")]
        for endpoint in item.get("endpoints") or []:
            ref = endpoint.get("targetRef") or {}
            if not ports or ref.get("kind") != "Pod":
                continue
            if not (endpoint.get("conditions") or {}).get("ready"):
                continue
            try:
                pod = cp.request("GET", f"/api/v1/namespaces/{namespace}/pods/{ref['name']}")
            except urllib.error.HTTPError:
                continue  # deleted meanwhile
            urls.append(f"http://127.0.0.1:{network.host_port(pod, ports[0])}")
    return urls


def decided_checkpoint(cp: ControlPlane) -> tuple[str, str] | None:
    """The first cycle's Checkpoint (its name, its phase) once its phase is final: the
    cycle has decided (promoted, rolled back, rejected or failed)."""
    try:
        found = cp.request("GET", f"/apis/rtrl.io/v1alpha1/namespaces/{qm.NAMESPACE}/checkpoints")
    except urllib.error.URLError:
        return None
    for item in found["items"]:
        name = item["metadata"]["name"]
        phase = (item.get("status") or {}).get("phase")
        if name != qm.BASE and phase not in RUNNING_PHASES:
            return name, str(phase)
    return None


def wait_for(
    what: str,
    check: Callable[[], Any],
    timeout: float,
    every: float = 2.0,
    stop: threading.Event | None = None,
) -> Any:
    """``check()``'s first true value within ``timeout`` seconds; a line every minute.
    Raises when ``stop`` is set meanwhile (Ctrl-C)."""
    started = time.monotonic()
    last = started
    while True:
        if stop is not None and stop.is_set():
            raise QuickstartError(f"stopped while waiting for {what}")
        value = check()
        if value:
            return value
        now = time.monotonic()
        if now - started > timeout:
            raise QuickstartError(f"{what}: not after {timeout / 60:.0f} minutes")
        if now - last >= 60:
            say(f"  ... still waiting for {what} ({(now - started) / 60:.0f} min)")
            last = now
        time.sleep(every)


def claim(root: Path) -> None:
    """Make ``root`` this run's: a previous run's files go (only a directory a quick start
    made, :data:`MARKER`, is ever emptied), a live run refuses."""
    pid_file = root / PID_FILE
    if pid_file.exists():
        with contextlib.suppress(ValueError, ProcessLookupError, PermissionError):
            pid = int(pid_file.read_text().strip())
            os.kill(pid, 0)
            raise QuickstartError(
                f"a quick start (pid {pid}) already runs in {root}: `make quickstart-down`"
            )
    if root.exists() and any(root.iterdir()):
        if not (root / MARKER).exists():
            raise QuickstartError(f"{root} is not empty and not a quick start's: pass --dir")
        shutil.rmtree(root)
    root.mkdir(parents=True, exist_ok=True)
    (root / MARKER).write_text("made by python -m rtrl_localkube.quickstart\n")
    pid_file.write_text(f"{os.getpid()}\n")
