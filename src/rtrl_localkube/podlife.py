"""One pod's life on the kubelet stand-in: its containers run (and restart) as local
processes, and every change is reported as the pod's status, as a kubelet reports it."""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import subprocess
import threading
import urllib.error
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from rtrl.core.api.reasons import PodPhase
from rtrl_localkube.controlplane import ControlPlane
from rtrl_localkube.pods import CancelledError, PodRunner, Termination, job_of

from .kinds import now_rfc3339
from .outcomes import Fail, Hang, Outcome, Run, Succeed
from .probes import ReadinessProber, runs_probe

RESTART_BACKOFF = (0.5, 1.0, 2.0, 5.0)
# A deleted pod's processes get at most this long after SIGTERM (the pod's own
# terminationGracePeriodSeconds, if shorter), so that tests do not wait 30 s per pod.
MAX_GRACE_SECONDS = 3.0


@dataclass
class Worker:
    """The kubelet's slot for one pod: the thread that lives its life, and how to stop it."""

    pod: dict[str, Any]
    cancel: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None
    grace: float = MAX_GRACE_SECONDS
    # the containers' processes, as started (Kubelet.kill signals them)
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)


class Node(Protocol):
    """What a pod's life needs of the kubelet it runs on
    (:class:`rtrl_localkube.kubelet.Kubelet`)."""

    cp: ControlPlane
    runner: PodRunner
    never_ready: list[str]
    unavailable_images: tuple[str, ...]

    def _patch_status(self, pod: dict[str, Any], status: dict[str, Any]) -> None: ...

    def _outcome(self, pod: dict[str, Any]) -> Outcome: ...

    def _guard(self, target: Callable[[], None]) -> Callable[[], None]: ...


def workload_names(pod: dict[str, Any]) -> list[str]:
    """The pod's name, its Job's, and its Deployment's (its ReplicaSet's name without the
    template hash): what ``never_ready`` patterns match."""
    meta = pod["metadata"]
    names = [meta["name"], job_of(pod)]
    for ref in meta.get("ownerReferences") or []:
        if ref.get("kind") == "ReplicaSet":
            names.append(str(ref["name"]).rsplit("-", 1)[0])
    return [n for n in names if n]


class PodLife:
    """One pod on the node: its containers' processes and the status the kubelet reports."""

    def __init__(self, kubelet: Node, worker: Worker) -> None:
        self.kubelet = kubelet
        self.worker = worker
        self.pod = worker.pod
        self.started = now_rfc3339()
        # as they listen on this machine (podnet.py: a port another pod holds is moved)
        network = kubelet.runner.network
        self.containers = [
            c if network is None else network.container(self.pod, c)
            for c in self.pod["spec"].get("containers") or []
        ]
        self.states: dict[str, dict[str, Any]] = {
            c["name"]: {"waiting": {"reason": "ContainerCreating"}} for c in self.containers
        }
        self.restarts: dict[str, int] = {c["name"]: 0 for c in self.containers}
        # the readiness probes of the containers that run now (probes.py)
        self.probers: dict[str, ReadinessProber] = {}
        self.lock = threading.Lock()
        # Each container's thread reports the pod's status: a report is built and sent under
        # this lock, so the last one sent holds the newest state (two sent concurrently could
        # arrive in the other order, the stale one last, and stay).
        self.reporting = threading.Lock()
        names = workload_names(self.pod)
        self.never_ready = any(fnmatch.fnmatch(n, p) for n in names for p in kubelet.never_ready)
        self.scripted = False  # an outcome other than Run: no process, so no probe

    def report(self, phase: str) -> None:
        with self.reporting:
            self._report(phase)

    def _report(self, phase: str) -> None:
        with self.lock:
            running = all("running" in s for s in self.states.values())
            probed = all(
                c["name"] in self.probers and self.probers[c["name"]].ready
                for c in self.containers
                if runs_probe(c) and not self.scripted
            )
            ready = running and probed and not self.never_ready and phase == PodPhase.RUNNING
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
            # no qosClass: the server set it at creation and refuses a change (a pod
            # with requests is Burstable), which would drop this whole status write
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
            self.report(PodPhase.PENDING)
            self.worker.cancel.wait()
            return
        self.report(PodPhase.PENDING)
        threads = [
            threading.Thread(
                target=self.kubelet._guard(functools.partial(self.container_loop, c)), daemon=True
            )
            for c in self.containers
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if self.worker.cancel.is_set():
            return
        # a container whose loop failed (in the kubelet's errors) has no termination: failed
        codes = [s.get("terminated", {}).get("exitCode", 1) for s in self.states.values()]
        self.report(PodPhase.SUCCEEDED if all(code == 0 for code in codes) else PodPhase.FAILED)

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
            self.report(PodPhase.RUNNING)
            delay = RESTART_BACKOFF[min(attempt, len(RESTART_BACKOFF) - 1)]
            attempt += 1
            if self.worker.cancel.wait(delay):
                return
            with self.lock:
                self.restarts[name] += 1

    def run_container(self, container: dict[str, Any]) -> Termination | None:
        outcome = self.kubelet._outcome(self.pod)
        self.scripted = not isinstance(outcome, Run)
        probing = threading.Event()

        def running(proc: subprocess.Popen[bytes] | None = None) -> None:
            with self.lock:
                if proc is not None:
                    self.worker.processes.append(proc)
                    if runs_probe(container):
                        prober = ReadinessProber(
                            container, lambda: self.report(PodPhase.RUNNING), probing
                        )
                        self.probers[container["name"]] = prober.start()
                self.states[container["name"]] = {"running": {"startedAt": now_rfc3339()}}
            self.report(PodPhase.RUNNING)

        try:
            return self._run_outcome(container, outcome, running)
        finally:
            probing.set()
            with self.lock:
                self.probers.pop(container["name"], None)

    def _run_outcome(
        self,
        container: dict[str, Any],
        outcome: Outcome,
        running: Callable[..., None],
    ) -> Termination | None:

        if isinstance(outcome, Succeed):
            running()
            if outcome.before is not None:
                try:
                    outcome.before(self.owner_job() or self.pod)
                except Exception as exc:
                    # the script is the container's process: its failure is the pod's, as a
                    # real kubelet reports a process that crashed
                    return Termination(1, "Error", f"{type(exc).__name__}: {exc}")
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
