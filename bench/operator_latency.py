"""The operator's reaction time, API requests per cycle and idle RSS, next to a kopf no-op
operator measured in the same run.

Everything runs against the emulated API server
(``src/rtrl_localkube/emulator.py``), served over HTTP from a thread of this process, with
Jobs played by ``rtrl_localkube.job_runner.JobRunner`` (every step succeeds at once and
commits its canned
result, ``cycle_world.commit_result``). The operator is its own process (``rtrl operator
--namespace default --standalone --liveness none``, ``RTRL_RESYNC_SECONDS=--resync``), and so
is the baseline (``kopf run --standalone -n default bench/operator_noop.py``, whose only
action is a status patch of a completed Job). Each process has its own bearer token in its
kubeconfig, so the emulator attributes every request to a process, and it timestamps every
write that changed an object as it commits it (under its lock, ``time.perf_counter`` of this
process: one clock for everything). kmock, under the emulator, scans every request it has
ever served to route a new one; the bench lets a request go once handled, so that a request
costs the same at the end of the run as at its start (see ``RecordingEmulator._handle``).

What is measured:

- latency, rtrl: for each Job of a cycle, from the commit of the JobRunner's status write that
  adds the Job's ``Complete`` condition to the commit of the operator's next write that
  changed something (a Job created, a Checkpoint or RLCycle status written, a Deployment,
  Service or ConfigMap written; Events aside) and was made by a round that began after the
  completion ("next action"; the table shows which writes these were). The rounds come from
  the operator's own trace (``RTRL_ROUND_TRACE``: one JSON line per round with its start and
  end, ``time.perf_counter`` of the operator's process, which on Linux is the same monotonic
  clock as the bench's, and whether it read live or from the watch cache); a round that
  reads its cache sends no request the API server could delimit it by. Also shown: until the
  reconciler's first request after the completion ("first request"), until the Job index
  handler woke the reconciler (the trace's ``woken``: kopf's delivery of the event), until the
  start of the round that acted, its observe and plan done, and its end, and the reconcile
  rounds themselves (the JSON also gives, per completion, how long the operator had been
  quiet before it: ``quiet_ms``, since its last write) (start to end, and
  how much of that the API server spent answering their requests).
- latency, baseline: Jobs labelled ``rtrl.io/bench=noop``, played by the same JobRunner; from
  the commit of the same ``Complete`` write to the commit of the baseline's status patch.
- trigger -> Checkpoint: from the commit of the bench's ``rtrl.io/trigger`` annotation write
  to the commit of the cycle's Checkpoint create.
- API requests per cycle: requests the operator process sent, counted as the emulator
  received them, from the trigger until the operator has been quiet for ``--quiet`` s after the
  RLCycle reported Idle again (so the rounds its own last writes cause are counted); split
  into the reconciler's (``KubeClient``, by verb) and kopf's own (aiohttp; watch streams
  apart), and reconcile rounds (from the trace; how many read live).
- RSS: ``--rlcycles`` RLCycles, each with its own Deployment and base Checkpoint and a cron
  schedule that is not due (``0 0 1 1 *``), created while the operator runs. Once all report
  phase Idle (and ``--settle`` s more), RSS of the process and its children is sampled every
  0.2 s for ``--idle-seconds`` (default: one resync period + 5 s, so every RLCycle's periodic
  round falls inside): median ("steady") and max; VmHWM is the process's peak over its whole
  life. The baseline, also watching the RLCycles, is started once they exist and sampled over
  the same window. The operator's requests per second in that window are the idle API load.

Statistics: median, p95 (nearest rank: with 30 samples, the 29th smallest) and max.

Goals (the Operator issue): median latency under 1 s and within 2x of the baseline's; RSS with
100 idle RLCycles under 200 MB (MB = 10^6 bytes, as in the other benches).

    .venv/bin/python bench/operator_latency.py [--cycles 10] [--rlcycles 100] [--quick]
        [--json OUT]
"""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import copy
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import attrs
import kubernetes
import psutil
import yaml
from kubernetes.dynamic import DynamicClient

from rtrl_localkube.api import KubeAPI, write_kubeconfig
from rtrl_localkube.cycle_world import (
    NAME,
    RESULTS,
    RTRL,
    base_checkpoint,
    commit_result,
    deployment,
    rlcycle,
)
from rtrl_localkube.deployment_controller import DeploymentController
from rtrl_localkube.emulator import EmulatorServer, KubeEmulator
from rtrl_localkube.job_runner import JobRunner
from rtrl_localkube.kinds import KOPF_PEERING_CRDS, PROJECT_CRDS, Kind, load_crds
from rtrl_localkube.outcomes import Succeed
from rtrl_localkube.tools import OPEN_POLICY_ENV

MB = 1_000_000
BIN = Path(sys.executable).parent
NAMESPACE = "default"
CRON = "0 0 1 1 *"  # next 1 January: never due during a run
LABEL = "rtrl.io/rlcycle"
NOOP_LABEL = "rtrl.io/bench"
STEPS = tuple(RESULTS)  # the steps with canned results: stage, train, eval (, analyze...)
FINISHED = {"Evaluated", "Rejected", "Promoted", "RolledBack", "Superseded", "Failed"}
REPO = Path(__file__).resolve().parents[1]
NOOP = REPO / "bench" / "operator_noop.py"
RTRL_OPERATOR = ["operator", "--namespace", NAMESPACE, "--standalone", "--liveness", "none"]

