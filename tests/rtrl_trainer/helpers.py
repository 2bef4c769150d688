"""Building blocks for the stage tests: hand-made interactions whose every value is chosen,
a stage run in-process, and reading back what it committed."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rtrl.core.shards import INTERACTION_SCHEMA
from rtrl.core.store.local import LocalStore
from rtrl_trainer.cli import main
from rtrl_trainer.stagedset import ADVANTAGE_SUFFIX, advantage_name, to_lists, with_advantages

T0 = datetime(2026, 1, 5, 8, 0, tzinfo=UTC)
NOW = datetime(2026, 1, 5, 12, 0, tzinfo=UTC)  # maturity 1h: cutoff 11:00
NOW_ISO = "2026-01-05T12:00:00Z"


def rows(n: int, **columns: Any) -> pa.Table:
    """``n`` canonical interactions of checkpoint ``ckpt-1``, created a minute apart from
    08:00, feedback ten minutes later, all signals neutral; keyword arguments replace a
    column by a list of ``n`` values or one value for every row."""
    created = [T0 + timedelta(minutes=i) for i in range(n)]
    values: dict[str, Any] = {
        "interaction_id": [f"i{i:05d}" for i in range(n)],
        "checkpoint_id": "ckpt-1",
        "user_id": "u1",
        "org": "acme",
        "created_at": created,
        "feedback_at": [c + timedelta(minutes=10) for c in created],
        "prompt_ids": [[1, 2, 3]] * n,
        "completion_ids": [[4, 5]] * n,
        "completion_logprobs": [[-0.5, -0.25]] * n,
        "completion_mask": [[True, False]] * n,
        "edit_persisted": 0.0,
        "dissatisfied_followup": False,
        "latency_ms": 0.0,
        "tool_calls": 0,
        "invalid_tool_calls": 0,
        "asked_clarification": False,
        "edits_proposed": 1,
    }
    values.update(columns)
    arrays = []
    for field in INTERACTION_SCHEMA:
        value = values[field.name]
        if not isinstance(value, list):
            value = [value] * n
        assert len(value) == n, f"{field.name}: {len(value)} values for {n} rows"
        arrays.append(pa.array(value, field.type))
    return pa.Table.from_arrays(arrays, schema=INTERACTION_SCHEMA)


def stage_args(
    shards: Path, out: Path, *extra: str, checkpoint: str = "ckpt-1", now: str = NOW_ISO
) -> list[str]:
    return [
        "stage",
        "--shards",
        shards.as_uri() + "/",
        "--checkpoint",
        checkpoint,
        "--out",
        out.as_uri() + "/",
        "--now",
        now,
        "--min-interactions",
        "1",
        # The held-out split has its own tests; these keep every selected row in training.
        "--heldout-fraction",
        "0",
        *extra,
    ]


def run_stage(
    shards: Path, out: Path, *extra: str, checkpoint: str = "ckpt-1", now: str = NOW_ISO
) -> tuple[int, dict[str, Any]]:
    """Run ``rtrl-job stage`` in-process; (exit status, committed stage.json or {})."""
    code = main(stage_args(shards, out, *extra, checkpoint=checkpoint, now=now))
    result = out / "stage.json"
    return code, json.loads(result.read_text()) if result.exists() else {}


def rank_table(out: Path, name: str) -> pa.Table:
    """One committed rank file with its advantages joined (as the trainer reads it)."""
    return with_advantages(
        pq.read_table(out / name), pq.read_table(out / advantage_name(name)), name
    )


def training_set(out: Path) -> pa.Table:
    """All rank files of a committed training set, in rank order, with their advantages,
    as one table (the packed per-token columns as lists, as the shards had them)."""
    manifest = LocalStore(out).committed("")
    assert manifest is not None, f"{out} is not committed"
    names = sorted(
        name
        for name in manifest.files
        if name.startswith("train/") and not name.endswith(ADVANTAGE_SUFFIX)
    )
    if not names:
        return pa.table({})
    return to_lists(pa.concat_tables(rank_table(out, name) for name in names))


def by_id(t: pa.Table) -> dict[str, dict[str, Any]]:
    return {row["interaction_id"]: row for row in t.to_pylist()}


def ids(t: pa.Table) -> list[str]:
    if t.num_columns == 0:
        return []
    return sorted(t.column("interaction_id").to_pylist())


def write_config(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def approx(values: Sequence[float], rel: float = 1e-6) -> Any:
    return pytest.approx(list(values), rel=rel, abs=1e-6)
