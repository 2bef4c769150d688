"""Property-based fuzzing of the validating reader: random bytes, and valid shard files cut
short or with one bit flipped anywhere (a page, a header, the footer). Whatever the file,
reading it never raises, and every row it passes on as good of a file of rtrl's writer is
a row of the original (page checksums catch a flipped bit in the data; a foreign file
without them can have a value changed undetectably, and such a row still passes every row
check, which is all the reader can promise). Fixed budget as in
tests/contract/test_validate_fuzz.py: derandomized under CI.

Two properties the fuzzing found broken have a test of their own below: a row group that
yields fewer rows than its footer says lost them without a reason (now counted as
``unreadable``), and a string that is not UTF-8 came out as a good row, which then failed
whoever read it (now ``invalid_utf8``)."""

from __future__ import annotations

import io
import json
import os
import tempfile
from array import array
from datetime import timedelta
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rtrl.core.shards import ValidatingReader, write_shards
from rtrl.core.shards.report import FileReport
from tests.rtrl.core.shards.helpers import replace, table, write

SHARD_FUZZ = settings(
    max_examples=150,
    deadline=timedelta(seconds=2),
    derandomize=bool(os.environ.get("CI")),
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)

ROWS = 40


def _key(row: dict[str, Any]) -> str:
    return json.dumps(row, sort_keys=True, default=str)


def _originals() -> tuple[bytes, bytes, set[str]]:
    """An rtrl-written shard (page checksums, two row groups), a foreign one (pyarrow's
    defaults, no checksums), and their rows."""
    rows = table(ROWS, seed=7)
    with tempfile.TemporaryDirectory() as directory:
        root = Path(directory)
        (key,) = write_shards(rows, root / "ours", partition_by=[], row_group_size=ROWS // 2)
        ours = (root / "ours" / key).read_bytes()
        foreign = write(rows, root / "foreign.parquet", row_group_size=ROWS // 2).read_bytes()
    return ours, foreign, {_key(r) for r in rows.to_pylist()}


OURS, FOREIGN, ORIGINAL_ROWS = _originals()


def _read(data: bytes) -> tuple[FileReport, list[dict[str, Any]]]:
    """The report and the good rows of one file holding ``data`` (rows that cannot even be
    turned into Python values are left out: see the UTF-8 xfail)."""
    with tempfile.TemporaryDirectory() as directory:
        (Path(directory) / "part-00000.parquet").write_bytes(data)
        reader = ValidatingReader(directory)
        batches = list(reader)
    good = []
    for batch in batches:
        try:
            good += pa.Table.from_batches([batch]).to_pylist()
        except UnicodeDecodeError:
            good += [{"not UTF-8": True}] * batch.num_rows
    (file,) = reader.report.files
    return file, good


def _accounted(file: FileReport, good: list[dict[str, Any]], *, checksummed: bool) -> None:
    assert file.rows_good == len(good)
    if checksummed:  # nothing altered passes as good
        assert {_key(row) for row in good} <= ORIGINAL_ROWS
    if len(good) < ROWS:  # lost rows are counted against the file
        assert file.status != "ok", file


@SHARD_FUZZ
@given(data=st.binary(max_size=2000))
def test_random_bytes_are_unreadable(data: bytes) -> None:
    file, good = _read(data)
    assert good == []
    assert file.status == "unreadable"
    assert file.reasons == {"unreadable"}


@SHARD_FUZZ
@given(source=st.sampled_from(["ours", "foreign"]), fraction=st.floats(0, 1, exclude_max=True))
def test_truncated_shards_are_unreadable(source: str, fraction: float) -> None:
    data = OURS if source == "ours" else FOREIGN
    file, good = _read(data[: int(len(data) * fraction)])
    assert good == []
    assert file.status == "unreadable"


@SHARD_FUZZ
@given(source=st.sampled_from(["ours", "foreign"]), where=st.floats(0, 1, exclude_max=True),
       bit=st.integers(0, 7))  # fmt: skip
def test_a_flipped_bit_is_never_silently_good(source: str, where: float, bit: int) -> None:
    data = bytearray(OURS if source == "ours" else FOREIGN)
    data[int(len(data) * where)] ^= 1 << bit
    file, good = _read(bytes(data))
    _accounted(file, good, checksummed=source == "ours")


@pytest.mark.parametrize("source", ["ours", "foreign"])
def test_the_originals_read_whole(source: str) -> None:
    """The properties above are about corruption: the untouched files are all good."""
    file, good = _read(OURS if source == "ours" else FOREIGN)
    assert (file.status, len(good)) == ("ok", ROWS)
    assert {_key(row) for row in good} == ORIGINAL_ROWS


def test_a_row_group_that_yields_fewer_rows_than_its_footer_says_loses_them_with_a_reason(
    tmp_path: Path,
) -> None:
    """One flipped bit in the first data page header of a column of row group 0 (found by
    the fuzzing): pyarrow's batch iterator then yields nothing of that row group, without an
    error, so 20 of 40 rows vanish with no reason in the report."""
    metadata = pq.read_metadata(io.BytesIO(OURS))
    chunk = metadata.row_group(0).column(1)
    data = bytearray(OURS)
    data[chunk.data_page_offset + 1] ^= 0b10
    file, good = _read(bytes(data))
    assert len(good) == ROWS // 2
    assert file.reasons == {"unreadable"}, file
    assert file.rows_by_reason == {"unreadable": ROWS // 2}, file


def test_a_string_that_is_not_utf8_is_never_a_good_row(tmp_path: Path) -> None:
    """A foreign pipeline's file whose ``org`` of row 3 is not UTF-8 (pyarrow writes and
    reads it without a check): the row must be quarantined, not passed on to fail whoever
    turns it into text."""
    rows = table(ROWS, seed=7)
    orgs = [org.encode() for org in rows["org"].to_pylist()]
    orgs[3] = b"\xb8\xff"
    offsets = [0]
    for org in orgs:
        offsets.append(offsets[-1] + len(org))
    broken = pa.Array.from_buffers(
        pa.string(),
        ROWS,
        [None, pa.py_buffer(array("i", offsets).tobytes()), pa.py_buffer(b"".join(orgs))],
    )
    file, good = _read(write(replace(rows, "org", broken), tmp_path / "x.parquet").read_bytes())
    assert {"not UTF-8": True} not in good
    assert file.rows_good == ROWS - 1, file


def test_a_time_no_interaction_can_have_is_quarantined_with_its_reason() -> None:
    """A flipped high bit in a foreign file's created_at (found by the fuzzing): the value
    is a valid 64-bit count of microseconds, but far beyond year 9999, so turning the row into
    Python values failed (OverflowError); it is now quarantined as time_out_of_range."""
    rows = table(ROWS, seed=7)
    micros = rows["created_at"].cast(pa.int64()).to_pylist()
    micros[5] = 3 * 10**17  # year ~11,500
    micros[6] = 0  # 1970
    created = pa.array(micros, pa.int64()).cast(rows.schema.field("created_at").type)
    bad = rows.set_column(rows.schema.get_field_index("created_at"), "created_at", created)
    with tempfile.TemporaryDirectory() as directory:
        data = write(bad, Path(directory) / "f.parquet", row_group_size=ROWS).read_bytes()
    file, good = _read(data)
    assert len(good) == ROWS - 2
    assert file.rows_by_reason == {"time_out_of_range": 2}, file
    assert any("outside the years 2000-9999" in m for m in file.messages), file.messages
