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
  (the trainer image's ``rtrl-job`` is ``.venv/bin/rtrl-job``).
- A pod being deleted gets its processes stopped (SIGTERM, SIGKILL after the grace period),
  then the kubelet confirms the deletion (``gracePeriodSeconds: 0``).

Tests script what a pod does with :meth:`Kubelet.script` (an fnmatch pattern on the pod's Job
name, or its pod name): ``Run()`` (the default) executes the containers; ``Succeed(before=fn)``
calls ``fn(job)`` and exits 0; ``Fail(...)`` exits with that termination; ``Hang()`` runs until
the pod is deleted. ``never_ready`` lists pod-name patterns whose containers run but never
pass readiness (a model that never loads); a pattern may name the Deployment.

Not done, on purpose: readiness and liveness probes (a running container is ready), init
containers, resource limits, port conflicts between pods (all pods share the host's network
namespace), and ``runAsUser`` unless a test sets ``runner.identities`` (processes run as the
kubelet's user; with it, as the securityContext's user and capabilities: pods.py).
"""

from __future__ import annotations

import contextlib
import datetime
import fnmatch
import ipaddress
import itertools
import os
import threading
import time
import traceback
import urllib.error
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rtrl_localkube.controlplane import ControlPlane
from rtrl_localkube.pods import CancelledError, PodRunner, Termination, job_of

NODE = "rtrl-node"
LEASE_SECONDS = 40
RENEW_SECONDS = 10.0
# A deleted pod's processes get at most this long after SIGTERM (the pod's own
# terminationGracePeriodSeconds, if shorter), so that tests do not wait 30 s per pod.
MAX_GRACE_SECONDS = 3.0
RESTART_BACKOFF = (0.5, 1.0, 2.0, 5.0)
# Each pod gets an address of this node's pod CIDR, as with a CNI plugin: the API rejects
# loopback addresses in EndpointSlices. Nothing listens on them (every pod shares the host's
# network namespace and is reached as 127.0.0.1, see src/rtrl_localkube/pods.py).
POD_CIDR = ipaddress.ip_network("10.244.0.0/16")


@dataclass(frozen=True)
class Run:
    """Execute the containers locally (the default)."""


@dataclass(frozen=True)
class Succeed:
    """Exit 0 without running; ``before(job)`` runs first with the pod's Job (e.g. to write
    the step's result files), or with the pod itself when no Job owns it."""

    before: Callable[[dict[str, Any]], None] | None = None


@dataclass(frozen=True)
class Fail:
    """End every attempt with this container termination."""

    reason: str = "Error"
    message: str = ""
    exit_code: int = 1


@dataclass(frozen=True)
class Hang:
    """Stay running until the pod is deleted."""


Outcome = Run | Succeed | Fail | Hang


def now_rfc3339() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _quantity_count(value: Any) -> float:
    """An extended-resource quantity as a number ("8", 8, "500m")."""
    text = str(value)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


@dataclass
class _Worker:
    pod: dict[str, Any]
    cancel: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None
    grace: float = MAX_GRACE_SECONDS


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
        self.runner = PodRunner(
            read=self._read,
            work_dir=work_dir,
            extra_env=dict(extra_env or {}),
            token=self._token,
            node_name=node,
        )
        self._scripts: list[tuple[str, Outcome]] = []
        self._workers: dict[str, _Worker] = {}
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
        alive = [w.pod["metadata"]["name"] for w in workers if w.thread and w.thread.is_alive()]
        if alive:
            raise RuntimeError(f"the kubelet did not stop (pods still running: {alive})")
        if self.errors:
            raise RuntimeError("the kubelet failed:\n" + "\n".join(self.errors))

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
        meta = pod["metadata"]
        with contextlib.suppress(urllib.error.HTTPError):  # 404: deleted meanwhile
            self.cp.request(
                "PATCH",
                f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status",
                {"status": status},
                content_type="application/merge-patch+json",
            )

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
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        capacity = {"cpu": str(os.cpu_count() or 1), "memory": str(memory), "pods": "250"}
        with contextlib.suppress(urllib.error.HTTPError):  # 409: registered before
            self.cp.request(
                "POST",
                "/api/v1/nodes",
                {"apiVersion": "v1", "kind": "Node",
                 "metadata": {"name": self.node, "labels": self.labels}},
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
        self.cp.request(
            "PATCH",
            f"/api/v1/nodes/{self.node}/status",
            {
                "status": {
                    "capacity": capacity,
                    "allocatable": capacity,
                    "conditions": conditions,
                    "addresses": [
                        {"type": "InternalIP", "address": "127.0.0.1"},
                        {"type": "Hostname", "address": self.node},
                    ],
                    "nodeInfo": self._node_info(),
                }
            },
            content_type="application/merge-patch+json",
        )

    def _node_info(self) -> dict[str, str]:
        info = dict.fromkeys(("kernelVersion", "osImage", "machineID", "systemUUID", "bootID"), "")
        return info | {
            "kubeletVersion": self.cp.version,
            "kubeProxyVersion": "",
            "operatingSystem": "linux",
            "architecture": "amd64",
            "containerRuntimeVersion": "local-process://1",
        }

    def _heartbeat(self) -> None:
        path = f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{self.node}"
        while not self._stop.is_set():
            renew = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
            lease = {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": self.node, "namespace": "kube-node-lease"},
                "spec": {
                    "holderIdentity": self.node,
                    "leaseDurationSeconds": LEASE_SECONDS,
                    "renewTime": renew,
                },
            }
            try:
                self.cp.request("PATCH", path, {"spec": lease["spec"]},
                                content_type="application/merge-patch+json")  # fmt: skip
            except urllib.error.HTTPError as exc:
                if exc.code != 404:
                    raise
                self.cp.request(
                    "POST",
                    "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases",
                    lease,
                )
            self._stop.wait(RENEW_SECONDS)

    # --- pods ----------------------------------------------------------------------------

    def _watch_pods(self) -> None:
        resource_version = ""
        while not self._stop.is_set():
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
        meta, spec = pod["metadata"], pod["spec"]
        problem = None
        wanted = spec.get("nodeSelector") or {}
        if any(self.labels.get(k) != v for k, v in wanted.items()):
            problem = "1 node(s) didn't match Pod's node affinity/selector"
        for container in spec.get("containers") or []:
            requests = {
                **((container.get("resources") or {}).get("limits") or {}),
                **((container.get("resources") or {}).get("requests") or {}),
            }
            extended = [k for k, v in requests.items() if "/" in k and _quantity_count(v) > 0]
            if extended:
                problem = f"1 Insufficient {extended[0]}"
        if problem is not None:
            self._patch_status(
                pod,
                {"phase": "Pending", "conditions": [
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

    def _start_worker(self, pod: dict[str, Any], *, started: bool) -> _Worker:
        worker = _Worker(pod=pod)
        with self._lock:
            status = pod.setdefault("status", {})
            status.setdefault("podIP", next(self._addresses))
            self._workers[pod["metadata"]["uid"]] = worker
            self.pods_seen.append(pod["metadata"]["name"])
            job = job_of(pod)
            if job and job not in self.jobs_seen:
                self.jobs_seen.append(job)
        if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed") or not started:
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

    def _run_pod(self, worker: _Worker) -> None:
        try:
            if not worker.cancel.is_set():
                _PodLife(self, worker).run()
        finally:
            if worker.cancel.is_set():
                self._confirm_deletion(worker)
            worker.done.set()

    def _confirm_deletion(self, worker: _Worker) -> None:
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
            if (current.get("status") or {}).get("phase") not in ("Succeeded", "Failed"):
                # as a kubelet does since 1.27: a pod killed on deletion ends in a final phase
                self._patch_status(current, {"phase": "Failed"})
            self.cp.request(
                "DELETE",
                f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}",
                {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0,
                 "preconditions": {"uid": meta["uid"]}},
            )  # fmt: skip


def workload_names(pod: dict[str, Any]) -> list[str]:
    """The pod's name, its Job's, and its Deployment's (its ReplicaSet's name without the
    template hash): what ``never_ready`` patterns match."""
    meta = pod["metadata"]
    names = [meta["name"], job_of(pod)]
    for ref in meta.get("ownerReferences") or []:
        if ref.get("kind") == "ReplicaSet":
            names.append(str(ref["name"]).rsplit("-", 1)[0])
    return [n for n in names if n]


class _PodLife:
    """One pod on the node: its containers' processes and the status the kubelet reports."""

    def __init__(self, kubelet: Kubelet, worker: _Worker) -> None:
        self.kubelet = kubelet
        self.worker = worker
        self.pod = worker.pod
        self.started = now_rfc3339()
        self.containers = list(self.pod["spec"].get("containers") or [])
        self.states: dict[str, dict[str, Any]] = {
            c["name"]: {"waiting": {"reason": "ContainerCreating"}} for c in self.containers
        }
        self.restarts: dict[str, int] = {c["name"]: 0 for c in self.containers}
        self.lock = threading.Lock()
        names = workload_names(self.pod)
        self.never_ready = any(fnmatch.fnmatch(n, p) for n in names for p in kubelet.never_ready)

    def report(self, phase: str) -> None:
        with self.lock:
            running = all("running" in s for s in self.states.values())
            ready = running and not self.never_ready and phase == "Running"
            statuses = [
                {
                    "name": c["name"],
                    "image": c.get("image", ""),
                    "imageID": "",
                    "ready": ready,
                    "started": "running" in self.states[c["name"]],
                    "restartCount": self.restarts[c["name"]],
                    "state": self.states[c["name"]],
                }
                for c in self.containers
            ]
        now = now_rfc3339()

        def condition(kind: str, value: bool) -> dict[str, Any]:
            return {"type": kind, "status": "True" if value else "False",
                    "lastProbeTime": None, "lastTransitionTime": now}  # fmt: skip

        status = {
            "phase": phase,
            "hostIP": "127.0.0.1",
            "hostIPs": [{"ip": "127.0.0.1"}],
            "podIP": self.pod["status"]["podIP"],
            "podIPs": [{"ip": self.pod["status"]["podIP"]}],
            "startTime": self.started,
            "qosClass": "BestEffort",
            "conditions": [
                condition("PodScheduled", True),
                condition("Initialized", True),
                condition("ContainersReady", ready),
                condition("Ready", ready),
            ],
            "containerStatuses": statuses,
        }
        self.kubelet._patch_status(self.pod, status)

    def run(self) -> None:
        unavailable = [
            c for c in self.containers
            if any(fnmatch.fnmatch(c.get("image", ""), p) for p in self.kubelet.unavailable_images)
        ]  # fmt: skip
        if unavailable:
            for c in unavailable:
                self.states[c["name"]] = {"waiting": {
                    "reason": "ErrImagePull",
                    "message": f'failed to pull image "{c.get("image")}": not available here',
                }}  # fmt: skip
            self.report("Pending")
            self.worker.cancel.wait()
            return
        self.report("Pending")
        threads = [
            threading.Thread(target=self.container_loop, args=(c,), daemon=True)
            for c in self.containers
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if self.worker.cancel.is_set():
            return
        codes = [s["terminated"]["exitCode"] for s in self.states.values()]
        self.report("Succeeded" if all(code == 0 for code in codes) else "Failed")

    def container_loop(self, container: dict[str, Any]) -> None:
        policy = self.pod["spec"].get("restartPolicy", "Always")
        name = container["name"]
        attempt = 0
        while True:
            end = self.run_container(container)
            if end is None:  # cancelled
                return
            with self.lock:
                finished = now_rfc3339()
                self.states[name] = {"terminated": {
                    "exitCode": end.exit_code, "reason": end.reason,
                    "startedAt": self.started, "finishedAt": finished,
                    **({"message": end.message} if end.message else {}),
                }}  # fmt: skip
            restart = policy == "Always" or (policy == "OnFailure" and end.exit_code != 0)
            if not restart:
                return
            self.report("Running")
            delay = RESTART_BACKOFF[min(attempt, len(RESTART_BACKOFF) - 1)]
            attempt += 1
            if self.worker.cancel.wait(delay):
                return
            with self.lock:
                self.restarts[name] += 1

    def run_container(self, container: dict[str, Any]) -> Termination | None:
        outcome = self.kubelet._outcome(self.pod)

        def running(_proc: Any = None) -> None:
            with self.lock:
                self.states[container["name"]] = {"running": {"startedAt": now_rfc3339()}}
            self.report("Running")

        if isinstance(outcome, Succeed):
            running()
            if outcome.before is not None:
                outcome.before(self.owner_job() or self.pod)
            return Termination(0, "Completed")
        if isinstance(outcome, Fail):
            running()
            return Termination(outcome.exit_code, outcome.reason, outcome.message)
        if isinstance(outcome, Hang):
            running()
            self.worker.cancel.wait()
            return None
        try:
            return self.kubelet.runner.run(
                self.pod,
                container,
                cancel=self.worker.cancel,
                on_start=running,
                grace=lambda: self.worker.grace,
            )
        except CancelledError:
            return None

    def owner_job(self) -> dict[str, Any] | None:
        meta = self.pod["metadata"]
        for ref in meta.get("ownerReferences") or []:
            if ref.get("kind") == "Job":
                with contextlib.suppress(urllib.error.HTTPError):
                    job: dict[str, Any] = self.kubelet.cp.request(
                        "GET", f"/apis/batch/v1/namespaces/{meta['namespace']}/jobs/{ref['name']}"
                    )
                    return job
        return None
