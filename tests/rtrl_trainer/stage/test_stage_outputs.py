"""What the stage step writes: rewards and advantages on hand-computed examples, behaviour
monitors, the rank split, the insufficient-data verdict, and identical output on a rerun."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from rtrl.core.store.local import LocalStore
from rtrl_trainer.cli import main
from rtrl_trainer.stage import ranks as stage_ranks
from tests.conftest import REPO
from tests.rtrl.core.shards.helpers import write
from tests.rtrl_trainer.helpers import (
    approx,
    by_id,
    ids,
    rank_table,
    rows,
    run_stage,
    stage_args,
    training_set,
)

PARTITION = "checkpoint=ckpt-1"


def _signals() -> dict[str, list[object]]:
    return {
        "edit_persisted": [1.0, 0.5, None, None, 0.0, 0.25],
        "dissatisfied_followup": [False, True, None, True, False, False],
        "latency_ms": [2_000.0, 10_000.0, None, 0.0, 1e9, 5_000.0],
        "tool_calls": [2, 3, None, 0, 0, 1],
        "invalid_tool_calls": [0, 1, None, 0, 0, 1],
        "asked_clarification": [False, False, None, False, False, True],
        "edits_proposed": [1, 2, None, 0, 1, 0],
    }


def test_rewards_on_hand_computed_examples(tmp_path: Path) -> None:
    write(rows(6, **_signals()), tmp_path / "shards" / PARTITION / "p.parquet")
    config = tmp_path / "c.yaml"
    config.write_text("reward: {askedClarification: -0.5}\n")
    code, doc = run_stage(tmp_path / "shards", tmp_path / "out", "--config", str(config))
    assert code == 0
    out = by_id(training_set(tmp_path / "out"))
    expected = [
        1.0 - 0.1 * 0.2,  # a persisted edit, 2 s
        0.5 - 1.0 - 0.1 * 1.0 - 1.0,  # dissatisfied, 10 s, an invalid tool call: kept
        0.0,  # every signal missing: nothing known, nothing rewarded
        -1.0,  # edit_persisted missing counts 0; dissatisfied
        -5.0,  # 1e9 ms would be -10000: clipped to -clip
        0.25 - 0.1 * 0.5 - 1.0 - 0.5,  # invalid call and a clarifying question
    ]
    assert [out[f"i{i:05d}"]["reward"] for i in range(6)] == approx(expected)
    mean = float(np.mean(expected))
    std = float(np.std(expected))
    assert doc["reward"] == {
        "mean": pytest.approx(mean),
        "std": pytest.approx(std),
        "min": -5.0,
        "max": pytest.approx(0.98),
    }
    adv = [(r - mean) / std for r in expected]
    assert [out[f"i{i:05d}"]["advantage"] for i in range(6)] == approx(adv, rel=1e-5)
    assert doc["advantage"]["mean"] == pytest.approx(0.0, abs=1e-6)
    assert doc["advantage"]["std"] == pytest.approx(1.0, rel=1e-5)
    assert doc["missing_signals"] == {
        "edit_persisted": 2,
        "dissatisfied_followup": 1,
        "latency_ms": 1,
        "tool_calls": 1,
        "invalid_tool_calls": 1,
        "asked_clarification": 1,
        "edits_proposed": 1,
    }


def test_per_org_baselines(tmp_path: Path) -> None:
    data = rows(
        5,
        org=["acme", "acme", "globex", "globex", None],
        edit_persisted=[1.0, 0.0, 0.5, 0.5, 0.0],
        dissatisfied_followup=[False, False, False, False, True],
    )
    write(data, tmp_path / "shards" / PARTITION / "p.parquet")
    config = tmp_path / "c.yaml"
    config.write_text("reward: {baseline: org}\n")
    code, doc = run_stage(tmp_path / "shards", tmp_path / "out", "--config", str(config))
    assert code == 0
    out = by_id(training_set(tmp_path / "out"))
    rewards = [1.0, 0.0, 0.5, 0.5, -1.0]
    std = float(np.std(rewards))  # the whole batch's: sqrt(0.46)
    assert std == pytest.approx(math.sqrt(0.46))
    expected = [0.5 / std, -0.5 / std, 0.0, 0.0, 0.0]  # each minus its org's mean
    assert [out[f"i{i:05d}"]["advantage"] for i in range(5)] == approx(expected, rel=1e-5)
    assert doc["baselines"] == [
        {"org": "acme", "rows": 2, "baseline": 0.5},
        {"org": "globex", "rows": 2, "baseline": 0.5},
        {"org": None, "rows": 1, "baseline": -1.0},
    ]


def test_equal_rewards_give_zero_advantages(tmp_path: Path) -> None:
    write(rows(4, edit_persisted=0.75), tmp_path / "shards" / PARTITION / "p.parquet")
    code, doc = run_stage(tmp_path / "shards", tmp_path / "out")
    assert code == 0
    out = training_set(tmp_path / "out")
    assert out.column("advantage").to_pylist() == [0.0] * 4
    assert doc["reward"]["std"] == 0.0


def test_behaviour_monitors(tmp_path: Path) -> None:
    data = rows(
        6,
        completion_ids=[[1] * n for n in (1, 2, 3, 4, 5, 6)],
        completion_logprobs=[[-0.1] * n for n in (1, 2, 3, 4, 5, 6)],
        completion_mask=[[True] * n for n in (1, 2, 3, 4, 5, 6)],
        latency_ms=[100.0, 200.0, 300.0, 400.0, 500.0, None],
        **{k: v for k, v in _signals().items() if k != "latency_ms"},
    )
    write(data, tmp_path / "shards" / PARTITION / "p.parquet")
    code, doc = run_stage(tmp_path / "shards", tmp_path / "out")
    assert code == 0
    monitors = doc["monitors"]
    assert monitors == {
        "edit_rate": 3 / 6,  # edits_proposed > 0 (null counts 0)
        "clarification_rate": 1 / 6,
        "invalid_tool_call_rate": 2 / 6,  # 2 invalid of 6 calls
        "invalid_tool_call_interaction_rate": 2 / 6,
        "mean_completion_tokens": 21 / 6,
        "latency_p50_ms": pytest.approx(300.0, rel=0.01),  # nearest rank of 5 reported
        "latency_p95_ms": pytest.approx(500.0, rel=0.01),
        "edit_persistence": pytest.approx(1.75 / 4),  # mean where measured
        "dissatisfied_rate": 2 / 6,
    }


def test_insufficient_data_writes_the_verdict_and_no_training_set(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write(rows(5), tmp_path / "shards" / PARTITION / "p.parquet")
    code = main(stage_args(tmp_path / "shards", tmp_path / "out", "--min-interactions", "10"))
    assert code == 0
    assert "insufficient" in capsys.readouterr().out
    doc = json.loads((tmp_path / "out" / "stage.json").read_text())
    assert (doc["ok"], doc["sufficient"], doc["interactions_used"]) == (True, False, 5)
    assert doc["message"].startswith("insufficient data: 5 interactions (minimum 10)")
    assert doc["ranks"] == [] and doc["files"] == []
    manifest = LocalStore(tmp_path / "out").committed("")
    assert manifest is not None and set(manifest.files) == {"stage.json"}
    # The monitors and rewards are still reported: the operator shows them while waiting.
    assert doc["monitors"]["edit_rate"] == 1.0

    code, doc = run_stage(tmp_path / "shards", tmp_path / "tokens", "--min-tokens", "11")
    assert code == 0
    assert (doc["sufficient"], doc["tokens_used"]) == (False, 10)


def test_ranks_are_dealt_round_robin(tmp_path: Path) -> None:
    lengths = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    data = rows(
        10,
        completion_ids=[[1] * n for n in lengths],
        completion_logprobs=[[-0.1] * n for n in lengths],
        completion_mask=[[True] * n for n in lengths],
    )
    write(data, tmp_path / "shards" / PARTITION / "p.parquet")
    out = tmp_path / "out"
    code, doc = run_stage(tmp_path / "shards", out, "--ranks", "3")
    assert code == 0
    names = [f"train/rank-0000{r}-of-00003.parquet" for r in range(3)]
    sides = [f"train/rank-0000{r}-of-00003.advantage.parquet" for r in range(3)]
    assert doc["files"] == sorted(names + sides)
    parts = [rank_table(out, name) for name in names]
    assert [p.column("interaction_id").to_pylist() for p in parts] == [
        ["i00000", "i00003", "i00006", "i00009"],
        ["i00001", "i00004", "i00007"],
        ["i00002", "i00005", "i00008"],
    ]
    assert doc["ranks"] == [
        {"rank": 0, "file": names[0], "advantages": sides[0], "rows": 4, "tokens": 1 + 4 + 7 + 10},
        {"rank": 1, "file": names[1], "advantages": sides[1], "rows": 3, "tokens": 2 + 5 + 8},
        {"rank": 2, "file": names[2], "advantages": sides[2], "rows": 3, "tokens": 3 + 6 + 9},
    ]
    assert doc["tokens_used"] == sum(lengths)
    # Fewer ranks on a rerun: the extra rank file of the earlier run is gone.
    code, doc = run_stage(tmp_path / "shards", out, "--ranks", "2")
    assert sorted(p.name for p in (out / "train").iterdir()) == [
        "rank-00000-of-00002.advantage.parquet",
        "rank-00000-of-00002.parquet",
        "rank-00001-of-00002.advantage.parquet",
        "rank-00001-of-00002.parquet",
    ]
    manifest = LocalStore(out).committed("")
    assert manifest is not None
    assert set(manifest.files) == {"stage.json", *doc["files"]}


def test_more_ranks_than_rows_leaves_empty_rank_files(tmp_path: Path) -> None:
    write(rows(2), tmp_path / "shards" / PARTITION / "p.parquet")
    code, doc = run_stage(tmp_path / "shards", tmp_path / "out", "--ranks", "4")
    assert code == 0
    assert [r["rows"] for r in doc["ranks"]] == [1, 1, 0, 0]
    empty = rank_table(tmp_path / "out", doc["ranks"][3]["file"])
    assert empty.num_rows == 0
    assert "advantage" in empty.schema.names


def _files(out: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(out)): p.read_bytes()
        for p in sorted(out.rglob("*"))
        if p.is_file() and p.name not in ("stage.json", "_MANIFEST.json")
    }


def _without_timing(out: Path) -> dict[str, object]:
    doc: dict[str, object] = json.loads((out / "stage.json").read_text())
    doc.pop("timing")
    return doc


def test_rerunning_gives_identical_output(tmp_path: Path) -> None:
    shards = tmp_path / "shards"
    write(rows(40, org=["acme", "globex"] * 20), shards / PARTITION / "a.parquet")
    previous = rows(
        30,
        checkpoint_id="ckpt-0",
        interaction_id=[f"p{i:05d}" for i in range(30)],
        edit_persisted=0.5,
    )
    write(previous, shards / "checkpoint=ckpt-0" / "a.parquet")
    config = tmp_path / "c.yaml"
    config.write_text("data: {maxOffPolicyFraction: 0.2}\nreward: {baseline: org}\n")
    args = ("--config", str(config), "--previous-checkpoint", "ckpt-0", "--ranks", "2")
    out = tmp_path / "out"
    assert run_stage(shards, out, *args)[0] == 0
    first_files, first_doc = _files(out), _without_timing(out)
    assert run_stage(shards, out, *args)[0] == 0
    assert _files(out) == first_files
    assert _without_timing(out) == first_doc
    assert first_doc["off_policy_interactions"] == 10
    # And into another prefix: the same training set, byte for byte.
    other = tmp_path / "other"
    assert run_stage(shards, other, *args)[0] == 0
    assert _files(other) == first_files
    assert ids(training_set(other)) == ids(training_set(out))


def test_stage_json_has_the_documented_keys(tmp_path: Path) -> None:
    write(rows(3), tmp_path / "shards" / PARTITION / "p.parquet")
    _, doc = run_stage(tmp_path / "shards", tmp_path / "out")
    required = {
        "ok", "sufficient", "checkpoint", "previous_checkpoint", "now", "since", "cutoff",
        "next_since", "rows_read", "immature", "too_recent", "excluded", "interactions_used",
        "tokens_used", "on_policy_fraction", "quarantined", "files_total", "files_bad",
        "bad_fraction", "reward", "advantage", "monitors", "ranks", "timing",
    }  # fmt: skip
    assert required <= set(doc)
    assert set(doc["monitors"]) == {
        "edit_rate", "clarification_rate", "invalid_tool_call_rate",
        "invalid_tool_call_interaction_rate", "mean_completion_tokens", "latency_p50_ms",
        "latency_p95_ms", "edit_persistence", "dissatisfied_rate",
    }  # fmt: skip
    assert set(doc["reward"]) == {"mean", "std", "min", "max"}
    # docs/stage.md shows a stage.json with exactly these keys.
    documented = (REPO / "docs" / "stage.md").read_text()
    for key in doc:
        assert f'"{key}"' in documented, key


def test_a_failing_local_disk_fails_the_step_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    write(rows(3), tmp_path / "shards" / PARTITION / "p.parquet")

    class FullDisk(pq.ParquetWriter):
        def write_table(self, table: object, row_group_size: int | None = None) -> None:
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(stage_ranks.pq, "ParquetWriter", FullDisk)
    code = main(stage_args(tmp_path / "shards", tmp_path / "out"))
    assert code == 1
    assert capsys.readouterr().err == (
        "stage: local I/O failed: [Errno 28] No space left on device\n"
    )
    assert LocalStore(tmp_path / "out").committed("") is None  # nothing half-written

    code = main(stage_args(tmp_path / "shards", tmp_path / "out", "--work-dir", "/dev/null"))
    assert code == 2
    assert "--work-dir /dev/null: not a directory" in capsys.readouterr().err
