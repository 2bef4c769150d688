"""The operator at scale on the real control plane: RSS, idle API load, the reaction to a
Job's completion and history pruning, with 100 and then 1,000 RLCycles of 10 Checkpoints
each (10,000 Checkpoints at 1,000), and how each figure grows between the two.

Everything is real but the kubelet: etcd, kube-apiserver and kube-controller-manager from
``rtrl_localkube.controlplane`` (``make controlplane``), the chart installed with helm, and
``rtrl operator`` as its own process with the chart's ServiceAccount token
(``rtrl_localkube.tools.OperatorProcess``) and the operator's default settings
(``RTRL_RESYNC_SECONDS`` 30 s, ``RTRL_LIVE_READ_SECONDS`` its default). Pods are run by the
kubelet stand-in, every step scripted to succeed at once with a canned result
(``cycle_world.commit_result``), as the e2e suites do.

The world, in one namespace (the worst case: a round sees every Checkpoint of its
namespace): per RLCycle ``sNNNN``, its inference Deployment (0 replicas: no pods), its base
Checkpoint ``sNNNN-0`` (the one the Deployment serves) and 9 finished Checkpoints of earlier
cycles (phase Superseded), and the RLCycle, on a cron schedule that is never due during a run
(``0 0 1 1 *``) and ``historyLimit: 10``.

How each figure is counted:

- requests: the API server's audit log (``--audit-policy-file``, level Metadata, only the
  operator's ServiceAccount), so every request the operator process sends (its reconcilers'
  and kopf's own) is counted where it arrives, with the server's timestamps. Watches are
  counted apart (a watch stream is re-opened when the server ends it, every 300 s per kind).
- startup: an operator is started once to meet the new RLCycles (each gets its first round
  and status), then stopped; the one measured is a restart with the fleet in place (as after
  an upgrade or a crash): from its start until every RLCycle has had a reconcile round (its
  ``RTRL_ROUND_TRACE``), and the requests sent meanwhile.
- idle: once every RLCycle has had a round (and ``--settle`` s more), a window of
  ``--idle-seconds`` (default 60): RSS of the process (psutil, every 0.5 s; median = steady,
  and max), its CPU, the requests it sent per second (goal: 0 besides watches), and the
  reconcile rounds run (the resync, from the watch cache).
- reaction: ``--reactions`` cycles, one after the other, each on an RLCycle of its own
  (triggered with the ``rtrl.io/trigger`` annotation; stage and train succeed, eval fails, so
  the cycle ends Rejected after 3 Jobs). For each Job: from the moment the bench's watch of
  Jobs receives it with a ``Complete`` condition (set by the real Job controller once the
  kubelet's pod succeeded) to the end of the operator's next write for that RLCycle (a Job,
  Checkpoint or RLCycle written; Events aside) in the audit log: median, p90, max.
- pruning: ``historyLimit`` of ``--prune`` RLCycles patched from 10 to 3 at once; per
  RLCycle, from the patch to the operator's last Checkpoint delete that brought it to 3
  (the audit log), and the number of Checkpoints left (checked by listing).

The machine has 2 cores shared with other work: the figures are noisy; the ratios are the
point. Hold ``flock /tmp/rtrl-e2e.lock`` while it runs (ports and CPU).

    flock /tmp/rtrl-e2e.lock .venv/bin/python bench/scale.py [--sizes 100,1000]
        [--idle-seconds 60] [--reactions 4] [--prune 20] [--json OUT]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from datetime import datetime
from pathlib import Path
from typing import Any

import kubernetes
import psutil

from rtrl.kube.client import KubeClient
from rtrl_localkube.controlplane import ControlPlane
from rtrl_localkube.controlplane_setup import REPO, binaries_dir
from rtrl_localkube.cycle_world import (
    EVAL_FAIL,
    RESULTS,
    base_checkpoint,
    commit_result,
    deployment,
    rlcycle,
)
from rtrl_localkube.kubelet import Kubelet
from rtrl_localkube.outcomes import Succeed
from rtrl_localkube.tools import Cli, OperatorProcess

MB = 1_000_000
NAMESPACE = "scale"
RELEASE, RELEASE_NAMESPACE = "rtrl", "rtrl-system"
CRON = "0 0 1 1 *"  # next 1 January: never due during a run
OWNED = 9  # finished Checkpoints of earlier cycles per RLCycle (and the base one: 10)
HISTORY_LIMIT = 10
PRUNED_TO = 3
LABEL = "rtrl.io/rlcycle"
RTRL = "rtrl.io/v1alpha1"
WRITE_VERBS = frozenset({"create", "update", "patch", "delete"})
AUDIT_POLICY = f"""\
apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
  - level: Metadata
    userGroups: ["system:serviceaccounts:{RELEASE_NAMESPACE}"]
  - level: None
