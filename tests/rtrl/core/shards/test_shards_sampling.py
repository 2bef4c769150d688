"""The optional sampling columns: read as nulls from shards that lack them, cast like the
required ones, impossible values quarantined, and the rule for which rows' log-probs the
trainer can match."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rtrl.core.shards import CANONICAL_COLUMNS, ValidatingReader, iter_batches, validate
from rtrl.core.shards.sampling import (
    GREEDY,
    RAW_LOGPROBS_TEMPERED,
    RAW_LOGPROBS_TRUNCATED,
    unmatched,
)
from rtrl.core.shards.schema import OPTIONAL_COLUMNS, OPTIONAL_SCHEMA
from rtrl.core.shards.writer import write_shards
from tests.rtrl.core.shards.helpers import table, write


def _with(t: pa.Table, **columns: pa.Array) -> pa.Table:
    for name, values in columns.items():
        t = t.append_column(name, values)
    return t


def test_a_shard_without_them_is_valid_and_reads_them_as_nulls(tmp_path: Path) -> None:
    write(table(12), tmp_path / "a.parquet")
    report = validate(tmp_path)
    assert report.ok and report.rows_good == 12
    out = pa.Table.from_batches(list(ValidatingReader(tmp_path, columns=CANONICAL_COLUMNS)))
    assert out.column_names == list(CANONICAL_COLUMNS)
    for name in OPTIONAL_COLUMNS:
        assert out.schema.field(name).type == OPTIONAL_SCHEMA.field(name).type
        assert out.column(name).null_count == 12, name
    # The default projection is unchanged: the required columns only.
    plain = pa.Table.from_batches(list(iter_batches(tmp_path)))
    assert not set(OPTIONAL_COLUMNS) & set(plain.column_names)


def test_foreign_types_are_cast_to_the_canonical_ones(tmp_path: Path) -> None:
    n = 4
    t = _with(
        table(n),
        temperature=pa.array([0.7, 1.0, 0.0, 2.0], pa.float64()),
        top_p=pa.array([1, 1, 1, 1], pa.int64()),  # an integer 1 is a top_p of 1
        top_k=pa.array([-1, 0, 40, None], pa.int64()),
        logprobs_mode=pa.array(["processed_logprobs"] * n).dictionary_encode(),
        serving_dtype=pa.array(["bfloat16"] * n, pa.large_string()),
    )
    write(t, tmp_path / "a.parquet")
    reader = ValidatingReader(tmp_path, columns=CANONICAL_COLUMNS)
    out = pa.Table.from_batches(list(reader))
    assert reader.report.ok
    for name in OPTIONAL_COLUMNS:
        assert out.schema.field(name).type == OPTIONAL_SCHEMA.field(name).type, name
    assert out.column("temperature").to_pylist() == pytest.approx([0.7, 1.0, 0.0, 2.0])
    assert out.column("top_k").to_pylist() == [-1, 0, 40, None]
    assert out.column("logprobs_mode").to_pylist() == ["processed_logprobs"] * n
    assert out.column("arm").null_count == n  # still absent


def test_a_string_temperature_rejects_the_file(tmp_path: Path) -> None:
    t = _with(table(3), temperature=pa.array(["0.7"] * 3))
    write(t, tmp_path / "a.parquet")
    report = validate(tmp_path)
    (file,) = report.files
    assert file.status == "rejected"
    assert report.rows_by_reason == {"wrong_type": 3}
    assert "column 'temperature' has type string" in file.messages[0]


@pytest.mark.parametrize(
    ("column", "value", "reason"),
    [
        ("temperature", -0.5, "sampling_out_of_range"),
        ("temperature", math.nan, "sampling_out_of_range"),
        ("temperature", math.inf, "sampling_out_of_range"),
        ("top_p", 0.0, "sampling_out_of_range"),
        ("top_p", 1.5, "sampling_out_of_range"),
        ("top_p", math.nan, "sampling_out_of_range"),
        ("top_k", -2, "sampling_out_of_range"),
        ("logprobs_mode", "raw_logits", "unknown_logprobs_mode"),
        ("logprobs_mode", "processed", "unknown_logprobs_mode"),
    ],
)
def test_impossible_values_are_quarantined(
    tmp_path: Path, column: str, value: object, reason: str
) -> None:
    n = 6
    values: list[object] = [None] * n
    values[3] = value
    t = _with(table(n), **{column: pa.array(values, OPTIONAL_SCHEMA.field(column).type)})
    write(t, tmp_path / "a.parquet")
    reader = ValidatingReader(tmp_path, columns=CANONICAL_COLUMNS)
    good = pa.Table.from_batches(list(reader))
    assert good.num_rows == n - 1
    (file,) = reader.report.files
    assert dict(file.rows_by_reason) == {reason: 1}
    assert file.examples[reason] == [3]
    (message,) = file.messages
    assert message.startswith(f"{reason}: row 3: ")
    assert column in message


@pytest.mark.parametrize(
    ("column", "value"),
    [
        ("temperature", 0.0),  # greedy: valid, refused later (not quarantined)
        ("temperature", 1.9),
        ("top_p", 1.0),
        ("top_p", 1e-6),
        ("top_k", -1),  # vLLM's "disabled"
        ("top_k", 0),
        ("logprobs_mode", "raw_logprobs"),
        ("logprobs_mode", "processed_logprobs"),
        ("serving_dtype", "float8"),  # recorded as the engine said it
    ],
)
def test_possible_values_pass(tmp_path: Path, column: str, value: object) -> None:
    t = _with(table(4), **{column: pa.array([value] * 4, OPTIONAL_SCHEMA.field(column).type)})
    write(t, tmp_path / "a.parquet")
    assert validate(tmp_path).ok


def test_the_writer_casts_them_and_keeps_them(tmp_path: Path) -> None:
    t = _with(
        table(5),
        temperature=pa.array([0.7] * 5, pa.float64()),
        logprobs_mode=pa.array(["processed_logprobs"] * 5, pa.large_string()),
    )
    (key,) = write_shards(t, tmp_path, partition_by=[])
    schema = pq.read_schema(tmp_path / key)
    assert schema.field("temperature").type == pa.float32()
    assert schema.field("logprobs_mode").type == pa.string()
    assert "top_p" not in schema.names  # not added: the file stays as it was written


def _batch(**columns: list[object]) -> pa.RecordBatch:
    n = len(next(iter(columns.values())))
    arrays = {
        name: pa.array(columns.get(name, [None] * n), OPTIONAL_SCHEMA.field(name).type)
        for name in ("temperature", "top_p", "top_k", "logprobs_mode")
    }
    return pa.RecordBatch.from_pydict(arrays)


def test_unmatched_rows_by_reason() -> None:
    p, r = "processed_logprobs", "raw_logprobs"
    batch = _batch(
        temperature=[None, 1.0, 0.7, 0.7, 1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.5],
        top_p=[None, 1.0, 1.0, 0.9, 0.9, 1.0, 1.0, 1.0, 1.0, 1.0, None, 0.8],
        top_k=[None, -1, None, None, None, 40, 300, None, None, 0, 20, 20],
        logprobs_mode=[None, r, r, p, None, r, r, r, p, None, p, None],
    )
    found = unmatched(batch, vocab_size=260)
    rows = {reason: np.flatnonzero(mask).tolist() for reason, mask in found.items()}
    assert rows == {
        # temperature 0 is greedy, whatever the mode
        GREEDY: [7, 8],
        # raw (or null: raw) at another temperature; the first reason only
        RAW_LOGPROBS_TEMPERED: [2, 11],
        # raw at temperature 1 with top-p < 1 or top-k within the vocabulary (300 is not)
        RAW_LOGPROBS_TRUNCATED: [4, 5],
    }
    # Without the vocabulary, any top-k >= 1 truncates.
    assert np.flatnonzero(unmatched(batch)[RAW_LOGPROBS_TRUNCATED]).tolist() == [4, 5, 6]


def test_a_batch_of_defaults_has_no_unmatched_rows() -> None:
    assert unmatched(_batch(temperature=[None] * 3)) == {}
    assert unmatched(_batch(temperature=[1.0] * 3, logprobs_mode=["raw_logprobs"] * 3)) == {}
