"""The validating reader and its report: every reason on a crafted file, a mixed set with
exact counts and exit codes, corrupt files that never crash, and good rows only out."""

from __future__ import annotations

import argparse
import json
import math
import random
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rtrl.core.shards import (
    INTERACTION_SCHEMA,
    ValidatingReader,
    ValidationReport,
    validate,
    write_shards,
)
from rtrl.core.shards.cli import add_shards_parser, run_validate
from rtrl.core.store.base import ObjectNotFound, StoreError
from rtrl.core.store.local import LocalStore
from tests.rtrl.core.shards.helpers import replace, set_cell, table, write


def _only(report: ValidationReport) -> dict[str, int]:
    """The row counts per reason of a one-file report, after checking the totals agree."""
    (file,) = report.files
    assert report.rows_total == file.rows_total
    assert report.rows_good == file.rows_good
    return dict(report.rows_by_reason)


def _validate_one(t: pa.Table, tmp_path: Path) -> ValidationReport:
    write(t, tmp_path / "shards" / "part-0.parquet")
    return validate(tmp_path / "shards")


def test_a_clean_set_is_ok(tmp_path: Path) -> None:
    write_shards(table(200), tmp_path)
    report = validate(tmp_path)
    assert report.ok
    assert (report.files_total, report.files_bad, report.rows_total, report.rows_good) == (
        3,
        0,
        200,
        200,
    )
    assert report.rows_by_reason == {}
    assert report.render().splitlines() == [
        "files: 3 total, 0 bad; rows: 200 total, 200 good, 0 bad"
    ]


@pytest.mark.parametrize(
    "content",
    [b"", b"not parquet at all", b"PAR1" + b"\0" * 100 + b"PAR1"],
    ids=["empty", "garbage", "bad-footer"],
)
def test_unreadable_files(tmp_path: Path, content: bytes) -> None:
    (tmp_path / "x.parquet").write_bytes(content)
    report = validate(tmp_path)
    (file,) = report.files
    assert file.status == "unreadable"
    assert file.reasons == {"unreadable"}
    assert report.files_by_reason == {"unreadable": 1}
    assert not report.ok
    assert report.render().startswith(f"{file.url}: unreadable: ")


def test_truncated_file(tmp_path: Path) -> None:
    path = write(table(50), tmp_path / "t.parquet")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    report = validate(tmp_path)
    assert report.files[0].status == "unreadable"
    assert report.files_by_reason == {"unreadable": 1}


def test_a_corrupt_row_group_loses_only_its_rows(tmp_path: Path) -> None:
    path = write(table(300), tmp_path / "c.parquet", row_group_size=100)
    chunk = pq.ParquetFile(path).metadata.row_group(1).column(0)
    start = chunk.dictionary_page_offset or chunk.data_page_offset
    data = bytearray(path.read_bytes())
    data[start : start + 16] = b"\xff" * 16  # the page header: undecodable
    path.write_bytes(bytes(data))
    reader = ValidatingReader(tmp_path, batch_size=60)
    ids = [i for batch in reader for i in batch.column("interaction_id").to_pylist()]
    (file,) = reader.report.files
    expected = table(300)["interaction_id"].to_pylist()
    assert ids == expected[:100] + expected[200:]
    assert (file.rows_good, file.rows_total, file.status) == (200, 300, "unreadable")
    assert file.rows_by_reason == {"unreadable": 100}
    assert file.messages[0].startswith("unreadable: row group 1, rows 100-199: OSError: ")


def test_page_checksums_of_our_writer_catch_silent_corruption(tmp_path: Path) -> None:
    (key,) = write_shards(table(300), tmp_path, partition_by=["checkpoint"], row_group_size=100)
    path = tmp_path / key
    chunk = pq.ParquetFile(path).metadata.row_group(1).column(6)  # prompt_ids, mid-page
    data = bytearray(path.read_bytes())
    middle = chunk.data_page_offset + chunk.total_compressed_size // 2
    data[middle : middle + 4] = b"\x01\x02\x03\x04"
    path.write_bytes(bytes(data))
    report = validate(tmp_path)
    assert report.rows_by_reason == {"unreadable": 100}
    assert "CRC checksum verification failed" in report.files[0].messages[0]


