"""The stage step's throughput and memory, against a raw Parquet scan and a row-by-row
Python implementation of the same selection and reward, side by side in one run.

``rtrl-job stage`` reads every shard through the validating reader, selects, rewards and
monitors the rows, writes the rank files (Parquet) as it goes, then the advantage files,
then commits them to the output store. This benchmark writes
synthetic interactions (~100 completion tokens, 100-300 prompt tokens each; 90% matured and
selected) to a temp directory as a ``file://`` store and measures, each in a fresh process:

  (a) raw scan: ``pq.ParquetFile(...).iter_batches`` over the same files and columns, no
      checks, nothing written: the floor for anything that reads the shards;
  (b) row-by-row: ``for row in batch.to_pylist()`` applying the same row contract,
      selection and reward rules in plain Python, then writing the training set from the
      rows in the same format (per-token lists packed with ``struct.pack``,
      ``Table.from_pylist``, stage's own Parquet writer and options, and the advantage file
      from the rows' advantages), on the first
      ``--rowwise-rows`` interactions (it is too slow for all of them), extrapolated as
      rows/s; its rewards are checked against the vectorised ones on the same rows;
  (s) ``rtrl-job stage`` as a Job runs it (the console script), end to end: wall time
      including interpreter start, the upload into the output store and the commit.

Peak RSS is the child's own (``wait4``), measured for (s) at each ``--rss-rows`` size (the
largest data set is generated in a temp dir and deleted afterwards). Goals: (s) within 3x of
(a) in time, over 20x faster than (b), and peak RSS at 4M rows within 1.2x of that at 1M.

    .venv/bin/python bench/stage.py [--rows 1000000] [--rss-rows 1000000,4000000] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from rtrl.core.api.rlcycle import RewardSpec
from rtrl.core.shards import (
    NON_NULL_COLUMNS,
    REQUIRED_COLUMNS,
    list_files,
    synthetic_interactions,
    write_shards,
)
from rtrl.core.shards.statistics import TOKEN_ID_COLUMNS
from rtrl.core.store.local import LocalStore
from rtrl_trainer.reward import rewards
from rtrl_trainer.stage.ranks import train_writer
from rtrl_trainer.stage.select import token_id_type
from rtrl_trainer.stagedset import (
    ADVANTAGE_SCHEMA,
    ADVANTAGE_SUFFIX,
    CARRIED_COLUMNS,
    train_schema,
)

MB = 1_000_000
CHECKPOINT = "bench-ckpt"
# Synthetic rows are created over 3 hours from 2026-01-05 08:00 with feedback ~20 minutes
# later: at this --now every row is past maturity, and the 90% with feedback are selected.
NOW = "2026-01-06T00:00:00Z"
MATURITY = timedelta(hours=1)
BATCH = 16_384


def _rtrl_job() -> str:
    path = Path(sys.executable).parent / "rtrl-job"
    if not path.exists():
        raise SystemExit(f"{path} not found: install the project first (make test)")
    return os.fspath(path)


def _vm_hwm(pid: int) -> int | None:
    """The peak RSS of process ``pid`` so far (Linux VmHWM), or None once it has exited."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _run_child(command: list[str]) -> tuple[subprocess.CompletedProcess[str], float, int]:
    """Run ``command``; (result, wall seconds, the child's own peak RSS in bytes).

    VmHWM belongs to the address space exec creates, so it is the child's alone (the
    child's ru_maxrss would start from this process's peak, which vfork lends it); it is
    sampled until the child exits, and the peak is monotonic, so the last sample counts.
    """
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        start = time.perf_counter()
        child = subprocess.Popen(command, stdout=out, stderr=err, text=True)
        peak = 0
        while child.poll() is None:
            peak = max(peak, _vm_hwm(child.pid) or 0)
            time.sleep(0.01)
        seconds = time.perf_counter() - start
        out.seek(0)
        err.seek(0)
        done = subprocess.CompletedProcess(command, child.returncode, out.read(), err.read())
    return done, seconds, peak


