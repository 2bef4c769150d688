"""How long does ``rtrl-job seal`` take on an hour of events, next to a raw scan of the same
event files, and does its memory stay flat as the hour grows? Side by side in one run.

For each size of ``--interactions`` it writes one hour of synthetic events to a local
``file://`` events root, as the capture proxy and the feedback service write them: the
generations in files of ``--rows-per-file`` rows (one writer's rotations; every column of
GENERATION_SCHEMA, prompts of ~``--prompt`` and completions of ~``--completion`` tokens, with
per-token log-probs and masks), and ``--feedback`` feedback events per interaction (with 1%
of them written twice, as retries do) in files of 100,000 events. Then, each in a fresh
process (both pay the interpreter's start):

  scan   the strongest honest baseline: pyarrow's multi-threaded dataset scanner reading
         every column of every generation and feedback file once, and nothing else, with
         each of Arrow's allocators (mimalloc, its default; jemalloc, the seal's): the
         faster is the baseline
  write  the write alone: the rows a seal writes (every generation row's shard columns),
         written by the seal's writer (``write_shards``, zstd, page checksums), the CPU
         time of reading them taken out: what any seal that rewrites the rows pays on top
         of reading them
  seal   ``rtrl-job seal`` on the same files: the join, the sealed shards written to a local
         ``file://`` shard root (zstd Parquet), the marker

It reports each one's wall time, CPU time (user + system: steadier than wall time on a
machine shared with other work) and peak RSS (sampled every 20 ms, children included), the
ratios seal / scan and seal / (scan + write), and the 1-minute load average at the end of
each. Goals: the seal within 2x the scan, and its peak memory flat from 1M to 4M
interactions (DuckDB's memory limit, ``--memory-limit``, bounds the join; the rows are
streamed a batch at a time).

    .venv/bin/python bench/seal.py [--interactions 1000000,4000000] [--memory-limit 512MB]
        [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.parquet as pq

from rtrl.core.events import FEEDBACK_SCHEMA, GENERATION_SCHEMA, event_file_key

HOUR = datetime(2026, 12, 3, 10, tzinfo=UTC)
NOW = HOUR + timedelta(hours=3)
HOUR_US = int(HOUR.timestamp()) * 1_000_000

SCAN = """
import sys, pyarrow.dataset as ds
rows = 0
for batch in ds.dataset(sys.argv[1:], format="parquet").to_batches(batch_size=65536):
    rows += batch.num_rows
print(rows)
"""

# The write alone: the rows a seal writes (the shard columns of every generation row),
# written by the seal's own writer (write_shards: zstd, page checksums) to a local root
# with the pool the seal uses. The files are read one at a time before their rows are
# written and the reading's CPU time is taken out, so what is left is the writing's.
WRITE = """
import resource, sys, time
from pathlib import Path
import pyarrow as pa
import pyarrow.parquet as pq
from rtrl.core.shards import write_shards
from rtrl_trainer.seal.cli import use_jemalloc
from rtrl_trainer.seal.rows import GENERATION_COLUMNS, SEALED_SCHEMA

def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime

use_jemalloc()
reading = 0.0
def rows():
    global reading
    for path in sys.argv[2:]:
        started = cpu()
        table = pq.read_table(path, columns=list(GENERATION_COLUMNS))
        table = table.append_column("feedback_at", table.column("created_at"))
        for field in SEALED_SCHEMA:  # the signals nobody reported: null
            if field.name not in table.column_names:
                table = table.append_column(field.name, pa.nulls(table.num_rows, field.type))
        batches = table.select(SEALED_SCHEMA.names).to_batches(65536)
        reading += cpu() - started
        yield from batches

