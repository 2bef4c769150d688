"""``rtrl demo``: the real-time RL loop on one machine, with simulated users.

The operator's own planning core (:func:`rtrl.planning.plan`) decides every step; a
:class:`~rtrl_localkube.cluster.LocalCluster` applies its actions like the API server, and the
Jobs it creates run their real ``rtrl-job`` commands as subprocesses on a ``file://``
store. Only the users are simulated (``python -m rtrl_demo.serve``, docs/demo.md). Simulated time
advances in ticks; in each tick the users interact with whatever the target and canary
Deployments serve at that moment, split by a hash of their user id, through the inlet a
deployment has: a real ``rtrl-capture`` sidecar in front of each arm's model server (with the
env the operator injected in the pod template), a real ``rtrl-feedback`` for their feedback,
and the seal CronJob's ``rtrl-job seal``, run here at the simulated time, writing the shards
the cycles stage.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from rtrl.core.api.rlcycle import RLCycleSpec
from rtrl.core.store import read_committed_json
from rtrl.planning import plan
from rtrl.planning.manifests import capture as cap
from rtrl.planning.manifests.seal import seal_name
from rtrl.planning.plan import validate_spec
from rtrl.planning.timeutil import iso
from rtrl_localkube.cluster import LocalCluster
from rtrl_localkube.podprocess import BIN, run_pod

from .console import Progress, colour, cycle_table, final_summary, head_to_head_table
from .fleet import SERVE, ServingFleet
from .pipeline import (
    ServedArm,
    events_root,
    injected_env,
    reward_view,
    routes_into_pods,
    seal_job,
    served_arm,
)
from .scenario import (
    CONTAINER,
    DEPLOYMENT,
    FINAL,
    HISTORY,
    NAME,
    SCENARIOS,
    SEAL_LAG,
    T0,
    TICK_MINUTES,
    TWO_ORGS,
    adapter_rlcycle_name,
    base_checkpoint_manifest,
    deployment_manifest,
    rlcycle_manifests,
)
from .summary import by_org, summary
from .traces import answer_mix


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cycles", type=int, default=3, help="cycles to run (default 3)")
    parser.add_argument(
        "--users",
        type=int,
        default=2000,
        help="simulated users, 3 requests/hour each (default 2000)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), default="default")
    parser.add_argument("--out", type=Path, default=Path("demo-report"), help="output directory")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.add_argument(
        "--verbose", action="store_true", help="a line for each of the users' serving ticks too"
    )
    parser.add_argument(
        "--tick-minutes",
        type=int,
        default=TICK_MINUTES,
        help=f"simulated minutes per serving step (default {TICK_MINUTES}; longer is faster)",
    )
    parser.add_argument(
        "--pretrain-steps", type=int, default=300, help="base model pre-training steps"
    )


class Demo:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out: Path = args.out.resolve()
        self.root = self.out / "store"
        self.store = self.root.as_uri() + "/"
        self.work = self.out / "work"
        self.cluster = LocalCluster(T0 - HISTORY)
        self.progress = Progress(args.quiet, getattr(args, "verbose", False))
        self.timings: dict[str, float] = {}
        self.env = {
            "HF_HUB_OFFLINE": "1",
            "HF_HUB_DISABLE_PROGRESS_BARS": "1",
            "DS_ACCELERATOR": "cpu",
            "PYTHONWARNINGS": "ignore",
            "OMP_NUM_THREADS": str(min(2, os.cpu_count() or 1)),
        }
        self.serve_calls = 0
        self.fleet = ServingFleet(self.env, self.work)
        self.tick = timedelta(minutes=args.tick_minutes)
        self.reported: set[str] = set()
        self.sealed_through: datetime | None = None  # the last hour the seal found final
        # the canary's share of the users at each serving tick of the cycles
        self.weights: list[dict[str, Any]] = []
        # two-orgs: an adapter per organisation; -shared: their users, one model, no adapter
        self.two_orgs, self.org_users = args.scenario == "two-orgs", args.scenario[:8] == "two-orgs"
        # the RLCycles the planning core reconciles, the base's first; those whose cycles
        # the demo counts (two-orgs: the organisations'; the base's is suspended)
        self.names = [NAME, *(adapter_rlcycle_name(o) for o in TWO_ORGS if self.two_orgs)]
        self.cycling = self.names[1:] if self.two_orgs else [NAME]
        # two-orgs: the routing table as each tick served it (the adapters' routes)
        self.routes: list[dict[str, Any]] = []

    # Steps run as subprocesses ----------------------------------------------------------

    def job(self, argv: list[str], label: str, kind: str) -> None:
        name = f"{kind}-{self.serve_calls}"
        manifest = {
            "metadata": {"name": name},
            "spec": {"template": {"spec": {"containers": [{"command": argv}]}}},
        }
        self.serve_calls += 1

        def tick(seconds: float) -> None:
            self.progress.tick(label, kind, seconds)

        if tuple(argv[: len(SERVE)]) == SERVE:
            log = self.work / "logs" / f"{name}-0.log"
            result = self.fleet.run(argv[len(SERVE) :], log, on_tick=tick)
        else:
            result = run_pod(manifest, lambda _: None, self.work / "logs", extra_env=self.env,
                             on_tick=tick)  # fmt: skip
        self.progress.done(label, kind, result.seconds, result.exit_code == 0)
        self.timings[kind] = self.timings.get(kind, 0.0) + result.seconds
        if result.exit_code:
            raise RuntimeError(f"{label} failed (log {result.log}):\n{result.message}")

    def arms(self) -> tuple[ServedArm, ServedArm | None, float]:
        """What the target and canary Deployments serve now, each with the env of its
        pods' capture sidecar, and the canary's share of the pods."""
        target = self.cluster.get("Deployment", DEPLOYMENT)
        canary = self.cluster.get("Deployment", f"{DEPLOYMENT}-canary")
        stable = served_arm(target, CONTAINER, cap.STABLE, self.spec)
        if canary is None:
            return stable, None, 0.0
        n_stable = int(target["spec"].get("replicas", 1)) if target else 1
        n_canary = int(canary["spec"].get("replicas", 1))
        return (
            stable,
            served_arm(canary, CONTAINER, cap.CANARY, self.spec),
            n_canary / (n_stable + n_canary),
        )

    def arm_of(self, checkpoint: str, uri: str, arm: str) -> ServedArm:
        """An arm the Deployments do not hold (the head-to-head's base, the history before
        the operator's first round), its sidecar as the operator would inject it."""
        return checkpoint, uri, injected_env(self.spec(), arm, checkpoint, uri)

    def spec(self) -> RLCycleSpec:
        manifest = self.cluster.get("RLCycle", NAME) or {}
        spec, problem = validate_spec(manifest.get("spec"))
        if spec is None:
            raise RuntimeError(f"the demo's RLCycle is invalid: {problem}")
        return spec

    def serve_tick(self, arms: tuple[ServedArm, ServedArm | None, float] | None = None) -> None:
        """The users interact for one tick with what is deployed now (or with ``arms``);
        then the seal runs, as its CronJob would, if an hour has become final."""
        stable, canary, share = arms or self.arms()
        if arms is None:
            self.weights.append(
                {
                    "at": iso(self.cluster.now),
                    "until": iso(self.cluster.now + self.tick),
                    "serving": stable[0],
                    "canary": canary[0] if canary else None,
                    "weight": round(100 * share, 1),
                }
            )
        argv = [
            *SERVE, f"--events={events_root(self.spec())}",
            f"--serving={stable[0]}={stable[1]}", f"--serving-env={json.dumps(stable[2])}",
            f"--users={self.args.users}",
            f"--start={iso(self.cluster.now)}", f"--duration={int(self.tick.total_seconds())}s",
            f"--seed={self.args.seed * 100_003 + self.serve_calls}",
            f"--population-seed={self.args.seed}", f"--work={self.work / 'deployment'}",
        ]  # fmt: skip
        if self.org_users:
            argv.append(f"--orgs={','.join(TWO_ORGS)}")
        if self.two_orgs:
            target = self.cluster.get("Deployment", DEPLOYMENT) or {}
            self.routes.append({
                "at": iso(self.cluster.now),
                "orgs": routes_into_pods(self.cluster, self.work / "deployment"),
                # the target's pod template generation: a route changes no pod
                "generation": (target.get("metadata") or {}).get("generation"),
            })  # fmt: skip
        label = f"serve {stable[0]}"
        if canary is not None:
            argv += [f"--canary={canary[0]}={canary[1]}", f"--canary-env={json.dumps(canary[2])}",
                     f"--canary-share={share:.3f}"]  # fmt: skip
            label += f" | {canary[0]} {share:.0%}"
        self.job(argv, f"{iso(self.cluster.now)[11:16]} {label}", "serve")
        self.cluster.now += self.tick
        self.seal()

    def seal(self, now: datetime | None = None) -> None:
        """``rtrl-job seal`` as the operator's CronJob runs it, ``--now`` the simulated
        clock; only when an hour has become final since the last run (a run seals every
        final hour not sealed yet, so skipping the runs in between loses nothing)."""
        now = now or self.cluster.now
        final = (now - SEAL_LAG).replace(minute=0, second=0, microsecond=0)
        if self.sealed_through is not None and final <= self.sealed_through:
            return
        cron = self.cluster.get("CronJob", seal_name(NAME))
        job = seal_job(cron, self.spec(), f"seal-{self.serve_calls}")
        self.serve_calls += 1
        label = f"{iso(now)[11:16]} seal"
        result = run_pod(
            job, lambda _: None, self.work / "logs", extra_env=self.env,
            extra_args=[f"--now={iso(now)}"],
            on_tick=functools.partial(self.progress.tick, label, "seal"),
        )  # fmt: skip
        self.progress.done(label, "seal", result.seconds, result.exit_code == 0)
        self.timings["seal"] = self.timings.get("seal", 0.0) + result.seconds
        if result.exit_code:
            raise RuntimeError(f"{label} failed (log {result.log}):\n{result.message}")
        self.sealed_through = final

    def run_jobs(self) -> bool:
        ran = False
        for job in self.cluster.pending_jobs():
            name = job["metadata"]["name"]
            step = job["metadata"]["labels"].get("rtrl.io/step", "")
            kind = step.split("-")[0]
            extra: list[str] = []
            if kind == "stage" and self.args.scenario == "drop-invalid-tool-calls":
                ckpt = next(
                    a.split("=", 1)[1]
                    for a in job["spec"]["template"]["spec"]["containers"][0]["args"]
                    if a.startswith("--checkpoint=")
                )
                extra = [f"--shards={reward_view(self.root, ckpt)}"]

            def config_map(cm: str) -> dict[str, str] | None:
                obj = self.cluster.get("ConfigMap", cm)
                return None if obj is None else dict(obj.get("data") or {})

            label = f"{iso(self.cluster.now)[11:16]} {kind} {name}"
            result = run_pod(
                job, config_map, self.work / "logs", extra_env=self.env, extra_args=extra,
                on_tick=functools.partial(self.progress.tick, label, kind),
            )  # fmt: skip
            self.progress.done(label, kind, result.seconds, result.exit_code == 0)
            self.timings[kind] = self.timings.get(kind, 0.0) + result.seconds
            self.cluster.finish_job(
                name,
                succeeded=result.exit_code == 0,
                message=f"exit {result.exit_code}: {result.message}" if result.exit_code else "",
            )
            ran = True
        return ran

    def reconcile(self) -> None:
        """Plan and apply, every RLCycle each round, until each plan waits for time to pass.
        An RLCycle that has run its cycles is no longer planned (its next cycle would start
        at once: do not run its jobs)."""
        for _ in range(50):
            waiting = True
            for name in self.names:
                if name in self.cycling and self.cycles_of(name) >= self.args.cycles:
                    continue
                decided = plan(self.cluster.observe(name), self.cluster.now)
                self.cluster.apply(decided.actions)
                self.cluster.patch_status("RLCycle", name, decided.status)
                self.cluster.settle()
                waiting &= not decided.actions and decided.requeue_after != 0
            self.print_finished()
            if self.done():
                return
            ran = self.run_jobs()
            if waiting and not ran:
                return

    def cycles_of(self, name: str) -> int:
        """The cycles of the RLCycle ``name`` that have ended."""
        return sum(1 for c in self.finished_cycles() if c["spec"].get("rlCycle") == name)

    def done(self) -> bool:
        return all(self.cycles_of(name) >= self.args.cycles for name in self.cycling)

    # The whole demo ---------------------------------------------------------------------

    def setup(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        base = f"{self.store}models/demo-0/"
        if read_committed_json(f"{base}config.json") is None:
            self.job([*SERVE, f"--base-out={base}", f"--seed={self.args.seed}",
                      f"--pretrain-steps={self.args.pretrain_steps}"],
                     "base model (pre-training)", "base")  # fmt: skip
        self.cluster.create(deployment_manifest(base, "demo-0", lora=self.two_orgs))
        self.cluster.create(base_checkpoint_manifest(base))
        for rlcycle in rlcycle_manifests(self.store, self.args.scenario, self.args.users):
            self.cluster.create(rlcycle)
        self.cluster.settle()
        while self.cluster.now < T0:
            self.serve_tick()

    def owned(self) -> list[dict[str, Any]]:
        everything = self.cluster.list_objects("Checkpoint")
        return [c for c in everything if c["metadata"]["name"] != "demo-0"]

    def print_finished(self) -> None:
        """The blog's table for each cycle that just ended, before the next one's jobs run."""
        for ck in self.finished_cycles():
            if ck["metadata"]["name"] not in self.reported:
                self.reported.add(ck["metadata"]["name"])
                print(cycle_table(ck, colour()), file=sys.stderr)

    def finished_cycles(self) -> list[dict[str, Any]]:
        return [c for c in self.owned() if (c.get("status") or {}).get("phase") in FINAL]

    def run(self) -> dict[str, Any]:
        started = time.monotonic()
        print(
            f"rtrl demo: scenario {self.args.scenario}: {SCENARIOS[self.args.scenario]}",
            file=sys.stderr,
        )
        try:
            return self._run(started)
        finally:
            self.fleet.close()

    def _run(self, started: float) -> dict[str, Any]:
        self.setup()
        deadline = T0 + timedelta(hours=8 * self.args.cycles)
        while not self.done() and self.cluster.now < deadline:
            self.reconcile()
            if self.done():
                break
            self.serve_tick()
        if self.two_orgs:
            self.after_decisions()
        head_to_head = None if self.two_orgs else self.head_to_head()
        result = summary(
            self.cluster, self.owned(), self.args, self.timings, time.monotonic() - started
        )
        if self.org_users:  # each organisation: its adapter (or the one shared model)
            result.update(by_org(self.cluster, result, self.root / "interactions",
                                 self.routes if self.two_orgs else None))  # fmt: skip
        result.update(head_to_head=head_to_head, canary_weights=self.weights)
        result["answer_mix"] = answer_mix(self.root / "interactions")
        spec = (self.cluster.get("RLCycle", NAME) or {}).get("spec") or {}
        result["gates"] = (spec.get("eval") or {}).get("gates") or []
        if head_to_head:
            print(head_to_head_table(head_to_head), file=sys.stderr)
        from .report import write_report

        report = write_report(self.out, result)
        print(final_summary(result, str(report), colour()), file=sys.stderr)
        return result

    def after_decisions(self) -> None:
        """two-orgs: an hour more of serving on the routes the RLCycles decided (each org on
        its promoted adapter, or on the base), sealed once all of it has matured: who
        served each org after the decisions is in the shards."""
        start = self.cluster.now
        while self.cluster.now < start + timedelta(hours=1):
            self.serve_tick()
        self.seal(self.cluster.now + SEAL_LAG + timedelta(hours=1))

    def head_to_head(self) -> dict[str, Any] | None:
        """The base model against the checkpoint now serving (:mod:`.headtohead`)."""
        from .headtohead import head_to_head

        return head_to_head(self)


def run(args: argparse.Namespace) -> int:
    if not (BIN / "rtrl-job").exists():
        print("rtrl demo: rtrl-job is not installed next to this Python", file=sys.stderr)
        return 1
    summary = Demo(args).run()
    (args.out.resolve() / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    return 0
