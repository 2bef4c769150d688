"""Lost rows at every unit (rtrl_trainer.analyze.reconcile): each arm's rows against its
share, and against the requests the capture proxy served (generation events, counted over
the hours the seal's markers say are complete), by hand and through ``rtrl-job analyze``
on real shards, event files and markers."""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rtrl.core.events import GENERATION_SCHEMA, SealMarker, event_file_key, seal_marker_key
from rtrl.core.events.ids import new_interaction_id
from rtrl.core.shards import write_shards
from rtrl.core.store.local import LocalStore
from rtrl_trainer.analyze.reconcile import count_served, logged_per_served, rows_per_share
from rtrl_trainer.cli import main
from tests.rtrl_trainer.helpers import rows

START = datetime(2026, 1, 5, 8, 0, tzinfo=UTC)


def test_logged_per_served_by_hand() -> None:
    d = logged_per_served(10_000, 9_950, 5_000, 4_800)
    assert d.baseline == pytest.approx(0.995) and d.canary == pytest.approx(0.96)
    assert d.log_ratio == pytest.approx(math.log(0.96 / 0.995))
    expected = 0.96 * 0.04 / 5_000 / 0.96**2 + 0.995 * 0.005 / 10_000 / 0.995**2
    assert d.log_var == pytest.approx(expected)
    # nothing lost anywhere: no binomial variance, so half a lost row stands in for it
    whole = logged_per_served(1_000, 1_000, 1_000, 1_000)
    assert whole.log_ratio == 0 and whole.log_var == pytest.approx(2 * 0.5 / 1_000 / 1_000)


def test_rows_per_share_by_hand() -> None:
    # steps at 5% and 50%: the canary logged 3% fewer rows than its share in both
    counts = np.array([[9_500.0, 20_000.0], [0.97 * 500, 0.97 * 20_000]])
    d = rows_per_share(counts, [0.05, 0.5])
    assert float(np.expm1(d.log_ratio)) == pytest.approx(-0.03, abs=1e-12)
    w = [1 / (1 / 9_500 + 1 / 485), 1 / (1 / 20_000 + 1 / 19_400)]
    assert float(d.log_var) == pytest.approx(1 / sum(w))


def generations(
    hour: datetime, count: int, checkpoint: str, seed: int, *, start: datetime | None = None,
    end: datetime | None = None,
) -> list[dict[str, Any]]:  # fmt: skip
    """``count`` requests served by ``checkpoint`` in ``[start, end)`` (default: the hour)."""
    rng = np.random.default_rng(seed)
    first = start or hour
    span = ((end or hour + timedelta(hours=1)) - first).total_seconds()
    out = []
    for i in range(count):
        at = first + timedelta(seconds=float(rng.uniform(0, span)))
        row: dict[str, Any] = {name: None for name in GENERATION_SCHEMA.names}
        row.update(interaction_id=new_interaction_id(at), created_at=at, checkpoint_id=checkpoint,
                   arm="canary" if checkpoint == "cand" else "stable", status=200,
                   user_id=f"u{i % 300}")  # fmt: skip
        out.append(row)
    return out


def write_generations(
    store: LocalStore, hour: datetime, rows_: list[dict[str, Any]], seq: int
) -> str:
    key = event_file_key("generations", hour, "capture-0", seq)
    path = store.root / key
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows_, schema=GENERATION_SCHEMA), path)
    return key


def seal(store: LocalStore, hour: datetime, keys: list[str], at: datetime) -> None:
    marker = SealMarker(hour=hour, sealed_at=at, generations=keys)
    path = store.root / seal_marker_key(hour)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(marker.to_json())


def served_world(
    tmp_path: Path, *, lost: float
) -> tuple[LocalStore, LocalStore, list[dict[str, Any]]]:
    """Four hours of a canary at 50% from 08:30: each arm served 2,000 requests an hour
    (1,000 in the first half hour); the canary's rows of ``lost`` of them never reached the
    shards. Hours 08 to 10 are sealed (11 is not)."""
    events, shards = LocalStore(tmp_path / "events"), LocalStore(tmp_path / "shards")
    logged: list[dict[str, Any]] = []
    rng = np.random.default_rng(5)
    for h in range(4):
        hour = START + timedelta(hours=h)
        since = START + timedelta(minutes=30) if h == 0 else None
        count = 1_000 if h == 0 else 2_000
        keys = []
        for seq, ckpt in enumerate(("base", "cand")):
            served = generations(hour, count, ckpt, seed=10 * h + seq, start=since)
            if h == 0 and ckpt == "base":  # and before the canary: not counted
                served += generations(hour, 500, "base", seed=99, end=since)
            keys.append(write_generations(events, hour, served, seq))
            drop = rng.random(len(served)) < (lost if ckpt == "cand" else 0.0)
            logged += [r for r, d in zip(served, drop, strict=True) if not d]
        # a retried upload: the same canary events once more, counted once
        if h == 1:
            keys.append(keys[1])
        if h < 3:
            seal(shards, hour, keys, hour + timedelta(hours=2, minutes=10))
    return events, shards, logged