"""


def name_of(index: int) -> str:
    return f"s{index:04d}"


# --- the world -----------------------------------------------------------------------------


def world(root: Path, index: int) -> list[dict[str, Any]]:
    """One RLCycle's objects, in creation order; Checkpoints' statuses are set apart."""
    name = name_of(index)
    uri = (root / "models" / name).as_uri() + "/"
    dep = deployment(root, serving_uri=uri)
    dep["metadata"]["name"] = f"{name}-vllm"
    dep["spec"]["replicas"] = 0
    dep["spec"]["template"]["spec"]["containers"][0]["env"][1]["value"] = f"{name}-0"
    base = base_checkpoint(root)
    base["metadata"] = {"name": f"{name}-0", "labels": {LABEL: name}}
    base["spec"]["uri"] = uri
    objects = [dep, base]
    for cycle in range(1, OWNED + 1):
        objects.append(
            {
                "apiVersion": RTRL,
                "kind": "Checkpoint",
                "metadata": {"name": f"{name}-{cycle}", "labels": {LABEL: name}},
                "spec": {
                    "uri": (root / "artifacts" / name / f"c{cycle}").as_uri() + "/",
                    "parent": f"{name}-{cycle - 1}",
                    "rlCycle": name,
                    "cycle": cycle,
                },
            }
        )
    rlc = rlcycle(root / name, schedule={"cron": CRON}, historyLimit=HISTORY_LIMIT)
    rlc["metadata"]["name"] = name
    rlc["spec"]["target"]["deployment"] = f"{name}-vllm"
    rlc["spec"]["eval"] = {
        "suites": ["replay"],
        "gates": [{"metric": "replay.kl", "maxRegression": 5}],
    }
    objects.append(rlc)
    return objects


SUPERSEDED = {"phase": "Superseded", "reason": "Superseded", "message": "bench history"}


def create_world(client: KubeClient, root: Path, indexes: Iterable[int], workers: int = 8) -> float:
    """Create the RLCycles ``indexes`` (each with its Deployment and Checkpoints); seconds."""
    started = time.monotonic()

    def one(index: int) -> None:
        for obj in world(root, index):
            obj["metadata"]["namespace"] = NAMESPACE
            client.create(obj)
            owned = obj["kind"] == "Checkpoint" and obj["spec"].get("rlCycle")
            if owned:
                client.patch(
                    "Checkpoint",
                    NAMESPACE,
                    obj["metadata"]["name"],
                    {"status": SUPERSEDED},
                    sub="status",
                )

    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        for future in [pool.submit(one, i) for i in indexes]:
            future.result()
    return time.monotonic() - started


# --- the audit log -------------------------------------------------------------------------


def _ts(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


class Audit:
    """The operator's requests, read from the API server's audit log (one JSON per line)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.entries: list[dict[str, Any]] = []

    def read(self) -> list[dict[str, Any]]:
        with contextlib.suppress(FileNotFoundError), self.path.open("rb") as f:
            f.seek(self.offset)
            data = f.read()
            end = data.rfind(b"\n") + 1
            self.offset += end
            for line in data[:end].splitlines():
                with contextlib.suppress(ValueError):
                    event = json.loads(line)
                    ref = event.get("objectRef") or {}
                    watch = event.get("verb") == "watch"
                    # a watch logs ResponseStarted (when it opens) and ResponseComplete
                    if event.get("stage") != ("ResponseStarted" if watch else "ResponseComplete"):
                        continue
                    self.entries.append(
                        {
                            "verb": event.get("verb"),
                            "resource": ref.get("resource", event.get("requestURI", "")),
                            "sub": ref.get("subresource", ""),
                            "name": ref.get("name", ""),
                            "received": _ts(event["requestReceivedTimestamp"]),
                            "done": _ts(event["stageTimestamp"]),
                            "code": (event.get("responseStatus") or {}).get("code"),
                        }
                    )
        return self.entries

    def between(self, start: float, end: float) -> list[dict[str, Any]]:
        return [e for e in self.read() if start <= e["received"] < end]


