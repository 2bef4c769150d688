"""The stand-in for the kubelet (and the scheduler) of the real control plane.

Everything above the pod is the real controllers' work: the Job controller creates a Job's
pods, retries them and writes the Job's status; the Deployment and ReplicaSet controllers
create and count serving pods; the garbage collector deletes what a deleted owner owned. What
this module does is only what a kubelet does for those pods, with local processes instead of
containers (see ``src/rtrl_localkube/pods.py`` for how a pod spec maps onto this machine):

- It registers its Node (Ready, with the machine's CPUs and memory) and renews the Node's
  Lease, as a kubelet does, so the node lifecycle controller keeps it.
- It binds every pod that names no node to its Node (the scheduler's one decision here),
  unless the pod's ``nodeSelector`` or its requests of extended resources (GPUs) cannot be
  met: then the pod stays Pending with ``PodScheduled=False``, reason ``Unschedulable``.
- It runs the containers of the pods bound to it and reports what a kubelet reports: phase,
  ``podIP``/``hostIP``, ``startTime``, the PodScheduled/Initialized/ContainersReady/Ready
  conditions and each container's state (waiting, running, terminated with exit code,
  reason and termination message), restarting containers as ``restartPolicy`` says.
- A container whose image matches ``unavailable_images`` waits with ``ErrImagePull``, as a
  pull from an unreachable registry would; every other image "is" this machine's environment
  (the trainer image's ``rtrl-job`` is ``.venv/bin/rtrl-job``), except vLLM's official
  image (``vllm/vllm-openai:*``), which is the vLLM venv of ``make vllm`` (``pods.py``).
- A container with an ``httpGet``/``tcpSocket`` readiness probe is ready once it passes.
- A pod being deleted gets its processes stopped (SIGTERM, SIGKILL after the grace period),
  then the kubelet confirms the deletion (``gracePeriodSeconds: 0``).

Tests script what a pod does with :meth:`Kubelet.script` (an fnmatch pattern on the pod's Job
name, or its pod name) and an outcome of :mod:`rtrl_localkube.outcomes`. ``never_ready`` lists
patterns of pod (or Deployment) names whose containers run but never pass readiness.

Pods behind a headless Service find their peers by name, from the Service's EndpointSlices,
each Job's ``MASTER_PORT`` is a free port of its own, and a port a pod declares that another
live pod holds is moved to a free one (``podnet.py``: the stable and the canary pod of one
Deployment both listen). :meth:`Kubelet.kill`
signals a pod's processes, as the OOM killer or a crash would.

Not done, on purpose: liveness and startup probes, ``exec`` and ``grpc`` readiness probes
(such a container is ready once it runs), init containers, resource limits, and
``runAsUser`` unless a test sets ``runner.identities`` (processes run as the kubelet's
user; with it, as the securityContext's user and capabilities: pods.py).
"""

from __future__ import annotations

import contextlib
import fnmatch
import http.client
import ipaddress
import itertools
import os
import signal
import threading
import time
import traceback
import urllib.error
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rtrl.core.api.reasons import PodPhase
from rtrl_localkube.controlplane import ControlPlane, ControlPlaneError
from rtrl_localkube.pods import PodRunner, job_of

from . import node as node_api
from .kinds import now_rfc3339
from .outcomes import Outcome, Run
from .podlife import MAX_GRACE_SECONDS, PodLife, Worker
from .podnet import PodNetwork
from .processes import check_stopped

NODE = "rtrl-node"
# Each pod gets an address of this node's pod CIDR, as with a CNI plugin: the API rejects
# loopback addresses in EndpointSlices. Nothing listens on them (every pod shares the host's
# network namespace and is reached as 127.0.0.1, see src/rtrl_localkube/pods.py).
POD_CIDR = ipaddress.ip_network("10.244.0.0/16")