def test_missing_column_rejects_the_file(tmp_path: Path) -> None:
    report = _validate_one(table(20).drop_columns(["latency_ms", "org"]), tmp_path)
    (file,) = report.files
    assert file.status == "rejected"
    assert file.rows_good == 0
    assert _only(report) == {"missing_column": 20}
    assert report.files_by_reason == {"missing_column": 1}
    assert "required column 'latency_ms' is missing" in file.render()
    assert "required column 'org' is missing" in file.render()


def test_uncastable_type_rejects_the_file(tmp_path: Path) -> None:
    t = replace(table(20), "completion_ids", pa.array([["1"]] * 20))
    report = _validate_one(t, tmp_path)
    assert _only(report) == {"wrong_type": 20}
    assert "'completion_ids' has type list<element: string>" in report.render()


def test_value_out_of_range_quarantines_its_batch(tmp_path: Path) -> None:
    t = table(10)
    ids = t["prompt_ids"].cast(pa.list_(pa.int64())).to_pylist()
    ids[3] = [2**40]
    write(replace(t, "prompt_ids", pa.array(ids, pa.list_(pa.int64()))), tmp_path / "a.parquet")
    write(table(10, seed=1), tmp_path / "b.parquet")
    report = validate(tmp_path, batch_size=4)
    assert report.rows_by_reason == {"wrong_type": 4}
    assert report.rows_good == 16
    assert "rows 0-3" in report.files[0].messages[0]


@pytest.mark.parametrize(
    ("column", "value"),
    [
        ("interaction_id", None),
        ("checkpoint_id", None),
        ("created_at", None),
        ("prompt_ids", None),
        ("completion_mask", None),
        ("prompt_ids", [1, None, 3]),
    ],
)
def test_null_required(tmp_path: Path, column: str, value: object) -> None:
    t = set_cell(table(10), column, 4, value)
    report = _validate_one(t, tmp_path)
    assert _only(report) == {"null_required": 1}
    assert report.files[0].examples == {"null_required": [4]}


def test_null_tokens_and_signals(tmp_path: Path) -> None:
    t = table(10)
    ids = t["completion_ids"].to_pylist()
    ids[2][0] = None
    t = replace(t, "completion_ids", pa.array(ids, pa.list_(pa.int32())))
    # Nullable columns: nulls are fine.
    for name in ["user_id", "org", "feedback_at", "latency_ms", "tool_calls", "edit_persisted"]:
        t = set_cell(t, name, 7, None)
    report = _validate_one(t, tmp_path)
    assert _only(report) == {"null_required": 1}
    assert report.files[0].examples == {"null_required": [2]}


def test_list_length_mismatch(tmp_path: Path) -> None:
    t = table(10)
    for row, name in [(1, "completion_logprobs"), (5, "completion_mask"), (6, "completion_ids")]:
        values = t[name].to_pylist()
        values[row] = values[row][:-1]
        t = replace(t, name, pa.array(values, t.schema.field(name).type))
    report = _validate_one(t, tmp_path)
    assert _only(report) == {"list_length_mismatch": 3}
    assert report.files[0].examples == {"list_length_mismatch": [1, 5, 6]}
    assert report.rows_good == 7


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (0.5, "logprob_positive"),
        (math.nan, "logprob_non_finite"),
        (math.inf, "logprob_positive"),
        (-math.inf, "logprob_non_finite"),
    ],
)
def test_logprobs(tmp_path: Path, value: float, reason: str) -> None:
    t = table(10)
    logprobs = t["completion_logprobs"].to_pylist()
    logprobs[8][-1] = value
    t = replace(t, "completion_logprobs", pa.array(logprobs, pa.list_(pa.float32())))
    counts = _only(_validate_one(t, tmp_path))
    # +inf is both positive and non-finite.
    expected = {reason: 1}
    if value == math.inf:
        expected["logprob_non_finite"] = 1
    assert counts == expected