started = cpu()
written = write_shards(rows(), Path(sys.argv[1]), file_prefix="written")
print(round(cpu() - started - reading, 3), len(written))
"""


def _ids(ms: np.ndarray, rng: np.random.Generator) -> pa.Array:
    """UUIDv7 strings (as rtrl.core.events.new_interaction_id mints them) for ``ms``."""
    rand_a = rng.integers(0, 1 << 12, size=len(ms)).tolist()
    rand_b = rng.integers(0, 1 << 62, size=len(ms), dtype=np.uint64).tolist()
    ids = []
    for m, a, b in zip(ms.tolist(), rand_a, rand_b, strict=True):
        t = f"{(m << 80) | (0x7 << 76) | (a << 64) | (0b10 << 62) | b:032x}"
        ids.append(f"{t[:8]}-{t[8:12]}-{t[12:16]}-{t[16:20]}-{t[20:]}")
    return pa.array(ids, pa.string())


def _lists(rng: np.random.Generator, lengths: np.ndarray, values: pa.Array) -> pa.Array:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), values)


def generation_table(rng: np.random.Generator, n: int) -> tuple[pa.Table, pa.Array, np.ndarray]:
    """``n`` generation events of the hour (sorted by time, as one writer writes them);
    also their ids and created_at in microseconds."""
    created = np.sort(HOUR_US + rng.integers(0, 3_600_000_000, size=n, dtype=np.int64))
    ids = _ids(created // 1000, rng)
    prompt = rng.integers(ARGS.prompt // 2, ARGS.prompt * 3 // 2, size=n)
    completion = rng.integers(ARGS.completion // 2, ARGS.completion * 3 // 2, size=n)
    tokens = int(completion.sum())
    columns: dict[str, pa.Array] = {
        "interaction_id": ids,
        "created_at": pa.array(created, GENERATION_SCHEMA.field("created_at").type),
        "checkpoint_id": pa.repeat("ckpt-41", n),
        "model_uri": pa.repeat("s3://models/ckpt-41/", n),
        "engine_model": pa.repeat("s3://models/ckpt-41/", n),
        "checkpoint_verified": pa.repeat(True, n),
        "arm": pa.array(np.where(rng.random(n) < 0.1, "canary", "stable")),
        "rlcycle": pa.repeat("composer", n),
        "pod": pa.repeat("composer-7d9f-abcde", n),
        "user_id": pa.array([f"u-{i}" for i in rng.integers(0, 5000, size=n)]),
        "session_id": pa.array([f"s-{i}" for i in rng.integers(0, 50000, size=n)]),
        "org": pa.array(np.where(rng.random(n) < 0.5, "acme", "globex")),
        "endpoint": pa.repeat("chat.completions", n),
        "stream": pa.array(rng.random(n) < 0.7),
        "status": pa.repeat(pa.scalar(200, pa.int32()), n),
        "choice_index": pa.repeat(pa.scalar(0, pa.int32()), n),
        "finish_reason": pa.repeat("stop", n),
        "latency_ms": pa.array(rng.gamma(2.0, 400.0, size=n)),
        "prompt_ids": _lists(rng, prompt, pa.array(rng.integers(0, 50000, int(prompt.sum()),
                                                                dtype=np.int32))),
        "completion_ids": _lists(rng, completion, pa.array(rng.integers(0, 50000, tokens,
                                                                        dtype=np.int32))),
        "completion_logprobs": _lists(rng, completion, pa.array(
            -rng.exponential(0.5, tokens).astype(np.float32))),
        "completion_mask": _lists(rng, completion, pa.array(np.ones(tokens, dtype=bool))),
        "temperature": pa.repeat(pa.scalar(0.7, pa.float32()), n),
        "top_p": pa.repeat(pa.scalar(0.95, pa.float32()), n),
        "top_k": pa.nulls(n, pa.int32()),
        "logprobs_mode": pa.repeat("processed_logprobs", n),
        "serving_dtype": pa.repeat("bfloat16", n),
        "tool_calls": pa.array(rng.integers(0, 4, size=n, dtype=np.int32)),
        "invalid_tool_calls": pa.array((rng.random(n) < 0.03).astype(np.int32)),
        "tool_call_errors": _lists(rng, np.zeros(n, dtype=np.int32), pa.array([], pa.string())),
    }  # fmt: skip
    table = pa.Table.from_arrays(
        [columns[f.name].cast(f.type) for f in GENERATION_SCHEMA], schema=GENERATION_SCHEMA
    )
    return table, ids, created


def feedback_table(rng: np.random.Generator, ids: pa.Array, created: np.ndarray) -> pa.Table:
    """``ARGS.feedback`` events per interaction, 1% of them twice."""
    signals = ["edit_persisted", "dissatisfied_followup", "tool_calls", "latency_ms"]
    n = len(ids)
    parts = []
    for k in range(ARGS.feedback):
        signal = signals[k % len(signals)]
        value = {
            "edit_persisted": rng.random(n),
            "dissatisfied_followup": (rng.random(n) < 0.2).astype(np.float64),
            "tool_calls": rng.integers(0, 5, size=n).astype(np.float64),
            "latency_ms": rng.gamma(2.0, 500.0, size=n),
        }[signal]
        observed = created + rng.integers(60, 3000, size=n) * 1_000_000
        parts.append(pa.table({
            "event_id": pa.array([f"{signal[:4]}-{i}" for i in ids.to_pylist()]),
            "interaction_id": ids,
            "signal": pa.repeat(signal, n),
            "value": pa.array(value),
            "observed_at": pa.array(observed, FEEDBACK_SCHEMA.field("observed_at").type),
            "received_at": pa.array(observed + 1000, FEEDBACK_SCHEMA.field("received_at").type),
        }, schema=FEEDBACK_SCHEMA))  # fmt: skip
    table = pa.concat_tables(parts)
    again = table.take(pa.array(rng.choice(table.num_rows, table.num_rows // 100, replace=False)))
    return pa.concat_tables([table, again])


def write_hour(root: Path, n: int, seed: int) -> list[Path]:
    """One hour of ``n`` interactions under ``root``; the paths of every event file."""
    rng = np.random.default_rng(seed)
    paths = []
    for seq, start in enumerate(range(0, n, ARGS.rows_per_file)):
        table, ids, created = generation_table(rng, min(ARGS.rows_per_file, n - start))
        key = event_file_key("generations", HOUR, "composer-7d9f-abcde-1a2b3c4d", seq)
        path = root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, path, compression="zstd", row_group_size=16384)
        paths.append(path)
        feedback = feedback_table(rng, ids, created)
        for part, offset in enumerate(range(0, feedback.num_rows, 100_000)):
            key = event_file_key("feedback", HOUR, f"rtrl-feedback-{seq:04d}", part)
            path = root / key
            path.parent.mkdir(parents=True, exist_ok=True)
            pq.write_table(feedback.slice(offset, 100_000), path, compression="zstd")
            paths.append(path)
    return paths


def measured(command: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``command``; wall time, CPU time (user + system, its threads and children), peak
    RSS (the process and its children, sampled)."""
    peak = 0
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               env=env, text=True)  # fmt: skip
    ps = psutil.Process(process.pid)
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            try:
                rss = ps.memory_info().rss + sum(
                    c.memory_info().rss for c in ps.children(recursive=True)
                )
                peak = max(peak, rss)
            except psutil.Error:
                pass
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, err = process.communicate()
    elapsed = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    done.set()
    sampler.join()
    if process.returncode != 0:
        raise SystemExit(f"{command[:3]} failed ({process.returncode}): {err[-2000:]}")
    return {
        "load": round(os.getloadavg()[0], 1),  # of the minute it ran in, at its end
        "seconds": round(elapsed, 2),
        "cpu_seconds": round(cpu, 2),
        "peak_rss_mb": round(peak / 2**20),
        "out": out,
    }


