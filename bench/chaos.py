"""Chaos soak: whole cycles of a few RLCycles on the real control plane while the operator is
SIGKILLed and restarted, the API server is killed and restarted (etcd and the controllers
keep running) and S3 answers with errors and cut bodies, at random times from a seed; the
invariants of ``rtrl_localkube.invariants`` are checked after every event.

The world: ``--rlcycles`` namespaces ``chaos-K``, each with the RLCycle of
``rtrl_localkube.cycle_world`` (its Deployment, base Checkpoint and RLCycle), on a short
``schedule.interval`` (``--interval``), its artifacts in S3 (moto's server, behind the fault
proxy of ``rtrl_localkube.s3faults``: ``spec.storage.endpoint`` is the proxy, so every result
the operator reads goes through it). The kubelet stand-in plays each step's pod: it writes the
step's canned result straight to moto (no faults on the Job side) and exits 0. By cycle
number: eval fails on cycles ending in 3 or 7 (Rejected), the analysis rolls back on cycles
ending in 2, 5 or 8 (RolledBack), all others are promoted; the canary's pods are real
processes (they sleep), so the canary Deployment becomes ready through the real Deployment
controller. ``rtrl operator`` runs as its own process with the chart's ServiceAccount, every
namespace given with ``--namespace``.

The events, one every ``--mean-gap`` seconds on average (exponential gaps), drawn from
``--seed``:

- ``kill``: SIGKILL the operator; a new one starts 0-3 s later;
- ``apiserver``: ``ControlPlane.restart_apiserver`` (SIGKILL, start again on the same port);
- ``s3``: ``--s3-error`` 503s and ``--s3-cut`` cut bodies for 5-20 s.

After each event (once the world answers again) the safety invariants of every namespace's
``Ledger`` are read (duplicate Job or Checkpoint, a lost Checkpoint, serving an unevaluated
one). At the end the schedules are suspended, and once every RLCycle has settled
(Suspended, or Idle) the status invariants are checked too (``status_problems``). The report:
cycles ended by phase, kills, API-server restarts, S3 fault windows and the faults injected,
and every violation (goal: 0). The machine has 2 cores shared with other work.

    flock /tmp/rtrl-e2e.lock .venv/bin/python bench/chaos.py [--minutes 6] [--seed 1]
        [--rlcycles 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import random
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import boto3
import kubernetes
from kubernetes.dynamic import DynamicClient
from moto.server import ThreadedMotoServer

from rtrl_localkube.api import KubeAPI
from rtrl_localkube.controlplane import ControlPlane
from rtrl_localkube.controlplane_setup import REPO, binaries_dir
from rtrl_localkube.cycle_world import (
    ANALYSIS_ROLLBACK,
    EVAL_FAIL,
    NAME,
    RESULTS,
    commit_result,
    setup_namespace,
)
from rtrl_localkube.invariants import Ledger, Violation, status_problems, watching
from rtrl_localkube.kubelet import Kubelet
from rtrl_localkube.outcomes import Succeed
from rtrl_localkube.s3faults import FaultProxy, serve_fault_proxy
from rtrl_localkube.tools import Cli, OperatorProcess

RELEASE, RELEASE_NAMESPACE = "rtrl", "rtrl-system"
BUCKET = "rtrl-chaos"
FINAL = ("Promoted", "RolledBack", "Rejected", "Failed", "Superseded")
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "chaos",
    "AWS_SECRET_ACCESS_KEY": "chaos-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
}


class Soak:
    def __init__(
        self, args: argparse.Namespace, tmp: Path, cp: ControlPlane, proxy: FaultProxy, s3: str
    ):
        self.args, self.tmp, self.cp, self.proxy, self.s3 = args, tmp, cp, proxy, s3
        self.rng = random.Random(args.seed)
        self.namespaces = [f"chaos-{k}" for k in range(args.rlcycles)]
        self.counts: Counter[str] = Counter()
        self.timeline: list[dict[str, Any]] = []
        self.violations: list[dict[str, Any]] = []
        self.seen: set[str] = set()
        self.operators = 0
        self.operator: OperatorProcess | None = None
        self.admin = Cli(cp.admin_kubeconfig)
        self.service_account = ""

    # --- the world -------------------------------------------------------------------------
    def install(self) -> None:
        self.admin.helm(
            "install",
            RELEASE,
            os.fspath(REPO / "charts" / "rtrl-operator"),
            "-n",
            RELEASE_NAMESPACE,
            "--create-namespace",
        )
        self.admin.kubectl(
            "wait",
            "--for=condition=Established",
            "crd/rlcycles.rtrl.io",
            "crd/checkpoints.rtrl.io",
            "--timeout=60s",
        )
        accounts = self.admin.get(
            "serviceaccounts",
            "-n",
            RELEASE_NAMESPACE,
            "-l",
            f"app.kubernetes.io/instance={RELEASE}",
        )["items"]
        self.service_account = str(accounts[0]["metadata"]["name"])

    def api(self, namespace: str) -> KubeAPI:
        config = self.cp.kubeconfig(self.tmp / f"{namespace}.kubeconfig", namespace=namespace)
        client = kubernetes.config.new_client_from_config(config_file=os.fspath(config))
        dynamic = DynamicClient(client, cache_file=os.fspath(self.tmp / f"{namespace}.disc"))
        return KubeAPI(self.cp.url, config, namespace, client, dynamic)

    def populate(self) -> None:
        for namespace in self.namespaces:
            self.admin.kubectl("create", "namespace", namespace)
            root = self.tmp / "store" / namespace
            storage = {
                "artifacts": f"s3://{BUCKET}/{namespace}/",
                "endpoint": self.proxy_url,
                "region": "us-east-1",
            }
            setup_namespace(
                self.api(namespace),
                root,
                schedule={"interval": self.args.interval},
                storage=storage,
            )

    def script(self, node: Kubelet) -> None:
        scratch = self.tmp / "results"
        hook = {step: commit_result(step, doc, scratch) for step, doc in RESULTS.items()}
        for step in ("stage", "train", "eval", "analyze"):
            node.script(f"*-{step}-*", Succeed(before=hook[step]))
        reject = Succeed(before=commit_result("eval", EVAL_FAIL, scratch))
        rollback = Succeed(before=commit_result("analyze", ANALYSIS_ROLLBACK, scratch))
        for digit in "37":
            node.script(f"{NAME}-*{digit}-eval-*", reject)
        for digit in "258":
            node.script(f"{NAME}-*{digit}-analyze-*", rollback)

    # --- the operator ----------------------------------------------------------------------
    def start_operator(self) -> None:
        args = [a for ns in self.namespaces for a in ("--namespace", ns)] + ["--standalone"]
        env = {"RTRL_RESYNC_SECONDS": "2", "RTRL_ERROR_BACKOFF_SECONDS": "1", **CREDENTIALS}
        env["AWS_ENDPOINT_URL"] = ""  # the operator reaches S3 through spec.storage.endpoint
        deadline = time.monotonic() + 60
        while True:
            try:
                self.operators += 1
                self.operator = OperatorProcess(
                    self.cp,
                    self.tmp / f"operator-{self.operators}",
                    service_account=(RELEASE_NAMESPACE, self.service_account),
                    args=args,
                    env=env,
                )
                return
            except Exception:  # the API server is restarting: no token yet
                if time.monotonic() > deadline:
                    raise
                time.sleep(1)

    def kill_operator(self) -> None:
        if self.operator is not None and self.operator.proc.poll() is None:
            self.operator.proc.kill()  # SIGKILL, by pid
            self.operator.proc.wait(10)

    # --- events ----------------------------------------------------------------------------
    def event(self, kind: str) -> dict[str, Any]:
        at = time.monotonic() - self.started
        record: dict[str, Any] = {"t": round(at, 1), "event": kind}
        if kind == "kill":
            self.kill_operator()
            time.sleep(self.rng.uniform(0, 3))
            self.start_operator()
        elif kind == "apiserver":
            record["down_s"] = round(self.cp.restart_apiserver(), 1)
        elif kind == "s3":
            seconds = self.rng.uniform(5, 20)
            self.proxy.chaos(self.args.s3_error, self.args.s3_cut, seed=self.rng.randrange(2**31))
            record["seconds"] = round(seconds, 1)
            time.sleep(seconds)
            self.proxy.chaos(0, 0)
        self.counts[kind] += 1
        return record

    def check(self, ledgers: dict[str, Ledger], when: str) -> None:
        for namespace, ledger in ledgers.items():
            for violation in ledger.violations():
                self.note(namespace, violation, when)

    def note(self, namespace: str, violation: Violation, when: str) -> None:
        key = f"{namespace}: {violation}"
        if key not in self.seen:
            self.seen.add(key)
            self.violations.append(
                {
                    "namespace": namespace,
                    "when": when,
                    "invariant": violation.invariant,
                    "message": violation.message,
                }
            )
            print(f"    VIOLATION after {when}: {key}", flush=True)

    def soak(self, ledgers: dict[str, Ledger]) -> None:
        kinds = ["kill", "apiserver", "s3"]
        weights = [self.args.kill_weight, self.args.apiserver_weight, self.args.s3_weight]
        deadline = self.started + self.args.minutes * 60
        while True:
            gap = self.rng.expovariate(1 / self.args.mean_gap)
            if time.monotonic() + gap > deadline:
                break
            self.quiet(gap)
            kind = self.rng.choices(kinds, weights)[0]
            record = self.event(kind)
            self.timeline.append(record)
            print(f"    {record}", flush=True)
            self.quiet(1.0)
            self.check(ledgers, f"{kind} at {record['t']} s")

    def quiet(self, seconds: float) -> None:
        """Sleep, restarting an operator that died by itself (counted: it should not)."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if self.operator is not None and self.operator.proc.poll() is not None:
                self.counts["operator died by itself"] += 1
                print(self.operator.output()[-3000:], file=sys.stderr)
                self.start_operator()
            time.sleep(min(0.5, max(0.0, end - time.monotonic())))

    def settle(self, ledgers: dict[str, Ledger]) -> dict[str, Any]:
        """Suspend every schedule, let the running cycles end, check the statuses."""
        for namespace in self.namespaces:
            self.admin.kubectl(
                "patch",
                "rlcycle",
                NAME,
                "-n",
                namespace,
                "--type=merge",
                "-p",
                '{"spec":{"suspend":true}}',
            )
        deadline = time.monotonic() + self.args.settle_timeout
        phases: dict[str, Any] = {}
        while time.monotonic() < deadline:
            phases = {ns: self.rlcycle(ns).get("status", {}).get("phase") for ns in self.namespaces}
            if all(p in ("Suspended", "Idle") for p in phases.values()):
                break
            self.quiet(1.0)
        time.sleep(3)  # a round more: nothing left to write
        for namespace in self.namespaces:
            path = f"/namespaces/{namespace}"
            rlc = self.rlcycle(namespace)
            items = {
                kind: self.cp.request("GET", f"{prefix}{path}/{plural}")["items"]
                for kind, prefix, plural in (
                    ("checkpoints", "/apis/rtrl.io/v1alpha1", "checkpoints"),
                    ("jobs", "/apis/batch/v1", "jobs"),
                    ("deployments", "/apis/apps/v1", "deployments"),
                )
            }
            for violation in status_problems(
                rlc, items["checkpoints"], items["jobs"], items["deployments"]
            ):
                self.note(namespace, violation, "the end (settled)")
        self.check(ledgers, "the end")
        return phases

    def rlcycle(self, namespace: str) -> dict[str, Any]:
        path = f"/apis/rtrl.io/v1alpha1/namespaces/{namespace}/rlcycles/{NAME}"
        return dict(self.cp.request("GET", path))

    def cycles(self) -> dict[str, Any]:
        ended: Counter[str] = Counter()
        for namespace in self.namespaces:
            path = f"/apis/rtrl.io/v1alpha1/namespaces/{namespace}/checkpoints"
            for ck in self.cp.request("GET", path)["items"]:
                phase = (ck.get("status") or {}).get("phase")
                if (ck.get("spec") or {}).get("rlCycle") and phase in FINAL:
                    ended[phase] += 1
        return dict(ended)

    def run(self) -> dict[str, Any]:
        self.install()
        self.populate()
        node = Kubelet(self.cp, self.tmp / "kubelet", unavailable_images=("*rtrl-operator*",))
        node.start()
        with contextlib.ExitStack() as stack:
            self.script(node)
            ledgers = {
                ns: stack.enter_context(watching(Ledger(), self.cp, ns)) for ns in self.namespaces
            }
            self.started = time.monotonic()
            self.start_operator()
            try:
                self.soak(ledgers)
                self.proxy.chaos(0, 0)
                phases = self.settle(ledgers)
            finally:
                if self.operator is not None:
                    self.operator.stop()
            soaked = time.monotonic() - self.started
            jobs = sum(len(ledger.created("Job")) for ledger in ledgers.values())
        try:  # what the kubelet stand-in met (a pod status it could not write while the API
            node.stop()  # server was down): reported, not raised
            kubelet_errors = ""
        except RuntimeError as exc:
            kubelet_errors = str(exc)[-3000:]
        faults = self.proxy.counts()
        return {
            "seed": self.args.seed,
            "minutes": self.args.minutes,
            "rlcycles": self.args.rlcycles,
            "interval": self.args.interval,
            "seconds": soaked,
            "cycles_ended": self.cycles(),
            "jobs_created": jobs,
            "events": dict(self.counts),
            "operators_started": self.operators,
            "s3_requests": faults,
            "final_phases": phases,
            "violations": self.violations,
            "kubelet_errors": kubelet_errors,
            "timeline": self.timeline,
        }

    @property
    def proxy_url(self) -> str:
        return self.args.proxy_url