def test_zero_logprob_is_fine(tmp_path: Path) -> None:
    t = table(5)
    logprobs = t["completion_logprobs"].to_pylist()
    logprobs[0][0] = 0.0
    t = replace(t, "completion_logprobs", pa.array(logprobs, pa.list_(pa.float32())))
    assert _validate_one(t, tmp_path).ok


@pytest.mark.parametrize(
    ("column", "value"),
    [
        ("edit_persisted", 1.5),
        ("edit_persisted", -0.1),
        ("edit_persisted", math.nan),
        ("latency_ms", -1.0),
        ("latency_ms", math.inf),
        ("tool_calls", -1),
        ("invalid_tool_calls", -2),
        ("edits_proposed", -1),
        ("invalid_tool_calls", 99),  # more invalid tool calls than tool calls
    ],
)
def test_signal_out_of_range(tmp_path: Path, column: str, value: object) -> None:
    report = _validate_one(set_cell(table(10), column, 3, value), tmp_path)
    assert _only(report) == {"signal_out_of_range": 1}
    assert report.files[0].examples == {"signal_out_of_range": [3]}


def test_signal_bounds_are_inclusive(tmp_path: Path) -> None:
    t = set_cell(table(10), "edit_persisted", 0, 0.0)
    t = set_cell(t, "edit_persisted", 1, 1.0)
    t = set_cell(t, "latency_ms", 2, 0.0)
    t = set_cell(set_cell(t, "tool_calls", 3, 2), "invalid_tool_calls", 3, 2)
    assert _validate_one(t, tmp_path).ok


def test_duplicate_ids_within_and_across_files(tmp_path: Path) -> None:
    a, b = table(10), table(10, seed=1)
    ids_a = a["interaction_id"].to_pylist()
    a = set_cell(a, "interaction_id", 9, ids_a[2])  # within the file
    b = set_cell(b, "interaction_id", 0, ids_a[5])  # across files
    b = set_cell(b, "interaction_id", 1, ids_a[5])  # and again
    write(a, tmp_path / "a.parquet")
    write(b, tmp_path / "b.parquet")
    report = validate(tmp_path, batch_size=4)
    assert report.rows_by_reason == {"duplicate_interaction_id": 3}
    assert [f.examples for f in report.files] == [
        {"duplicate_interaction_id": [9]},
        {"duplicate_interaction_id": [0, 1]},
    ]
    assert report.rows_good == 17


def test_a_quarantined_row_does_not_claim_its_id(tmp_path: Path) -> None:
    a, b = table(5), table(5, seed=1)
    a = set_cell(a, "latency_ms", 0, -5.0)
    b = set_cell(b, "interaction_id", 0, a["interaction_id"][0].as_py())
    write(a, tmp_path / "a.parquet")
    write(b, tmp_path / "b.parquet")
    report = validate(tmp_path)
    assert report.rows_by_reason == {"signal_out_of_range": 1}


def test_only_good_rows_come_out_canonical_and_projected(tmp_path: Path) -> None:
    t = table(30)
    t = set_cell(t, "latency_ms", 10, -1.0)
    t = set_cell(t, "interaction_id", 20, None)
    t = replace(t, "created_at", t["created_at"].cast(pa.timestamp("ns")))
    write(t, tmp_path / "p.parquet")
    reader = ValidatingReader(tmp_path, batch_size=8)
    out = pa.Table.from_batches(list(reader))
    assert out.schema.equals(INTERACTION_SCHEMA)
    assert out.num_rows == 28
    expected = [v for i, v in enumerate(t["interaction_id"].to_pylist()) if i not in (10, 20)]
    assert out["interaction_id"].to_pylist() == expected
    assert reader.report.rows_good == 28
    assert reader.report.files[0].status == "bad"
    projected = ValidatingReader(tmp_path, columns=["latency_ms", "created_at"])
    table_projected = pa.Table.from_batches(list(projected))
    assert table_projected.schema.names == ["latency_ms", "created_at"]
    assert table_projected.num_rows == 28
    # The projection does not change what is judged: the report is the same.
    assert projected.report.to_dict() == reader.report.to_dict()


