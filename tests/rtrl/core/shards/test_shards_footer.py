"""rtrl's own reading of a Parquet footer (rtrl.core.shards.footer) agrees with pyarrow's on
every file pyarrow reads without trouble, and where pyarrow's metadata accessors abort the
process (a C++ exception through a call Cython cannot catch) the reader reports the file as
unreadable instead."""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rtrl.core.shards import validate, write_shards
from rtrl.core.shards.footer import FooterError, read_footer
from rtrl.core.shards.reader import list_files
from rtrl.core.shards.statistics import declared_range
from rtrl.core.store.local import LocalStore
from tests.rtrl.core.shards.helpers import replace, table, write


def _footer_bytes(path: Path) -> bytes:
    data = path.read_bytes()
    (length,) = struct.unpack("<I", data[-8:-4])
    return data[len(data) - 8 - length : len(data) - 8]


def _files(tmp_path: Path) -> list[Path]:
    rows = table(60, seed=3)
    nested = pa.table(
        {
            "a": pa.array([{"x": 1, "y": [1, 2]}, None, {"x": 3, "y": []}]),
            "m": pa.array([[("k", 1)], [], None], pa.map_(pa.string(), pa.int64())),
            "u": pa.array([1, 2**32 - 1, None], pa.uint32()),
            "f": pa.array([b"abcd", b"efgh", None], pa.binary(4)),
        }
    )
    (ours,) = write_shards(rows, tmp_path / "ours", partition_by=[], row_group_size=16)
    return [
        tmp_path / "ours" / ours,
        write(rows, tmp_path / "plain.parquet", use_dictionary=False, compression="none"),
        write(rows, tmp_path / "nostats.parquet", write_statistics=False, row_group_size=7),
        write(rows, tmp_path / "v1.parquet", version="1.0", data_page_version="1.0"),
        write(nested, tmp_path / "nested.parquet"),
    ]


def test_the_footer_reads_as_pyarrow_reads_it(tmp_path: Path) -> None:
    for path in _files(tmp_path):
        footer = read_footer(_footer_bytes(path), max_row_groups=4096)
        meta = pq.read_metadata(path)
        assert footer.num_rows == meta.num_rows, path
        assert [leaf.path for leaf in footer.leaves] == [
            meta.schema.column(i).path for i in range(meta.num_columns)
        ]
        for i, leaf in enumerate(footer.leaves):
            column = meta.schema.column(i)
            assert leaf.physical_type == column.physical_type, (path, leaf)
            assert leaf.max_repetition_level == column.max_repetition_level, (path, leaf)
            assert leaf.max_definition_level == column.max_definition_level, (path, leaf)
        assert len(footer.row_groups) == meta.num_row_groups
        for g, group in enumerate(footer.row_groups):
            theirs = meta.row_group(g)
            assert (group.num_rows, group.total_byte_size) == (
                theirs.num_rows,
                theirs.total_byte_size,
            )
            for c, chunk in enumerate(group.chunks):
                col = theirs.column(c)
                assert chunk.num_values == col.num_values
                assert chunk.total_uncompressed_size == col.total_uncompressed_size
                assert chunk.total_compressed_size == col.total_compressed_size
                assert chunk.data_page_offset == col.data_page_offset
                assert chunk.dictionary_page_offset == (
                    col.dictionary_page_offset if col.has_dictionary_page else None
                )
                assert chunk.encodings == frozenset(col.encodings), (chunk.encodings, col)
                stats = col.statistics
                if stats is not None and stats.has_min_max and col.physical_type == "INT32":
                    low = struct.unpack("<i", chunk.min_value or b"")[0]
                    high = struct.unpack("<i", chunk.max_value or b"")[0]
                    unsigned = footer.leaves[c].unsigned
                    assert unsigned == (footer.leaves[c].path == "u")
                    if not unsigned:
                        assert (low, high) == (stats.min, stats.max)