def count(entries: list[dict[str, Any]]) -> dict[str, int]:
    """Requests by "verb resource[/sub]", watches apart, plus totals."""
    counts: Counter[str] = Counter()
    for e in entries:
        resource = e["resource"] + (f"/{e['sub']}" if e["sub"] else "")
        counts[f"{e['verb']} {resource}"] += 1
        counts["watches" if e["verb"] == "watch" else "requests"] += 1
    return dict(counts)


# --- figures -------------------------------------------------------------------------------


def stats(values: list[float]) -> dict[str, Any]:
    """n, median, p90 (nearest rank) and max."""
    if not values:
        return {"n": 0, "median": None, "p90": None, "max": None}
    ordered = sorted(values)
    p90 = ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]
    return {"n": len(ordered), "median": statistics.median(ordered), "p90": p90, "max": ordered[-1]}


def rss_tree(pid: int) -> int | None:
    with contextlib.suppress(psutil.Error):
        proc = psutil.Process(pid)
        return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)])
    return None


def cpu_seconds(pid: int) -> float:
    with contextlib.suppress(psutil.Error):
        t = psutil.Process(pid).cpu_times()
        return float(t.user + t.system)
    return 0.0


def rounds(trace: Path) -> list[dict[str, Any]]:
    out = []
    with contextlib.suppress(OSError):
        for line in trace.read_text().splitlines():
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
    return out


class JobWatch:
    """The bench's own watch of the namespace's Jobs: when each was first seen Complete."""

    def __init__(self, cp: ControlPlane) -> None:
        self.cp = cp
        self.completed: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="job-watch", daemon=True)

    def _run(self) -> None:
        path = f"/apis/batch/v1/namespaces/{NAMESPACE}/jobs"
        rv = str(self.cp.request("GET", path)["metadata"]["resourceVersion"])
        while not self._stop.is_set():
            with contextlib.suppress(Exception):
                for event in self.cp.watch(path, rv, timeout_seconds=60):
                    obj = event.get("object") or {}
                    rv = (obj.get("metadata") or {}).get("resourceVersion", rv)
                    if event.get("type") == "ERROR":
                        rv = str(self.cp.request("GET", path)["metadata"]["resourceVersion"])
                        break
                    conditions = (obj.get("status") or {}).get("conditions") or []
                    name = obj.get("metadata", {}).get("name", "")
                    complete = any(
                        c.get("type") == "Complete" and c.get("status") == "True"
                        for c in conditions
                    )
                    if complete and name not in self.completed:
                        self.completed[name] = time.time()

    def __enter__(self) -> JobWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()


# --- the run -------------------------------------------------------------------------------