def _write(root: Path, rows: int, seed: int) -> dict[str, Any]:
    """Write ``rows`` synthetic interactions under ``root`` (in a child process, so that
    this one stays small)."""
    command = [sys.executable, __file__, "--measure", "write", "--root", str(root)]
    command += ["--rows", str(rows), "--seed", str(seed)]
    done, _, _ = _run_child(command)
    if done.returncode:
        raise SystemExit(f"writing the shards failed: {done.stderr}")
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def _generate(root: Path, rows: int, seed: int) -> dict[str, Any]:
    start = time.perf_counter()
    batches = synthetic_interactions(rows, seed=seed, checkpoint_id=CHECKPOINT, tokens=100)
    keys = write_shards(batches, LocalStore(root))
    size = sum((root / key).stat().st_size for key in keys)
    return {"rows": rows, "files": len(keys), "bytes": size, "seconds": time.perf_counter() - start}


# --- (a) raw scan ------------------------------------------------------------------------


def _raw_scan(root: Path) -> dict[str, Any]:
    store = LocalStore(root)
    rows = decoded = 0
    start = time.perf_counter()
    for shard in list_files(store):
        with store.open_input(shard.key) as handle:
            parquet = pq.ParquetFile(handle)
            for batch in parquet.iter_batches(batch_size=BATCH, columns=list(REQUIRED_COLUMNS)):
                rows += batch.num_rows
                decoded += batch.nbytes
    return {"rows": rows, "decoded_bytes": decoded, "seconds": time.perf_counter() - start}


# --- (b) row by row ----------------------------------------------------------------------


def _row_reward(row: dict[str, Any], spec: RewardSpec) -> float:
    """The reward of one interaction, the straightforward way (same rule as reward.py)."""
    r = spec.edit_persisted * (row["edit_persisted"] or 0.0)
    r += spec.dissatisfied_followup * (1.0 if row["dissatisfied_followup"] else 0.0)
    r += spec.latency * (row["latency_ms"] or 0.0) / spec.latency_scale_ms
    r += spec.invalid_tool_call * (1.0 if (row["invalid_tool_calls"] or 0) > 0 else 0.0)
    r += spec.asked_clarification * (1.0 if row["asked_clarification"] else 0.0)
    return max(-spec.clip, min(spec.clip, r))


def _row_is_good(row: dict[str, Any]) -> bool:
    """The row contract of the validating reader, one row at a time (docs/shards.md)."""
    if any(row[name] is None for name in NON_NULL_COLUMNS):
        return False
    ids, logprobs, mask = (
        row["completion_ids"],
        row["completion_logprobs"],
        row["completion_mask"],
    )
    if not len(ids) == len(logprobs) == len(mask):
        return False
    for tokens in (row["prompt_ids"], ids, logprobs, mask):
        if any(token is None for token in tokens):
            return False
    if not all(lp <= 0 and math.isfinite(lp) for lp in logprobs):
        return False
    edit, latency = row["edit_persisted"], row["latency_ms"]
    if edit is not None and not 0 <= edit <= 1:
        return False
    if latency is not None and not (latency >= 0 and math.isfinite(latency)):
        return False
    counts = (row["tool_calls"], row["invalid_tool_calls"], row["edits_proposed"])
    if any(c is not None and c < 0 for c in counts):
        return False
    calls, invalid = row["tool_calls"], row["invalid_tool_calls"]
    return calls is None or invalid is None or invalid <= calls


