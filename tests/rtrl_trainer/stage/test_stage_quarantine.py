"""Quarantine through the stage step: every reason is skipped, counted and listed, never
trained on; too much bad data fails the step with a clear message and no training set."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rtrl.core.store.local import LocalStore
from rtrl_trainer.cli import main
from tests.rtrl.core.shards.helpers import replace, set_cell, write
from tests.rtrl_trainer.helpers import ids, rows, run_stage, stage_args, training_set

PARTITION = "checkpoint=ckpt-1"


def _bad_file(root: Path, t: pa.Table) -> None:
    write(t, root / PARTITION / "part-9.parquet")


def _unreadable(root: Path) -> None:
    (root / PARTITION / "part-9.parquet").write_bytes(b"not parquet at all")


def _missing_column(root: Path) -> None:
    _bad_file(root, rows(2, interaction_id=["b0", "b1"]).drop_columns(["org"]))


def _wrong_type(root: Path) -> None:
    t = rows(2, interaction_id=["b0", "b1"])
    _bad_file(root, replace(t, "completion_ids", pa.array([["4", "5"]] * 2)))


def _row(column: str, value: object) -> Callable[[Path], None]:
    def make(root: Path) -> None:
        t = rows(2, interaction_id=["b0", "b1"])
        _bad_file(root, set_cell(t, column, 1, value))

    return make


def _duplicate(root: Path) -> None:
    _bad_file(root, rows(2, interaction_id=["b0", "i00003"]))


CASES: dict[str, tuple[Callable[[Path], None], int, list[str]]] = {
    # reason: (how to break the set, rows quarantined, bad ids never trained on)
    "unreadable": (_unreadable, 0, []),
    "missing_column": (_missing_column, 2, ["b0", "b1"]),
    "wrong_type": (_wrong_type, 2, ["b0", "b1"]),
    "null_required": (_row("prompt_ids", None), 1, ["b1"]),
    "list_length_mismatch": (_row("completion_mask", [True, True, True]), 1, ["b1"]),
    "logprob_positive": (_row("completion_logprobs", [-0.5, 0.25]), 1, ["b1"]),
    "logprob_non_finite": (_row("completion_logprobs", [-0.5, math.nan]), 1, ["b1"]),
    "signal_out_of_range": (_row("edit_persisted", 1.5), 1, ["b1"]),
    "duplicate_interaction_id": (_duplicate, 1, []),
}


@pytest.mark.parametrize("reason", list(CASES))
def test_each_reason_is_quarantined_counted_and_listed(tmp_path: Path, reason: str) -> None:
    make, count, bad_ids = CASES[reason]
    shards = tmp_path / "shards"
    write(rows(10), shards / PARTITION / "part-0.parquet")
    make(shards)
    code, doc = run_stage(shards, tmp_path / "out", "--max-bad-fraction", "1")
    assert code == 0, doc
    out_ids = ids(training_set(tmp_path / "out"))
    assert not set(bad_ids) & set(out_ids)
    assert set(out_ids) >= {f"i{i:05d}" for i in range(10)}
    assert doc["quarantined"] == ({reason: count} if count else {})
    assert doc["files_by_reason"] == {reason: 1}
    assert (doc["files_total"], doc["files_bad"]) == (2, 1)
    assert doc["rows_bad"] == count
    (listed,) = doc["quarantined_files"]
    assert listed["key"] == f"{PARTITION}/part-9.parquet"
    assert reason in listed["reasons"]
    assert listed["status"] in ("bad", "rejected", "unreadable")


def test_too_much_bad_data_fails_without_a_training_set(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shards = tmp_path / "shards"
    out = tmp_path / "out"
    write(rows(10), shards / PARTITION / "part-0.parquet")
    # A good earlier run into the same prefix: its training set must not survive the failure.
    assert run_stage(shards, out)[0] == 0
    assert training_set(out).num_rows == 10
    t = rows(10)
    t = set_cell(t, "completion_mask", 2, [True])
    write(t, shards / PARTITION / "part-0.parquet")
    _unreadable(shards)

    code, doc = run_stage(shards, out)
    assert code == 1
    err = capsys.readouterr().err.strip()
    assert err == (
        "stage: 10% of rows are bad (limit 1%): list_length_mismatch=1; "
        "2 of 2 files bad (unreadable=1, list_length_mismatch=1)"
    )
    assert (doc["ok"], doc["sufficient"]) == (False, False)
    assert doc["message"] == err.removeprefix("stage: ")
    assert doc["bad_fraction"] == 0.1
    assert doc["quarantined"] == {"list_length_mismatch": 1}
    assert [f["key"] for f in doc["quarantined_files"]] == [
        f"{PARTITION}/part-0.parquet",
        f"{PARTITION}/part-9.parquet",
    ]
    manifest = LocalStore(out).committed("")
    assert manifest is not None and set(manifest.files) == {"stage.json"}
    assert manifest.metadata["ok"] is False
    assert not list((out / "train").glob("*.parquet"))


def test_a_set_of_only_unreadable_files_is_all_bad(tmp_path: Path) -> None:
    shards = tmp_path / "shards"
    (shards / PARTITION).mkdir(parents=True)
    _unreadable(shards)
    code, doc = run_stage(shards, tmp_path / "out")
    assert code == 1
    assert (doc["rows_read"], doc["files_bad"], doc["bad_fraction"]) == (0, 1, 1.0)


def test_a_corrupt_row_group_counts_its_rows(tmp_path: Path) -> None:
    path = write(rows(30), tmp_path / "shards" / PARTITION / "p.parquet", row_group_size=10)
    data = bytearray(path.read_bytes())
    chunk = pq.ParquetFile(path).metadata.row_group(1).column(0)
    start = chunk.dictionary_page_offset or chunk.data_page_offset
    data[start : start + 16] = b"\xff" * 16
    path.write_bytes(bytes(data))
    code, doc = run_stage(tmp_path / "shards", tmp_path / "out", "--max-bad-fraction", "0.5")
    assert code == 0
    assert doc["quarantined"] == {"unreadable": 10}
    assert (doc["rows_read"], doc["rows_bad"], doc["interactions_used"]) == (30, 10, 20)


def test_no_shards_at_all_is_insufficient_not_an_error(tmp_path: Path) -> None:
    (tmp_path / "shards").mkdir()
    code, doc = run_stage(tmp_path / "shards", tmp_path / "out")
    assert code == 0
    assert (doc["ok"], doc["sufficient"], doc["files_total"], doc["rows_read"]) == (
        True,
        False,
        0,
        0,
    )
    assert doc["on_policy_fraction"] is None
    assert doc["reward"]["mean"] is None and doc["monitors"]["edit_rate"] is None


def test_a_missing_shard_directory_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(stage_args(tmp_path / "nowhere", tmp_path / "out"))
    assert code == 2
    assert "data.shards" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_the_report_is_json_serialisable_and_lists_bad_files_with_examples(
    tmp_path: Path,
) -> None:
    shards = tmp_path / "shards"
    t = rows(10)
    for row in (1, 4):
        t = set_cell(t, "completion_logprobs", row, [1.0, -1.0])
    write(t, shards / PARTITION / "part-0.parquet")
    code, doc = run_stage(shards, tmp_path / "out", "--max-bad-fraction", "0.2")
    assert code == 0
    (listed,) = doc["quarantined_files"]
    assert listed["examples"] == {"logprob_positive": [1, 4]}
    json.dumps(doc)