def test_report_is_updated_while_streaming(tmp_path: Path) -> None:
    write(table(10), tmp_path / "a.parquet")
    write(table(10, seed=1), tmp_path / "b.parquet")
    reader = ValidatingReader(tmp_path)
    stream = iter(reader)
    next(stream)
    assert (reader.report.files_total, reader.report.rows_good) == (1, 10)
    list(stream)
    assert (reader.report.files_total, reader.report.rows_good) == (2, 20)


# --- the mixed set of the acceptance criteria, through the CLI entry point -----------------


def _mixed_set(root: Path) -> None:
    write_shards(table(100), root, partition_by=["checkpoint"])  # 100 good rows
    truncated = write(table(40, seed=1), root / "checkpoint=ckpt-1" / "part-00001.parquet")
    truncated.write_bytes(truncated.read_bytes()[:-100])
    write(
        table(30, seed=2).drop_columns(["org"]), root / "checkpoint=ckpt-1" / "part-00002.parquet"
    )
    mismatched = table(50, seed=3)
    mask = mismatched["completion_mask"].to_pylist()
    for row in (3, 17, 42):
        mask[row] = [*mask[row], True]
    mismatched = replace(mismatched, "completion_mask", pa.array(mask, pa.list_(pa.bool_())))
    write(mismatched, root / "checkpoint=ckpt-1" / "part-00003.parquet")
    (root / "checkpoint=ckpt-1" / "_MANIFEST.json").write_text("{}")


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="rtrl")
    add_shards_parser(parser.add_subparsers())
    return parser.parse_args(argv)


