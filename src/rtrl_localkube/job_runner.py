"""A stand-in for the Kubernetes Job controller and kubelet, for tests against the emulated API.

The emulator stores Jobs but runs nothing. :class:`JobRunner` polls the Jobs of a namespace
(every ``poll_interval``, 50 ms by default), reacts to each new Job (by uid) once, and plays the
Job controller for it: it creates Pod objects per attempt, runs (or pretends to run) them and
writes Pod and Job status as Kubernetes 1.31+ does. What happens to a Job is chosen by the test
with :meth:`JobRunner.script` (an fnmatch glob on the Job name); unmatched Jobs get ``Run()``.

Outcomes:

- ``Run()`` executes the pod template's first container as a local subprocess per completion
  (see below).
- ``Succeed(before=fn)`` calls ``fn(job_dict)`` (e.g. to write a step's result files), then
  reports success without running anything.
- ``Fail(reason, message, exit_code)`` fails every attempt: ``backoffLimit + 1`` Pods, then the
  Job fails with ``BackoffLimitExceeded``.
- ``Hang()`` keeps the Pod running until the Job is deleted (or its deadline passes).

``Run()`` runs the pod's first container as a local process the way the real control
plane's kubelet stand-in does (``src/rtrl_localkube/pods.py`` says how a pod spec maps onto this
machine); its output goes to ``<log_dir>/<namespace>/<pod>/<container>.log``, and
:meth:`JobRunner.logs` joins a Job's.
- ``activeDeadlineSeconds`` kills the Job's Pods (``DeadlineExceeded``) and fails the Job.

Simplifications, on purpose: retries start at once (no exponential back-off), all completions
run in parallel (``parallelism`` is ignored), ``podFailurePolicy``, ``backoffLimitPerIndex``,
``successPolicy``, suspend and pod deletion by others are not emulated, and Pods stay (as with
the real controller) until the Job is deleted and the emulator garbage-collects them.
"""

from __future__ import annotations

import fnmatch
import threading
import time
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kubernetes.dynamic.exceptions import NotFoundError

from rtrl_localkube.outcomes import Outcome, Run
from rtrl_localkube.pods import CancelledError, PodRunner
from rtrl_localkube.processes import check_stopped, kill_group

if TYPE_CHECKING:
    from rtrl_localkube.api import KubeAPI

from rtrl_localkube.job_controller import JobController, TrackedJob


class JobRunner:
    """Plays the Job controller for the Jobs of one namespace (see the module docstring).

    Use as a context manager (or ``start()``/``stop()``); ``stop()`` kills whatever still runs
    and raises if the runner itself hit an unexpected error, so harness bugs do not hide.
    """

    def __init__(
        self,
        api: KubeAPI,
        log_dir: Path,
        *,
        namespace: str | None = None,
        extra_env: Mapping[str, str] | None = None,
        poll_interval: float = 0.05,
    ) -> None:
        self.api = api
        self.namespace = namespace or api.namespace
        self.log_dir = Path(log_dir)
        self.pods = PodRunner(
            read=self._read, work_dir=self.log_dir, extra_env=dict(extra_env or {})
        )
        self.poll_interval = poll_interval
        self.jobs_seen: list[str] = []
        self.errors: list[str] = []
        self._scripts: list[tuple[str, Outcome]] = []
        self._tracked: dict[str, TrackedJob] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # Test-facing API ------------------------------------------------------------------------

    @property
    def extra_env(self) -> dict[str, str]:
        """Environment every container gets (e.g. ``DS_ACCELERATOR``, ``AWS_*``)."""
        return self.pods.extra_env

    @extra_env.setter
    def extra_env(self, value: Mapping[str, str]) -> None:
        self.pods.extra_env = dict(value)

    def script(self, pattern: str, outcome: Outcome) -> JobRunner:
        """Jobs whose name matches ``pattern`` (fnmatch) get ``outcome``; later scripts win."""
        with self._lock:
            self._scripts.append((pattern, outcome))
        return self

    def start(self) -> JobRunner:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._thread = threading.Thread(target=self._poll_loop, name="job-runner", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        with self._lock:
            tracked = list(self._tracked.values())
        for job in tracked:
            self._cancel(job)
        for job in tracked:
            if job.thread is not None:
                job.thread.join(10)
        alive = [job.name for job in tracked if job.thread is not None and job.thread.is_alive()]
        polling = self._thread is not None and self._thread.is_alive()
        check_stopped("the job runner", "jobs", alive, self.errors, stuck=bool(alive) or polling)

    def __enter__(self) -> JobRunner:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Wait until every Job seen so far has finished (or was deleted)."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                busy = [job.name for job in self._tracked.values() if not job.done.is_set()]
            if not busy:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"jobs still running after {timeout}s: {busy}")
            time.sleep(0.02)

    def logs(self, job_name: str) -> str:
        """The output of all of a Job's Pods, each under a header with the Pod's name."""
        return self.pods.logs(job_name, self.namespace)

    def _read(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return self.api.get("v1", kind, name, namespace=namespace)

    # Watching -------------------------------------------------------------------------------

    def _outcome(self, name: str) -> Outcome:
        with self._lock:
            for pattern, outcome in reversed(self._scripts):
                if fnmatch.fnmatchcase(name, pattern):
                    return outcome
        return Run()

    def _poll_loop(self) -> None:
        while not self._stop.is_set():
            try:
                jobs = self.api.list("batch/v1", "Job", namespace=self.namespace)
            except Exception:
                if self._stop.is_set():
                    return
                self.errors.append(traceback.format_exc())
                return
            live = {
                job["metadata"]["uid"]: job
                for job in jobs
                if not job["metadata"].get("deletionTimestamp")
            }
            for uid, job in live.items():
                if uid not in self._tracked:
                    self._track(uid, job)
            with self._lock:
                gone = [tracked for uid, tracked in self._tracked.items() if uid not in live]
            for tracked in gone:
                self._cancel(tracked)
            self._stop.wait(self.poll_interval)

    def _track(self, uid: str, job: dict[str, Any]) -> None:
        tracked = TrackedJob(job=job, outcome=self._outcome(job["metadata"]["name"]))
        with self._lock:
            self._tracked[uid] = tracked
            self.jobs_seen.append(tracked.name)
        if (job.get("status") or {}).get("conditions"):
            tracked.done.set()  # already finished before we saw it
            return
        tracked.thread = threading.Thread(
            target=self._run_job, args=(tracked,), name=f"job-{tracked.name}", daemon=True
        )
        tracked.thread.start()

    def _cancel(self, job: TrackedJob) -> None:
        job.cancel.set()
        with job.lock:
            procs = list(job.procs)
        for proc in procs:
            kill_group(proc)

    # The Job controller ---------------------------------------------------------------------

    def _run_job(self, tracked: TrackedJob) -> None:
        try:
            JobController(self, tracked).run()
        except CancelledError:
            pass
        except NotFoundError:
            if not tracked.cancel.is_set():
                self.errors.append(f"job {tracked.name}:\n{traceback.format_exc()}")
        except Exception:
            if not tracked.cancel.is_set():
                self.errors.append(f"job {tracked.name}:\n{traceback.format_exc()}")
        finally:
            tracked.done.set()