class Kubelet:
    """Runs the pods of one Node on a real API server. Use as a context manager; ``stop()``
    kills what still runs and raises if the kubelet itself hit an unexpected error."""

    def __init__(
        self,
        controlplane: ControlPlane,
        work_dir: Path,
        *,
        node: str = NODE,
        extra_env: dict[str, str] | None = None,
        unavailable_images: tuple[str, ...] = (),
        labels: dict[str, str] | None = None,
    ) -> None:
        self.cp = controlplane
        self.node = node
        self.unavailable_images = unavailable_images
        self.labels = {
            "kubernetes.io/hostname": node,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64",
            **(labels or {}),
        }
        self.never_ready: list[str] = []
        self.pods_seen: list[str] = []
        self.jobs_seen: list[str] = []
        self.errors: list[str] = []
        self.network = PodNetwork(controlplane)
        self.runner = PodRunner(
            read=self._read,
            work_dir=work_dir,
            extra_env=dict(extra_env or {}),
            token=self._token,
            node_name=node,
            network=self.network,
            api_server=controlplane.url,  # pods reach the API as their ServiceAccount (pods.py)
        )
        self._scripts: list[tuple[str, Outcome]] = []
        self._workers: dict[str, Worker] = {}
        self._scheduled: set[str] = set()
        self._addresses = (str(ip) for ip in itertools.islice(POD_CIDR.hosts(), 1, None))
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    @property
    def extra_env(self) -> dict[str, str]:
        return self.runner.extra_env

    # --- test-facing ---------------------------------------------------------------------

    def script(self, pattern: str, outcome: Outcome) -> Kubelet:
        """Pods whose Job (or, without one, whose name) matches ``pattern`` get ``outcome``;
        later scripts win."""
        with self._lock:
            self._scripts.append((pattern, outcome))
        return self

    def reset(self, extra_env: dict[str, str]) -> None:
        """Forget a test's scripts, readiness overrides and the pods and Jobs it saw;
        restore ``extra_env``."""
        with self._lock:
            self._scripts.clear()
            self.pods_seen.clear()
            self.jobs_seen.clear()
        self.never_ready = []
        self.runner.extra_env = dict(extra_env)
        self.runner.identities = False

    def logs(self, job_or_pod: str, namespace: str | None = None) -> str:
        """The output of the pods of a Job (or of one pod), each under a header."""
        return self.runner.logs(job_or_pod, namespace)

    def kill(self, pod: str, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the process groups of pod ``pod``'s running containers; the pod's
        ``restartPolicy`` and its controller decide what follows."""
        with self._lock:
            workers = [w for w in self._workers.values() if w.pod["metadata"]["name"] == pod]
        groups = [proc.pid for w in workers for proc in w.processes if proc.poll() is None]
        if not groups:
            raise LookupError(f"pod {pod} runs no process on {self.node}")
        for pid in groups:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, sig)

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Until every pod seen so far has finished or been deleted."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                busy = [w.pod["metadata"]["name"] for w in self._workers.values()
                        if not w.done.is_set()]  # fmt: skip
            if not busy:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"pods still running after {timeout}s: {busy}")
            time.sleep(0.05)

    def start(self) -> Kubelet:
        self.runner.work_dir.mkdir(parents=True, exist_ok=True)
        self._register_node()
        self.network.start()
        for target, name in ((self._heartbeat, "kubelet-lease"), (self._watch_pods, "kubelet")):
            thread = threading.Thread(target=self._guard(target), name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> None:
        self._stop.set()
        self.cp.close_watches()
        with self._lock:
            workers = list(self._workers.values())
        for worker in workers:
            worker.cancel.set()
        for worker in workers:
            if worker.thread is not None:
                worker.thread.join(15)
        for thread in self._threads:
            thread.join(10)
        self.network.stop()
        alive = [w.pod["metadata"]["name"] for w in workers if w.thread and w.thread.is_alive()]
        check_stopped("the kubelet", "pods", alive, self.errors, stuck=bool(alive))

    def __enter__(self) -> Kubelet:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # --- the API -------------------------------------------------------------------------

    def _read(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        plural = {"Secret": "secrets", "ConfigMap": "configmaps"}[kind]
        try:
            answer: dict[str, Any] = self.cp.request(
                "GET", f"/api/v1/namespaces/{namespace}/{plural}/{name}"
            )
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise
        return answer

    def _token(self, pod: dict[str, Any], audience: str | None, seconds: int) -> str:
        meta = pod["metadata"]
        spec: dict[str, Any] = {
            "expirationSeconds": max(600, int(seconds)),
            "boundObjectRef": {
                "apiVersion": "v1", "kind": "Pod", "name": meta["name"], "uid": meta["uid"]
            },
        }  # fmt: skip
        if audience:
            spec["audiences"] = [audience]
        sa = pod["spec"].get("serviceAccountName") or "default"
        answer = self.cp.request(
            "POST",
            f"/api/v1/namespaces/{meta['namespace']}/serviceaccounts/{sa}/token",
            {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec},
        )
        return str(answer["status"]["token"])

    def _patch_status(self, pod: dict[str, Any], status: dict[str, Any]) -> None:
        node_api.patch_pod_status(self.cp, pod, status, self._stop)

    def _guard(self, target: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                target()
            except Exception:
                if not self._stop.is_set():
                    self.errors.append(traceback.format_exc())

        return run

    # --- the Node ------------------------------------------------------------------------

    def _register_node(self) -> None:
        node_api.register(self.cp, self.node, self.labels)

    def _heartbeat(self) -> None:
        node_api.heartbeat(self.cp, self.node, self._stop)

    # --- pods ----------------------------------------------------------------------------

    def _watch_pods(self) -> None:
        resource_version = ""
        while not self._stop.is_set():
            try:
                if not resource_version:
                    listing = self.cp.request("GET", "/api/v1/pods")
                    for pod in listing["items"]:
                        self._on_pod("ADDED", pod)
                    resource_version = listing["metadata"]["resourceVersion"]
                for event in self.cp.watch("/api/v1/pods", resource_version):
                    if event["type"] == "ERROR":  # 410 Gone: list again
                        resource_version = ""
                        break
                    obj = event["object"]
                    resource_version = obj["metadata"]["resourceVersion"]
                    if event["type"] != "BOOKMARK":
                        self._on_pod(event["type"], obj)
            except (OSError, ValueError, http.client.HTTPException, ControlPlaneError):
                # the API server restarts (bench/chaos.py): watch again from where it was
                self._stop.wait(0.5)

    def _on_pod(self, kind: str, pod: dict[str, Any]) -> None:
        meta, spec = pod["metadata"], pod.get("spec") or {}
        uid = meta["uid"]
        with self._lock:
            worker = self._workers.get(uid)
        if kind == "DELETED":
            if worker is not None:
                worker.cancel.set()
            return
        node = spec.get("nodeName")
        if not node:
            if uid not in self._scheduled and not meta.get("deletionTimestamp"):
                self._scheduled.add(uid)
                self._schedule(pod)
            return
        if node != self.node:
            return
        if meta.get("deletionTimestamp"):
            grace = min(MAX_GRACE_SECONDS, float(spec.get("terminationGracePeriodSeconds", 30)))
            if worker is None:
                worker = self._start_worker(pod, started=False)
            worker.grace = grace
            worker.cancel.set()
            return
        if worker is None:
            self._start_worker(pod, started=True)
        else:
            worker.pod = {**pod, "status": {**(pod.get("status") or {}),
                                            "podIP": worker.pod["status"]["podIP"]}}  # fmt: skip

    def _schedule(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        problem = node_api.unschedulable(pod, self.labels)
        if problem is not None:
            self._patch_status(
                pod,
                {"phase": PodPhase.PENDING, "conditions": [
                    {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                     "message": f"0/1 nodes are available: {problem}.",
                     "lastTransitionTime": now_rfc3339()}
                ]},
            )  # fmt: skip
            return
        with contextlib.suppress(urllib.error.HTTPError):  # 409 / 404: bound or gone
            self.cp.request(
                "POST",
                f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/binding",
                {"apiVersion": "v1", "kind": "Binding",
                 "metadata": {"name": meta["name"], "uid": meta["uid"]},
                 "target": {"apiVersion": "v1", "kind": "Node", "name": self.node}},
            )  # fmt: skip

    def _start_worker(self, pod: dict[str, Any], *, started: bool) -> Worker:
        worker = Worker(pod=pod)
        with self._lock:
            status = pod.setdefault("status", {})
            status.setdefault("podIP", next(self._addresses))
            self._workers[pod["metadata"]["uid"]] = worker
            self.pods_seen.append(pod["metadata"]["name"])
            job = job_of(pod)
            if job and job not in self.jobs_seen:
                self.jobs_seen.append(job)
        if (pod.get("status") or {}).get("phase") in (
            PodPhase.SUCCEEDED,
            PodPhase.FAILED,
        ) or not started:
            worker.cancel.set()
        worker.thread = threading.Thread(
            target=self._guard(lambda: self._run_pod(worker)),
            name=f"pod-{pod['metadata']['name']}",
            daemon=True,
        )
        worker.thread.start()
        return worker

    def _outcome(self, pod: dict[str, Any]) -> Outcome:
        names = [n for n in (job_of(pod), pod["metadata"]["name"]) if n]
        with self._lock:
            for pattern, outcome in reversed(self._scripts):
                if any(fnmatch.fnmatchcase(name, pattern) for name in names):
                    return outcome
        return Run()

    def _run_pod(self, worker: Worker) -> None:
        try:
            if not worker.cancel.is_set():
                PodLife(self, worker).run()
        finally:
            self.network.release(worker.pod)
            if worker.cancel.is_set():
                self._confirm_deletion(worker)
            worker.done.set()

    def _confirm_deletion(self, worker: Worker) -> None:
        """A deleted pod whose processes ended: gone for good (a kubelet's final DELETE)."""
        meta = worker.pod["metadata"]
        if self._stop.is_set():
            return
        with contextlib.suppress(urllib.error.HTTPError):
            current = self.cp.request(
                "GET", f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}"
            )
            if current["metadata"]["uid"] != meta["uid"]:
                return
            if not current["metadata"].get("deletionTimestamp"):
                return  # cancelled because the kubelet stops, not because it was deleted
            if (current.get("status") or {}).get("phase") not in (
                PodPhase.SUCCEEDED,
                PodPhase.FAILED,
            ):
                # as a kubelet does since 1.27: a pod killed on deletion ends in a final phase
                self._patch_status(current, {"phase": PodPhase.FAILED})
            self.cp.request(
                "DELETE",
                f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}",
                {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0,
                 "preconditions": {"uid": meta["uid"]}},
            )  # fmt: skip