def _row_by_row(root: Path, limit: int, out: Path) -> dict[str, Any]:
    """What stage does, the straightforward way: each row as a Python dict, checked against
    the row contract, deduplicated, selected, rewarded and added to the monitors; then
    advantages, and the training set written from the rows in stage's format (per-token
    lists packed, ``Table.from_pylist``, stage's writer and options). The selected rows
    are held in memory until their advantages are known (the quickest way, here; stage
    streams instead)."""
    spec = RewardSpec()
    now = datetime.fromisoformat(NOW)
    cutoff = now - MATURITY
    seen: set[str] = set()
    selected: list[dict[str, Any]] = []
    monitors = {"edits": 0, "clarifications": 0, "tool_calls": 0, "invalid": 0, "tokens": 0}
    latencies: list[float] = []
    rows = 0
    start = time.perf_counter()
    for batch in _first_rows(root, limit):
        for row in batch.to_pylist():
            rows += 1
            if not _row_is_good(row) or row["interaction_id"] in seen:
                continue
            seen.add(row["interaction_id"])
            if row["checkpoint_id"] != CHECKPOINT:
                continue
            feedback = row["feedback_at"]
            if row["created_at"] > cutoff or feedback is None or feedback > now:
                continue
            row["reward"] = _row_reward(row, spec)
            selected.append(row)
            monitors["edits"] += (row["edits_proposed"] or 0) > 0
            monitors["clarifications"] += bool(row["asked_clarification"])
            monitors["tool_calls"] += row["tool_calls"] or 0
            monitors["invalid"] += row["invalid_tool_calls"] or 0
            monitors["tokens"] += len(row["completion_ids"])
            if row["latency_ms"] is not None:
                latencies.append(row["latency_ms"])
    values = np.array([row["reward"] for row in selected])
    mean, std = float(values.mean()), float(values.std())
    p95 = sorted(latencies)[int(0.95 * (len(latencies) - 1))]
    # Token ids as stage stores them: two bytes when the footers vouch that they fit
    # (struct.pack refuses one that does not), else four.
    narrow = token_id_type(LocalStore(root)) == "<u2"
    schema = train_schema("<u2" if narrow else "<i4")
    with train_writer(out, schema) as writer:
        for first in range(0, len(selected), BATCH):
            records = [
                {name: _packed(name, row[name], narrow) for name in CARRIED_COLUMNS}
                | {"reward": row["reward"], "sample_weight": 1.0, "on_policy": True}
                for row in selected[first : first + BATCH]
            ]
            writer.write_table(pa.Table.from_pylist(records, schema=schema))
    advantages = [(row["reward"] - mean) / std for row in selected]  # the batch baseline
    pq.write_table(
        pa.Table.from_arrays([pa.array(advantages, pa.float32())], schema=ADVANTAGE_SCHEMA),
        out.with_name(out.name.removesuffix(".parquet") + ADVANTAGE_SUFFIX),
        compression="none",
    )
    seconds = time.perf_counter() - start
    return {
        "rows": rows,
        "selected": len(selected),
        "latency_p95_ms": p95,
        "out_bytes": sum(p.stat().st_size for p in out.parent.iterdir()),
        "seconds": seconds,
        "agrees_with_vectorised": _agrees(root, limit, selected),
    }


_PACK_FORMATS = {"prompt_ids": "i", "completion_ids": "i", "completion_logprobs": "f"}


def _packed(name: str, value: Any, narrow: bool) -> Any:
    """A per-token list as the training set stores it (little-endian fixed-width bytes;
    token ids in two bytes when ``narrow``)."""
    if name == "completion_mask":
        return bytes(value)
    if narrow and name in TOKEN_ID_COLUMNS:
        return struct.pack(f"<{len(value)}H", *value)
    kind = _PACK_FORMATS.get(name)
    return value if kind is None else struct.pack(f"<{len(value)}{kind}", *value)


def _first_rows(root: Path, limit: int) -> Iterator[pa.RecordBatch]:
    """The first ``limit`` rows of the set, in batches, in the order stage reads them."""
    store = LocalStore(root)
    left = limit
    for shard in list_files(store):
        with store.open_input(shard.key) as handle:
            for batch in pq.ParquetFile(handle).iter_batches(batch_size=BATCH):
                yield batch.slice(0, left)
                left -= min(left, batch.num_rows)
                if left == 0:
                    return


def _agrees(root: Path, limit: int, selected: list[dict[str, Any]]) -> bool:
    """Whether the vectorised reward of the same rows equals the row-by-row one."""
    by_id: dict[str, float] = {}
    for batch in _first_rows(root, limit):
        values = rewards(batch, RewardSpec()).tolist()
        by_id.update(zip(batch.column("interaction_id").to_pylist(), values, strict=True))
    return all(abs(by_id[row["interaction_id"]] - row["reward"]) < 1e-5 for row in selected)


