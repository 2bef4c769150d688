"""A demo run's summary for the report's tests, without running the demo: three cycles
(promoted then superseded, promoted, rolled back by a tripped guardrail), their looks, the
canary's weights, Events, eval gates, and real inputs where the summary reads files: answer
mixes counted from Parquet shards by :func:`rtrl_demo.traces.answer_mix`, learning curves
read back by :func:`rtrl_demo.traces.training_curves` from TensorBoard event files that
torch's SummaryWriter wrote (the tags the train step writes)."""

from __future__ import annotations

import math
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from rtrl_demo import sim
from rtrl_demo.traces import TRAIN_TAGS, answer_mix, training_curves

T0 = datetime(2026, 1, 5, 8, 0)


def iso(t: datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


def metric(  # noqa: PLR0917  (a row of the table, in its columns' order)
    name: str,
    kind: str,
    old: float,
    new: float,
    lo: float,
    hi: float,
    verdict: str,
    band: dict[str, float] | None = None,
) -> dict[str, Any]:
    rel = new / old - 1
    return {
        "name": name,
        "kind": kind,
        "baseline": old,
        "canary": new,
        "difference": new - old,
        "ci_low": old * lo,
        "ci_high": old * hi,
        "relative_difference": rel,
        "relative_ci_low": lo,
        "relative_ci_high": hi,
        "verdict": verdict,
        "baseline_samples": 4500,
        "canary_samples": 4400,
        "band": band,
    }


RISE = {"max_relative_rise": 0.1}


def metrics(k: int, tripped: bool) -> list[dict[str, Any]]:
    """Cycle k's rows at a look: goals better; the clarification guardrail tripped (with
    an interval beyond any axis) when ``tripped``."""
    s = 1 / (k + 1)
    clar = (0.118, 0.233, 0.50, 3.2, "tripped") if tripped else (0.118, 0.074, -0.54, -0.21, "ok")
    return [
        metric(
            "edit_persistence", "goal", 0.456, 0.456 * (1 + 0.49 * s), 0.3 * s, 0.66 * s, "better"
        ),
        metric("dissatisfied_followup_rate", "goal", 0.44, 0.292, -0.41, -0.265, "better"),
        metric("latency_ms", "goal", 1327.4, 1143.2, -0.166, -0.111, "better"),
        metric(
            "edit_rate", "guardrail", 0.807, 0.905, 0.084, 0.16, "ok", {"max_relative_drop": 0.05}
        ),
        metric("clarification_rate", "guardrail", *clar, RISE),
        metric("invalid_tool_call_rate", "guardrail", 0.187, 0.034, -0.925, -0.715, "ok", RISE),
    ]


def write_events(uri: Path, steps: int, seed: float) -> None:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(uri / "tensorboard"))
    for step in range(1, steps + 1):
        for i, tag in enumerate(TRAIN_TAGS):
            writer.add_scalar(tag, (1 + i) * math.exp(-step / (5 + seed)) + 0.01 * i, step)
    writer.close()


def write_shards(root: Path) -> Path:
    """Interactions of demo-0..3, their answers drawn by the base model's prior, with more
    questions on the hidden-preference tasks for demo-3 (a clarify-dodge)."""
    import random

    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(0)
    rows: dict[str, list[Any]] = {"checkpoint_id": [], "prompt_ids": [], "completion_ids": []}
    for ckpt in ("demo-0", "demo-1", "demo-2", "demo-3"):
        for _ in range(400):
            task = sim.make_task(rng)
            answer = sim.prior_completion(task, rng)
            if ckpt == "demo-3" and task.kind in ("tool_hard", "vague") and rng.random() < 0.6:
                answer = [sim.ASK, sim.Q, sim.EOS]
            rows["checkpoint_id"].append(ckpt)
            rows["prompt_ids"].append(task.prompt)
            rows["completion_ids"].append(answer)
    path = root / "interactions" / "checkpoint=all" / "part-00000.parquet"
    path.parent.mkdir(parents=True)
    pq.write_table(pa.table(rows), path)
    return root / "interactions"


