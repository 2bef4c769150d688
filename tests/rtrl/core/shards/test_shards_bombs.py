"""A hostile shard set of each kind of issue 32 is quarantined by ``rtrl shards validate``
within 10 s and 500 MB, with one line per file saying why, and the honest rows beside it
still good (bombs.py says what each bomb is and what it cost before the limits).

Each run is a process of its own, measured from outside (wall time, peak RSS). Before the
limits of rtrl.core.shards.limits: the row groups took > 60 s and GBs (the red team: > 120 s,
3.4 GB), the dictionary ended in a traceback (malloc of 16 GiB failed) or took GBs, the long
list ~0.8 GB, and the 10^9-row footer was counted as 999,999,000 quarantined rows."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from rtrl.core.shards.limits import MAX_LIST_LENGTH, MAX_ROW_GROUPS
from tests.rtrl.core.shards import bombs

MiB = 1 << 20


def _validate(root: Path) -> tuple[bombs.Measured, dict]:
    run = bombs.measure(bombs.rtrl("shards", "validate", str(root), "--json"))
    assert run.returncode == 1, (run.returncode, run.stderr[-3000:])
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    return run, json.loads(run.stdout)


def _within_bounds(run: bombs.Measured) -> None:
    assert run.seconds < bombs.SECONDS, f"{run.seconds:.1f} s"
    assert run.peak_bytes < bombs.MEMORY, f"{run.peak_bytes / MiB:.0f} MB"


def _bomb_file(report: dict) -> dict:
    (bad,) = [f for f in report["files"] if f["status"] != "ok"]
    (honest,) = [f for f in report["files"] if f["status"] == "ok"]
    assert honest["rows_good"] == bombs.GOOD_ROWS
    return bad


def test_two_hundred_thousand_row_groups_are_rejected_from_the_footer_size(
    tmp_path: Path,
) -> None:
    bombs.row_groups(tmp_path)
    bombs.good(tmp_path)
    run, report = _validate(tmp_path)
    _within_bounds(run)
    bad = _bomb_file(report)
    assert bad["status"] == "rejected" and bad["reasons"] == ["over_limit"], bad
    assert "footer of" in bad["messages"][0] and "MiB limit" in bad["messages"][0], bad


def test_more_row_groups_than_the_limit_are_rejected_from_the_footer(tmp_path: Path) -> None:
    """A footer small enough to parse still may not list more row groups than the limit:
    rejected, counted with the rows the row groups plausibly hold."""
    groups = MAX_ROW_GROUPS + 1
    path = bombs.row_groups(tmp_path, groups)
    bombs.good(tmp_path)
    assert path.stat().st_size < 8 * MiB
    run, report = _validate(tmp_path)
    _within_bounds(run)
    bad = _bomb_file(report)
    assert bad["status"] == "rejected" and bad["reasons"] == ["over_limit"], bad
    assert f"{groups:,} row groups, over the limit of {MAX_ROW_GROUPS:,}" in bad["messages"][0]


@pytest.mark.parametrize("store_schema", [True, False], ids=["arrow-schema", "plain-strings"])
def test_a_dictionary_bomb_is_quarantined_before_a_value_is_copied_out(
    tmp_path: Path, store_schema: bool
) -> None:
    bombs.dictionary(tmp_path, store_schema=store_schema)
    bombs.good(tmp_path)
    run, report = _validate(tmp_path)
    _within_bounds(run)
    bad = _bomb_file(report)
    assert bad["rows_total"] == 16_384 and bad["rows_good"] == 0, bad
    assert bad["rows_by_reason"] == {"too_long": 16_384}, bad
    assert "user_id is 1,048,576 bytes, over the 4,096 of a string" in bad["messages"][0]


def test_a_list_of_fifty_million_ids_is_rejected_from_the_footer(tmp_path: Path) -> None:
    bombs.long_list(tmp_path)
    bombs.good(tmp_path)
    run, report = _validate(tmp_path)
    _within_bounds(run)
    bad = _bomb_file(report)
    assert bad["status"] == "rejected" and bad["rows_by_reason"] == {"over_limit": 1}, bad
    assert f"so a list of more than {MAX_LIST_LENGTH:,}" in bad["messages"][0], bad


def test_a_footer_claiming_a_billion_rows_counts_the_rows_its_columns_hold(
    tmp_path: Path,
) -> None:
    path = bombs.claimed_rows(tmp_path)
    bombs.good(tmp_path)
    assert bombs.footer_rows(path) == 10**9
    run, report = _validate(tmp_path)
    _within_bounds(run)
    bad = _bomb_file(report)
    assert bad["status"] == "unreadable", bad
    assert bad["rows_total"] == 1000 and bad["rows_by_reason"] == {"unreadable": 1000}, bad
    assert report["rows_total"] == 1000 + bombs.GOOD_ROWS
    assert (
        "claims 1,000,000,000 rows and its columns hold 1,000 values each" in (bad["messages"][0])
    )


BOMBS: dict[str, Callable[[Path], Path]] = {
    "row-groups": bombs.row_groups,
    "dictionary": lambda root: bombs.dictionary(root, store_schema=False),
    "long-list": bombs.long_list,
    "claimed-rows": bombs.claimed_rows,
}


def test_every_bomb_at_once_is_one_report_within_the_bounds(tmp_path: Path) -> None:
    """All four kinds in one set: the time and memory do not add up beyond the bounds."""
    for make in BOMBS.values():
        make(tmp_path)
    bombs.good(tmp_path)
    run, report = _validate(tmp_path)
    _within_bounds(run)
    assert report["files_bad"] == len(BOMBS) and report["rows_good"] == bombs.GOOD_ROWS
    # The honest rows plus: 1 row group row counted... each bomb as plausibly many rows.
    lines = bombs.measure(bombs.rtrl("shards", "validate", str(tmp_path)))
    assert lines.returncode == 1 and "Traceback" not in lines.stderr
    bad_lines = [line for line in lines.stdout.splitlines() if line.startswith("file://")]
    assert len(bad_lines) == len(BOMBS), lines.stdout
