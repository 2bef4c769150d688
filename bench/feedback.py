"""Durable feedback events per second through ``rtrl-feedback``, next to the raw PUT limit of
the same store, side by side in one run.

For each store of ``--stores`` (``s3``: moto's S3 server over HTTP on this machine;
``file``: a local directory) it starts ``rtrl-feedback`` as a process, as a pod runs it,
and ``--clients`` concurrent HTTP clients (keep-alive, one asyncio process) post requests of
``--batch`` fresh events each for ``--seconds``; an event counts once its request got 202,
i.e. once it was in the store. Then the baseline: a plain loop writing the same events as
FEEDBACK_SCHEMA Parquet files with boto3's ``put_object`` (or a file write with fsync), one
file per ``--batch`` events, and again one file per the service's mean group (the events
one group commit wrote together): the most a writer without the HTTP service could make
durable, one PUT at a time. Reported: events/s of each, and the service's over the raw
PUT loop of the same file size. Everything shares the machine's CPUs (the service, moto,
the clients).

    .venv/bin/python bench/feedback.py [--stores s3,file] [--clients 32] [--batch 100]
        [--seconds 10] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import logging
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import boto3
import pyarrow as pa
import pyarrow.parquet as pq
from moto.server import ThreadedMotoServer

from rtrl.core.events import FEEDBACK_SCHEMA, new_interaction_id

TOKEN = "bench-token-0123456789abcdef"
SIGNALS = ("edit_persisted", "dissatisfied_followup", "latency_ms", "tool_calls")


def bodies(count: int, batch: int) -> list[bytes]:
    """``count`` request bodies of ``batch`` fresh events each (served in the last hour)."""
    now = datetime.now(UTC)
    out = []
    for _ in range(count):
        events = []
        for i in range(batch):
            served = now - timedelta(minutes=1 + i % 50)
            signal = SIGNALS[i % len(SIGNALS)]
            value: Any = {"edit_persisted": 0.5, "dissatisfied_followup": True,
                          "latency_ms": 812.5, "tool_calls": 2}[signal]  # fmt: skip
            events.append({
                "event_id": uuid.uuid4().hex,
                "interaction_id": new_interaction_id(served),
                "signal": signal,
                "value": value,
                "observed_at": (served + timedelta(seconds=20)).isoformat(),
            })  # fmt: skip
        out.append(json.dumps({"events": events}).encode())
    return out


async def load(port: int, clients: int, seconds: float, batch: int) -> dict[str, Any]:
    pool = bodies(clients * 4, batch)
    url = f"http://127.0.0.1:{port}/v1/feedback"
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    acked = 0
    codes: dict[int, int] = {}
    stop = time.perf_counter() + seconds

    async def client(session: aiohttp.ClientSession, k: int) -> None:
        nonlocal acked
        n = k
        while time.perf_counter() < stop:
            body = pool[n % len(pool)]
            n += clients
            if n >= len(pool):  # fresh ids for the next round: never a duplicate
                pool[n % len(pool)] = bodies(1, batch)[0]
            async with session.post(url, data=body, headers=headers) as response:
                await response.read()
                codes[response.status] = codes.get(response.status, 0) + 1
                if response.status == 202:
                    acked += batch

    connector = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(connector=connector) as session:
        started = time.perf_counter()
        await asyncio.gather(*(client(session, k) for k in range(clients)))
        elapsed = time.perf_counter() - started
        async with session.get(f"http://127.0.0.1:{port}/metrics") as response:
            metrics = await response.text()
    groups = _metric(metrics, "rtrl_feedback_commit_events_count")
    grouped = _metric(metrics, "rtrl_feedback_commit_events_sum")
    seconds_sum = _metric(metrics, "rtrl_feedback_commit_seconds_sum")
    return {
        "events_per_s": round(acked / elapsed),
        "acked": acked,
        "codes": codes,
        "group_commits": int(groups),
        "mean_group_events": round(grouped / groups) if groups else 0,
        "mean_commit_ms": round(1000 * seconds_sum / groups, 1) if groups else None,
    }


def _metric(text: str, name: str) -> float:
    found = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(found[1]) if found else 0.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def service(events_uri: str, tmp: Path, env: dict[str, str]) -> tuple[subprocess.Popen[bytes], int]:
    tokens = tmp / "tokens"
    tokens.write_text(TOKEN + "\n")
    port = free_port()
    process = subprocess.Popen(
        [str(Path(sys.executable).parent / "rtrl-feedback"), "--events", events_uri,
         "--token-file", str(tokens), "--listen", f"127.0.0.1:{port}",
         "--max-events", str(max(1000, ARGS.batch))],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return process, port
        except OSError:
            time.sleep(0.1)
    process.kill()
    raise SystemExit("rtrl-feedback did not start")


def parquet_file(batch: int) -> bytes:
    now = datetime.now(UTC)
    table = pa.table({
        "event_id": [uuid.uuid4().hex for _ in range(batch)],
        "interaction_id": [new_interaction_id(now) for _ in range(batch)],
        "signal": ["edit_persisted"] * batch,
        "value": [0.5] * batch,
        "observed_at": [now] * batch,
        "received_at": [now] * batch,
    }, schema=FEEDBACK_SCHEMA)  # fmt: skip
    sink = io.BytesIO()
    pq.write_table(table, sink, compression="zstd", write_page_checksum=True)
    return sink.getvalue()


def raw_puts(kind: str, target: Any, batch: int, seconds: float) -> int:
    """Events/s of a plain loop: build the file, PUT it (or write and fsync it)."""
    written = 0
    started = time.perf_counter()
    n = 0
    while time.perf_counter() - started < seconds / 2:
        data = parquet_file(batch)  # the encoding is part of what the service pays too
        if kind == "s3":
            client, bucket = target
            client.put_object(Bucket=bucket, Key=f"raw/{batch}/{n:08d}.parquet", Body=data)
        else:
            path = Path(target) / f"raw-{batch}-{n:08d}.parquet"
            with path.open("wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
        n += 1
        written += batch
    return round(written / (time.perf_counter() - started))


def one_store(kind: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="rtrl-bench-feedback-") as tmp_name:
        tmp = Path(tmp_name)
        env = dict(os.environ)
        moto: ThreadedMotoServer | None = None
        if kind == "s3":
            logging.getLogger("werkzeug").setLevel(logging.ERROR)
            moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
            moto.start()
            host, port = moto.get_host_and_port()
            endpoint = f"http://{host}:{port}"
            env.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench",
                       AWS_DEFAULT_REGION="us-east-1", AWS_ENDPOINT_URL=endpoint)  # fmt: skip
            os.environ.update({k: env[k] for k in ("AWS_ACCESS_KEY_ID",
                               "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")})  # fmt: skip
            client = boto3.session.Session().client("s3", endpoint_url=endpoint)
            client.create_bucket(Bucket="bench")
            uri, target = "s3://bench/events/", (client, "bench")
        else:
            (tmp / "events").mkdir()
            (tmp / "raw").mkdir()
            uri, target = (tmp / "events").as_uri() + "/", tmp / "raw"
        try:
            process, port = service(uri, tmp, env)
            try:
                served = asyncio.run(load(port, ARGS.clients, ARGS.seconds, ARGS.batch))
            finally:
                process.terminate()
                process.wait(30)
            group = max(1, served["mean_group_events"])
            raw_request = raw_puts(kind, target, ARGS.batch, ARGS.seconds)
            raw_group = raw_puts(kind, target, group, ARGS.seconds)
        finally:
            if moto is not None:
                moto.stop()
    return {
        "store": kind,
        "service": served,
        "raw_put_per_request_batch": raw_request,
        "raw_put_per_group": raw_group,
        "service_over_raw_request_batch": round(served["events_per_s"] / raw_request, 2),
        "service_over_raw_group": round(served["events_per_s"] / raw_group, 2),
    }


def main() -> None:
    results = [one_store(kind) for kind in ARGS.stores]
    if ARGS.json:
        print(json.dumps({"results": results, "clients": ARGS.clients, "batch": ARGS.batch,
                          "cpus": os.cpu_count()}, indent=1))  # fmt: skip
        return
    for r in results:
        s = r["service"]
        print(
            f"{r['store']:>4}: rtrl-feedback {s['events_per_s']:,} events/s durable "
            f"({ARGS.clients} clients x {ARGS.batch} events, {s['group_commits']} group "
            f"commits of {s['mean_group_events']} events, {s['mean_commit_ms']} ms each; "
            f"answers {s['codes']}); raw PUT loop: {r['raw_put_per_request_batch']:,}/s in "
            f"files of {ARGS.batch}, {r['raw_put_per_group']:,}/s in files of "
            f"{s['mean_group_events']}; service / raw: {r['service_over_raw_request_batch']}x"
            f" and {r['service_over_raw_group']}x",
            flush=True,
        )


parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--stores", type=lambda t: t.split(","), default=["s3", "file"])
parser.add_argument("--clients", type=int, default=32)
parser.add_argument("--batch", type=int, default=100, help="events per request")
parser.add_argument("--seconds", type=float, default=10.0)
parser.add_argument("--json", action="store_true")
ARGS = parser.parse_args()

if __name__ == "__main__":
    main()
