"""``rtrl-job stage`` over a hostile shard set of each kind of issue 32 (built by
tests/rtrl/core/shards/bombs.py) quarantines it within 10 s and 500 MB and stages the honest
rows beside it; stage.json counts the bomb with the rows its footer plausibly holds.

Before the shard limits: the 200,000 row groups hung the stage (> 150 s, 6.4 GB: its footers
are read twice, for the token-id range and for the rows), the dictionary bomb ended in a
traceback or GBs, the long list cost ~0.8 GB, and a footer claiming 10^9 rows made
999,999,000 quarantined rows, a bad fraction that fails any stage."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.rtrl.core.shards import bombs
from tests.rtrl_trainer.helpers import stage_args

MiB = 1 << 20

# (the bomb, the rows stage.json quarantines for it, by reason)
CASES: dict[str, tuple[Callable[[Path], Path], dict[str, int]]] = {
    "row-groups": (bombs.row_groups, {}),  # its footer is not even parsed: no rows known
    "dictionary": (lambda root: bombs.dictionary(root, store_schema=False), {"too_long": 16_384}),
    "long-list": (bombs.long_list, {"over_limit": 1}),
    "claimed-rows": (bombs.claimed_rows, {"unreadable": 1000}),
}


@pytest.mark.parametrize("kind", list(CASES))
def test_the_stage_quarantines_a_bomb_within_the_bounds(tmp_path: Path, kind: str) -> None:
    make, quarantined = CASES[kind]
    shards, out = tmp_path / "shards", tmp_path / "out"
    make(shards)
    bombs.good(shards)
    job = str(Path(sys.executable).parent / "rtrl-job")
    run = bombs.measure([job, *stage_args(shards, out, "--max-bad-fraction", "1")])
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Traceback" not in run.stderr
    assert run.seconds < bombs.SECONDS, f"{run.seconds:.1f} s"
    assert run.peak_bytes < bombs.MEMORY, f"{run.peak_bytes / MiB:.0f} MB"
    stage = json.loads((out / "stage.json").read_text())
    assert stage["quarantined"] == quarantined, stage["quarantined"]
    assert stage["files_bad"] == 1 and stage["files_total"] == 2
    # The honest rows (their feedback matured before the stage's cutoff) are staged.
    assert stage["interactions_used"] > 0


def test_a_footer_claiming_a_billion_rows_does_not_fail_the_stage_on_its_own(
    tmp_path: Path,
) -> None:
    """The default maxBadFraction (1%): 1,000 unreadable rows beside 20 good ones fail the
    stage, as they should; it is their number, not the 10^9 claimed, that is reported."""
    shards, out = tmp_path / "shards", tmp_path / "out"
    bombs.claimed_rows(shards)
    bombs.good(shards)
    job = str(Path(sys.executable).parent / "rtrl-job")
    run = bombs.measure([job, *stage_args(shards, out)])
    assert run.returncode == 1, run.stderr[-3000:]
    assert "Traceback" not in run.stderr
    assert "1000" in run.stderr and "999999000" not in run.stderr.replace(",", ""), run.stderr
