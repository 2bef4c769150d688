"""The Job controller's part of :class:`~rtrl_localkube.job_runner.JobRunner`, for one Job: its
pods (one per attempt and completion index), their runs, retries up to ``backoffLimit``, and
the Job's status and conditions as the real controller writes them."""

from __future__ import annotations

import secrets
import subprocess
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Protocol

from kubernetes.dynamic.exceptions import NotFoundError

from rtrl.core.api.reasons import JobCondition, PodPhase
from rtrl_localkube.api import KubeAPI
from rtrl_localkube.kinds import now_rfc3339
from rtrl_localkube.outcomes import Fail, Hang, Outcome, Succeed
from rtrl_localkube.pods import CancelledError, PodRunner, Termination
from rtrl_localkube.processes import kill_group

BACKOFF_LIMIT_DEFAULT = 6
POD_NAME_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"  # what Kubernetes uses for name suffixes


def compress_indexes(indexes: set[int]) -> str:
    """``{0, 1, 2, 5}`` -> ``"0-2,5"``, the format of ``status.completedIndexes``."""
    ranges: list[str] = []
    ordered = sorted(indexes)
    start: int | None = None
    prev: int | None = None
    for i in [*ordered, None]:
        if start is not None and prev is not None and (i is None or i != prev + 1):
            ranges.append(str(start) if start == prev else f"{start}-{prev}")
            start = None
        if i is not None and start is None:
            start = i
        prev = i
    return ",".join(ranges)


@dataclass
class TrackedJob:
    job: dict[str, Any]
    outcome: Outcome
    cancel: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    procs: set[subprocess.Popen[bytes]] = field(default_factory=set)
    thread: threading.Thread | None = None

    @property
    def name(self) -> str:
        return str(self.job["metadata"]["name"])


class Runner(Protocol):
    """What a Job's controller needs of the runner that tracks it
    (:class:`rtrl_localkube.job_runner.JobRunner`)."""

    api: KubeAPI
    namespace: str
    pods: PodRunner
    errors: list[str]

    def _cancel(self, job: TrackedJob) -> None: ...