@pytest.mark.parametrize("cut", [1, 3, 10, 100])
def test_a_footer_cut_short_is_unreadable_never_a_crash(tmp_path: Path, cut: int) -> None:
    data = _footer_bytes(_files(tmp_path)[0])
    with pytest.raises(FooterError) as error:
        read_footer(data[:-cut], max_row_groups=4096)
    assert error.value.reason == "unreadable"


def _flipped(tmp_path: Path) -> Path:
    """A shard whose footer has one bit flipped in a column's schema element (its
    repetition: required becomes optional), so that its size statistics no longer fit it:
    pyarrow's ``row_group(i).column(j)`` throws a C++ exception Cython lets through, and the
    process aborts."""
    (key,) = write_shards(table(40, seed=7), tmp_path / "src", partition_by=[],
                          row_group_size=20)  # fmt: skip
    data = bytearray((tmp_path / "src" / key).read_bytes())
    (length,) = struct.unpack("<I", bytes(data[-8:-4]))
    start = len(data) - 8 - length
    data[start + 21] ^= 1  # found by flipping every bit of this footer (issue 32)
    path = tmp_path / "flipped" / "part-0.parquet"
    path.parent.mkdir()
    path.write_bytes(bytes(data))
    return path


_ABORTS = """
import sys, pyarrow.parquet as pq
meta = pq.read_metadata(sys.argv[1])
meta.row_group(0).column(0)
"""


def test_a_flipped_bit_that_aborts_pyarrow_is_an_unreadable_file(tmp_path: Path) -> None:
    path = _flipped(tmp_path)
    done = subprocess.run([sys.executable, "-c", _ABORTS, str(path)], capture_output=True)
    assert done.returncode < 0, "pyarrow no longer aborts: this test can be dropped"
    report = validate(path.parent)
    (file,) = report.files
    assert file.status == "unreadable", file
    # The stage's first read of it, its footer's token-id statistics, goes through too.
    store = LocalStore(path.parent)
    assert declared_range(store, list(list_files(store))) is not None


def test_the_stage_survives_the_flipped_bit(tmp_path: Path) -> None:
    """The stage reads the footers' token-id statistics first; with pyarrow's accessors that
    read aborted the whole step on this file."""
    path = _flipped(tmp_path)
    code = (
        "import sys; from rtrl.core.shards.statistics import declared_range; "
        "from rtrl.core.shards.reader import list_files; from rtrl.core.store.local import "
        "LocalStore; s = LocalStore(sys.argv[1]); print(declared_range(s, list_files(s)))"
    )
    done = subprocess.run([sys.executable, "-c", code, str(path.parent)], capture_output=True,
                          text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("ValueRange("), done.stdout


def test_unsigned_statistics_declare_no_range(tmp_path: Path) -> None:
    """uint32 ids are stored as INT32 in unsigned order: read as signed, 2^32-1 would be -1,
    a range that hides a large id. Such a file declares no range at all."""
    ids = pa.array([[1, 2**32 - 1]] * 3, pa.list_(pa.uint32()))
    rows = replace(table(3), "prompt_ids", ids)
    write(rows, tmp_path / "checkpoint=ckpt-1" / "u.parquet")
    store = LocalStore(tmp_path)
    assert declared_range(store, list_files(store), ["prompt_ids"]) is None


def test_a_footer_read_costs_no_more_than_its_bytes(tmp_path: Path) -> None:
    """4,096 row groups of the canonical schema (a 6 MB footer) read in a second or so."""
    rows = pa.Table.from_batches([table(1).to_batches()[0]] * 4096)
    path = write(rows, tmp_path / "many.parquet", row_group_size=1)
    footer = read_footer(_footer_bytes(path), max_row_groups=4096)
    assert len(footer.row_groups) == 4096
    assert sum(g.num_rows for g in footer.row_groups) == 4096
    assert np.all([len(g.chunks) == 17 for g in footer.row_groups])
    with pytest.raises(FooterError, match="4,096 row groups, over the limit of 4,095"):
        read_footer(_footer_bytes(path), max_row_groups=4095)