# (client token, method, path) of the request being handled, for the write hooks.
_REQUEST: contextvars.ContextVar[tuple[str, str, str]] = contextvars.ContextVar(
    "bench_request", default=("emulator", "", "")
)


# --- the recording emulator ----------------------------------------------------------------


@dataclass
class Request:
    """One HTTP request as the emulator received it."""

    t0: float
    client: str  # the bearer token: "rtrl", "noop" or "bench" (the bench and the JobRunner)
    agent: str  # "kopf" (aiohttp, User-Agent kopf/...) or "client" (the kubernetes package)
    method: str
    path: str
    watch: bool
    t1: float | None = None  # answered (for a watch: the stream ended)

    @property
    def verb(self) -> str:
        if self.watch:
            return "WATCH"
        if self.method != "GET":
            return self.method
        if "/namespaces/" not in self.path:
            return "GET (cluster)"  # discovery, CRDs, namespaces
        rest = self.path.split("/namespaces/", 1)[1].strip("/").split("/")
        return "LIST" if len(rest) == 2 else "GET"


@dataclass
class Write:
    """A write that changed an object, as committed (one per watch event it caused)."""

    t: float
    client: str
    method: str
    path: str
    kind: str
    event: str  # ADDED, MODIFIED, DELETED
    name: str
    rlcycle: str  # the RLCycle it belongs to (its own name, or the rtrl.io/rlcycle label)
    status: bool  # written through the status subresource
    completed: bool  # a Job's first write with Complete=True


