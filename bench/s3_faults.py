"""At what S3 fault rate does a stage still complete? Old retry budgets against the new ones,
side by side in one run.

A busy S3 answers some requests with 503 and drops some responses mid-body. This benchmark
writes synthetic interactions to moto's S3 server (``--files`` shards, one per hour), puts
the fault proxy of :mod:`rtrl_localkube.s3faults` in front of it, and runs the real
``rtrl-job stage`` (a subprocess, as a Job pod runs it) through the proxy at each fault rate
of ``--rates``: that share of requests answered ``503 <--code>``, and ``--cut-ratio`` times
that share of response bodies cut (20% 503 with 15% cut bodies at the default 0.75). Each
rate runs ``--runs`` times (seeds 0, 1, ...; the proxy's faults are a function of the seed and
the request, so both budgets meet the same faults) under each budget of ``--budgets``:

  old       what rtrl had before: standard mode, 8 tries per request, 3 tries per body
  new       rtrl's defaults (nothing set: AWS_RETRY_MODE, AWS_MAX_ATTEMPTS and
            RTRL_S3_BODY_ATTEMPTS unset)
  adaptive  the defaults with AWS_RETRY_MODE=adaptive (botocore's client-side rate limiter)

It reports, per rate and budget, the runs completed, the median and the slowest wall time
(interpreter start, retries and backoff included), the requests the proxy answered and the
longest run of cuts one body met; a run past ``--timeout`` counts as failed. Goal: the new
budget completes every run at 20% 503 + 15% cut bodies.

    .venv/bin/python bench/s3_faults.py [--files 20] [--runs 5] [--rates 0,10,20,30,40,50]
        [--code ServiceUnavailable|SlowDown] [--budgets old,new] [--json]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import boto3

from rtrl.core.shards import synthetic_interactions, write_shards
from rtrl.core.store import open_store
from rtrl_localkube.s3faults import FaultProxy, serve_fault_proxy

CHECKPOINT = "bench-5"
NOW = "2026-01-31T00:00:00Z"  # every synthetic row is mature by then
RETRY_VARIABLES = ("AWS_RETRY_MODE", "AWS_MAX_ATTEMPTS", "RTRL_S3_BODY_ATTEMPTS")
BUDGETS: dict[str, dict[str, str]] = {
    "old": {"AWS_RETRY_MODE": "standard", "AWS_MAX_ATTEMPTS": "8", "RTRL_S3_BODY_ATTEMPTS": "3"},
    "new": {},
    "adaptive": {"AWS_RETRY_MODE": "adaptive"},
}


def _rtrl_job() -> str:
    path = Path(sys.executable).parent / "rtrl-job"
    if not path.exists():
        raise SystemExit(f"{path} not found: install the project first (make test)")
    return os.fspath(path)


@contextmanager
def _moto() -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


def _environment(tmp: Path) -> dict[str, str]:
    """Dummy credentials and nothing of the host's AWS configuration."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    for name in RETRY_VARIABLES:
        env.pop(name, None)
    env.update(
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_CONFIG_FILE=str(tmp / "no-aws-config"),
        AWS_SHARED_CREDENTIALS_FILE=str(tmp / "no-aws-config"),
        AWS_EC2_METADATA_DISABLED="true",
    )
    return env


def _write_shards(moto: str, env: dict[str, str], files: int) -> tuple[str, int]:
    """``files`` shards of 30 interactions each, straight to moto (no faults), in a bucket of
    their own: each budget stages from its own copy (the proxy's faults do not depend on the
    bucket, so each budget meets the same ones)."""
    os.environ.update(env)
    bucket = f"bench-{uuid.uuid4().hex[:12]}"
    boto3.session.Session().client("s3", endpoint_url=moto).create_bucket(Bucket=bucket)
    uri = f"s3://{bucket}/interactions/"
    rows = synthetic_interactions(
        30 * files,
        seed=5,
        checkpoint_id=CHECKPOINT,
        tokens=8,
        prompt_tokens=(8, 16),
        duration=timedelta(hours=files),
    )
    written = write_shards(rows, open_store(uri, endpoint_url=moto), row_group_size=50)
    return uri, len(written)


def _stage(
    shards: str, out: str, endpoint: str, env: dict[str, str], timeout: float
) -> tuple[bool, float, str]:
    """(completed, wall seconds, the last line of stderr) of one stage run."""
    command = [_rtrl_job(), "stage", "--shards", shards, "--checkpoint", CHECKPOINT]
    command += ["--out", out, "--now", NOW, "--ranks", "1"]
    started = time.perf_counter()
    try:
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            env=dict(env, AWS_ENDPOINT_URL=endpoint),
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return False, time.perf_counter() - started, f"timed out after {timeout:.0f} s"
    seconds = time.perf_counter() - started
    lines = done.stderr.strip().splitlines()
    return done.returncode == 0, seconds, lines[-1] if lines else ""