# --- measuring ---------------------------------------------------------------------------


def _measure_child(kind: str, root: Path, limit: int) -> dict[str, Any]:
    command = [sys.executable, __file__, "--measure", kind, "--root", str(root)]
    command += ["--rowwise-rows", str(limit)]
    done, seconds, rss = _run_child(command)
    if done.returncode:
        raise SystemExit(f"{kind} failed: {done.stderr}")
    result: dict[str, Any] = json.loads(done.stdout)
    result.update(wall_seconds=seconds, peak_rss_bytes=rss)
    return result


def _stage(root: Path, work: Path, ranks: int) -> dict[str, Any]:
    out = work / "staged"
    command = [
        _rtrl_job(),
        "stage",
        "--shards",
        root.as_uri() + "/",
        "--checkpoint",
        CHECKPOINT,
        "--out",
        out.as_uri() + "/",
        "--now",
        NOW,
        "--min-interactions",
        "1",
        "--ranks",
        str(ranks),
        "--work-dir",
        str(work),
    ]
    done, seconds, rss = _run_child(command)
    if done.returncode:
        raise SystemExit(f"rtrl-job stage failed ({done.returncode}): {done.stderr}")
    doc = json.loads((out / "stage.json").read_text())
    out_bytes = sum(p.stat().st_size for p in out.rglob("*.parquet"))
    shutil.rmtree(out)
    return {
        "seconds": seconds,
        "peak_rss_bytes": rss,
        "rows_read": doc["rows_read"],
        "interactions_used": doc["interactions_used"],
        "tokens_used": doc["tokens_used"],
        "out_bytes": out_bytes,
        "timing": doc["timing"],
    }


def _best_stage(root: Path, work: Path, ranks: int, repeat: int) -> dict[str, Any]:
    runs = [_stage(root, work, ranks) for _ in range(repeat)]
    best = min(runs, key=lambda r: float(r["seconds"]))
    best["peak_rss_bytes"] = max(int(r["peak_rss_bytes"]) for r in runs)
    return best


