"""``rtrl demo``: the real-time RL loop on one machine, with simulated users.

The operator's own planning core (:func:`rtrl.planning.plan`) decides every step; a
:class:`~rtrl_localkube.cluster.LocalCluster` applies its actions like the API server, and the
Jobs it creates run their real ``rtrl-job`` commands as subprocesses on a ``file://``
store. Only the users are simulated (``python -m rtrl_demo.serve``, docs/demo.md). Simulated time
advances in ticks; in each tick the users interact with whatever the target and canary
Deployments serve at that moment, split by a hash of their user id.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from rtrl.abtable import ab_table
from rtrl.core.store import read_committed_json
from rtrl.planning import plan
from rtrl.planning.manifests.canary import CHECKPOINT_ID_ENV, env_value
from rtrl.planning.manifests.names import result_uri
from rtrl.planning.timeutil import iso
from rtrl_localkube.cluster import LocalCluster
from rtrl_localkube.podprocess import BIN, run_pod

from .fleet import SERVE, ServingFleet

NAME = "demo"
DEPLOYMENT = "demo-serve"
CONTAINER = "server"
T0 = datetime(2026, 1, 5, 8, 0, tzinfo=UTC)
TICK_MINUTES = 20
HISTORY = timedelta(hours=2)
# The final head-to-head: the base model against the last promoted checkpoint, 50/50.
HEAD_TO_HEAD = timedelta(hours=2)
# Superseded: promoted, then replaced by a later promotion
FINAL = {"Promoted", "Superseded", "RolledBack", "Rejected", "Failed"}
SCENARIOS = {
    "default": "the correct reward: invalid tool calls are penalised, questions cost a little",
    "drop-invalid-tool-calls": "the blog's first reward: interactions with an invalid tool call "
    "are dropped before staging (never penalised)",
    "clarify-dodge": "asking a clarifying question costs nothing (askedClarification: 0)",
}


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
        "--tick-minutes",
        type=int,
        default=TICK_MINUTES,
        help=f"simulated minutes per serving step (default {TICK_MINUTES}; longer is faster)",
    )
    parser.add_argument(
        "--pretrain-steps", type=int, default=300, help="base model pre-training steps"
    )


def rlcycle_manifest(store: str, scenario: str, users: int) -> dict[str, Any]:
    """A realistic RLCycle (examples/rlcycle.yaml's shape) scaled to one CPU and minutes."""
    reward = {
        "editPersisted": 1.0,
        "dissatisfiedFollowup": -1.0,
        "latency": -0.1,
        "latencyScaleMs": 10000,
        "invalidToolCall": -1.0,
        "askedClarification": 0.0 if scenario == "clarify-dodge" else -0.3,
        "clip": 5,
        "baseline": "batch",
    }
    min_samples = max(100, users)
    return {
        "apiVersion": "rtrl.io/v1alpha1",
        "kind": "RLCycle",
        "metadata": {"name": NAME, "namespace": "default"},
        "spec": {
            "target": {
                "deployment": DEPLOYMENT,
                "container": CONTAINER,
                "checkpointEnv": "MODEL_URI",
            },
            "schedule": {"interval": "1h"},
            "data": {
                "shards": f"{store}interactions/",
                "maturity": "30m",
                "window": "3h",
                "minInteractions": 100,
                "maxOffPolicyFraction": 0.0,
                "maxBadFraction": 0.01,
            },
            "reward": reward,
            "training": {
                "image": "rtrl-trainer:demo",
                "nodes": 1,
                "gpusPerNode": 0,
                "zeroStage": 0,
                "precision": "fp32",
                "learningRate": 1e-3,
                "batchTokens": 1024,
                "microBatchSize": 256,
                "maxSequenceLength": 32,
                "epochs": 2,
                "klCoef": 0.02,
                "clipRatio": 1.0,
            },
            "eval": {
                "suites": ["replay"],
                "gates": [{"metric": "replay.kl", "maxRegression": 2.0}],
                "alpha": 0.05,
            },
            "rollout": {
                "router": "replicas",
                # the simulated fleet assigns each user whole to one arm, by a hash of the
                # user id (rtrl_demo/serve.py)
                "unit": "user",
                "steps": [{"weight": 50, "minDuration": "2h", "minSamples": min_samples}],
                "readyTimeout": "30m",
                "analysis": {
                    "alpha": 0.05,
                    "maxDuration": "4h",
                    "interval": "20m",
                    "inconclusive": "rollback",
                },
                "guardrails": {
                    "clarificationRate": {"maxRelativeRise": 0.10},
                    "invalidToolCallRate": {"maxRelativeRise": 0.10},
                },
            },
            "storage": {"artifacts": f"{store}artifacts/"},
            "jobs": {"backoffLimit": 0, "backoff": "1s"},
            "historyLimit": 20,
        },
    }


def deployment_manifest(uri: str, checkpoint: str) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": DEPLOYMENT, "namespace": "default", "labels": {"app": "demo"}},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": "demo"}},
            "template": {
                "metadata": {"labels": {"app": "demo"}},
                "spec": {
                    "containers": [
                        {
                            "name": CONTAINER,
                            "image": "simulated-users",
                            "env": [
                                {"name": "MODEL_URI", "value": uri},
                                {"name": CHECKPOINT_ID_ENV, "value": checkpoint},
                            ],
                        }
                    ]
                },
            },
        },
    }