class JobController:
    """One Job's life: pods per completion index, retries up to backoffLimit, Job status."""

    def __init__(self, runner: Runner, tracked: TrackedJob) -> None:
        self.runner = runner
        self.api = runner.api
        self.tracked = tracked
        self.job = tracked.job
        spec = self.job.get("spec") or {}
        self.name: str = self.job["metadata"]["name"]
        self.namespace: str = self.job["metadata"].get("namespace") or runner.namespace
        self.uid: str = self.job["metadata"]["uid"]
        self.indexed = spec.get("completionMode") == "Indexed"
        self.completions = int(spec.get("completions") or 1)
        self.backoff_limit = int(spec.get("backoffLimit", BACKOFF_LIMIT_DEFAULT))
        deadline = spec.get("activeDeadlineSeconds")
        self.deadline = time.monotonic() + float(deadline) if deadline else None
        self.lock = threading.Lock()
        self.failed = 0
        self.active = 0
        self.ready = 0
        self.succeeded: set[int] = set()
        self.finished = threading.Event()  # the Job reached a final condition
        self.start_time = now_rfc3339()
        self.status: dict[str, Any] = {}

    # Job status -------------------------------------------------------------------------

    def write_status(self, final: tuple[str, str, str] | None = None) -> None:
        """Send the whole status; ``final`` is (Complete|Failed, reason, message)."""
        status: dict[str, Any] = {
            "startTime": self.start_time,
            "ready": self.ready,
            "terminating": 0,
            "uncountedTerminatedPods": {},
        }
        if self.active:
            status["active"] = self.active
        if self.succeeded:
            status["succeeded"] = len(self.succeeded)
            if self.indexed:
                status["completedIndexes"] = compress_indexes(self.succeeded)
        if self.failed:
            status["failed"] = self.failed
        if final is not None:
            kind, reason, message = final
            now = now_rfc3339()
            first = (
                JobCondition.SUCCESS_CRITERIA_MET
                if kind == JobCondition.COMPLETE
                else JobCondition.FAILURE_TARGET
            )
            status["conditions"] = [
                {
                    "type": cond,
                    "status": "True",
                    "reason": reason,
                    "message": message,
                    "lastProbeTime": now,
                    "lastTransitionTime": now,
                }
                for cond in (first, kind)
            ]
            if kind == JobCondition.COMPLETE:
                status["completionTime"] = now
        patch = {key: None for key in self.status if key not in status} | status
        self.status = status
        try:
            self.api.patch(
                "batch/v1",
                "Job",
                self.name,
                {"status": patch},
                namespace=self.namespace,
                subresource="status",
            )
        except NotFoundError:
            raise CancelledError from None  # the Job was deleted meanwhile: stop playing it

    # Pods -------------------------------------------------------------------------------

    def pod_manifest(self, index: int) -> dict[str, Any]:
        template = self.job["spec"]["template"]
        suffix = "".join(secrets.choice(POD_NAME_ALPHABET) for _ in range(5))
        name = f"{self.name}-{index}-{suffix}" if self.indexed else f"{self.name}-{suffix}"
        labels = dict((template.get("metadata") or {}).get("labels") or {})
        annotations = dict((template.get("metadata") or {}).get("annotations") or {})
        labels |= {
            "job-name": self.name,
            "batch.kubernetes.io/job-name": self.name,
            "controller-uid": self.uid,
            "batch.kubernetes.io/controller-uid": self.uid,
        }
        spec = dict(template.get("spec") or {})
        if self.indexed:
            labels["batch.kubernetes.io/job-completion-index"] = str(index)
            annotations["batch.kubernetes.io/job-completion-index"] = str(index)
            spec["hostname"] = f"{self.name}-{index}"
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": self.namespace,
                "labels": labels,
                "annotations": annotations,
                "ownerReferences": [
                    {
                        "apiVersion": "batch/v1",
                        "kind": "Job",
                        "name": self.name,
                        "uid": self.uid,
                        "controller": True,
                        "blockOwnerDeletion": True,
                    }
                ],
            },
            "spec": spec,
        }

    def pod_status(self, pod: dict[str, Any], started: str, end: Termination | None) -> None:
        container = pod["spec"]["containers"][0]["name"]
        cstatus: dict[str, Any] = {"name": container, "ready": end is None, "restartCount": 0}
        if end is None:
            cstatus["state"] = {"running": {"startedAt": started}}
            phase = PodPhase.RUNNING
        else:
            terminated = {
                "exitCode": end.exit_code,
                "reason": end.reason,
                "startedAt": started,
                "finishedAt": now_rfc3339(),
            }
            if end.message:
                terminated["message"] = end.message
            cstatus["state"] = {"terminated": terminated}
            phase = PodPhase.SUCCEEDED if end.exit_code == 0 else PodPhase.FAILED
        status = {
            "phase": phase,
            "podIP": "127.0.0.1",
            "startTime": started,
            "containerStatuses": [cstatus],
        }
        self.api.patch(
            "v1",
            "Pod",
            pod["metadata"]["name"],
            {"status": status},
            namespace=self.namespace,
            subresource="status",
        )

    # The run ----------------------------------------------------------------------------

    def run(self) -> None:
        with self.lock:
            self.active = self.completions
            self.write_status()
        threads = [
            threading.Thread(target=self.run_index, args=(i,), name=f"{self.name}-{i}", daemon=True)
            for i in range(self.completions)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    def run_index(self, index: int) -> None:
        try:
            while not self.finished.is_set():
                end = self.run_pod(index)
                with self.lock:
                    self.active -= 1
                    if self.finished.is_set():
                        return
                    if end.reason == "DeadlineExceeded":
                        self.failed += 1
                        self.finish(
                            JobCondition.FAILED,
                            "DeadlineExceeded",
                            "Job was active longer than specified deadline",
                        )
                    elif end.exit_code == 0:
                        self.succeeded.add(index)
                        if len(self.succeeded) == self.completions:
                            self.finish(
                                JobCondition.COMPLETE,
                                "CompletionsReached",
                                "Reached expected number of succeeded pods",
                            )
                        else:
                            self.write_status()
                        return
                    else:
                        self.failed += 1
                        if self.failed > self.backoff_limit:
                            self.finish(
                                JobCondition.FAILED,
                                "BackoffLimitExceeded",
                                "Job has reached the specified backoff limit",
                            )
                        else:
                            self.active += 1  # the replacement pod
                            self.write_status()
        except CancelledError:
            return
        except Exception as exc:
            # A 404 on the pod: the Job may have been deleted (its pods with it) before this
            # runner's watch noticed; that is a cancellation, not an error.
            if getattr(exc, "status", None) == 404:
                self.tracked.cancel.wait(2.0)
            if not self.tracked.cancel.is_set():
                self.runner.errors.append(f"job {self.name}[{index}]:\n{traceback.format_exc()}")
            self.finished.set()
            self.runner._cancel(self.tracked)

    def finish(self, kind: str, reason: str, message: str) -> None:
        """Called under self.lock: the final status, and the other indexes' pods stopped."""
        self.finished.set()
        self.active = 0
        self.ready = 0
        self.write_status((kind, reason, message))
        with self.tracked.lock:
            procs = list(self.tracked.procs)
        for proc in procs:
            kill_group(proc)

    def run_pod(self, index: int) -> Termination:
        if self.tracked.cancel.is_set():
            raise CancelledError
        pod = self.api.create(self.pod_manifest(index), namespace=self.namespace)
        started = now_rfc3339()
        self.pod_status(pod, started, None)
        with self.lock:
            self.ready += 1
            self.write_status()
        try:
            end = self.attempt(pod, index)
        finally:
            with self.lock:
                self.ready -= 1
        if self.tracked.cancel.is_set():
            raise CancelledError
        self.pod_status(pod, started, end)
        return end

    def attempt(self, pod: dict[str, Any], index: int) -> Termination:
        outcome = self.tracked.outcome
        if isinstance(outcome, Succeed):
            if outcome.before is not None:
                outcome.before(self.job)
            return Termination(0, "Completed")
        if isinstance(outcome, Fail):
            return Termination(outcome.exit_code, outcome.reason, outcome.message)
        if isinstance(outcome, Hang):
            while not self.tracked.cancel.is_set() and not self.finished.is_set():
                if self.deadline is not None and time.monotonic() > self.deadline:
                    return Termination(137, "DeadlineExceeded")
                time.sleep(0.02)
            raise CancelledError
        return self.execute(pod, index)

    # Executing a container --------------------------------------------------------------

    def execute(self, pod: dict[str, Any], index: int) -> Termination:
        container = pod["spec"]["containers"][0]
        base = {"JOB_COMPLETION_INDEX": str(index)} if self.indexed else {}
        started: list[subprocess.Popen[bytes]] = []

        def track(proc: subprocess.Popen[bytes]) -> None:
            started.append(proc)
            with self.tracked.lock:
                self.tracked.procs.add(proc)

        try:
            end = self.runner.pods.run(
                pod,
                container,
                cancel=self.tracked.cancel,
                deadline=self.deadline,
                base_env=base,
                on_start=track,
            )
        finally:
            with self.tracked.lock:
                self.tracked.procs.difference_update(started)
        if self.finished.is_set():  # another index ended the Job and killed this one
            raise CancelledError
        return end