def _point(
    proxy: FaultProxy,
    endpoint: str,
    shards: str,
    env: dict[str, str],
    *,
    rate: float,
    budget: str,
    args: argparse.Namespace,
) -> dict[str, Any]:
    runs: list[dict[str, Any]] = []
    for seed in range(args.runs):
        proxy.log.clear()
        proxy.chaos(rate, rate * args.cut_ratio, seed=seed, code=args.code)
        out = shards.replace("/interactions/", f"/out/{rate}-{seed}/")
        budget_env = dict(env, **BUDGETS[budget])
        ok, seconds, last = _stage(shards, out, endpoint, budget_env, args.timeout)
        runs.append({"seed": seed, "ok": ok, "seconds": round(seconds, 2), **proxy.counts()})
        if not ok:
            runs[-1]["error"] = last[:300]
    proxy.chaos(0, 0)
    times = [r["seconds"] for r in runs]
    return {
        "rate": rate,
        "cut_rate": round(rate * args.cut_ratio, 4),
        "budget": budget,
        "completed": sum(r["ok"] for r in runs),
        "runs": len(runs),
        "median_s": round(statistics.median(times), 2),
        "max_s": round(max(times), 2),
        "requests_median": statistics.median(r["requests"] for r in runs),
        "longest_cut_run": max(r["longest_cut_run"] for r in runs),
        "details": runs,
    }


def _table(points: list[dict[str, Any]], args: argparse.Namespace, files: int) -> str:
    lines = [
        f"stage of {files} shards through the fault proxy: 503 {args.code} at the rate, "
        f"cut bodies at {args.cut_ratio:g}x the rate, {args.runs} runs (seeds) per row",
        "",
        "| 503 | cut bodies | budget | completed | median s | slowest s | requests | "
        "longest cut run |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in points:
        lines.append(
            f"| {p['rate']:.0%} | {p['cut_rate']:.1%} | {p['budget']} | "
            f"{p['completed']}/{p['runs']} | {p['median_s']:.1f} | {p['max_s']:.1f} | "
            f"{p['requests_median']:.0f} | {p['longest_cut_run']} |"
        )
    failures = [
        f"  {p['budget']} at {p['rate']:.0%}, seed {r['seed']}: {r['error']}"
        for p in points
        for r in p["details"]
        if not r["ok"]
    ]
    if failures:
        lines += ["", "failures:", *failures]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=20, help="shards to stage (one per hour)")
    parser.add_argument("--runs", type=int, default=5, help="runs (seeds) per rate and budget")
    parser.add_argument("--rates", default="0,10,20,30,40,50", help="503 rates in percent")
    parser.add_argument("--cut-ratio", type=float, default=0.75, help="cut-body rate / 503 rate")
    parser.add_argument(
        "--code",
        default="ServiceUnavailable",
        help="the 503's error code: ServiceUnavailable (botocore backs off from 50 ms) or "
        "SlowDown (a throttling error: from 1 s, and adaptive mode slows its sending)",
    )
    parser.add_argument("--budgets", default="old,new", help=f"of {', '.join(BUDGETS)}")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per stage run")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    rates = [float(r) / 100 for r in args.rates.split(",") if r.strip()]
    budgets = [b.strip() for b in args.budgets.split(",") if b.strip()]
    unknown = set(budgets) - set(BUDGETS)
    if unknown:
        parser.error(f"--budgets: unknown {', '.join(sorted(unknown))}")
    with tempfile.TemporaryDirectory(prefix="rtrl-bench-s3-") as tmp, _moto() as moto:
        env = _environment(Path(tmp))
        copies = {budget: _write_shards(moto, env, args.files) for budget in budgets}
        files = copies[budgets[0]][1]
        with serve_fault_proxy(moto) as (proxy, endpoint):
            points = []
            for rate in rates:
                for budget in budgets:
                    shards = copies[budget][0]
                    point = _point(
                        proxy, endpoint, shards, env, rate=rate, budget=budget, args=args
                    )
                    points.append(point)
                    print(
                        f"{rate:.0%} {budget}: {point['completed']}/{point['runs']} "
                        f"completed, median {point['median_s']} s",
                        file=sys.stderr,
                    )
    if args.json:
        print(json.dumps({"files": files, "code": args.code, "points": points}, indent=2))
    else:
        print(_table(points, args, files))
    return 0


if __name__ == "__main__":
    sys.exit(main())