def test_count_served_reads_the_sealed_hours_once_each(tmp_path: Path) -> None:
    events, shards, _ = served_world(tmp_path, lost=0.0)
    found = count_served(
        events, shards, since=START + timedelta(minutes=30), until=START + timedelta(hours=5),
        checkpoints=("base", "cand"),
    )  # fmt: skip
    # hours 08, 09 and 10 were sealed by 13:00 (11 was not), the repeated file counted once
    assert sorted(found.by_hour) == [START + timedelta(hours=h) for h in range(3)]
    assert found.by_hour[START]["cand"] == 1_000
    assert sum(c["base"] for c in found.by_hour.values()) == 5_000
    assert sum(c["cand"] for c in found.by_hour.values()) == 5_000
    # by 11:00 only hour 08 was sealed (at 10:10)
    early = count_served(
        events, shards, since=START + timedelta(minutes=30), until=START + timedelta(hours=3),
        checkpoints=("base", "cand"),
    )  # fmt: skip
    assert sorted(early.by_hour) == [START]


def test_count_served_counts_one_organisations_requests(tmp_path: Path) -> None:
    """An organisation's adapter canary reconciles its own served requests, not the other
    organisations' (which the base serves and which never reach its analysis)."""
    events, shards = LocalStore(tmp_path / "events"), LocalStore(tmp_path / "shards")
    keys = []
    for seq, ckpt in enumerate(("base", "cand")):
        served = generations(START, 1_000, ckpt, seed=seq)
        for i, row in enumerate(served):
            row["org"] = "acme" if ckpt == "cand" or i % 4 == 0 else "globex"
        keys.append(write_generations(events, START, served, seq))
    seal(shards, START, keys, START + timedelta(hours=2))
    found = count_served(
        events, shards, since=START, until=START + timedelta(hours=3),
        checkpoints=("base", "cand"), org="acme",
    )  # fmt: skip
    assert found.by_hour[START] == {"base": 250, "cand": 1_000}
    left = count_served(
        events, shards, since=START, until=START + timedelta(hours=3),
        checkpoints=("base", "cand"), exclude_orgs=("acme",),
    )  # fmt: skip
    assert left.by_hour[START] == {"base": 750, "cand": 0}


def shard_rows(logged: list[dict[str, Any]]) -> pa.Table:
    n = len(logged)
    rng = np.random.default_rng(2)
    created = [r["created_at"] for r in logged]
    return rows(
        n,
        interaction_id=[r["interaction_id"] for r in logged],
        checkpoint_id=[r["checkpoint_id"] for r in logged],
        user_id=[r["user_id"] for r in logged],
        created_at=created,
        feedback_at=[c + timedelta(minutes=20) for c in created],
        edit_persisted=(rng.random(n) < 0.45).astype(float).tolist(),
        dissatisfied_followup=(rng.random(n) < 0.1).tolist(),
        latency_ms=(1000 * rng.lognormal(0, 0.5, n)).tolist(),
        edits_proposed=(rng.random(n) < 0.8).astype(int).tolist(),
        asked_clarification=(rng.random(n) < 0.05).tolist(),
    )


def analyze(shards: Path, out: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    code = main([
        "analyze", "--shards", shards.as_uri() + "/", "--baseline", "base", "--canary", "cand",
        "--out", out.as_uri() + "/", "--since", "2026-01-05T08:30:00Z",
        "--now", "2026-01-05T13:00:00Z", "--canary-weight", "50", *extra,
    ])  # fmt: skip
    path = out / "analysis.json"
    return code, json.loads(path.read_text()) if path.exists() else {}


@pytest.mark.parametrize("lost", [0.0, 0.03])
def test_a_logging_fault_in_one_arm_stops_the_canary(tmp_path: Path, lost: float) -> None:
    """3% of the canary's rows never reached the shards: its logged share of what it
    served is 97% against the stable arm's 100%, beyond the 1% band: rollback. Without
    the loss the guardrail is within its band."""
    events, shards, logged = served_world(tmp_path, lost=lost)
    write_shards(shard_rows(logged), shards.root, partition_by=("checkpoint",))
    code, doc = analyze(shards.root, tmp_path / "out", "--events", events.root.as_uri() + "/")
    assert code == 0, doc
    rec = doc["reconciliation"]
    assert rec["served"] == {"base": 5_000, "cand": 5_000}
    assert len(rec["sealed_hours"]) == 3
    row = {m["name"]: m for m in doc["metrics"]}["logged_per_served"]
    if lost:
        assert row["relative_difference"] == pytest.approx(-0.03, abs=0.006)
        assert row["verdict"] == "tripped"
        assert doc["decision"] == "rollback"
        assert doc["reasons"][0].startswith("guardrail tripped: logged_per_served")
    else:
        assert row["relative_difference"] == 0 and row["verdict"] == "ok"
        assert doc["decision"] != "rollback"
    # without the events the guardrail is not judged and spends nothing
    code, plain = analyze(shards.root, tmp_path / "plain")
    assert "logged_per_served" not in {m["name"] for m in plain["metrics"]}
    assert "reconciliation" not in plain
