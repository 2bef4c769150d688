"""Hostile shard sets of issue 32 (the red team's "26 runs, 0 tracebacks"), and a way to run
a command on them that measures what it cost: wall time and peak memory, in a process of
its own (a bomb measured in the test's process would blow up the test runner instead).

Each bomb is a few MB on disk at most and made in about a second:

- :func:`row_groups`: 200,000 row groups of one row each (the footer lists all of them;
  parsing it took 3.4 GB and minutes, the stage 6.4 GB);
- :func:`dictionary`: every row's ``user_id`` a reference to one 1 MiB dictionary entry
  (16 GiB per batch once decoded), with the file's Arrow schema stored (read back as a
  dictionary column) or not (read back as strings);
- :func:`long_list`: one row whose ``prompt_ids`` holds 50 million ids (~0.9 GB read);
- :func:`claimed_rows`: 1,000 real rows under a footer claiming 10^9 (999,999,000 of them
  were reported quarantined).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from tests.rtrl.core.shards.footers import claim_rows, repeat_row_groups
from tests.rtrl.core.shards.helpers import replace, table, write

MiB = 1 << 20
# The bound issue 32 sets: a hostile shard set of each kind is quarantined within these.
SECONDS = 10.0
MEMORY = 500 * MiB

# Where each bomb goes in a shard set (Hive partition of checkpoint ckpt-1).
PARTITION = "checkpoint=ckpt-1"
GOOD_ROWS = 20


def row_groups(root: Path, groups: int = 200_000) -> Path:
    path = write(table(1, seed=1), root / PARTITION / "part-rowgroups.parquet")
    repeat_row_groups(path, groups)
    return path


def dictionary(root: Path, *, store_schema: bool, rows: int = 16_384) -> Path:
    big = pa.array(["x" * MiB])
    users = pa.DictionaryArray.from_arrays(pa.array(np.zeros(rows, np.int32)), big)
    bomb = replace(table(rows, seed=2), "user_id", users)
    return write(
        bomb,
        root / PARTITION / f"part-dictionary-{'arrow' if store_schema else 'plain'}.parquet",
        use_dictionary=["user_id"],
        dictionary_pagesize_limit=4 * MiB,
        store_schema=store_schema,
    )


def long_list(root: Path, ids: int = 50_000_000) -> Path:
    values = pa.array(np.zeros(ids, np.int32))
    prompt = pa.ListArray.from_arrays(pa.array([0, ids], pa.int32()), values)
    bomb = replace(table(1, seed=3), "prompt_ids", prompt)
    return write(bomb, root / PARTITION / "part-list.parquet", compression="zstd")


def claimed_rows(root: Path, rows: int = 1000, claim: int = 10**9) -> Path:
    path = write(table(rows, seed=4), root / PARTITION / "part-claim.parquet")
    claim_rows(path, claim)
    return path


def good(root: Path) -> Path:
    """Honest rows beside the bomb: what must still come out."""
    return write(table(GOOD_ROWS, seed=9), root / PARTITION / "part-good.parquet")


@dataclass(frozen=True)
class Measured:
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    peak_bytes: int


# Runs the command as its only child, under an address-space limit (so that a bomb on a
# broken build fails this test, not the machine), and reports its wall time and peak RSS.
_MEASURE = r"""
import json, resource, subprocess, sys, time
cap = int(sys.argv[1])
def limit():
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
started = time.monotonic()
try:
    done = subprocess.run(sys.argv[3:], capture_output=True, text=True, preexec_fn=limit,
                          timeout=float(sys.argv[2]))
    code, out, err = done.returncode, done.stdout, done.stderr
except subprocess.TimeoutExpired as exc:
    code, out, err = "timeout", exc.stdout or "", exc.stderr or ""
    out = out.decode() if isinstance(out, bytes) else out
    err = err.decode() if isinstance(err, bytes) else err
seconds = time.monotonic() - started
peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
print(json.dumps({"code": code, "out": out, "err": err, "seconds": seconds, "peak": peak}))
"""


def measure(argv: list[str], *, timeout: float = 60.0, cap: int = 6 << 30) -> Measured:
    """Run ``argv``; its exit status (-1 when it ran past ``timeout``), output, wall time
    and peak resident memory."""
    done = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(cap), str(timeout), *argv],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONFAULTHANDLER": "0"},
    )
    got = json.loads(done.stdout)
    code = -1 if got["code"] == "timeout" else int(got["code"])
    return Measured(code, got["out"], got["err"], float(got["seconds"]), int(got["peak"]))


def rtrl(*args: str) -> list[str]:
    return [str(Path(sys.executable).parent / "rtrl"), *args]


def footer_rows(path: Path) -> int:
    """What the footer of ``path`` claims."""
    return int(pq.read_metadata(path).num_rows)