def _complete(obj: Mapping[str, Any]) -> bool:
    conditions = (obj.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Complete" and c.get("status") == "True" for c in conditions)


@attrs.define(kw_only=True)
class RecordingEmulator(KubeEmulator):
    """The tests' emulator, recording every request and every committed change."""

    requests: list[Request] = attrs.field(factory=list, init=False)
    writes: list[Write] = attrs.field(factory=list, init=False)
    latest: dict[tuple[str, str], dict[str, Any]] = attrs.field(factory=dict, init=False)
    changed: threading.Condition = attrs.field(factory=threading.Condition, init=False)
    activity: dict[str, float] = attrs.field(factory=dict, init=False)
    in_flight: Counter[str] = attrs.field(factory=Counter, init=False)
    _completed: set[str] = attrs.field(factory=set, init=False)

    async def __call__(self, raw_request: Any) -> Any:
        auth = raw_request.headers.get("Authorization", "")
        client = auth.removeprefix("Bearer ").strip() or "anonymous"
        agent = "kopf" if raw_request.headers.get("User-Agent", "").startswith("kopf") else "client"
        watch = raw_request.query.get("watch") in ("true", "1")
        record = Request(
            time.perf_counter(), client, agent, raw_request.method, raw_request.path, watch
        )
        self.requests.append(record)
        if not watch:
            self.activity[client] = record.t0
            self.in_flight[client] += 1
        token = _REQUEST.set((client, raw_request.method, raw_request.path))
        try:
            return await super().__call__(raw_request)
        finally:
            _REQUEST.reset(token)
            record.t1 = time.perf_counter()
            if not watch:
                self.activity[client] = record.t1
                self.in_flight[client] -= 1

    async def _handle(self, request: Any) -> Any:
        # kmock keeps every request it has served and, to route each new one, scans them all
        # through its filters (``request in payload._source`` in ``apps._handle``): a request
        # costs O(requests so far), so the emulator slows down as a run goes on and what runs
        # later looks slower (profiled: 90% of its CPU in a 30 s run). Routing only needs the
        # request itself in the list, so a request leaves it once handled.
        try:
            return await super()._handle(request)
        finally:
            for index, known in enumerate(self._requests):
                if known is request:
                    del self._requests[index]
                    break

    async def _emit(self, kind: Kind, event_type: str, obj: Mapping[str, Any]) -> None:
        now = time.perf_counter()
        client, method, path = _REQUEST.get()
        meta = obj.get("metadata") or {}
        name = str(meta.get("name", ""))
        completed = False
        if kind.kind == "Job" and event_type != "DELETED" and _complete(obj):
            uid = str(meta.get("uid"))
            completed = uid not in self._completed
            self._completed.add(uid)
        owner = name if kind.kind == "RLCycle" else (meta.get("labels") or {}).get(LABEL, "")
        self.writes.append(
            Write(
                now,
                client,
                method,
                path,
                kind.kind,
                event_type,
                name,
                owner,
                path.endswith("/status"),
                completed,
            )
        )
        with self.changed:
            if event_type == "DELETED":
                self.latest.pop((kind.kind, name), None)
            else:
                self.latest[kind.kind, name] = copy.deepcopy(dict(obj))
            self.changed.notify_all()
        await super()._emit(kind, event_type, obj)

    # Read from the bench's thread ---------------------------------------------------------

    def wait(
        self,
        predicate: Callable[[dict[tuple[str, str], dict[str, Any]]], Any],
        what: str,
        timeout: float,
        check: Callable[[], None] = lambda: None,
    ) -> Any:
        """Block until ``predicate(latest objects)`` is truthy (checked on every change)."""
        deadline = time.monotonic() + timeout
        with self.changed:
            while True:
                value = predicate(self.latest)
                if value:
                    return value
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
                check()
                self.changed.wait(min(remaining, 0.5))

    def wait_quiet(
        self, client: str, seconds: float, timeout: float, check: Callable[[], None]
    ) -> None:
        """Until ``client`` has had no request open or started for ``seconds`` (watches aside)."""
        deadline = time.monotonic() + timeout
        while True:
            idle = time.perf_counter() - self.activity.get(client, 0.0)
            if self.in_flight[client] == 0 and idle >= seconds:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{client} did not go quiet for {seconds}s in {timeout:.0f}s")
            check()
            time.sleep(min(0.05, max(0.005, seconds - idle)))

    def watching(self, client: str, plural: str) -> bool:
        return any(
            r.client == client and r.watch and r.path.rstrip("/").endswith(f"/{plural}")
            for r in list(self.requests)
        )


def status_of(latest: Mapping[tuple[str, str], dict[str, Any]], kind: str, name: str) -> Any:
    return (latest.get((kind, name)) or {}).get("status") or {}


# --- processes and RSS ---------------------------------------------------------------------


class Process:
    """A child process in its own session, its output in a log file."""

    def __init__(self, name: str, argv: list[str], env: Mapping[str, str], log: Path) -> None:
        self.name = name
        self.log_path = log
        self._log = log.open("wb")
        self.popen = subprocess.Popen(
            argv,
            env={**os.environ, **env},
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.ps = psutil.Process(self.popen.pid)

    def tree(self) -> list[psutil.Process]:
        with contextlib.suppress(psutil.Error):
            return [self.ps, *self.ps.children(recursive=True)]
        return []

    def rss(self) -> int | None:
        """RSS of the process and its children (bytes); None once it has exited."""
        total, alive = 0, False
        for proc in self.tree():
            with contextlib.suppress(psutil.Error):
                total += proc.memory_info().rss
                alive = True
        return total if alive else None

    def cpu_seconds(self) -> float:
        """User + system CPU of the process and its children so far."""
        total = 0.0
        for proc in self.tree():
            with contextlib.suppress(psutil.Error):
                times = proc.cpu_times()
                total += times.user + times.system
        return total

    def hwm(self) -> int | None:
        """The process's own peak RSS so far (Linux VmHWM)."""
        with contextlib.suppress(OSError), open(f"/proc/{self.popen.pid}/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        return None

    def check(self) -> None:
        code = self.popen.poll()
        if code is not None:
            raise RuntimeError(f"{self.name} exited with {code}:\n{self.tail()}")

    def tail(self, lines: int = 40) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM (kopf stops gracefully), then SIGKILL the process and its children."""
        children = self.tree()[1:]
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)
        for child in children:
            with contextlib.suppress(psutil.Error):
                child.kill()
        self._log.close()


class RssSampler:
    """Samples the RSS of the registered processes every ``interval`` s in a thread."""

    def __init__(self, interval: float = 0.2) -> None:
        self.interval = interval
        self.samples: list[tuple[float, str, int]] = []
        self.processes: dict[str, Process] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            for name, proc in list(self.processes.items()):
                rss = proc.rss()
                if rss is not None:
                    self.samples.append((time.perf_counter(), name, rss))

    def between(self, name: str, start: float, end: float) -> list[int]:
        return [rss for t, n, rss in list(self.samples) if n == name and start <= t <= end]

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(5)


# --- the figures ---------------------------------------------------------------------------


def stats(values: list[float]) -> dict[str, Any]:
    """n, median, p95 (nearest rank) and max, in the unit given."""
    if not values:
        return {"n": 0, "median": None, "p95": None, "max": None}
    ordered = sorted(values)
    p95 = ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]
    return {"n": len(values), "median": statistics.median(ordered), "p95": p95, "max": ordered[-1]}


def _step(job_name: str) -> str:
    return next((s for s in STEPS if f"-{s}-" in job_name), "?")


@dataclass
class Round:
    """One reconcile round of rtrl, from its ``RTRL_ROUND_TRACE`` record."""

    rlcycle: str  # name (the bench's namespace)
    t0: float  # began (before its first read)
    t1: float  # ended (after its last write)
    live: bool  # read the cluster (else the watch cache)
    requests: list[Request]  # the reconciler's requests in [t0, t1]
    marks: dict[str, float]  # the trace's other timestamps (observed, planned, applied)


def read_rounds(em: RecordingEmulator, trace: Path) -> list[Round]:
    """The operator's rounds as it traced them (one JSON line each, time.perf_counter of its
    process: the same clock as the emulator's), with the requests each sent."""
    rounds, lines = [], []
    with contextlib.suppress(OSError):
        lines = trace.read_text().splitlines()
    requests = [r for r in list(em.requests) if r.client == "rtrl" and r.agent == "client"]
    for line in lines:
        with contextlib.suppress(ValueError):
            rec = json.loads(line)
            t0, t1 = float(rec["t0"]), float(rec["t1"])
            mine = [r for r in requests if not r.watch and t0 <= r.t0 <= t1]
            name = str(rec["rlcycle"]).split("/", 1)[-1]
            marks = {k: v for k, v in rec.items() if isinstance(v, float) and k not in ("t0", "t1")}
            rounds.append(Round(name, t0, t1, bool(rec.get("live")), mine, marks))
    return rounds


def rounds_of(rounds: list[Round], rlcycle: str, start: float, end: float) -> list[Round]:
    """rtrl's reconcile rounds of ``rlcycle`` started in [start, end]."""
    return [r for r in rounds if r.rlcycle == rlcycle and start <= r.t0 <= end]


def rtrl_reactions(
    em: RecordingEmulator, rounds: list[Round], start: float, end: float
) -> list[dict[str, Any]]:
    """For each Job completion of rtrl's cycles: ms to the next action (the first write that
    changed something, Events aside, made by a round that began after the completion), to
    the reconciler's first request, and to the start and the end of the round that acted."""
    writes, requests = list(em.writes), list(em.requests)

    def acting(write: float) -> Round | None:
        return next((r for r in rounds if r.t0 <= write <= r.t1), None)

    def saw(write: float, completed: float) -> bool:
        """Whether the round that made a write at ``write`` began after ``completed``: a
        write of a round that began before (one already past its reads, whether live or
        from the cache) is not a reaction to it."""
        current = acting(write)
        return current is not None and current.t0 > completed

    samples = []
    for done in (w for w in writes if w.completed and start <= w.t <= end):
        if done.kind != "Job" or not done.rlcycle:
            continue
        action = next(
            (
                w
                for w in writes
                if w.t > done.t
                and w.client == "rtrl"
                and w.kind != "Event"
                and w.rlcycle in ("", done.rlcycle)
                and saw(w.t, done.t)
            ),
            None,
        )
        if action is None:
            continue
        first = next(
            (
                r.t0
                for r in requests
                if r.t0 > done.t and r.client == "rtrl" and r.agent == "client" and not r.watch
            ),
            action.t,
        )
        current = acting(action.t)
        round_start = None if current is None else current.t0
        round_end = None if current is None else current.t1

        def mark(key: str, current: Round | None = current, since: float = done.t) -> float | None:
            at = None if current is None else current.marks.get(key)
            return None if at is None else (at - since) * 1000

        before = [w.t for w in writes if w.client == "rtrl" and w.t < done.t]
        samples.append(
            {
                "job": done.name,
                "quiet_ms": (done.t - max(before)) * 1000 if before else None,
                "step": _step(done.name),
                "action": f"{action.method} {action.kind}{'/status' if action.status else ''}",
                "object": action.name,
                "next_action_ms": (action.t - done.t) * 1000,
                "first_request_ms": (first - done.t) * 1000,
                "woken_ms": mark("woken"),
                "round_start_ms": None if round_start is None else (round_start - done.t) * 1000,
                "observed_ms": mark("observed"),
                "planned_ms": mark("planned"),
                "round_end_ms": None if round_end is None else (round_end - done.t) * 1000,
                "round_live": None if current is None else current.live,
            }
        )
    return samples


def trigger_reactions(em: RecordingEmulator, start: float, end: float) -> list[float]:
    """ms from each trigger annotation write to the cycle's Checkpoint created."""
    writes = list(em.writes)
    out = []
    for trigger in writes:
        if not (
            start <= trigger.t <= end
            and trigger.client == "bench"
            and trigger.kind == "RLCycle"
            and not trigger.status
            and trigger.event == "MODIFIED"
        ):
            continue
        created = next(
            (
                w
                for w in writes
                if w.t > trigger.t
                and w.client == "rtrl"
                and w.kind == "Checkpoint"
                and w.event == "ADDED"
                and w.rlcycle == trigger.name
            ),
            None,
        )
        if created is not None:
            out.append((created.t - trigger.t) * 1000)
    return out


def noop_reactions(em: RecordingEmulator, start: float, end: float) -> list[float]:
    writes = list(em.writes)
    out = []
    for done in (w for w in writes if w.completed and start <= w.t <= end):
        if not done.name.startswith("noop-"):
            continue
        patched = next(
            (
                w
                for w in writes
                if w.t > done.t and w.client == "noop" and w.kind == "Job" and w.name == done.name
            ),
            None,
        )
        if patched is not None:
            out.append((patched.t - done.t) * 1000)
    return out


def round_anatomy(
    em: RecordingEmulator, rounds: list[Round], rlcycle: str, start: float, end: float
) -> list[dict[str, float]]:
    """rtrl's reconcile rounds of ``rlcycle`` in [start, end]: each from its start to its end;
    how much of that the API server took to answer its requests, whether the round changed
    anything but Events (1.0) or only read (0.0), and whether it read live (1.0)."""
    changes = [w.t for w in list(em.writes) if w.client == "rtrl" and w.kind != "Event"]
    out = []
    for current in rounds_of(rounds, rlcycle, start, end):
        out.append(
            {
                "ms": (current.t1 - current.t0) * 1000,
                "server_ms": sum((q.t1 or 0) - q.t0 for q in current.requests) * 1000,
                "requests": len(current.requests),
                "changed": float(any(current.t0 <= t <= current.t1 for t in changes)),
                "live": float(current.live),
            }
        )
    return out


def request_counts(
    em: RecordingEmulator,
    client: str,
    start: float,
    end: float,
    rounds: list[Round] | None = None,
) -> dict[str, int]:
    """The requests ``client`` sent in [start, end), keyed "agent verb", plus totals, and
    the reconcile rounds begun in that window (of any RLCycle) and how many read live."""
    counts: Counter[str] = Counter()
    for r in list(em.requests):
        if r.client != client or not start <= r.t0 < end:
            continue
        counts[f"{r.agent} {r.verb}"] += 1
        counts["watch streams" if r.watch else f"{r.agent} total"] += 1
    for current in rounds or ():
        if start <= current.t0 < end:
            counts["rounds"] += 1
            counts["rounds live"] += current.live
    counts["total"] = sum(
        v for k, v in counts.items() if k.endswith(" total") or k == "watch streams"
    )
    return dict(counts)


# --- the world -----------------------------------------------------------------------------


def kubeconfig(path: Path, url: str, token: str) -> Path:
    write_kubeconfig(path, url, NAMESPACE)
    doc = yaml.safe_load(path.read_text())
    doc["users"][0]["user"]["token"] = token
    path.write_text(yaml.safe_dump(doc))
    return path


def noop_job(index: int) -> dict[str, Any]:
    container = {"name": "main", "image": "unused", "command": ["true"]}
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": f"noop-{index}", "labels": {NOOP_LABEL: "noop"}},
        "spec": {
            "backoffLimit": 0,
            "template": {"spec": {"restartPolicy": "Never", "containers": [container]}},
        },
    }


def idle_world(root: Path, name: str) -> list[dict[str, Any]]:
    """A Deployment, its base Checkpoint and an RLCycle whose cron schedule is not due."""
    uri = (root / "models" / name).as_uri() + "/"
    dep = deployment(root, serving_uri=uri)
    dep["metadata"]["name"] = f"{name}-vllm"
    dep["spec"]["template"]["spec"]["containers"][0]["env"][1]["value"] = f"{name}-0"
    ckpt = base_checkpoint(root)
    ckpt["metadata"]["name"] = f"{name}-0"
    ckpt["metadata"].setdefault("labels", {})[LABEL] = name
    ckpt["spec"]["uri"] = uri
    rlc = rlcycle(root, schedule={"cron": CRON})
    rlc["metadata"]["name"] = name
    rlc["spec"]["target"]["deployment"] = f"{name}-vllm"
    return [dep, ckpt, rlc]


class Bench:
    def __init__(self, args: argparse.Namespace, stack: contextlib.ExitStack) -> None:
        self.args = args
        self.stack = stack
        self.tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="rtrl-bench-op-")))
        self.em = RecordingEmulator(crd_documents=load_crds([*PROJECT_CRDS, KOPF_PEERING_CRDS]))
        server = stack.enter_context(EmulatorServer(self.em))  # stopped last
        self.url = server.url
        config = kubeconfig(self.tmp / "kubeconfig-bench", self.url, "bench")
        api_client = kubernetes.config.new_client_from_config(config_file=os.fspath(config))
        stack.callback(api_client.close)
        dynamic = DynamicClient(api_client, cache_file=os.fspath(self.tmp / "discovery.json"))
        self.api = KubeAPI(self.url, config, NAMESPACE, api_client, dynamic, self.em)
        self.runner = JobRunner(self.api, self.tmp / "jobs")
        for step in STEPS:
            hook = commit_result(step, RESULTS[step], self.tmp / "results")
            self.runner.script(f"*-{step}-*", Succeed(before=hook))
        self.runner.script("noop-*", Succeed())
        stack.enter_context(self.runner)  # stopped after the operators, before the API
        self.sampler = stack.enter_context(RssSampler())
        self.processes: list[Process] = []
        self.trace = self.tmp / "rtrl-rounds.jsonl"  # RTRL_ROUND_TRACE of the operator

    def start(self, name: str, argv: list[str], env: Mapping[str, str] | None = None) -> Process:
        config = kubeconfig(self.tmp / f"kubeconfig-{name}", self.url, name)
        log = self.tmp / f"{name}-{len(self.processes)}.log"
        proc = Process(name, argv, {"KUBECONFIG": os.fspath(config), **(env or {})}, log)
        self.processes.append(proc)
        self.stack.callback(proc.stop)  # stopped before the job runner and the API
        self.sampler.processes[name] = proc
        return proc

    def check(self) -> None:
        """Fail at once if an operator that should be running has exited."""
        for proc in list(self.sampler.processes.values()):
            proc.check()

    def stop(self, proc: Process) -> None:
        self.sampler.processes.pop(proc.name, None)
        proc.stop()

    def start_noop(self) -> Process:
        proc = self.start(
            "noop",
            [os.fspath(BIN / "kopf"), "run", "--standalone", "-n", NAMESPACE, os.fspath(NOOP)],
        )
        self.em.wait(
            lambda _: self.em.watching("noop", "jobs") and self.em.watching("noop", "rlcycles"),
            "the no-op operator's watches",
            60,
            proc.check,
        )
        return proc

    # phases ------------------------------------------------------------------------------

    def baseline_latency(self, samples: int) -> dict[str, Any]:
        proc = self.start_noop()
        start = time.perf_counter()
        for i in range(samples):
            self.api.create(noop_job(i))
            self.em.wait(
                lambda latest, i=i: status_of(latest, "Job", f"noop-{i}").get("noopSeen"),
                f"the no-op's status patch of noop-{i}",
                30,
                self.check,
            )
            self.em.wait_quiet("noop", 0.2, 30, self.check)
        end = time.perf_counter()
        result = {
            "latency_ms": stats(noop_reactions(self.em, start, end)),
            "requests": request_counts(self.em, "noop", start, end),
            "samples": samples,
        }
        self.stop(proc)
        for i in range(samples):
            self.api.delete("batch/v1", "Job", f"noop-{i}")
        return result

    def deployment_controller(self) -> contextlib.AbstractContextManager[Any]:
        """The stand-in for the Deployment controller (canary Deployments get ready); it
        polls every Deployment, so only while cycles run."""
        return DeploymentController(self.api)

    def rtrl_cycles(self, cycles: int) -> tuple[Process, dict[str, Any]]:
        root = self.tmp / "world"
        self.api.create(deployment(root))
        self.api.create(base_checkpoint(root))
        self.api.create(rlcycle(root, schedule={"cron": CRON}))
        env = {"RTRL_RESYNC_SECONDS": str(self.args.resync), "RTRL_ROUND_TRACE": str(self.trace),
               **OPEN_POLICY_ENV}  # fmt: skip
        started = time.perf_counter()
        proc = self.start(
            "rtrl",
            [os.fspath(BIN / "rtrl"), *RTRL_OPERATOR],
            env,
        )
        self.em.wait(
            lambda latest: status_of(latest, "RLCycle", NAME).get("phase") == "Idle",
            "the RLCycle's first status",
            60,
            self.check,
        )
        first_status_s = time.perf_counter() - started
        self.em.wait_quiet("rtrl", self.args.quiet, 60, self.check)
        windows, walls, ended = [], [], []
        cpu0 = proc.cpu_seconds()
        for i in range(1, cycles + 1):
            value = f"bench-{i}"
            start = time.perf_counter()
            trigger = {"metadata": {"annotations": {"rtrl.io/trigger": value}}}
            self.api.patch(RTRL, "RLCycle", NAME, trigger)

            def done(latest: Any, i: int = i, value: str = value) -> str | None:
                st = status_of(latest, "RLCycle", NAME)
                phase = status_of(latest, "Checkpoint", f"{NAME}-{i}").get("phase")
                ended = st.get("phase") == "Idle" and st.get("lastTrigger") == value
                return phase if ended and phase in FINISHED else None

            ended.append(self.em.wait(done, f"cycle {i} to end (RLCycle Idle)", 120, self.check))
            walls.append((time.perf_counter() - start) * 1000)
            self.em.wait_quiet("rtrl", self.args.quiet, 60, self.check)
            windows.append((start, time.perf_counter()))
        first, last = windows[0][0], windows[-1][1]
        cpu_per_cycle_ms = (proc.cpu_seconds() - cpu0) / cycles * 1000
        rounds = read_rounds(self.em, self.trace)
        per_cycle = [request_counts(self.em, "rtrl", a, b, rounds) for a, b in windows]
        keys = sorted({k for counts in per_cycle for k in counts})
        reactions = rtrl_reactions(self.em, rounds, first, last)
        by_step = {
            step: stats([s["next_action_ms"] for s in reactions if s["step"] == step])
            for step in STEPS
        }
        anatomy = round_anatomy(self.em, rounds, NAME, first, last)
        return proc, {
            "first_status_s": first_status_s,
            "cycles_ended": dict(Counter(ended)),
            "jobs_per_cycle": len(reactions) / cycles,
            "round_ms": stats([a["ms"] for a in anatomy]),
            "round_server_ms": stats([a["server_ms"] for a in anatomy]),
            "round_requests": stats([a["requests"] for a in anatomy]),
            "rounds_without_change": sum(1 for a in anatomy if not a["changed"]),
            "rounds_live": sum(1 for a in anatomy if a["live"]),
            "rounds_timed": len(anatomy),
            "request_server_ms": stats(
                [
                    ((r.t1 or 0) - r.t0) * 1000
                    for r in list(self.em.requests)
                    if r.client == "rtrl" and not r.watch and r.t1 and first <= r.t0 < last
                ]
            ),
            "cycle_wall_ms": stats(walls),
            "latency_ms": stats([s["next_action_ms"] for s in reactions]),
            "first_request_ms": stats([s["first_request_ms"] for s in reactions]),
            **{
                key: stats([s[key] for s in reactions if s[key] is not None])
                for key in ("woken_ms", "round_start_ms", "observed_ms", "planned_ms")
            },
            "round_end_ms": stats([s["round_end_ms"] for s in reactions if s["round_end_ms"]]),
            "acted_live": sum(1 for s in reactions if s["round_live"]),
            "by_step_ms": by_step,
            "trigger_to_checkpoint_ms": stats(trigger_reactions(self.em, first, last)),
            "requests_per_cycle": {
                key: {
                    "mean": statistics.mean(c.get(key, 0) for c in per_cycle),
                    "min": min(c.get(key, 0) for c in per_cycle),
                    "max": max(c.get(key, 0) for c in per_cycle),
                }
                for key in keys
            },
            "requests_total": request_counts(self.em, "rtrl", first, last, rounds),
            "rounds": [
                {**asdict(r), "requests": len(r.requests)} for r in rounds if first <= r.t0 <= last
            ],
            "completions": [
                asdict(w) for w in list(self.em.writes) if w.completed and first <= w.t <= last
            ],
            "reactions": reactions,
            "rss_after_cycles_bytes": proc.rss(),
            "cpu_per_cycle_ms": cpu_per_cycle_ms,
        }

    def idle_rss(self, rtrl: Process, count: int) -> dict[str, Any]:
        root = self.tmp / "idle"
        names = [f"idle-{k:03d}" for k in range(count)]
        start = time.perf_counter()
        for name in names:
            for obj in idle_world(root, name):
                self.api.create(obj)
        created_s = time.perf_counter() - start

        def all_idle(latest: Any) -> bool:
            phases = (status_of(latest, "RLCycle", n).get("phase") for n in names)
            return all(p in ("Idle", "Suspended") for p in phases)

        self.em.wait(all_idle, f"{count} RLCycles Idle", 60 + count, self.check)
        idle_after_s = time.perf_counter() - start
        noop = self.start_noop()
        time.sleep(self.args.settle)
        window = self.args.idle_seconds
        if window is None:
            window = self.args.resync + 5.0
        w0, cpu0 = time.perf_counter(), rtrl.cpu_seconds()
        deadline = w0 + window
        while time.perf_counter() < deadline:
            self.check()
            time.sleep(min(0.5, max(0.0, deadline - time.perf_counter())))
        w1, cpu1 = time.perf_counter(), rtrl.cpu_seconds()
        rtrl_rss = self.sampler.between("rtrl", w0, w1)
        noop_rss = self.sampler.between("noop", w0, w1)
        requests = request_counts(self.em, "rtrl", w0, w1, read_rounds(self.em, self.trace))
        hwm = rtrl.hwm()
        result = {
            "rlcycles": count,
            "created_s": created_s,
            "all_idle_after_s": idle_after_s,
            "window_s": w1 - w0,
            "rtrl_steady_bytes": statistics.median(rtrl_rss) if rtrl_rss else None,
            "rtrl_window_max_bytes": max(rtrl_rss) if rtrl_rss else None,
            "rtrl_peak_bytes": max(
                hwm or 0, *(rss for _, n, rss in self.sampler.samples if n == "rtrl")
            ),
            "noop_steady_bytes": statistics.median(noop_rss) if noop_rss else None,
            "noop_window_max_bytes": max(noop_rss) if noop_rss else None,
            "idle_requests": requests,
            "idle_requests_per_s": requests.get("total", 0) / (w1 - w0),
            "idle_rounds": requests.get("rounds", 0),
            "idle_cpu_percent": (cpu1 - cpu0) / (w1 - w0) * 100,
        }
        self.stop(noop)
        return result