def one_size(n: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="rtrl-bench-seal-", dir=ARGS.dir) as tmp:
        root = Path(tmp)
        started = time.perf_counter()
        paths = write_hour(root / "events", n, seed=n)
        written = time.perf_counter() - started
        size = sum(p.stat().st_size for p in paths)
        # the faster of Arrow's two allocators (the seal uses jemalloc, the default is
        # mimalloc): the baseline is the strongest scan, not the one the seal beats
        scans = {pool: measured([sys.executable, "-c", SCAN, *map(str, paths)],
                                env={**os.environ, "ARROW_DEFAULT_MEMORY_POOL": pool})
                 for pool in ("mimalloc", "jemalloc")}  # fmt: skip
        pool, scan = min(scans.items(), key=lambda item: item[1]["cpu_seconds"])
        generations = [p for p in paths if "/generations/" in p.as_posix()]
        write = measured([sys.executable, "-c", WRITE, str(root / "written"),
                          *map(str, generations)])  # fmt: skip
        write_cpu = float(write["out"].split()[0])
        work = root / "work"
        work.mkdir()
        seal = measured([
            str(Path(sys.executable).parent / "rtrl-job"), "seal", "--log-format", "json",
            "--events", (root / "events").as_uri() + "/",
            "--shards", (root / "shards").as_uri() + "/",
            "--now", NOW.isoformat(), "--work-dir", str(work),
            "--memory-limit", ARGS.memory_limit,
        ])  # fmt: skip
        result = next(json.loads(line) for line in seal["out"].splitlines() if '"result"' in line)
        return {
            "interactions": n,
            "event_files": len(paths),
            "event_bytes_mb": round(size / 2**20),
            "generated_s": round(written, 1),
            "scan_rows": int(scan["out"].strip()),
            "scan_s": scan["seconds"],
            "scan_cpu_s": scan["cpu_seconds"],
            "scan_peak_rss_mb": scan["peak_rss_mb"],
            "scan_pool": pool,
            "scan_cpu_s_per_pool": {k: v["cpu_seconds"] for k, v in scans.items()},
            "write_only_cpu_s": round(write_cpu, 2),
            "seal_s": seal["seconds"],
            "seal_cpu_s": seal["cpu_seconds"],
            "seal_peak_rss_mb": seal["peak_rss_mb"],
            "seal_over_scan": round(seal["seconds"] / scan["seconds"], 2),
            "seal_over_scan_cpu": round(seal["cpu_seconds"] / scan["cpu_seconds"], 2),
            "write_over_scan_cpu": round(write_cpu / scan["cpu_seconds"], 2),
            "seal_over_scan_plus_write_cpu": round(
                seal["cpu_seconds"] / (scan["cpu_seconds"] + write_cpu), 2
            ),
            "load_1min": [scan["load"], write["load"], seal["load"]],
            "sealed": result["counts"]["sealed"],
            "feedback_used": result["counts"]["feedback_used"],
            "feedback_duplicates": result["counts"]["feedback_duplicates"],
        }