@contextlib.contextmanager
def s3_server() -> Iterator[str]:
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


def render(result: dict[str, Any]) -> str:
    ended = result["cycles_ended"]
    s3 = result["s3_requests"]
    lines = [
        f"chaos soak, seed {result['seed']}: {result['rlcycles']} RLCycles (interval "
        f"{result['interval']}), {result['seconds'] / 60:.1f} min on the real control plane",
        f"cycles ended: {sum(ended.values())} ({', '.join(f'{k} {v}' for k, v in ended.items())})"
        f"; Jobs created: {result['jobs_created']}",
        "events: " + ", ".join(f"{k} {v}" for k, v in sorted(result["events"].items())),
        f"operators started: {result['operators_started']}",
        "S3 requests through the fault proxy: " + ", ".join(f"{k} {v}" for k, v in s3.items()),
        f"final phases: {result['final_phases']}",
        f"invariant violations: {len(result['violations'])} (goal 0)",
    ]
    if result["kubelet_errors"]:
        lines.append(f"the kubelet stand-in met errors: {result['kubelet_errors'][-500:]}")
    lines += [
        f"  {v['namespace']} after {v['when']}: {v['invariant']}: {v['message']}"
        for v in result["violations"]
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=6.0, help="how long the chaos lasts")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--rlcycles", type=int, default=3)
    parser.add_argument("--interval", default="10s", help="each RLCycle's schedule.interval")
    parser.add_argument("--mean-gap", type=float, default=15.0, help="seconds between events")
    parser.add_argument("--kill-weight", type=float, default=0.5)
    parser.add_argument("--apiserver-weight", type=float, default=0.25)
    parser.add_argument("--s3-weight", type=float, default=0.25)
    parser.add_argument("--s3-error", type=float, default=0.2, help="503 rate in a window")
    parser.add_argument("--s3-cut", type=float, default=0.15, help="cut-body rate in a window")
    parser.add_argument("--settle-timeout", type=float, default=120.0)
    parser.add_argument("--json", type=Path, metavar="OUT")
    args = parser.parse_args(argv)
    binaries = binaries_dir()
    if binaries is None:
        print("the control plane is not built: run `make controlplane`", file=sys.stderr)
        return 2
    os.environ.update(CREDENTIALS)
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="rtrl-chaos-")))
        s3 = stack.enter_context(s3_server())
        os.environ["AWS_ENDPOINT_URL"] = s3  # the kubelet's step results: straight to moto
        boto3.client("s3", endpoint_url=s3).create_bucket(Bucket=BUCKET)
        proxy, args.proxy_url = stack.enter_context(serve_fault_proxy(s3))
        cp = stack.enter_context(ControlPlane(tmp / "controlplane", binaries))
        result = Soak(args, tmp, cp, proxy, s3).run()
    result["date"] = datetime.now().isoformat(timespec="minutes")
    print(render(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 1 if result["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
