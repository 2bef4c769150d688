"""The width of the training set's token ids: two bytes when every shard file's footer
declares ids within 0-65535, else four; every id is checked either way, and a row that
contradicts its file's footer is quarantined, never truncated."""

from __future__ import annotations

import json
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


def test_a_negative_id_is_quarantined_and_keeps_ids_in_four_bytes(tmp_path: Path) -> None:
    # The footer declares the -1, so the width is chosen wide before any row is read.
    write(
        rows(3, completion_ids=[[-1, 5], [4, 5], [4, 5]]),
        tmp_path / "shards" / PARTITION / "p.parquet",
    )
    code, doc = run_stage(tmp_path / "shards", tmp_path / "out", "--max-bad-fraction", "0.5")
    assert code == 0 and doc["token_ids"] == "int32"
    assert doc["quarantined"] == {"token_out_of_range": 1}
    assert doc["vocab_size"] is None and doc["parent"] is None
    assert sorted(by_id(training_set(tmp_path / "out"))) == ["i00001", "i00002"]


VOCAB = 260


# The rows' log-probs are made up: the fidelity gate (its own tests) would quarantine them.
NO_GATE = ("--fidelity-sample-rows", "0")


def _parent(root: Path, vocab_size: int = VOCAB) -> str:
    """A parent checkpoint as far as these tests need one: its config.json (no weights:
    the fidelity gate is off, NO_GATE)."""
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": vocab_size}))
    return root.as_uri() + "/"


def _out_of_range_shards(root: Path) -> None:
    """Six rows: row 1 has prompt id -5, row 4 completion id VOCAB + 1; row 2's VOCAB - 1
    is the last id inside the vocabulary."""
    write(
        rows(6,
             prompt_ids=[[1, 2], [1, -5, 3], [1], [2], [3], [4]],
             completion_ids=[[4, 5], [4, 5], [4, VOCAB - 1], [4, 5], [4, VOCAB + 1], [4, 5]]),
        root / PARTITION / "part-0.parquet",
    )  # fmt: skip


def test_ids_outside_the_parents_vocabulary_are_quarantined(tmp_path: Path) -> None:
    _out_of_range_shards(tmp_path / "shards")
    parent = _parent(tmp_path / "models" / "ckpt-1")
    code, doc = run_stage(
        tmp_path / "shards", tmp_path / "out", "--parent", parent, "--max-bad-fraction", "0.5",
        *NO_GATE,
    )  # fmt: skip
    assert code == 0, doc
    assert (doc["parent"], doc["vocab_size"]) == (parent, VOCAB)
    assert doc["quarantined"] == {"token_out_of_range": 2}
    assert doc["files_by_reason"] == {"token_out_of_range": 1}
    assert (doc["rows_read"], doc["rows_bad"], doc["interactions_used"]) == (6, 2, 4)
    (listed,) = doc["quarantined_files"]
    assert listed["key"] == f"{PARTITION}/part-0.parquet"
    assert listed["rows_by_reason"] == {"token_out_of_range": 2}
    assert listed["examples"] == {"token_out_of_range": [1, 4]}
    assert listed["messages"] == [
        f"token_out_of_range: row 1: prompt_ids has token id -5, outside [0, {VOCAB})"
    ]
    staged = by_id(training_set(tmp_path / "out"))
    assert sorted(staged) == ["i00000", "i00002", "i00003", "i00005"]
    assert staged["i00002"]["completion_ids"] == [4, VOCAB - 1]


def test_without_a_parent_only_negative_ids_are_quarantined(tmp_path: Path) -> None:
    """What an older stage (or one run by hand without --parent) lets through: the train
    step checks the ids again against the parent it trains (tests of train/examples.py)."""
    _out_of_range_shards(tmp_path / "shards")
    code, doc = run_stage(tmp_path / "shards", tmp_path / "out", "--max-bad-fraction", "0.5")
    assert code == 0 and doc["quarantined"] == {"token_out_of_range": 1}
    staged = by_id(training_set(tmp_path / "out"))
    assert staged["i00004"]["completion_ids"] == [4, VOCAB + 1]


def test_too_many_ids_outside_the_vocabulary_fail_the_stage(tmp_path: Path) -> None:
    _out_of_range_shards(tmp_path / "shards")
    # One id smaller: row 2's VOCAB - 1 is out too.
    parent = _parent(tmp_path / "models" / "ckpt-1", vocab_size=VOCAB - 1)
    code, doc = run_stage(tmp_path / "shards", tmp_path / "out", "--parent", parent, *NO_GATE)
    assert code == 1 and not doc["ok"]
    assert doc["quarantined"] == {"token_out_of_range": 3}
    assert doc["message"].startswith("50% of rows are bad (limit 1%): token_out_of_range=3")
    assert "train/rank-00000-of-00001.parquet" not in doc["files"]


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (None, "no config.json (not a Hugging Face checkpoint"),
        ({"model_type": "gpt2"}, "config.json has no vocab_size"),
    ],
    ids=["no-config", "no-vocab-size"],
)
def test_a_parent_without_a_vocabulary_fails_the_stage_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], config: object, message: str
) -> None:
    _out_of_range_shards(tmp_path / "shards")
    parent = tmp_path / "models" / "ckpt-1"
    parent.mkdir(parents=True)
    if config is not None:
        (parent / "config.json").write_text(json.dumps(config))
    code, doc = run_stage(tmp_path / "shards", tmp_path / "out", "--parent", parent.as_uri() + "/")
    assert code == 1 and doc == {}
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"stage: parent {parent.as_uri()}/: {message}"), err
    assert "\n" not in err


def test_rows_contradicting_their_footer_are_quarantined_not_truncated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A producer whose footers under-declare (pyarrow will not write a wrong footer, so the
    # declaration is what the step is told it read).
    shards = tmp_path / "shards" / PARTITION
    write(rows(3, prompt_ids=[[1], [70_000, 2], [3]]), shards / "part-0.parquet")
    write(rows(1, interaction_id=["c0"], completion_ids=[[4, 70_001]]), shards / "part-1.parquet")
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