def _render(result: dict[str, Any]) -> str:
    data, raw, stage, rowwise = (
        result["dataset"],
        result["raw"],
        result["stage"],
        result["rowwise"],
    )
    mb = data["bytes"] / MB
    lines = [
        f"shards: {data['rows']:,} interactions in {data['files']} files, {mb:,.0f} MB "
        f"(zstd), decoded {raw['decoded_bytes'] / MB:,.0f} MB; {result['cpus']} CPUs; "
        f"stage --ranks {result['ranks']}",
        f"stage selected {stage['interactions_used']:,} interactions "
        f"({stage['tokens_used']:,} completion tokens), wrote {stage['out_bytes'] / MB:,.0f} MB",
        "",
        f"{'':34}{'rows/s':>12}{'MB/s':>8}{'seconds':>10}{'peak RSS MB':>13}",
    ]
    runs = (
        ("(a) raw pyarrow scan", raw["rows"], raw["seconds"], raw["peak_rss_bytes"]),
        (
            "(s) rtrl-job stage (end to end)",
            data["rows"],
            stage["seconds"],
            stage["peak_rss_bytes"],
        ),
    )
    for label, rows, seconds, rss in runs:
        lines.append(
            f"{label:34}{rows / seconds:>12,.0f}{mb / seconds:>8,.0f}{seconds:>10.2f}"
            f"{rss / MB:>13,.0f}"
        )
    rw_rate = rowwise["rows"] / rowwise["seconds"]
    lines.append(
        f"{'(b) row-by-row Python':34}{rw_rate:>12,.0f}{rw_rate * mb / data['rows']:>8,.1f}"
        f"{data['rows'] / rw_rate:>10.1f}{rowwise['peak_rss_bytes'] / MB:>13,.0f}"
        f"   (on {rowwise['rows']:,} rows, extrapolated)"
    )
    t = stage["timing"]
    lines += [
        "",
        f"stage inside the process: {t['seconds']:.2f} s (pass 1, writing the rank files "
        f"included, {t['select_seconds']:.2f} s; advantages {t['write_seconds']:.2f} s); the "
        "rest is start-up, fsync, sha256 and commit",
        f"time ratio s/a: {result['ratio_stage_over_raw']:.2f}x (goal <= 3x); process to "
        f"process (a's interpreter start and imports included, {raw['wall_seconds']:.2f} s): "
        f"{result['ratio_stage_over_raw_wall']:.2f}x",
        f"speed-up s over b: {result['speedup_over_rowwise']:.1f}x (goal > 20x); row-by-row "
        f"rewards agree with the vectorised ones: {rowwise['agrees_with_vectorised']}",
    ]
    rss = result["rss"]
    if len(rss) > 1:
        parts = ", ".join(
            f"{r['rows']:,} rows: {r['peak_rss_bytes'] / MB:,.0f} MB in {r['seconds']:.1f} s"
            for r in rss
        )
        lines.append(f"peak RSS of stage: {parts}; ratio {result['rss_ratio']:.2f}x (goal <= 1.2x)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument(
        "--rss-rows",
        default="1000000,4000000",
        help="comma-separated sizes to measure stage's peak RSS at ('' to skip)",
    )
    parser.add_argument("--rowwise-rows", type=int, default=100_000)
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=2, help="runs of (a) and (s); best kept")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--measure", choices=["raw", "rowwise", "write"], help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure == "raw":
        print(json.dumps(_raw_scan(args.root)))
        return 0
    if args.measure == "write":
        print(json.dumps(_generate(args.root, args.rows, args.seed)))
        return 0
    if args.measure == "rowwise":
        with tempfile.TemporaryDirectory(prefix="rtrl-bench-rowwise-") as tmp:
            result = _row_by_row(args.root, args.rowwise_rows, Path(tmp) / "train.parquet")
        print(json.dumps(result))
        return 0

    rss_sizes = [int(x) for x in args.rss_rows.split(",") if x.strip()]
    with tempfile.TemporaryDirectory(prefix="rtrl-bench-stage-") as tmp:
        work = Path(tmp)
        root = work / "shards"
        dataset = _write(root, args.rows, seed=0)
        raws = [_measure_child("raw", root, args.rowwise_rows) for _ in range(args.repeat)]
        # The scan's own time, without interpreter start (stage's includes it): the
        # comparison errs against stage.
        raw = min(raws, key=lambda r: float(r["seconds"]))
        stage = _best_stage(root, work, args.ranks, args.repeat)
        rowwise = _measure_child("rowwise", root, args.rowwise_rows)
        rss = []
        for size in rss_sizes:
            if size == args.rows:
                rss.append({"rows": size, **stage})
                continue
            other = work / f"shards-{size}"
            _write(other, size, seed=1)
            rss.append({"rows": size, **_stage(other, work, args.ranks)})
            shutil.rmtree(other)
    if raw["rows"] != args.rows or stage["rows_read"] != args.rows:
        print("stage or the raw scan did not read every row", file=sys.stderr)
        return 1
    rowwise_rate = rowwise["rows"] / rowwise["seconds"]
    result = {
        "dataset": dataset,
        "cpus": os.cpu_count(),
        "ranks": args.ranks,
        "raw": raw,
        "stage": stage,
        "rowwise": rowwise,
        "rss": rss,
        "ratio_stage_over_raw": stage["seconds"] / raw["seconds"],
        "ratio_stage_over_raw_wall": stage["seconds"] / raw["wall_seconds"],
        "speedup_over_rowwise": (args.rows / stage["seconds"]) / rowwise_rate,
        "rss_ratio": (
            rss[-1]["peak_rss_bytes"] / rss[0]["peak_rss_bytes"] if len(rss) > 1 else None
        ),
    }
    print(json.dumps(result, indent=2) if args.json else _render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
