"""The streaming reader: canonical types out of foreign files, projection, listing rules,
partition pruning, and clear errors naming the file."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from rtrl.core.shards import INTERACTION_SCHEMA, ShardError, iter_batches, list_files, write_shards
from rtrl.core.store.local import LocalStore
from tests.rtrl.core.shards.helpers import replace, table, write


def _foreign(t: pa.Table) -> pa.Table:
    """The same rows in the types another team's pipeline might have chosen."""
    t = replace(t, "created_at", t["created_at"].cast(pa.timestamp("ns")))
    t = replace(t, "completion_ids", t["completion_ids"].cast(pa.large_list(pa.int64())))
    t = replace(t, "interaction_id", t["interaction_id"].cast(pa.large_string()))
    return replace(t, "org", pc.dictionary_encode(t["org"]))


def test_foreign_files_come_out_canonical(tmp_path: Path) -> None:
    canonical = table(100)
    write(_foreign(canonical), tmp_path / "checkpoint=ckpt-1/part-0.parquet")
    batches = list(iter_batches(tmp_path, batch_size=32))
    assert [b.num_rows for b in batches] == [32, 32, 32, 4]
    for batch in batches:
        assert batch.schema.equals(INTERACTION_SCHEMA)
    assert pa.Table.from_batches(batches).equals(canonical)


def test_projection_and_extra_columns(tmp_path: Path) -> None:
    t = table(10).append_column("session", pa.array(["s"] * 10, pa.large_string()))
    write(_foreign(t), tmp_path / "a.parquet")
    (batch,) = iter_batches(tmp_path.as_uri(), columns=["session", "completion_ids"])
    assert batch.schema.names == ["session", "completion_ids"]
    assert batch.schema.field("session").type == pa.large_string()
    assert batch.schema.field("completion_ids").type == pa.list_(pa.int32())


def test_lists_only_data_files_in_key_order(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    write_shards(table(10), store, prefix="x", partition_by=["checkpoint"])
    for name in ["x/_MANIFEST.json", "x/_SUCCESS", "x/notes.txt", "x/_tmp/part-0.parquet"]:
        store.put_bytes(name, b"{}")
    store.put_bytes("x/.part-00001.parquet.tmp", b"partial")
    store.put_bytes("x/.hidden.parquet", b"partial")
    store.put_bytes("x/checkpoint=ckpt-1/_staging.parquet", b"partial")
    store.put_bytes("xy/part-0.parquet", b"other prefix")
    files = list(list_files(store, prefix="x"))
    assert [f.key for f in files] == ["x/checkpoint=ckpt-1/part-00000.parquet"]
    assert files[0].partitions == {"checkpoint": "ckpt-1"}
    assert files[0].url == tmp_path.as_uri() + "/" + files[0].key


def test_partition_filter_prunes_files(tmp_path: Path) -> None:
    write_shards(pa.concat_tables([table(5), table(6, seed=1, checkpoint_id="ckpt-2")]), tmp_path)
    only_2 = list(iter_batches(tmp_path, partitions={"checkpoint": "ckpt-2"}))
    assert sum(b.num_rows for b in only_2) == 6
    both = list(iter_batches(tmp_path, partitions={"checkpoint": {"ckpt-1", "ckpt-2"}}))
    assert sum(b.num_rows for b in both) == 11


def test_escaped_partition_values_are_decoded(tmp_path: Path) -> None:
    write_shards(table(3, checkpoint_id="team/a b"), tmp_path, partition_by=["checkpoint"])
    (shard,) = list_files(LocalStore(tmp_path))
    assert shard.partitions == {"checkpoint": "team/a b"}
    assert list(iter_batches(tmp_path, partitions={"checkpoint": "team/a b"}))


def test_unusable_files_raise_naming_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "b.parquet"
    bad.write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(ShardError, match=r"b\.parquet: ") as caught:
        list(iter_batches(tmp_path))
    assert caught.value.reason == "unreadable"
    bad.unlink()
    write(table(3).drop_columns(["org"]), tmp_path / "c.parquet")
    with pytest.raises(ShardError, match=r"c\.parquet: required column 'org' is missing"):
        list(iter_batches(tmp_path))


def test_bad_uri_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="unsupported store URI"):
        list(iter_batches("ftp://host/x"))


def test_files_with_huge_row_groups_are_streamed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    canonical = table(100)
    write(_foreign(canonical), tmp_path / "a.parquet", row_group_size=100)
    monkeypatch.setattr("rtrl.core.shards.reader.PREBUFFER_LIMIT", 0)
    batches = list(iter_batches(tmp_path, batch_size=30))
    assert [b.num_rows for b in batches] == [30, 30, 30, 10]
    assert pa.Table.from_batches(batches).equals(canonical)
