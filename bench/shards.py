"""Shard read throughput and memory: rtrl's validating reader against a raw pyarrow read.

Every pipeline step reads shards through the validating reader, so its cost over simply
decoding the Parquet is the price of never training on a bad row. This benchmark writes
synthetic interactions (~100 completion tokens, 100-300 prompt tokens each) to a temp
directory as a ``file://`` store, then reads them, side by side in one run:

  (a) raw pyarrow: ``pq.ParquetFile(store.open_input(key)).iter_batches(...)`` over the same
      files, columns and batch size, no checks;
  (a') raw pyarrow with rtrl's I/O pattern (row group by row group, the same ParquetFile
      options), no casts or checks: (b) against (a') is the cost of validation alone;
  (b) rtrl: :class:`rtrl.core.shards.ValidatingReader` (casts, row checks, duplicate ids).

Each read runs in a fresh subprocess, so the peak RSS it reports is the reader's own and
not the writer's. The validating read is also measured on a set a quarter of the size, to
show its peak RSS does not grow with the number of rows. Goals: (b) within 2x of (a) in
time; peak RSS independent of rows.

    .venv/bin/python bench/shards.py [--rows 1000000] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from rtrl.core.shards import (
    DEFAULT_BATCH_SIZE,
    REQUIRED_COLUMNS,
    ValidatingReader,
    list_files,
    synthetic_interactions,
    write_shards,
)
from rtrl.core.shards.reader import iter_row_groups, open_parquet
from rtrl.core.store.local import LocalStore

MB = 1_000_000


def _peak_rss() -> int:
    """This process's peak resident set size in bytes.

    Linux's VmHWM belongs to the address space, which exec replaces, so it is the child's
    own; ru_maxrss would carry over the parent's peak from the fork.
    """
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def _measure(kind: str, root: Path, batch_size: int) -> dict[str, Any]:
    """One read of the whole set in this (fresh) process; returns its figures."""
    store = LocalStore(root)
    files = list(list_files(store))
    file_bytes = sum(f.size for f in files)
    rss_before = _peak_rss()
    rows = decoded = 0
    start = time.perf_counter()
    ok = True
    if kind == "raw_row_groups":
        for shard in files:
            with open_parquet(store, shard) as parquet:
                for batch in iter_row_groups(parquet, REQUIRED_COLUMNS, batch_size):
                    rows += batch.num_rows
                    decoded += batch.nbytes
    elif kind == "raw":
        for shard in files:
            with store.open_input(shard.key) as handle:
                parquet = pq.ParquetFile(handle)
                for batch in parquet.iter_batches(
                    batch_size=batch_size, columns=list(REQUIRED_COLUMNS)
                ):
                    rows += batch.num_rows
                    decoded += batch.nbytes
    else:
        reader = ValidatingReader(store, batch_size=batch_size)
        for batch in reader:
            rows += batch.num_rows
            decoded += batch.nbytes
        ok = reader.report.ok
    seconds = time.perf_counter() - start
    return {
        "kind": kind,
        "rows": rows,
        "seconds": seconds,
        "file_bytes": file_bytes,
        "decoded_bytes": decoded,
        "rows_per_s": rows / seconds,
        "file_mb_per_s": file_bytes / MB / seconds,
        "decoded_mb_per_s": decoded / MB / seconds,
        "peak_rss_bytes": _peak_rss(),
        "rss_before_read_bytes": rss_before,
        "report_ok": ok,
    }


def _run_measure(kind: str, root: Path, batch_size: int) -> dict[str, Any]:
    command = [sys.executable, __file__, "--measure", kind, "--root", str(root)]
    command += ["--batch-size", str(batch_size)]
    done = subprocess.run(command, check=True, capture_output=True, text=True)
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def _write(root: Path, rows: int, seed: int) -> dict[str, Any]:
    start = time.perf_counter()
    batches = synthetic_interactions(rows, seed=seed, checkpoint_id="bench-ckpt", tokens=100)
    keys = write_shards(batches, LocalStore(root))
    seconds = time.perf_counter() - start
    size = sum((root / key).stat().st_size for key in keys)
    return {"rows": rows, "files": len(keys), "bytes": size, "seconds": seconds}


def _best(kind: str, root: Path, batch_size: int, repeat: int) -> dict[str, Any]:
    """The fastest of ``repeat`` runs (timing noise is one-sided), with the highest RSS."""
    runs = [_run_measure(kind, root, batch_size) for _ in range(repeat)]
    best = min(runs, key=lambda r: float(r["seconds"]))
    best["peak_rss_bytes"] = max(int(r["peak_rss_bytes"]) for r in runs)
    return best


def _render(result: dict[str, Any]) -> str:
    data, raw, checked = result["dataset"], result["raw"], result["validating"]
    small = result["validating_small"]
    lines = [
        f"shards: {data['rows']:,} interactions in {data['files']} files, "
        f"{data['bytes'] / MB:,.0f} MB on disk (zstd), decoded "
        f"{raw['decoded_bytes'] / MB:,.0f} MB; batch {result['batch_size']:,} rows; "
        f"written in {data['seconds']:.1f} s",
        "",
        f"{'':24}{'rows/s':>12}{'file MB/s':>12}{'decoded MB/s':>14}{'seconds':>10}"
        f"{'peak RSS MB':>13}",
    ]
    runs = (
        ("(a) raw pyarrow", raw),
        ("(a') raw, rtrl's I/O", result["raw_row_groups"]),
        ("(b) rtrl validating", checked),
    )
    for label, run in runs:
        lines.append(
            f"{label:24}{run['rows_per_s']:>12,.0f}{run['file_mb_per_s']:>12,.0f}"
            f"{run['decoded_mb_per_s']:>14,.0f}{run['seconds']:>10.2f}"
            f"{run['peak_rss_bytes'] / MB:>13,.0f}"
        )
    lines += [
        "",
        f"time ratio b/a: {result['ratio_b_over_a']:.2f}x (goal <= 2x); "
        f"b/a': {result['ratio_b_over_a_row_groups']:.2f}x (validation alone)",
        f"peak RSS of (b): {checked['rows']:,} rows: {checked['peak_rss_bytes'] / MB:,.0f} MB; "
        f"{small['rows']:,} rows: {small['peak_rss_bytes'] / MB:,.0f} MB "
        f"(goal: independent of rows; interpreter + imports: "
        f"{checked['rss_before_read_bytes'] / MB:,.0f} MB)",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE)
    parser.add_argument("--repeat", type=int, default=2, help="reads per reader (best kept)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument(
        "--measure", choices=["raw", "raw_row_groups", "validating"], help=argparse.SUPPRESS
    )
    parser.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure:
        print(json.dumps(_measure(args.measure, args.root, args.batch_size)))
        return 0

    small_rows = max(args.rows // 4, 1)
    with tempfile.TemporaryDirectory(prefix="rtrl-bench-shards-") as tmp:
        large, small = Path(tmp) / "large", Path(tmp) / "small"
        dataset = _write(large, args.rows, seed=0)
        _write(small, small_rows, seed=1)
        raw = _best("raw", large, args.batch_size, args.repeat)
        raw_row_groups = _best("raw_row_groups", large, args.batch_size, args.repeat)
        checked = _best("validating", large, args.batch_size, args.repeat)
        checked_small = _best("validating", small, args.batch_size, 1)
    if not (checked["report_ok"] and checked["rows"] == raw["rows"] == args.rows):
        print("validating reader disagreed with the raw read", file=sys.stderr)
        return 1
    result = {
        "dataset": dataset,
        "batch_size": args.batch_size,
        "cpus": os.cpu_count(),
        "raw": raw,
        "raw_row_groups": raw_row_groups,
        "validating": checked,
        "validating_small": checked_small,
        "ratio_b_over_a": checked["seconds"] / raw["seconds"],
        "ratio_b_over_a_row_groups": checked["seconds"] / raw_row_groups["seconds"],
    }
    print(json.dumps(result, indent=2) if args.json else _render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