# --- output --------------------------------------------------------------------------------


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _mb(value: float | None) -> str:
    return "-" if value is None else f"{value / MB:,.0f}"


def render(result: dict[str, Any]) -> str:
    r, b, i = result["rtrl"], result["baseline"], result["idle"]
    steps = ", ".join(STEPS)
    ended = ", ".join(f"{n} {phase}" for phase, n in r["cycles_ended"].items())
    lines = [
        f"emulated API server in the bench process, Jobs played by the JobRunner (all steps "
        f"succeed at once); {result['cpus']} CPUs; RTRL_RESYNC_SECONDS={result['resync']}",
        f"rtrl: {result['cycles']} cycles of {r['jobs_per_cycle']:.0f} Jobs ({steps}), ended "
        f"{ended}; first status {r['first_status_s']:.1f} s "
        f"after start; a cycle (trigger -> Idle) takes median "
        f"{_ms(r['cycle_wall_ms']['median'])} ms, the operator's CPU per cycle "
        f"{_ms(r['cpu_per_cycle_ms'])} ms",
        "",
        f"{'latency (ms)':62}{'n':>4}{'median':>9}{'p95':>9}{'max':>9}",
    ]

    def row(label: str, s: dict[str, Any]) -> None:
        lines.append(
            f"{label:62}{s['n']:>4}{_ms(s['median']):>9}{_ms(s['p95']):>9}{_ms(s['max']):>9}"
        )

    row("rtrl: Job complete -> next action", r["latency_ms"])
    for step in STEPS:
        actions = Counter(s["action"] for s in r["reactions"] if s["step"] == step)
        row(f"  after {step} ({', '.join(actions)})", r["by_step_ms"][step])
    row("  Job complete -> reconciler's first request", r["first_request_ms"])
    row("  Job complete -> its reconciler woken (Job index handler)", r["woken_ms"])
    row("  Job complete -> start of the round that acted", r["round_start_ms"])
    row("  Job complete -> that round observed (cache, step result)", r["observed_ms"])
    row("  Job complete -> that round planned", r["planned_ms"])
    row("  Job complete -> end of the round that acted", r["round_end_ms"])
    row("  a reconcile round (start -> end)", r["round_ms"])
    row("    of which the API server answering its requests", r["round_server_ms"])
    lines.append(
        f"  ({r['rounds_without_change']} of these {r['rounds_timed']} rounds changed nothing, "
        f"{r['rounds_live']} read live, the others the watch cache; a round sends median "
        f"{r['round_requests']['median']:.0f} requests; {r['acted_live']} of the "
        f"{len(r['reactions'])} acting rounds read live)"
    )
    row("  one request of rtrl, as the API server took it", r["request_server_ms"])
    row("rtrl: trigger -> Checkpoint created", r["trigger_to_checkpoint_ms"])
    row("kopf no-op: Job complete -> its status patch", b["latency_ms"])
    ratio = result["latency_ratio"]
    p95_ratio = result["latency_ratio_p95"]
    lines.append(
        f"ratio rtrl / no-op: median {ratio:.2f}x, p95 {p95_ratio:.2f}x"
        if ratio is not None and p95_ratio is not None
        else "ratio rtrl / no-op: -"
    )
    lines += ["", f"{'API requests per cycle (rtrl process)':62}{'mean':>9}{'min':>9}{'max':>9}"]
    per = r["requests_per_cycle"]
    order = ["total", "client total", "rounds", "rounds live"]
    order += sorted(k for k in per if k.startswith("client ") and k != "client total")
    order += ["kopf total", *sorted(k for k in per if k.startswith("kopf ") and k != "kopf total")]
    order += ["watch streams"]
    labels = {
        "total": "all requests",
        "client total": "reconciler (KubeClient)",
        "rounds": "  reconcile rounds",
        "rounds live": "    of which read live",
        "kopf total": "kopf's own",
        "watch streams": "watch streams opened",
    }
    for key in order:
        if key not in per:
            continue
        label = labels[key] if key in labels else "  " + key.split(" ", 1)[1]
        s = per[key]
        lines.append(f"{label:62}{s['mean']:>9.1f}{s['min']:>9}{s['max']:>9}")
    idle_label = f"rtrl, {i['rlcycles']} idle RLCycles"
    lines += [
        "",
        f"{'RSS (MB)':62}{'steady':>9}{'max':>9}{'peak':>9}",
        f"{'rtrl, 1 RLCycle, after the cycles':62}{_mb(r['rss_after_cycles_bytes']):>9}",
        f"{idle_label:62}{_mb(i['rtrl_steady_bytes']):>9}"
        f"{_mb(i['rtrl_window_max_bytes']):>9}{_mb(i['rtrl_peak_bytes']):>9}",
        f"{'kopf no-op, watching the same RLCycles':62}{_mb(i['noop_steady_bytes']):>9}"
        f"{_mb(i['noop_window_max_bytes']):>9}",
        f"(steady: median over {i['window_s']:.0f} s once all were Idle; max: in that window; "
        "peak: VmHWM over the whole run)",
        f"{i['rlcycles']} RLCycles created in {i['created_s']:.1f} s, all Idle "
        f"{i['all_idle_after_s']:.1f} s after the first create; idle API load "
        f"{i['idle_requests_per_s']:.1f} req/s ({i['idle_rounds']} rounds in "
        f"{i['window_s']:.0f} s), operator CPU {i['idle_cpu_percent']:.1f}%",
        "",
    ]
    lines += [
        f"{v['goal']}: {'met' if v['met'] else 'NOT met'} ({v['figures']})"
        for v in result["verdicts"]
    ]
    return "\n".join(lines)