def main() -> None:
    results = []
    for n in ARGS.interactions:
        row = one_size(n)
        results.append(row)
        if not ARGS.json:
            print(
                f"{n:>9,} interactions ({row['event_bytes_mb']} MB in {row['event_files']} "
                f"files): scan {row['scan_s']:.1f} s, {row['scan_cpu_s']:.1f} CPU-s "
                f"({row['scan_peak_rss_mb']} MB, {row['scan_pool']}); write only "
                f"{row['write_only_cpu_s']:.1f} CPU-s; seal {row['seal_s']:.1f} s, "
                f"{row['seal_cpu_s']:.1f} CPU-s ({row['seal_peak_rss_mb']} MB peak): "
                f"seal/scan {row['seal_over_scan']:.2f}x wall, "
                f"{row['seal_over_scan_cpu']:.2f}x CPU, seal/(scan+write) "
                f"{row['seal_over_scan_plus_write_cpu']:.2f}x CPU; sealed {row['sealed']:,}; "
                f"load {row['load_1min']}",
                flush=True,
            )
    flat = results[-1]["seal_peak_rss_mb"] / max(1, results[0]["seal_peak_rss_mb"])
    summary = {"results": results, "peak_rss_largest_over_smallest": round(flat, 2),
               "cpus": os.cpu_count(), "memory_limit": ARGS.memory_limit}  # fmt: skip
    if ARGS.json:
        print(json.dumps(summary, indent=1))
    else:
        print(f"seal peak RSS, largest size over smallest: {flat:.2f}x")


def _sizes(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--interactions", type=_sizes, default=[1_000_000, 4_000_000])
parser.add_argument("--rows-per-file", type=int, default=100_000)
parser.add_argument("--prompt", type=int, default=48, help="mean prompt tokens")
parser.add_argument("--completion", type=int, default=24, help="mean completion tokens")
parser.add_argument("--feedback", type=int, default=2, help="feedback events per interaction")
parser.add_argument("--memory-limit", default="512MB")
parser.add_argument("--dir", default=None, help="scratch directory (default: $TMPDIR)")
parser.add_argument("--json", action="store_true")
ARGS = parser.parse_args()

if __name__ == "__main__":
    main()
