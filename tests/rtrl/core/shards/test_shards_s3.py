"""Shards over real HTTP S3 (moto): write through the store, list, range-read and validate
by ``s3://`` URI, the way Job pods do in the cluster."""

from __future__ import annotations

import argparse

import pyarrow as pa
import pytest

from rtrl.core.shards import INTERACTION_SCHEMA, ValidatingReader, iter_batches, write_shards
from rtrl.core.shards.cli import add_shards_parser, run_validate
from rtrl.core.store import open_store
from tests.rtrl.core.shards.helpers import table


def test_write_read_and_validate_over_s3(
    s3_bucket: str, capsys: pytest.CaptureFixture[str]
) -> None:
    uri = f"s3://{s3_bucket}/interactions/composer/"
    data = table(300)
    keys = write_shards(data, open_store(uri), row_group_size=64)
    assert len(keys) == 3
    store = open_store(uri)
    assert [info.key for info in store.list()] == keys

    batches = list(iter_batches(uri, batch_size=100, columns=["interaction_id", "prompt_ids"]))
    assert sum(b.num_rows for b in batches) == 300
    assert batches[0].schema.field("prompt_ids").type == pa.list_(pa.int32())

    # A foreign team's broken upload next to the good files.
    store.put_bytes("checkpoint=ckpt-1/date=2026-01-05/hour=11/part-00000.parquet", b"oops")
    reader = ValidatingReader(uri)
    out = pa.Table.from_batches(list(reader), schema=INTERACTION_SCHEMA)
    assert out.sort_by("interaction_id").equals(data.sort_by("interaction_id"))
    assert (reader.report.files_total, reader.report.files_bad) == (4, 1)
    assert reader.report.files[3].status == "unreadable"

    parser = argparse.ArgumentParser(prog="rtrl")
    add_shards_parser(parser.add_subparsers())
    assert run_validate(parser.parse_args(["shards", "validate", uri])) == 1
    assert "1 bad" in capsys.readouterr().out
    store.delete("checkpoint=ckpt-1/date=2026-01-05/hour=11/part-00000.parquet")
    assert run_validate(parser.parse_args(["shards", "validate", uri])) == 0


def test_missing_bucket_is_a_usage_error(
    s3_bucket: str, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser(prog="rtrl")
    add_shards_parser(parser.add_subparsers())
    args = parser.parse_args(["shards", "validate", f"s3://{s3_bucket}-missing/x/"])
    assert run_validate(args) == 2
    assert "cannot read" in capsys.readouterr().err