class Scale:
    def __init__(self, args: argparse.Namespace, tmp: Path, cp: ControlPlane) -> None:
        self.args = args
        self.tmp = tmp
        self.cp = cp
        self.root = tmp / "store"
        api_client = kubernetes.config.new_client_from_config(
            config_file=os.fspath(cp.admin_kubeconfig)
        )
        api_client.configuration.connection_pool_maxsize = 16
        api_client.rest_client.pool_manager.connection_pool_kw["maxsize"] = 16
        self.client = KubeClient(api_client)
        self.audit = Audit(tmp / "audit.log")
        self.created = 0
        self.service_account = self.install()

    def install(self) -> str:
        (self.tmp / "helm").mkdir()
        cli = Cli(self.cp.kubeconfig(self.tmp / "helm" / "admin.kubeconfig"))
        cli.helm(
            "install",
            RELEASE,
            os.fspath(REPO / "charts" / "rtrl-operator"),
            "-n",
            RELEASE_NAMESPACE,
            "--create-namespace",
        )
        cli.kubectl(
            "wait",
            "--for=condition=Established",
            "crd/rlcycles.rtrl.io",
            "crd/checkpoints.rtrl.io",
            "--timeout=60s",
        )
        cli.kubectl("create", "namespace", NAMESPACE)
        accounts = cli.get(
            "serviceaccounts",
            "-n",
            RELEASE_NAMESPACE,
            "-l",
            f"app.kubernetes.io/instance={RELEASE}",
        )["items"]
        return str(accounts[0]["metadata"]["name"])

    def grow(self, size: int) -> float:
        seconds = create_world(self.client, self.root, range(self.created, size))
        self.created = size
        return seconds

    def operator(self, label: str, src: Path | None = None) -> tuple[OperatorProcess, Path]:
        trace = self.tmp / f"rounds-{label}.jsonl"
        env = {
            "RTRL_RESYNC_SECONDS": str(self.args.resync),
            "RTRL_ERROR_BACKOFF_SECONDS": "5",
            "RTRL_ROUND_TRACE": os.fspath(trace),
        }
        src = src or self.args.operator_src
        if src:  # e.g. an earlier commit's src/, for a before/after
            env["PYTHONPATH"] = os.fspath(src)
        proc = OperatorProcess(
            self.cp,
            self.tmp / f"operator-{label}",
            service_account=(RELEASE_NAMESPACE, self.service_account),
            args=["--namespace", NAMESPACE, "--standalone", "--liveness", "none"],
            env=env,
        )
        return proc, trace

    def variants(self) -> list[tuple[str, Path | None]]:
        """The operators measured on each world: with ``--baseline-src``, that one
        ("before") and then this checkout's ("after"), on the same world and machine."""
        if self.args.baseline_src:
            return [("before", self.args.baseline_src), ("after", self.args.operator_src)]
        return [("", self.args.operator_src)]

    def measure(self, size: int) -> list[dict[str, Any]]:
        print(f"--- {size} RLCycles: creating ...", flush=True)
        created_s = self.grow(size)
        names = [name_of(i) for i in range(size)]
        print(f"    created in {created_s:.0f} s; starting the operator", flush=True)
        if self.args.restart:
            # A first operator meets the new RLCycles (one live round each, a status written);
            # the one measured starts with a fleet that exists, as after an upgrade or a crash.
            first, first_trace = self.operator(f"{size}-first")
            try:
                self.wait_rounds(first, first_trace, set(names), time.perf_counter())
            finally:
                first.stop()
        variants = self.variants()
        r, p, n = self.args.reactions, self.args.prune, len(names)
        runs = []
        for k, (label, src) in enumerate(variants):
            # each operator reacts to and prunes RLCycles of its own
            reacting = names[n - (k + 1) * r : n - k * r]
            pruned = names[n - len(variants) * r - (k + 1) * p : n - len(variants) * r - k * p]
            run = self.measure_operator(
                size, names, label=label, src=src, reacting=reacting, pruned=pruned
            )
            runs.append({**run, "created_s": created_s})
        return runs

    def measure_operator(
        self,
        size: int,
        names: list[str],
        *,
        label: str,
        src: Path | None,
        reacting: list[str],
        pruned: list[str],
    ) -> dict[str, Any]:
        print(f"    operator {label or 'measured'} ({src or 'this checkout'})", flush=True)
        started_wall, started = time.time(), time.perf_counter()
        operator, trace = self.operator(f"{size}{'-' + label if label else ''}", src)
        pid = operator.proc.pid
        load = {"start": os.getloadavg()}
        try:
            startup_s = self.wait_rounds(operator, trace, set(names), started)
            startup_cpu_s = cpu_seconds(pid)
            startup_requests = count(self.audit.between(started_wall, time.time()))
            print(f"    every RLCycle had a round after {startup_s:.1f} s; settling", flush=True)
            time.sleep(self.args.settle)
            load["idle"] = os.getloadavg()
            idle = self.idle(operator, trace)
            print(
                f"    idle: {idle['requests_per_s']:.2f} req/s, RSS "
                f"{idle['rss_steady_bytes'] / MB:.0f} MB, CPU {idle['cpu_percent']:.1f}%",
                flush=True,
            )
            reaction = self.reactions(operator, reacting)
            print(f"    reaction median {reaction['ms']['median']} ms", flush=True)
            pruning = self.pruning(operator, pruned)
            print(f"    pruning median {pruning['s']['median']} s", flush=True)
            rss_end = rss_tree(pid)
            load["end"] = os.getloadavg()
        except Exception:
            print(operator.output()[-6000:], file=sys.stderr)
            raise
        finally:
            code = operator.stop()
        errors = [line for line in operator.output().splitlines() if "Traceback" in line]
        return {
            "rlcycles": size,
            "label": label,
            "checkpoints": size * (OWNED + 1),
            "startup_s": startup_s,
            "startup_cpu_s": startup_cpu_s,
            "load_average": load,
            "startup_requests": startup_requests,
            "idle": idle,
            "reaction": reaction,
            "pruning": pruning,
            "rss_end_bytes": rss_end,
            "operator_exit": code,
            "operator_tracebacks": len(errors),
        }

    def wait_rounds(
        self, operator: OperatorProcess, trace: Path, names: set[str], started: float
    ) -> float:
        deadline = time.monotonic() + self.args.startup_timeout
        while True:
            seen = {str(r["rlcycle"]).split("/", 1)[1] for r in rounds(trace)}
            if names <= seen:
                last = max(r["t1"] for r in rounds(trace))
                return float(last - started)
            if operator.proc.poll() is not None:
                raise RuntimeError(f"operator exited:\n{operator.output()[-4000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(names - seen)} RLCycles had no round")
            time.sleep(1)

    def idle(self, operator: OperatorProcess, trace: Path) -> dict[str, Any]:
        pid = operator.proc.pid
        samples: list[int] = []
        w0_wall, w0, cpu0 = time.time(), time.perf_counter(), cpu_seconds(pid)
        deadline = w0 + self.args.idle_seconds
        while time.perf_counter() < deadline:
            rss = rss_tree(pid)
            if rss is not None:
                samples.append(rss)
            time.sleep(0.5)
        w1_wall, w1, cpu1 = time.time(), time.perf_counter(), cpu_seconds(pid)
        window = w1 - w0
        counts = count(self.audit.between(w0_wall, w1_wall))
        idle_rounds = [r for r in rounds(trace) if w0 <= r["t0"] < w1]
        return {
            "window_s": window,
            "rss_steady_bytes": statistics.median(samples),
            "rss_max_bytes": max(samples),
            "cpu_percent": (cpu1 - cpu0) / window * 100,
            "requests": counts,
            "requests_per_s": counts.get("requests", 0) / window,
            "watches_opened": counts.get("watches", 0),
            "rounds": len(idle_rounds),
            "rounds_live": sum(1 for r in idle_rounds if r.get("live")),
            "round_ms": stats([(r["t1"] - r["t0"]) * 1000 for r in idle_rounds]),
        }

    def reactions(self, operator: OperatorProcess, names: list[str]) -> dict[str, Any]:
        samples: list[dict[str, Any]] = []
        with (
            # the chart's own operator pod must not run: its image is not here (ErrImagePull)
            Kubelet(self.cp, self.tmp / "kubelet", unavailable_images=("*rtrl-operator*",)) as node,
            JobWatch(self.cp) as jobs,
        ):
            scratch = self.tmp / "results"
            for step, doc in (*RESULTS.items(), ("eval", EVAL_FAIL)):
                node.script(f"*-{step}-*", Succeed(before=commit_result(step, doc, scratch)))
            time.sleep(1)  # the watch is open
            for name in names:
                triggered = time.time()
                self.client.patch(
                    "RLCycle",
                    NAMESPACE,
                    name,
                    {"metadata": {"annotations": {"rtrl.io/trigger": f"bench-{name}"}}},
                )
                self.wait_phase(operator, f"{name}-{OWNED + 1}", "Rejected")
                time.sleep(1)  # the audit log has the last write
                mine = [
                    e
                    for e in self.audit.between(triggered, time.time())
                    if e["verb"] in WRITE_VERBS
                    and e["resource"] != "events"
                    and (e["name"] == name or e["name"].startswith(f"{name}-"))
                ]
                for job, done in sorted(jobs.completed.items(), key=lambda kv: kv[1]):
                    if not job.startswith(f"{name}-") or done < triggered:
                        continue
                    nxt = next((e for e in mine if e["received"] > done), None)
                    if nxt is None:
                        continue
                    resource = nxt["resource"] + (f"/{nxt['sub']}" if nxt["sub"] else "")
                    samples.append(
                        {
                            "job": job,
                            "ms": (nxt["done"] - done) * 1000,
                            "write": f"{nxt['verb']} {resource} {nxt['name']}",
                        }
                    )
        return {"ms": stats([s["ms"] for s in samples]), "samples": samples}

    def wait_phase(self, operator: OperatorProcess, checkpoint: str, phase: str) -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            found = self.client.get("Checkpoint", NAMESPACE, checkpoint)
            if ((found or {}).get("status") or {}).get("phase") == phase:
                return
            if operator.proc.poll() is not None:
                raise RuntimeError("operator exited")
            time.sleep(0.5)
        raise TimeoutError(f"Checkpoint {checkpoint} not {phase} after 120 s")

    def pruning(self, operator: OperatorProcess, names: list[str]) -> dict[str, Any]:
        start = time.time()
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            list(
                pool.map(
                    lambda n: self.client.patch(
                        "RLCycle", NAMESPACE, n, {"spec": {"historyLimit": PRUNED_TO}}
                    ),
                    names,
                )
            )
        left: dict[str, int] = {}
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            listed = self.client.list("Checkpoint", NAMESPACE)
            left = Counter(
                (c["spec"].get("rlCycle") or "")
                for c in listed
                if (c["spec"].get("rlCycle") or "") in names
            )
            if all(left.get(n, 0) <= PRUNED_TO for n in names):
                break
            time.sleep(1)
        time.sleep(1)
        deletes = [
            e
            for e in self.audit.between(start, time.time())
            if e["verb"] == "delete" and e["resource"] == "checkpoints"
        ]
        per = []
        for n in names:
            mine = [e["done"] for e in deletes if e["name"].startswith(f"{n}-")]
            if mine:
                per.append(max(mine) - start)
        return {
            "rlcycles": len(names),
            "deleted": len(deletes),
            "s": stats(per),
            "all_pruned_s": max(per) if per else None,
            "left_max": max(left.values()) if left else None,
        }


