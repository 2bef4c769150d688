"""The width of the training set's token ids: two bytes when every shard file's footer
declares ids within 0-65535, else four; every id is checked either way, and a row that
contradicts its file's footer is quarantined, never truncated."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rtrl.core.shards.statistics import ValueRange
from rtrl_trainer.stage import select as stage_select
from rtrl_trainer.stagedset import METADATA_KEY, fits_narrow, pack, rows_not_narrow, unpack
from tests.rtrl.core.shards.helpers import write
from tests.rtrl_trainer.helpers import by_id, rows, run_stage, training_set

PARTITION = "checkpoint=ckpt-1"


def _stored_types(out: Path) -> set[bytes]:
    schema = pq.read_schema(out / "train" / "rank-00000-of-00001.parquet")
    return {
        (schema.field(name).metadata or {})[METADATA_KEY]
        for name in ("prompt_ids", "completion_ids")
    }


def test_ids_that_fit_are_stored_in_two_bytes(tmp_path: Path) -> None:
    prompts = [[0, 65_535, 7], [300, 40_000], [1]]
    completions = [[65_535], [2, 3], [0, 0]]
    write(
        rows(3, prompt_ids=prompts, completion_ids=completions,
             completion_logprobs=[[-0.5], [-0.5, -0.5], [-0.5, -0.5]],
             completion_mask=[[True], [True, True], [True, True]]),
        tmp_path / "shards" / PARTITION / "part-0.parquet",
    )  # fmt: skip
    code, doc = run_stage(tmp_path / "shards", tmp_path / "out")
    assert code == 0 and doc["token_ids"] == "uint16"
    assert _stored_types(tmp_path / "out") == {b"<u2"}
    staged = by_id(training_set(tmp_path / "out"))
    assert [staged[f"i{i:05d}"]["prompt_ids"] for i in range(3)] == prompts
    assert [staged[f"i{i:05d}"]["completion_ids"] for i in range(3)] == completions
    assert doc["tokens_used"] == 5


@pytest.mark.parametrize("big", [65_536, 2**31 - 1])
def test_one_file_declaring_a_larger_id_keeps_every_id_in_four_bytes(
    tmp_path: Path, big: int
) -> None:
    shards = tmp_path / "shards" / PARTITION
    write(rows(2), shards / "part-0.parquet")
    write(rows(1, interaction_id=["b0"], prompt_ids=[[big, 5]]), shards / "part-1.parquet")
    code, doc = run_stage(tmp_path / "shards", tmp_path / "out")
    assert code == 0 and doc["token_ids"] == "int32"
    assert _stored_types(tmp_path / "out") == {b"<i4"}
    staged = by_id(training_set(tmp_path / "out"))
    assert staged["b0"]["prompt_ids"] == [big, 5]
    assert staged["i00000"]["prompt_ids"] == [1, 2, 3]


def test_a_file_without_statistics_keeps_ids_in_four_bytes(tmp_path: Path) -> None:
    shards = tmp_path / "shards" / PARTITION
    write(rows(2), shards / "part-0.parquet")
    write(rows(1, interaction_id=["b0"]), shards / "part-1.parquet", write_statistics=False)
    code, doc = run_stage(tmp_path / "shards", tmp_path / "out")
    assert code == 0 and doc["token_ids"] == "int32"
    assert len(training_set(tmp_path / "out")) == 3


def test_a_negative_id_keeps_ids_in_four_bytes(tmp_path: Path) -> None:
    write(rows(1, completion_ids=[[-1, 5]]), tmp_path / "shards" / PARTITION / "p.parquet")
    code, doc = run_stage(tmp_path / "shards", tmp_path / "out")
    assert code == 0 and doc["token_ids"] == "int32"
    assert training_set(tmp_path / "out").column("completion_ids").to_pylist() == [[-1, 5]]


def test_rows_contradicting_their_footer_are_quarantined_not_truncated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A producer whose footers under-declare (pyarrow will not write a wrong footer, so the
    # declaration is what the step is told it read).
    shards = tmp_path / "shards" / PARTITION
    write(rows(3, prompt_ids=[[1], [70_000, 2], [3]]), shards / "part-0.parquet")
    write(rows(1, interaction_id=["c0"], completion_ids=[[4, -7]]), shards / "part-1.parquet")
    monkeypatch.setattr(stage_select, "declared_range", lambda *_: ValueRange(0, 9, 2))
    code, doc = run_stage(tmp_path / "shards", tmp_path / "out", "--max-bad-fraction", "0.9")
    assert code == 0 and doc["token_ids"] == "uint16"
    assert doc["quarantined"] == {"statistics_mismatch": 2}
    assert doc["files_by_reason"] == {"statistics_mismatch": 2}
    listed = {f["key"]: f for f in doc["quarantined_files"]}
    assert listed[f"{PARTITION}/part-0.parquet"]["rows_by_reason"] == {"statistics_mismatch": 1}
    assert listed[f"{PARTITION}/part-1.parquet"]["status"] == "bad"
    assert sorted(by_id(training_set(tmp_path / "out"))) == ["i00000", "i00002"]


def test_narrowing_checks_every_id() -> None:
    lists = pa.array([[0, 65_535], [], [65_536, 1], [3], [-1]], pa.list_(pa.int32()))
    assert not fits_narrow(lists)
    assert rows_not_narrow(lists).tolist() == [False, False, True, False, True]
    assert fits_narrow(lists.slice(0, 2)) and fits_narrow(lists.slice(3, 1))
    assert not fits_narrow(lists.slice(4))
    with pytest.raises(ValueError, match="outside 0-65535"):
        pack(lists, "<u2")
    for part in (lists.slice(0, 2), lists.slice(1, 1), lists.slice(3, 1)):
        packed = pack(part, "<u2")
        assert unpack(packed, "<u2").to_pylist() == part.to_pylist()
        assert unpack(packed, "<u2").type == pa.list_(pa.int32())
