"""The shard writer's Hive layout, determinism and canonical output, and the synthetic data
it is fed with in tests, benchmarks and the demo."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from rtrl.core.shards import INTERACTION_SCHEMA, synthetic_interactions, validate, write_shards
from rtrl.core.store.local import LocalStore
from tests.rtrl.core.shards.helpers import replace, set_cell, table

START = datetime(2026, 3, 1, 22, 30, tzinfo=UTC)


def _synthetic(n: int, seed: int = 1, **options: object) -> pa.Table:
    options.setdefault("checkpoint_id", "ckpt-7")
    options.setdefault("tokens", 10)
    batches = synthetic_interactions(n, seed=seed, **options)  # type: ignore[arg-type]
    return pa.Table.from_batches(list(batches), schema=INTERACTION_SCHEMA)


def _files(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


def test_hive_layout_from_checkpoint_and_created_at(tmp_path: Path) -> None:
    data = _synthetic(300, start=START, duration=timedelta(hours=3))
    keys = write_shards(data, tmp_path)
    assert keys == [
        "checkpoint=ckpt-7/date=2026-03-01/hour=22/part-00000.parquet",
        "checkpoint=ckpt-7/date=2026-03-01/hour=23/part-00000.parquet",
        "checkpoint=ckpt-7/date=2026-03-02/hour=00/part-00000.parquet",
        "checkpoint=ckpt-7/date=2026-03-02/hour=01/part-00000.parquet",
    ]
    assert _files(tmp_path) == keys  # no temp files left behind
    for key in keys:
        rows = pq.read_table(tmp_path / key)
        assert rows.schema.equals(INTERACTION_SCHEMA)
        date, hour = key.split("/")[1].removeprefix("date="), key.split("/")[2][5:]
        assert set(pc.strftime(rows["created_at"], "%Y-%m-%d").to_pylist()) == {date}
        assert set(pc.strftime(rows["created_at"], "%H").to_pylist()) == {hour}
    written = pa.concat_tables(pq.read_table(tmp_path / k) for k in keys)
    assert written.sort_by("interaction_id").equals(data.sort_by("interaction_id"))


def test_files_split_by_rows_and_named_in_order(tmp_path: Path) -> None:
    data = _synthetic(250, duration=timedelta(minutes=10))
    keys = write_shards(data, tmp_path, rows_per_file=100, row_group_size=30)
    names = [k.rsplit("/", 1)[1] for k in keys]
    assert names == ["part-00000.parquet", "part-00001.parquet", "part-00002.parquet"]
    metadata = [pq.ParquetFile(tmp_path / k).metadata for k in keys]
    assert [m.num_rows for m in metadata] == [100, 100, 50]
    assert [m.row_group(0).num_rows for m in metadata] == [30, 30, 30]
    first = pq.read_table(tmp_path / keys[0])
    assert first["interaction_id"].to_pylist() == data["interaction_id"].to_pylist()[:100]


def test_a_second_write_into_the_same_partitions_keeps_the_first(tmp_path: Path) -> None:
    """A logging pipeline appends every flush: a prefix of its own per write keeps both, the
    same prefix replaces (names restart at 00000 each call)."""
    first = _synthetic(50, seed=1, start=START, duration=timedelta(minutes=5))
    second = _synthetic(50, seed=2, start=START, duration=timedelta(minutes=5))
    keys = write_shards(first, tmp_path, file_prefix="part-flush1")
    keys += write_shards(second, tmp_path, file_prefix="part-flush2")
    assert [k.rsplit("/", 1)[1] for k in sorted(keys)] == [
        "part-flush1-00000.parquet",
        "part-flush2-00000.parquet",
    ]
    report = validate(tmp_path)
    assert report.ok and report.rows_total == 100
    for bad in ("", "_part", ".part", "a/b"):
        with pytest.raises(ValueError, match="file_prefix"):
            write_shards(first, tmp_path / "bad", file_prefix=bad)


def test_output_is_deterministic(tmp_path: Path) -> None:
    data = _synthetic(120, duration=timedelta(hours=2))
    a = write_shards(data.to_batches(max_chunksize=17), tmp_path / "a", row_group_size=25)
    b = write_shards(data, tmp_path / "b", row_group_size=25)
    assert a == b
    for key in a:
        assert (tmp_path / "a" / key).read_bytes() == (tmp_path / "b" / key).read_bytes()


def test_writes_through_a_store(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "bucket")
    data = _synthetic(40)
    keys = write_shards(data, store, prefix="interactions/composer")
    assert keys == [
        "interactions/composer/checkpoint=ckpt-7/date=2026-01-05/hour=08/part-00000.parquet",
        "interactions/composer/checkpoint=ckpt-7/date=2026-01-05/hour=09/part-00000.parquet",
        "interactions/composer/checkpoint=ckpt-7/date=2026-01-05/hour=10/part-00000.parquet",
    ]
    assert [info.key for info in store.list()] == keys
    written = pa.concat_tables(pq.read_table(tmp_path / "bucket" / key) for key in keys)
    assert written.equals(data)


def test_file_uri_root(tmp_path: Path) -> None:
    keys = write_shards(_synthetic(10), tmp_path.as_uri() + "/", partition_by=["checkpoint"])
    assert keys == ["checkpoint=ckpt-7/part-00000.parquet"]


def test_partition_values_are_escaped_and_nulls_named_hive_style(tmp_path: Path) -> None:
    data = _synthetic(4, checkpoint_id="team/a=b c")
    data = set_cell(data, "org", 0, None)
    keys = write_shards(data, tmp_path, partition_by=["checkpoint", "org"])
    assert {k.split("/")[0] for k in keys} == {"checkpoint=team%2Fa%3Db%20c"}
    assert "org=__HIVE_DEFAULT_PARTITION__" in {k.split("/")[1] for k in keys}


def test_casts_foreign_types_and_keeps_extra_columns(tmp_path: Path) -> None:
    data = table(10)
    data = replace(data, "created_at", data["created_at"].cast(pa.timestamp("ns")))
    data = data.append_column("session", pa.array(["s"] * 10))
    (key,) = write_shards(data, tmp_path, partition_by=["checkpoint"])
    schema = pq.read_schema(tmp_path / key)
    assert schema.field("created_at").type == INTERACTION_SCHEMA.field("created_at").type
    assert schema.names == [*INTERACTION_SCHEMA.names, "session"]


def test_refuses_unusable_input_naming_the_columns(tmp_path: Path) -> None:
    data = table(3).drop_columns(["org"])
    data = replace(data, "prompt_ids", pa.array([["a"]] * 3))
    with pytest.raises(
        ValueError, match=r"'org' is missing.*'prompt_ids' has type list<item: string>"
    ):
        write_shards(data, tmp_path)
    with pytest.raises(ValueError, match="cannot partition by"):
        write_shards(table(3), tmp_path, partition_by=["minute"])


def test_empty_input_writes_nothing(tmp_path: Path) -> None:
    assert write_shards([], tmp_path) == []
    assert write_shards(table(0), tmp_path) == []


def test_synthetic_data_is_deterministic_plausible_and_valid(tmp_path: Path) -> None:
    a = _synthetic(2_000, seed=3, tokens=40, batch_size=512)
    assert a.equals(_synthetic(2_000, seed=3, tokens=40, batch_size=512))
    assert not a.equals(_synthetic(2_000, seed=4, tokens=40, batch_size=512))
    assert a.num_rows == 2_000
    assert pc.count_distinct(a["interaction_id"]).as_py() == 2_000
    completion = pc.list_value_length(a["completion_ids"])
    assert pc.min(completion).as_py() >= 20 and pc.max(completion).as_py() <= 60
    prompt = pc.list_value_length(a["prompt_ids"])
    assert pc.min(prompt).as_py() >= 100 and pc.max(prompt).as_py() <= 300
    assert pc.max(pc.list_flatten(a["completion_logprobs"])).as_py() <= 0
    assert 0 < pc.mean(pc.list_flatten(a["completion_mask"]).cast(pa.int8())).as_py() < 1
    created = a["created_at"]
    assert pc.all(pc.greater_equal(created.slice(1), created.slice(0, a.num_rows - 1))).as_py()
    assert 0 < a["edit_persisted"].null_count < 2_000
    assert pc.all(pc.less_equal(a["invalid_tool_calls"], a["tool_calls"])).as_py()
    write_shards(a, tmp_path)
    assert validate(tmp_path).ok


def test_a_failed_write_leaves_no_partial_files(tmp_path: Path) -> None:
    def batches() -> Iterator[pa.RecordBatch]:
        yield from _synthetic(50, duration=timedelta(minutes=5)).to_batches(max_chunksize=10)
        raise RuntimeError("upstream broke")

    with pytest.raises(RuntimeError, match="upstream broke"):
        write_shards(batches(), tmp_path, row_group_size=20, rows_per_file=30)
    leftovers = [p.name for p in tmp_path.rglob("*") if p.is_file()]
    # Files completed before the failure stay (they are whole); nothing half-written does.
    assert leftovers and all(name.startswith("part-") for name in leftovers)
    for path in tmp_path.rglob("part-*.parquet"):
        assert pq.ParquetFile(path).metadata.num_rows == 30


def test_long_rows_are_written_in_row_groups_the_readers_accept(tmp_path: Path) -> None:
    """1,024 prompts of 36,000 tokens are 147 MB of ids: as one row group (what the row count
    alone gave) the readers rejected the file, a column chunk over their 128 MiB limit; the
    writer cuts its row groups so that no column of one is over half of that."""
    n, tokens = 1024, 36_000
    ids = pa.array(np.ones(n * tokens, np.int32))
    prompts = pa.ListArray.from_arrays(pa.array(np.arange(n + 1, dtype=np.int32) * tokens), ids)
    rows = replace(table(n, seed=5), "prompt_ids", prompts)
    (key,) = write_shards(rows, tmp_path, partition_by=[])
    footer = pq.read_metadata(tmp_path / key)
    assert footer.num_rows == n and footer.num_row_groups > 1
    report = validate(tmp_path)
    assert report.ok and report.rows_good == n, report.render()