# --- output --------------------------------------------------------------------------------


def ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or a == 0:
        return "-"
    return f"{b / a:.2f}x"


def render(result: dict[str, Any]) -> str:
    runs = result["runs"]
    titles = [f"{r['rlcycles']:,} {r.get('label', '')}".strip() for r in runs]
    head = f"{'':48}" + "".join(f"{t:>12}" for t in titles)
    lines = [
        f"real control plane (kube-apiserver {result['version']}), 1 namespace, "
        f"{result['cpus']} CPUs (shared); RTRL_RESYNC_SECONDS={result['resync']}",
        head + ("       ratio" if len(runs) == 2 else ""),
    ]

    def row(label: str, get: Callable[[dict[str, Any]], float | None], fmt: str) -> None:
        values = [get(r) for r in runs]
        cells = "".join(f"{'-' if v is None else format(v, fmt):>12}" for v in values)
        extra = f"{ratio(values[0], values[1]):>12}" if len(values) == 2 else ""
        lines.append(f"{label:48}{cells}{extra}")

    row("Checkpoints", lambda r: r["checkpoints"], ",")
    row("world created (s)", lambda r: r["created_s"], ".0f")
    row("operator start -> every RLCycle had a round (s)", lambda r: r["startup_s"], ".1f")
    row("  operator CPU meanwhile (s)", lambda r: r.get("startup_cpu_s"), ".1f")
    row(
        "  requests meanwhile (watches aside)",
        lambda r: r["startup_requests"].get("requests", 0),
        ",",
    )
    row("RSS steady, idle (MB)", lambda r: r["idle"]["rss_steady_bytes"] / MB, ".0f")
    row("RSS max, idle (MB)", lambda r: r["idle"]["rss_max_bytes"] / MB, ".0f")
    row("idle requests per second (watches aside)", lambda r: r["idle"]["requests_per_s"], ".2f")
    row("  watch streams opened in the idle window", lambda r: r["idle"]["watches_opened"], "d")
    row("  reconcile rounds in the idle window", lambda r: r["idle"]["rounds"], "d")
    row("    of which read live", lambda r: r["idle"]["rounds_live"], "d")
    row("  a round, median (ms)", lambda r: r["idle"]["round_ms"]["median"], ".1f")
    row("idle CPU of the operator (%)", lambda r: r["idle"]["cpu_percent"], ".1f")
    row("  load average (1 min) in the idle window", lambda r: r["load_average"]["idle"][0], ".1f")
    row(
        "reaction to a Job's completion, median (ms)",
        lambda r: r["reaction"]["ms"]["median"],
        ".0f",
    )
    row("  p90 (ms)", lambda r: r["reaction"]["ms"]["p90"], ".0f")
    row("  max (ms)", lambda r: r["reaction"]["ms"]["max"], ".0f")
    row("  samples", lambda r: r["reaction"]["ms"]["n"], "d")
    row(
        f"pruning 10 -> {PRUNED_TO}: per RLCycle, median (s)",
        lambda r: r["pruning"]["s"]["median"],
        ".2f",
    )
    row("  all of them done (s)", lambda r: r["pruning"]["all_pruned_s"], ".2f")
    row("  RLCycles pruned at once", lambda r: r["pruning"]["rlcycles"], "d")
    row("  most Checkpoints left to one", lambda r: r["pruning"]["left_max"], "d")
    lines.append("")
    for run in runs:
        idle = run["idle"]["requests"]
        busy = ", ".join(
            f"{k} {v}" for k, v in sorted(idle.items()) if k not in ("requests", "watches")
        )
        lines.append(f"{run['rlcycles']:,} RLCycles, idle requests: {busy or 'none'}")
    lines.append("")
    last = runs[-1]
    rss = max(last["idle"]["rss_steady_bytes"], last["idle"]["rss_max_bytes"])
    median = last["reaction"]["ms"]["median"]
    cpu = last["idle"]["cpu_percent"]
    goals = [
        (f"RSS < 300 MB at {last['rlcycles']:,}", rss < 300 * MB, f"max {rss / MB:.0f} MB"),
        (f"idle CPU <= 10% of a core at {last['rlcycles']:,}", cpu <= 10, f"{cpu:.1f}%"),
        (
            f"0 idle requests per second at {last['rlcycles']:,}",
            last["idle"]["requests"].get("requests", 0) == 0,
            f"{last['idle']['requests_per_s']:.2f} req/s",
        ),
        (
            f"median reaction < 1 s at {last['rlcycles']:,}",
            median is not None and median < 1000,
            f"{median:.0f} ms" if median else "-",
        ),
    ]
    lines += [f"{goal}: {'met' if met else 'NOT met'} ({fig})" for goal, met, fig in goals]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="100,1000", help="RLCycles, growing (default 100,1000)")
    parser.add_argument("--idle-seconds", type=float, default=60.0)
    parser.add_argument("--settle", type=float, default=10.0)
    parser.add_argument("--resync", type=float, default=30.0, help="RTRL_RESYNC_SECONDS")
    parser.add_argument("--reactions", type=int, default=4, help="cycles timed (3 Jobs each)")
    parser.add_argument("--prune", type=int, default=20, help="RLCycles pruned at once")
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument(
        "--no-restart",
        dest="restart",
        action="store_false",
        help="measure the operator that meets the new RLCycles (default: a restarted one)",
    )
    parser.add_argument("--json", type=Path, metavar="OUT")
    parser.add_argument(
        "--operator-src", type=Path, help="run the operator from this src/ (e.g. `git archive`)"
    )
    parser.add_argument(
        "--baseline-src",
        type=Path,
        help="also measure an operator from this src/ first, on the same world (before/after)",
    )
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    binaries = binaries_dir()
    if binaries is None:
        print("the control plane is not built: run `make controlplane`", file=sys.stderr)
        return 2
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="rtrl-bench-scale-") as name:
        tmp = Path(name)
        (tmp / "audit-policy.yaml").write_text(AUDIT_POLICY)
        audit_args = (
            f"--audit-policy-file={tmp / 'audit-policy.yaml'}",
            f"--audit-log-path={tmp / 'audit.log'}",
            "--audit-log-maxsize=0",
        )
        with ControlPlane(tmp / "controlplane", binaries, apiserver_args=audit_args) as cp:
            bench = Scale(args, tmp, cp)
            runs = [run for size in sizes for run in bench.measure(size)]
            version = cp.version
    result = {
        "cpus": os.cpu_count(),
        "resync": args.resync,
        "version": version,
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO
        ).stdout.strip(),
        "date": datetime.now().isoformat(timespec="minutes"),
        "runs": runs,
        "seconds": time.monotonic() - started,
    }
    print(render(result))
    print(f"\n(run took {result['seconds']:.0f} s)")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
