"""What a shard set's footers declare about its token ids (read before any row)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from rtrl.core.shards import list_files
from rtrl.core.shards.statistics import ValueRange, declared_range
from rtrl.core.store.local import LocalStore
from tests.rtrl.core.shards.helpers import write
from tests.rtrl_trainer.helpers import rows


def _range(root: Path) -> ValueRange | None:
    store = LocalStore(root)
    return declared_range(store, list_files(store))


def test_the_range_spans_every_file_and_both_token_columns(tmp_path: Path) -> None:
    write(rows(2, prompt_ids=[[5, 9], [7]]), tmp_path / "a.parquet")
    write(rows(1, completion_ids=[[3, 40_000]]), tmp_path / "b.parquet", row_group_size=1)
    assert _range(tmp_path) == ValueRange(low=1, high=40_000, files=2)


def test_unreadable_files_and_empty_lists_declare_nothing(tmp_path: Path) -> None:
    write(rows(1, prompt_ids=[[8]]), tmp_path / "a.parquet")
    (tmp_path / "b.parquet").write_bytes(b"not parquet")  # the reader rejects it whole
    assert _range(tmp_path) == ValueRange(low=4, high=8, files=1)
    empty = rows(1, interaction_id=["e"], prompt_ids=[[]], completion_ids=[[]],
                 completion_logprobs=[[]], completion_mask=[[]])  # fmt: skip
    write(empty, tmp_path / "c.parquet")
    assert _range(tmp_path) == ValueRange(low=4, high=8, files=1)


def test_a_file_with_ids_but_no_statistics_makes_the_range_unknown(tmp_path: Path) -> None:
    write(rows(1), tmp_path / "a.parquet")
    assert _range(tmp_path) is not None
    write(rows(1, interaction_id=["x"]), tmp_path / "b.parquet", write_statistics=False)
    assert _range(tmp_path) is None


def test_token_ids_stored_as_floats_make_the_range_unknown(tmp_path: Path) -> None:
    t = rows(1)
    floats = pa.array([[1.0, 2.0, 3.0]], pa.list_(pa.float64()))
    write(t.set_column(t.schema.get_field_index("prompt_ids"), "prompt_ids", floats),
          tmp_path / "a.parquet")  # fmt: skip
    assert _range(tmp_path) is None


def test_no_files_declare_nothing(tmp_path: Path) -> None:
    assert _range(tmp_path) is None
