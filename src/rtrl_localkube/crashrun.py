"""Kill the operator after every write of a path, on the real control plane, and check the
invariants (:mod:`rtrl_localkube.invariants`) after every restart and at the end.

A :class:`CrashSweep` runs ``rtrl operator`` as children of a :class:`ForkServer` (a fresh
OS process per run, started in a fraction of a second: the imports are paid once), talking
to the API server through a :class:`KillProxy`. While the sweep is on, each run is
SIGKILLed right after its first write (the server has done it, the operator never hears
back), and a new run started, which goes on from there and is killed after *its* first
write: one pass of a path kills the operator once at every write boundary of it. Events
are not kill points: they are posted from a background thread after a round's changes, so
a kill after one is a kill between two rounds, which the next change's kill covers.

After each kill the safety invariants (no duplicate Job or Checkpoint, none lost, nothing
served before its eval passed) must hold; whenever a run has settled (two rounds that read
the cluster and wrote nothing) the RLCycle's status must agree with its children; at the
end, with the sweep off, the last run must settle without writing anything.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rtrl_localkube.api import KubeAPI
from rtrl_localkube.forkserver import Child, ForkServer
from rtrl_localkube.invariants import Ledger, Violation, status_problems
from rtrl_localkube.killproxy import KillProxy, Write
from rtrl_localkube.tools import OPEN_POLICY_ENV

RTRL = "rtrl.io/v1alpha1"
# What the fork server imports once: the operator's command and everything it loads.
OPERATOR_MODULES = ["rtrl.cli", "rtrl.handlers", "rtrl.logs", "kopf"]
OPERATOR_ENV = {
    "RTRL_RESYNC_SECONDS": "1",  # a round a second at least: rounds() counts them
    "RTRL_ERROR_BACKOFF_SECONDS": "0.5",
    "PYTHONUNBUFFERED": "1",
    **OPEN_POLICY_ENV,
}


@dataclass
class Step:
    """Something the test does once, the first time ``when()`` holds (in the sweep's loop):
    an annotation mid-canary, turning the sweep on."""

    when: Callable[[], Any]
    do: Callable[[], None]
    done: bool = False


@dataclass
class CrashSweep:
    """One RLCycle's path under kills. ``kube``: the admin's client in its namespace."""

    forkserver: ForkServer
    proxy: KillProxy
    kube: KubeAPI
    ledger: Ledger
    work: Path
    kubeconfig: Path
    rlcycle: str = "composer"
    target: str = "composer-vllm"
    env: Mapping[str, str] = field(default_factory=dict)
    sweeping: bool = False  # kill after each run's first write
    # Turns the sweep on at the first write it holds for, killing after that write: a sweep
    # that starts at a write, not at a moment a poll saw (a poll races the writes after it).
    sweep_from: Callable[[Write], bool] | None = None
    child: Child | None = None
    runs: int = 0
    kills: list[Write] = field(default_factory=list)
    kills_while_running: int = 0
    settled_checks: int = 0
    violations: list[Violation] = field(default_factory=list)
    _armed: bool = False
    _killed: threading.Event = field(default_factory=threading.Event)
    # Re-entrant: a write's kill decides and kills under one hold (see _after_write).
    _lock: threading.RLock = field(default_factory=threading.RLock)
    _checked_at: float = -1.0
    _restart_when: Callable[[], Any] | None = None

    def __post_init__(self) -> None:
        self.proxy.after_write = self._after_write
        self.log = self.work / "operator.log"

    # --- the operator ----------------------------------------------------------------------
    def start(self) -> None:
        with self._lock:
            assert self.child is None or self.child.poll() is not None, "still running"
            self.runs += 1
            self._killed.clear()
            self._armed = self.sweeping
            with self.log.open("a") as log:
                log.write(f"===== run {self.runs} (generation {self.proxy.generation}) =====\n")
            self.trace = self.work / f"rounds-{self.runs}.jsonl"
            env = {**os.environ, **OPERATOR_ENV, **self.env, "KUBECONFIG": str(self.kubeconfig),
                   "RTRL_ROUND_TRACE": str(self.trace)}  # fmt: skip
            argv = ["operator", "--namespace", self.kube.namespace, "--standalone",
                    "--liveness", "none", "--log-format", "text"]  # fmt: skip
            self.child = self.forkserver.spawn(
                "rtrl.cli:main", argv, env=env, cwd=self.work, log=self.log
            )

    def kill(self) -> None:
        """SIGKILL the running operator; returns once it is gone and the proxy has cut its
        connections."""
        with self._lock:
            # first: whatever the dying run still sends is refused, its answers dropped
            self.proxy.next_generation()
            child = self.child
            if child is not None and child.poll() is None:
                child.kill()
                child.wait(10)
            self._killed.set()

    def kill_while_running(self, restart_when: Callable[[], Any] | None = None) -> None:
        """A kill that no write triggers (a step's pod calls it while its Job runs); the
        next run starts once ``restart_when()`` holds (e.g. the Job has finished)."""
        self.kills_while_running += 1
        self._restart_when = restart_when
        self.kill()

    def _after_write(self, write: Write) -> None:
        if write.plural == "events" or write.generation != self.proxy.generation:
            return
        # A write a restarted run makes first every time (the same request re-sent because
        # the round it belongs to is planned again) is killed after once in a row, not for
        # ever: the next run may pass it and the sweep goes on.
        again = bool(self.kills) and _same(self.kills[-1], write)
        # Decided and done under one hold of the lock: settle() disarms under it, so a kill
        # is either over (and seen there) or never fires. (Done in two holds, a test that
        # saw this write's effect could disarm between them, find the operator alive and
        # then wait for rounds from a process killed just after.)
        with self._lock:
            if self.sweep_from is not None and self.sweep_from(write):
                self.sweep_from = None
                self.sweeping = self._armed = True
                again = False
            fire = self._armed and not again
            self._armed = self._armed and not fire
            if fire:
                self.kills.append(write)
                self.kill()

    def stop(self) -> None:
        self.sweeping = False
        child = self.child
        if child is not None and child.poll() is None:
            child.terminate()
            try:
                child.wait(15)
            except Exception:
                child.kill()

    # --- reading what happened ---------------------------------------------------------
    def rounds(self, since: float = 0.0) -> int:
        """Rounds the current run has finished after ``since`` (time.monotonic): its round
        trace (RTRL_ROUND_TRACE) stamps each with perf_counter, the same clock on Linux."""
        try:
            lines = self.trace.read_text().splitlines()
        except (OSError, AttributeError):
            return 0
        count = 0
        for line in lines:
            try:
                count += float(json.loads(line)["t1"]) > since
            except (ValueError, KeyError):
                continue  # a line still being written
        return count

    def last_write(self) -> float:
        writes = [w.at for w in self.proxy.writes if w.plural != "events"]
        return max(writes, default=0.0)

    def status(self, kind: str = "RLCycle", name: str | None = None) -> dict[str, Any]:
        obj = self.kube.get(RTRL, kind, name or self.rlcycle) or {}
        return dict(obj.get("status") or {})

    def status_now(self) -> list[Violation]:
        rlc = self.kube.get(RTRL, "RLCycle", self.rlcycle)
        if rlc is None:
            return []
        return status_problems(
            rlc,
            self.kube.list(RTRL, "Checkpoint"),
            self.kube.list("batch/v1", "Job"),
            self.kube.list("apps/v1", "Deployment"),
        )

    def explain(self) -> str:
        jobs = [j["metadata"]["name"] for j in self.kube.list("batch/v1", "Job")]
        cks = {c["metadata"]["name"]: (c.get("status") or {}).get("phase")
               for c in self.kube.list(RTRL, "Checkpoint")}  # fmt: skip
        writes = [str(w) for w in self.proxy.writes if w.plural != "events"][-40:]
        log = self.log.read_text(errors="replace") if self.log.exists() else ""
        return (
            f"\nruns {self.runs}, kills after writes {len(self.kills)}, while running "
            f"{self.kills_while_running}\nviolations: {[str(v) for v in self.violations]}"
            f"\nRLCycle status: {self.status()}\nCheckpoints: {cks}\nJobs: {jobs}"
            f"\nlast writes: {writes}\nproxy errors: {self.proxy.errors[-5:]}"
            f"\n--- operator log (end) ---\n{log[-6000:]}"
        )

    # --- the loop ------------------------------------------------------------------------
    def run(self, done: Callable[[], Any], *, steps: list[Step] | None = None,
            timeout: float = 120) -> None:  # fmt: skip
        """Start the operator and restart it after every kill until ``done()`` holds, doing
        each of ``steps`` when it is due; check the invariants after every restart and at
        every settled moment."""
        steps = steps or []
        deadline = time.monotonic() + timeout
        self.start()
        while True:
            for step in steps:
                if not step.done and step.when():
                    step.done = True
                    step.do()
            if self._killed.is_set():
                if self._restart_when is not None and not self._restart_when():
                    time.sleep(0.05)
                    continue
                self._restart_when = None
                self._check_safety()
                self.start()
                continue
            with self._lock:  # a kill holds it until _killed is set
                child = self.child
                died = child is not None and child.poll() is not None and not self._killed.is_set()
            if died and child is not None:
                raise AssertionError(
                    f"the operator exited by itself ({child.poll()}){self.explain()}"
                )
            self._check_settled()
            if all(s.done for s in steps) and done():
                return
            if not self.proxy.writes and time.monotonic() > deadline - timeout + 30:
                raise AssertionError(f"the operator wrote nothing in 30 s{self.explain()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"the path did not end within {timeout}s{self.explain()}")
            time.sleep(0.05)

    def settle(self, timeout: float = 30, *, rounds: bool = True) -> None:
        """The sweep off: the running operator must come to two rounds in a row that write
        nothing, having changed nothing but the RLCycle's status meanwhile (a status can
        take one more round to agree, e.g. ``Ready`` naming the newly serving Checkpoint),
        and every invariant hold. ``rounds=False``: no RLCycle is left to have rounds; two
        resync periods with no write at all instead."""
        with self._lock:  # a write's kill in progress finishes first (see _after_write)
            self.sweeping = False
            self._armed = False
            gone = self._killed.is_set() or self.child is None or self.child.poll() is not None
        if gone:
            self._check_safety()
            self.start()
        writes = len(self.proxy.writes)
        if rounds:
            self.kube.wait_for(
                lambda: self.rounds(self.last_write()) >= 2, timeout=timeout, message=self.explain
            )
        else:
            time.sleep(2 * float(OPERATOR_ENV["RTRL_RESYNC_SECONDS"]) + 0.5)
        late = [
            str(w)
            for w in self.proxy.writes[writes:]
            if w.plural != "events"
            and not (rounds and w.plural == "rlcycles" and w.path.endswith("/status"))
        ]
        assert not late, f"the settled operator still changed {late}{self.explain()}"
        self._check_safety()
        self.violations += self.status_now()
        assert not self.violations, self.explain()

    def _rlcycle_gone(self, name: str) -> bool:
        obj = self.kube.get(RTRL, "RLCycle", name)
        return obj is None or bool((obj.get("metadata") or {}).get("deletionTimestamp"))

    def _check_safety(self) -> None:
        found = [v for v in self.ledger.violations(self._rlcycle_gone) if v not in self.violations]
        self.violations += found
        assert not found, self.explain()

    def _check_settled(self) -> None:
        since = self.last_write()
        if since == self._checked_at or self.rounds(since) < 2:
            return
        self._checked_at = since
        self.settled_checks += 1
        found = self.status_now()
        if found and self.rounds(self.last_write()) >= 2:  # nothing was written meanwhile
            self.violations += found
            raise AssertionError(self.explain())


TIMESTAMP = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z")


def _same(a: Write, b: Write) -> bool:
    """The same request, but for the times in it."""

    def text(w: Write) -> str:
        return TIMESTAMP.sub("T", json.dumps(w.body, sort_keys=True))

    return (a.method, a.path) == (b.method, b.path) and text(a) == text(b)


__all__ = ["OPERATOR_MODULES", "CrashSweep", "Step"]