class Progress:
    """A one-line text bar on stderr per long step, scaled by how long that step took
    last time (the subprocess does not report its own progress)."""

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet or not sys.stderr.isatty()
        self.last: dict[str, float] = {}

    def tick(self, label: str, kind: str, elapsed: float) -> None:
        if self.quiet:
            return
        expected = self.last.get(kind, 20.0)
        frac = min(0.99, elapsed / max(expected, 0.1))
        bar = "#" * int(frac * 30)
        sys.stderr.write(f"\r  {label:<34} [{bar:<30}] {elapsed:5.1f}s")
        sys.stderr.flush()

    def done(self, label: str, kind: str, seconds: float, ok: bool) -> None:
        self.last[kind] = seconds
        mark = "done" if ok else "FAILED"
        if self.quiet:
            print(f"  {label:<34} {mark} in {seconds:.1f}s", file=sys.stderr)
        else:
            sys.stderr.write(f"\r  {label:<34} [{'#' * 30}] {seconds:5.1f}s {mark}\n")


class Demo:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out: Path = args.out.resolve()
        self.root = self.out / "store"
        self.store = self.root.as_uri() + "/"
        self.work = self.out / "work"
        self.cluster = LocalCluster(T0 - HISTORY)
        self.progress = Progress(args.quiet)
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

    def arms(self) -> tuple[tuple[str, str], tuple[str, str] | None, float]:
        target = self.cluster.get("Deployment", DEPLOYMENT)
        canary = self.cluster.get("Deployment", f"{DEPLOYMENT}-canary")
        stable = (
            str(env_value(target, CONTAINER, CHECKPOINT_ID_ENV)),
            str(env_value(target, CONTAINER, "MODEL_URI")),
        )
        if canary is None:
            return stable, None, 0.0
        arm = (
            str(env_value(canary, CONTAINER, CHECKPOINT_ID_ENV)),
            str(env_value(canary, CONTAINER, "MODEL_URI")),
        )
        n_stable = int(target["spec"].get("replicas", 1)) if target else 1
        n_canary = int(canary["spec"].get("replicas", 1))
        return stable, arm, n_canary / (n_stable + n_canary)

    def serve_tick(
        self, arms: tuple[tuple[str, str], tuple[str, str] | None, float] | None = None
    ) -> None:
        """The users interact for one tick with what is deployed now (or with ``arms``)."""
        stable, canary, share = arms or self.arms()
        argv = [
            *SERVE, f"--shards={self.store}interactions/",
            f"--serving={stable[0]}={stable[1]}", f"--users={self.args.users}",
            f"--start={iso(self.cluster.now)}", f"--duration={int(self.tick.total_seconds())}s",
            f"--seed={self.args.seed * 100_003 + self.serve_calls}",
            f"--population-seed={self.args.seed}",
        ]  # fmt: skip
        label = f"serve {stable[0]}"
        if canary is not None:
            argv += [f"--canary={canary[0]}={canary[1]}", f"--canary-share={share:.3f}"]
            label += f" | {canary[0]} {share:.0%}"
        self.job(argv, f"{iso(self.cluster.now)[11:16]} {label}", "serve")
        self.cluster.now += self.tick

    def reward_view(self, checkpoint: str) -> str:
        """drop-invalid-tool-calls: the shards the reward pipeline sees, without the
        interactions that had an invalid tool call (the blog's bug, demo only)."""
        import pyarrow.compute as pc
        import pyarrow.parquet as pq

        src = self.root / "interactions"
        dst = self.root / "reward-view" / checkpoint
        for path in sorted(src.rglob("*.parquet")):
            target = dst / path.relative_to(src)
            if target.exists():
                continue
            table = pq.read_table(path)
            keep = pc.fill_null(pc.equal(table["invalid_tool_calls"], 0), True)
            target.parent.mkdir(parents=True, exist_ok=True)
            pq.write_table(table.filter(keep), target)
        return str(dst.as_uri()) + "/"

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
                extra = [f"--shards={self.reward_view(ckpt)}"]

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
        """Plan and apply until the plan waits for time to pass."""
        for _ in range(50):
            decided = plan(self.cluster.observe(NAME), self.cluster.now)
            self.cluster.apply(decided.actions)
            self.cluster.patch_status("RLCycle", NAME, decided.status)
            self.cluster.settle()
            self.print_finished()
            if len(self.finished_cycles()) >= self.args.cycles:
                return  # the next cycle would start at once: do not run its jobs
            ran = self.run_jobs()
            if not decided.actions and not ran and decided.requeue_after != 0:
                return

    # The whole demo ---------------------------------------------------------------------

    def setup(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        base = f"{self.store}models/demo-0/"
        if read_committed_json(f"{base}config.json") is None:
            self.job([*SERVE, f"--base-out={base}", f"--seed={self.args.seed}",
                      f"--pretrain-steps={self.args.pretrain_steps}"],
                     "base model (pre-training)", "base")  # fmt: skip
        self.cluster.create(deployment_manifest(base, "demo-0"))
        self.cluster.create(
            {
                "apiVersion": "rtrl.io/v1alpha1",
                "kind": "Checkpoint",
                "metadata": {
                    "name": "demo-0",
                    "namespace": "default",
                    "labels": {"rtrl.io/rlcycle": NAME},
                },
                "spec": {"uri": base},
            }
        )
        self.cluster.create(rlcycle_manifest(self.store, self.args.scenario, self.args.users))
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
                print(cycle_table(ck), file=sys.stderr)

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
        while len(self.finished_cycles()) < self.args.cycles and self.cluster.now < deadline:
            self.reconcile()
            if len(self.finished_cycles()) >= self.args.cycles:
                break
            self.serve_tick()
        head_to_head = self.head_to_head()
        summary = self.summary(time.monotonic() - started)
        summary["head_to_head"] = head_to_head
        if head_to_head:
            print(head_to_head_table(head_to_head), file=sys.stderr)
        from .report import write_report

        write_report(self.out, summary)
        print(f"rtrl demo: report {self.out / 'report.html'}", file=sys.stderr)
        return summary

    def head_to_head(self) -> dict[str, Any] | None:
        """The newcomer's question: is the model now serving better than the one we started
        from? Both serve half the users for ``HEAD_TO_HEAD``, then the canary analysis
        (``rtrl-job analyze``, the same always-valid test) compares them once every
        interaction has matured. None when nothing was promoted."""
        target = self.cluster.get("Deployment", DEPLOYMENT)
        final = str(env_value(target, CONTAINER, CHECKPOINT_ID_ENV))
        if final == "demo-0":
            return None
        base = ("demo-0", f"{self.store}models/demo-0/")
        arm = (final, str(env_value(target, CONTAINER, "MODEL_URI")))
        start = self.cluster.now
        while self.cluster.now < start + HEAD_TO_HEAD:
            self.serve_tick((base, arm, 0.5))
        spec = self.cluster.get("RLCycle", NAME)
        config = self.work / "rlcycle.json"
        config.write_text(json.dumps(spec))
        out = f"{self.store}head-to-head/{final}-vs-demo-0/"
        try:
            self._head_to_head_job(out, final, start, config)
        except RuntimeError as exc:  # the demo's own extra: report it, keep the cycles
            return {"baseline": "demo-0", "canary": final, "error": str(exc)[:2000]}
        doc = read_committed_json(f"{out}analysis.json")
        if not isinstance(doc, dict):
            return {"baseline": "demo-0", "canary": final, "error": str(doc)}
        return {
            "baseline": "demo-0",
            "canary": final,
            "since": iso(start),
            "baseline_samples": doc.get("baseline_samples"),
            "canary_samples": doc.get("canary_samples"),
            "metrics": analysis_metrics(doc),
        }

    def _head_to_head_job(self, out: str, final: str, start: datetime, config: Path) -> None:
        maturity = timedelta(minutes=45)  # beyond the 40-minute cap on feedback delays
        self.job(
            [
                "rtrl-job", "analyze", f"--shards={self.store}interactions/",
                "--baseline=demo-0", f"--canary={final}", f"--out={out}",
                "--canary-weight=50", f"--since={iso(start)}", f"--weight-since={iso(start)}",
                f"--config={config}", f"--now={iso(self.cluster.now + maturity)}",
            ],
            f"head-to-head {final} vs demo-0",
            "analyze",
        )  # fmt: skip

    def summary(self, seconds: float) -> dict[str, Any]:
        cycles = []
        for ck in sorted(self.owned(), key=lambda c: c["metadata"]["creationTimestamp"]):
            status = ck.get("status") or {}
            records = status.get("rollout") or []
            last = records[-1] if records else {}
            analyses = []
            for record in records:
                analyses.append(
                    {
                        k: record.get(k)
                        for k in ("weight", "startedAt", "analyses", "decision", "reason")
                    }
                )
            looks = analysis_docs(ck)
            cycles.append(
                {
                    "cycle": ck["spec"].get("cycle"),
                    "checkpoint": ck["metadata"]["name"],
                    "parent": ck["spec"].get("parent"),
                    "phase": status.get("phase"),
                    "decision": last.get("decision") or status.get("phase"),
                    # the decision's own line; every metric's line is in "looks" and in
                    # the Checkpoint's rollout record
                    "reason": (looks[-1].get("message") if looks else None)
                    or last.get("reason")
                    or status.get("message")
                    or "",
                    "data": status.get("data"),
                    "training": status.get("training"),
                    "eval": {k: (status.get("eval") or {}).get(k) for k in ("verdict", "message")},
                    "metrics": analysis_metrics(looks[-1]) if looks else last.get("metrics") or [],
                    "looks": [
                        {
                            "now": doc.get("now"),
                            "decision": doc.get("decision"),
                            "baseline_samples": doc.get("baseline_samples"),
                            "canary_samples": doc.get("canary_samples"),
                            "metrics": analysis_metrics(doc),
                        }
                        for doc in looks
                    ],
                    "samples": {
                        "baseline": last.get("baselineSamples"),
                        "canary": last.get("canarySamples"),
                    },
                    "monitors": stage_monitors(ck),
                    "rollout": analyses,
                }
            )
        target = self.cluster.get("Deployment", DEPLOYMENT)
        return {
            "scenario": self.args.scenario,
            "scenario_description": SCENARIOS[self.args.scenario],
            "users": self.args.users,
            "seed": self.args.seed,
            "cycles_requested": self.args.cycles,
            "cycles": cycles,
            "serving": env_value(target, CONTAINER, CHECKPOINT_ID_ENV),
            "events": [
                {
                    "at": iso(e.at),
                    "object": f"{e.kind}/{e.name}",
                    "reason": e.reason,
                    "message": e.message,
                }
                for e in self.cluster.events
            ],
            "timings_seconds": {k: round(v, 1) for k, v in self.timings.items()},
            "wall_seconds": round(seconds, 1),
            "simulated_hours": round((self.cluster.now - T0).total_seconds() / 3600, 2),
        }


def stage_monitors(ck: dict[str, Any]) -> dict[str, Any]:
    """The behaviour monitors the stage step measured on the serving checkpoint's data."""
    manifest = ((ck.get("status") or {}).get("data") or {}).get("manifest")
    if not manifest:
        return {}
    doc = read_committed_json(f"{manifest.rstrip('/')}/stage.json")
    if not isinstance(doc, dict):
        return {}
    return {"monitors": doc.get("monitors"), "reward": doc.get("reward")}


def analysis_docs(ck: dict[str, Any]) -> list[dict[str, Any]]:
    """Every canary analysis of this checkpoint, in order (``analyze-<k>/analysis.json``):
    the Checkpoint's status keeps each step's last look only, and no metric's role or band;
    the documents have every look."""
    records = (ck.get("status") or {}).get("rollout") or []
    judged = sum(int(r.get("analyses") or 0) for r in records)
    docs = []
    for k in range(judged):
        doc = read_committed_json(result_uri(ck["spec"]["uri"], f"analyze-{k}"))
        if isinstance(doc, dict):
            docs.append(doc)
    return docs


ANALYSIS_KEYS = (
    "name", "kind", "baseline", "canary", "difference", "ci_low", "ci_high",
    "relative_difference", "relative_ci_low", "relative_ci_high", "verdict",
    "baseline_samples", "canary_samples", "band",
)  # fmt: skip


def analysis_metrics(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [{k: m.get(k) for k in ANALYSIS_KEYS} for m in doc.get("metrics") or []]


def metrics_table(metrics: list[dict[str, Any]]) -> list[str]:
    """The blog's table: each metric in both arms, the relative change of the new checkpoint
    vs the old with its always-valid interval, and the verdict (the cells of
    :mod:`rtrl.abtable`, as ``kubectl rtrl status`` and the report show them)."""
    return ab_table(metrics, indent="  ")


def cycle_table(ck: dict[str, Any]) -> str:
    status = ck.get("status") or {}
    records = status.get("rollout") or []
    last = records[-1] if records else {}
    looks = analysis_docs(ck)
    doc = looks[-1] if looks else {}
    lines = [
        "",
        f"cycle {ck['spec'].get('cycle')}: {ck['metadata']['name']} (new) vs "
        f"{ck['spec'].get('parent')} (old), {len(looks)} look(s), "
        f"{doc.get('baseline_samples', '?')}/{doc.get('canary_samples', '?')} matured "
        f"interactions  ->  {status.get('phase')}",
    ]
    lines += metrics_table(analysis_metrics(doc) if doc else last.get("metrics") or [])
    reason = doc.get("message") or last.get("reason") or status.get("message") or ""
    lines.append(f"  decision: {last.get('decision') or status.get('phase')}: {reason}")
    return "\n".join(lines)


def head_to_head_table(h2h: dict[str, Any]) -> str:
    if h2h.get("error"):
        return f"\nhead-to-head {h2h['canary']} vs {h2h['baseline']}: {h2h['error']}"
    lines = [
        "",
        f"head-to-head: {h2h['canary']} (now serving) vs {h2h['baseline']} (the base model), "
        f"50/50 for {HEAD_TO_HEAD}, {h2h.get('baseline_samples')}/{h2h.get('canary_samples')} "
        "interactions",
    ]
    return "\n".join(lines + metrics_table(h2h.get("metrics") or []))


def run(args: argparse.Namespace) -> int:
    if not (BIN / "rtrl-job").exists():
        print("rtrl demo: rtrl-job is not installed next to this Python", file=sys.stderr)
        return 1
    summary = Demo(args).run()
    (args.out.resolve() / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    return 0