def verdicts(result: dict[str, Any]) -> list[dict[str, Any]]:
    median, p95 = result["rtrl"]["latency_ms"]["median"], result["rtrl"]["latency_ms"]["p95"]
    base = result["baseline"]["latency_ms"]["median"]
    ratio = result["latency_ratio"]
    idle = result["idle"]
    steady, peak = idle["rtrl_steady_bytes"], idle["rtrl_peak_bytes"]
    return [
        {
            "goal": "median latency under 1 s",
            "met": median is not None and median < 1000,
            "figures": f"median {_ms(median)} ms, p95 {_ms(p95)} ms",
        },
        {
            "goal": "median latency within 2x of the kopf no-op baseline",
            "met": ratio is not None and ratio <= 2.0,
            "figures": f"{_ms(median)} ms vs {_ms(base)} ms: "
            + ("-" if ratio is None else f"{ratio:.2f}x"),
        },
        {
            "goal": f"RSS with {idle['rlcycles']} idle RLCycles under 200 MB",
            "met": steady is not None and peak is not None and max(steady, peak) < 200 * MB,
            "figures": f"steady {_mb(steady)} MB, peak {_mb(peak)} MB",
        },
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=10, help="rtrl cycles timed (3 Jobs each)")
    parser.add_argument("--rlcycles", type=int, default=100, help="idle RLCycles for the RSS")
    parser.add_argument(
        "--baseline-samples", type=int, help="no-op Job completions (default: 3 x --cycles)"
    )
    parser.add_argument("--resync", type=float, default=30.0, help="RTRL_RESYNC_SECONDS")
    parser.add_argument(
        "--idle-seconds", type=float, help="RSS sampling window (default: --resync + 5)"
    )
    parser.add_argument("--settle", type=float, default=3.0, help="wait before sampling RSS")
    parser.add_argument(
        "--quiet", type=float, default=0.5, help="operator silence that ends a cycle's window"
    )
    parser.add_argument("--quick", action="store_true", help="2 cycles, 10 RLCycles, 5 s idle")
    parser.add_argument("--json", type=Path, metavar="OUT", help="also write the figures here")
    args = parser.parse_args(argv)
    if args.quick:
        args.cycles, args.rlcycles = 2, 10
        if args.idle_seconds is None:
            args.idle_seconds = 5.0
    samples = args.baseline_samples or 3 * args.cycles

    # SIGTERM unwinds like Ctrl-C: the operators, the job runner and the API are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        bench = Bench(args, stack)
        try:
            baseline = bench.baseline_latency(samples)
            with bench.deployment_controller():
                rtrl, cycles = bench.rtrl_cycles(args.cycles)
            idle = bench.idle_rss(rtrl, args.rlcycles)
        except Exception:
            for proc in bench.processes:
                print(f"--- {proc.name} log (tail) ---\n{proc.tail()}", file=sys.stderr)
            raise
    rtrl_median = cycles["latency_ms"]["median"]
    base_median = baseline["latency_ms"]["median"]
    result: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "resync": args.resync,
        "cycles": args.cycles,
        "rtrl": cycles,
        "baseline": baseline,
        "idle": idle,
        "latency_ratio": rtrl_median / base_median if rtrl_median and base_median else None,
        "latency_ratio_p95": (
            cycles["latency_ms"]["p95"] / baseline["latency_ms"]["p95"]
            if cycles["latency_ms"]["p95"] and baseline["latency_ms"]["p95"]
            else None
        ),
        "seconds": time.monotonic() - started,
    }
    result["verdicts"] = verdicts(result)
    print(render(result))
    print(f"\n(run took {result['seconds']:.0f} s)")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, default=_jsonable))
    return 0


def _jsonable(obj: Any) -> Any:
    if hasattr(obj, "__dataclass_fields__"):
        return asdict(obj)
    raise TypeError(f"not JSON serialisable: {type(obj)}")


if __name__ == "__main__":
    sys.exit(main())