def summary(root: Path, with_events: bool = True) -> dict[str, Any]:
    phases = [("Superseded", "promote"), ("Promoted", "promote"), ("RolledBack", "rollback")]
    cycles, events, weights = [], [], []
    parents = ["demo-0", "demo-1", "demo-2"]
    for k, (phase, decision) in enumerate(phases, start=1):
        name = f"demo-{k}"
        uri = root / "models" / name
        uri.mkdir(parents=True)
        if with_events and k < 3:  # demo-3's train step wrote none
            write_events(uri, 12, k)
        start = T0 + timedelta(hours=3 * k)
        n_looks = 3 if k == 3 else 1
        looks = [
            {
                "now": iso(start + timedelta(hours=2, minutes=20 * j)),
                "decision": "continue",
                "baseline_samples": 4500 + 900 * j,
                "canary_samples": 4400 + 900 * j,
                "metrics": metrics(k, tripped=k == 3 and j == n_looks - 1),
            }
            for j in range(n_looks)
        ]
        for h in range(3 + n_looks):
            weights.append(
                {
                    "at": iso(start + timedelta(minutes=60 * h)),
                    "serving": parents[k - 1],
                    "canary": name if h > 0 else None,
                    "weight": 50.0 if h > 0 else 0.0,
                }
            )
        for minutes, reason, warning in (
            (0, "Staged", False),
            (10, "Trained", False),
            (20, "CanaryStarted", False),
            (
                140 + 20 * n_looks,
                "Promoted" if decision == "promote" else "RolledBack",
                decision == "rollback",
            ),
        ):
            events.append(
                {
                    "at": iso(start + timedelta(minutes=minutes)),
                    "object": f"Checkpoint/{name}",
                    "reason": reason,
                    "message": f"{name}: {reason}",
                    "warning": warning,
                }
            )
        cycles.append(
            {
                "cycle": k,
                "checkpoint": name,
                "parent": parents[k - 1] if k < 3 else "demo-2",
                "phase": phase,
                "decision": decision,
                "reason": "guardrail tripped: clarification_rate moved beyond its band"
                if k == 3
                else "edit_persistence significantly better",
                "training": {
                    "steps": 12,
                    "tokens": 9000,
                    "loss": 0.12,
                    "kl": 0.0042,
                    "wallSeconds": 20.5,
                },
                "training_curves": training_curves(uri.as_uri() + "/"),
                "eval": {
                    "verdict": "Passed",
                    "message": "",
                    "gates": [
                        {
                            "metric": "replay.kl",
                            "candidate": 0.01 * k,
                            "parent": 0.0,
                            "ciLow": 0.005 * k,
                            "ciHigh": 0.015 * k,
                            "passed": True,
                        }
                    ],
                },
                "metrics": looks[-1]["metrics"],
                "looks": looks,
                "monitors": {
                    "monitors": {
                        "edit_rate": 0.8,
                        "clarification_rate": 0.1,
                        "invalid_tool_call_rate": 0.15 / k,
                        "mean_completion_tokens": 3.2,
                    },
                    "reward": {"mean": -0.17 + 0.2 * k},
                },
                "rollout": [{"weight": 50, "decision": decision, "metrics": None}],
            }
        )
    events.insert(
        0,
        {
            "at": iso(T0),
            "object": "RLCycle/demo",
            "reason": "SpecValid",
            "message": "ok",
            "warning": False,
        },
    )
    h2h_metrics = metrics(1, tripped=False)
    return {
        "scenario": "default",
        "scenario_description": "test data",
        "users": 1000,
        "cycles": cycles,
        "serving": "demo-2",
        "events": events,
        "canary_weights": weights,
        "answer_mix": answer_mix(write_shards(root)),
        "gates": [{"metric": "replay.kl", "maxRegression": 2.0}],
        "head_to_head": {
            "baseline": "demo-0",
            "canary": "demo-2",
            "baseline_samples": 5949,
            "canary_samples": 6013,
            "metrics": h2h_metrics,
        },
        "simulated_hours": 14.0,
        "wall_seconds": 180.0,
    }


def failed_summary(root: Path) -> dict[str, Any]:
    """A demo whose only cycle failed in training: nothing was canaried or promoted, and
    only the base checkpoint served (one bar per task kind in the answer mix)."""
    import random

    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(1)
    rows: dict[str, list[Any]] = {"checkpoint_id": [], "prompt_ids": [], "completion_ids": []}
    for _ in range(300):
        task = sim.make_task(rng)
        rows["checkpoint_id"].append("demo-0")
        rows["prompt_ids"].append(task.prompt)
        rows["completion_ids"].append(sim.prior_completion(task, rng))
    path = root / "interactions" / "checkpoint=demo-0" / "part-00000.parquet"
    path.parent.mkdir(parents=True)
    pq.write_table(pa.table(rows), path)
    (root / "models" / "demo-1").mkdir(parents=True)
    start = T0 + timedelta(hours=3)
    return {
        "scenario": "default",
        "scenario_description": "test data",
        "users": 1000,
        "cycles": [
            {
                "cycle": 1,
                "checkpoint": "demo-1",
                "parent": "demo-0",
                "phase": "Failed",
                "decision": None,
                "reason": "train Job failed: exit 1",
                "training": None,
                "training_curves": training_curves((root / "models" / "demo-1").as_uri() + "/"),
                "eval": None,
                "metrics": [],
                "looks": [],
                "monitors": None,
                "rollout": [],
            }
        ],
        "serving": "demo-0",
        "events": [
            {
                "at": iso(start),
                "object": "Checkpoint/demo-1",
                "reason": "Staged",
                "message": "demo-1: Staged",
                "warning": False,
            },
            {
                "at": iso(start + timedelta(minutes=30)),
                "object": "Checkpoint/demo-1",
                "reason": "Failed",
                "message": "demo-1: train Job failed",
                "warning": True,
            },
        ],
        "canary_weights": [
            {"at": iso(start), "serving": "demo-0", "canary": None, "weight": 0.0},
            {
                "at": iso(start + timedelta(hours=1)),
                "serving": "demo-0",
                "canary": None,
                "weight": 0.0,
            },
        ],
        "answer_mix": answer_mix(root / "interactions"),
        "gates": [{"metric": "replay.kl", "maxRegression": 2.0}],
        "head_to_head": None,
        "simulated_hours": 4.0,
        "wall_seconds": 60.0,
    }