def test_mixed_set_counts_and_exit_code(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _mixed_set(tmp_path)
    args = _args("shards", "validate", str(tmp_path))
    assert args.func(args) == 1
    text = capsys.readouterr().out.splitlines()
    prefix = tmp_path.as_uri() + "/checkpoint=ckpt-1"
    assert text[0].startswith(f"{prefix}/part-00001.parquet: unreadable: ")
    assert text[1] == (
        f"{prefix}/part-00002.parquet: rejected (30 rows): "
        "missing_column: required column 'org' is missing"
    )
    assert text[2] == f"{prefix}/part-00003.parquet: 3 of 50 rows bad: list_length_mismatch=3"
    assert text[3] == "files: 4 total, 3 bad; rows: 180 total, 147 good, 33 bad"
    assert text[4:] == [
        "  unreadable: 0 rows in 1 files",
        "  missing_column: 30 rows in 1 files",
        "  list_length_mismatch: 3 rows in 1 files",
    ]

    args = _args("shards", "validate", tmp_path.as_uri() + "/", "--json")
    assert run_validate(args) == 1
    doc = json.loads(capsys.readouterr().out)
    assert (doc["ok"], doc["files_total"], doc["files_bad"]) == (False, 4, 3)
    assert (doc["rows_total"], doc["rows_good"], doc["rows_bad"]) == (180, 147, 33)
    assert doc["files_by_reason"] == {
        "unreadable": 1,
        "missing_column": 1,
        "list_length_mismatch": 1,
    }
    assert doc["rows_by_reason"] == {"missing_column": 30, "list_length_mismatch": 3}
    statuses = [(f["key"].rsplit("/", 1)[1], f["status"]) for f in doc["files"]]
    assert statuses == [
        ("part-00000.parquet", "ok"),
        ("part-00001.parquet", "unreadable"),
        ("part-00002.parquet", "rejected"),
        ("part-00003.parquet", "bad"),
    ]
    assert doc["files"][3]["examples"] == {"list_length_mismatch": [3, 17, 42]}


def test_cli_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_shards(table(20), tmp_path / "good", partition_by=["checkpoint"])
    assert run_validate(_args("shards", "validate", str(tmp_path / "good"))) == 0
    assert "0 bad" in capsys.readouterr().out
    (tmp_path / "empty").mkdir()
    assert run_validate(_args("shards", "validate", str(tmp_path / "empty"))) == 1
    assert "no shard files" in capsys.readouterr().out
    for uri in ["ftp://x/y", "s3://Bad_Bucket/x", "file://relative/x", str(tmp_path / "nope")]:
        assert run_validate(_args("shards", "validate", uri)) == 2, uri
        assert "rtrl shards validate:" in capsys.readouterr().err
    args = _args("shards", "validate", str(tmp_path / "good"), "--partition", "checkpoint=zzz")
    assert run_validate(args) == 1  # nothing under that partition
    args = _args("shards", "validate", str(tmp_path / "good"), "--partition", "checkpoint=ckpt-1")
    assert run_validate(args) == 0
    no_command = _args("shards")
    assert no_command.func(no_command) == 2


def test_bad_partition_flag_is_a_usage_error() -> None:
    with pytest.raises(SystemExit) as caught:
        _args("shards", "validate", "/x", "--partition", "checkpoint")
    assert caught.value.code == 2


def test_random_corruption_never_crashes(tmp_path: Path) -> None:
    source = write(table(120), tmp_path / "source.bin", row_group_size=40)
    good = source.read_bytes()
    rng = random.Random(0)
    statuses: set[str] = set()
    for attempt in range(100):
        data = bytearray(good)
        if attempt % 3 == 0:
            data = data[: rng.randrange(len(data))]
        else:
            start = rng.randrange(len(data))
            data[start : start + rng.choice([1, 8, 64])] = rng.randbytes(64)[: len(data) - start]
        shard = tmp_path / f"set-{attempt}" / "x.parquet"
        shard.parent.mkdir()
        shard.write_bytes(bytes(data))
        reader = ValidatingReader(shard.parent, batch_size=32)
        rows = sum(batch.num_rows for batch in reader)
        (file,) = reader.report.files
        assert rows == file.rows_good <= max(file.rows_total, rows)
        statuses.add(file.status)
    assert "unreadable" in statuses


def _failing(error: Exception) -> Callable[[str], NoReturn]:
    def open_input(key: str) -> NoReturn:
        raise error

    return open_input


def test_store_failures_propagate_but_vanished_files_are_unreadable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_shards(table(10), tmp_path, partition_by=["checkpoint"])
    flaky = LocalStore(tmp_path)
    # An unreachable endpoint is the store's failure, not the file's: it must fail the
    # step, not quarantine good data.
    monkeypatch.setattr(flaky, "open_input", _failing(StoreError("endpoint unreachable")))
    with pytest.raises(StoreError, match="endpoint unreachable"):
        validate(flaky)
    vanishing = LocalStore(tmp_path)
    monkeypatch.setattr(vanishing, "open_input", _failing(ObjectNotFound("x: no such object")))
    report = validate(vanishing)
    assert report.files[0].status == "unreadable"
    assert "no such object" in report.files[0].messages[0]


def test_rtrl_shards_validate_command(tmp_path: Path) -> None:
    """The command a user types, as a process: the same counts, exit 1."""
    import subprocess

    from tests.conftest import console_script

    _mixed_set(tmp_path)
    out = subprocess.run(
        [console_script("rtrl"), "shards", "validate", tmp_path.as_uri() + "/"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 1, out.stderr
    assert "files: 4 total, 3 bad; rows: 180 total, 147 good, 33 bad" in out.stdout
    assert "missing_column: required column 'org' is missing" in out.stdout
    assert "3 of 50 rows bad: list_length_mismatch=3" in out.stdout
