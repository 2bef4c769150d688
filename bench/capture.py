"""What the capture proxy costs: latency added (p50, p99) and throughput lost against the same
vLLM called directly, at 16 and 64 concurrent streams, side by side in one run.

Three paths serve the same requests (streamed chat completions of ``--tokens`` tokens each,
``ignore_eos`` so every one has that length): the engine directly (``direct``), the engine
directly with what the proxy adds to each request (``direct+fields``: log-probs and token ids,
the engine's share of the cost of capture), and the proxy (``proxy``). They take turns, round
after round, so that drift in the machine's load hits all alike; per concurrency level it
reports each path's latency per request (request sent to last byte received) at p50 and p99
and its tokens per second, as medians over the rounds, and each path's added latency and
throughput ratio against ``direct`` within the same round (medians, with the range of the
throughput ratio), the proxy alone against ``direct+fields``, and the proxy's own CPU per
request. The proxy runs as the real ``rtrl-capture`` console script, spooling to local disk
with its default commit window and shipping to a ``file://`` events store, as in a pod; its
events are counted at the end.

Goal (issue 30): <= 2 ms added at p50, <= 5% throughput lost.

    .venv/bin/python bench/capture.py --engine http://127.0.0.1:8000 [--levels 16,64]
        [--rounds 3] [--tokens 32] [--json]
    .venv/bin/python bench/capture.py --start-engine   # rtrl_localkube's tiny model on vLLM
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pyarrow.parquet as pq

from rtrl_localkube import tinymodel
from rtrl_localkube.engine import Engine, EngineSpec

BIN = Path(sys.executable).parent


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait(url: str, timeout: float, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the process exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"{url} not ready after {timeout} s")


def start_engine(workdir: Path) -> tuple[str, str, Engine]:
    """The tiny model of rtrl_localkube.tinymodel on a real vLLM from .venv-vllm, loaded from
    a local directory (as the tests start it, less the S3)."""
    model = workdir / "tiny"
    tinymodel.publish(model.as_uri() + "/")
    engine = Engine(EngineSpec(model=str(model), served_model_name="tiny"),
                    workdir / "engine.log").start()  # fmt: skip
    return engine.root_url, str(model), engine


def start_proxy(engine: str, model: str, workdir: Path) -> tuple[str, subprocess.Popen[bytes]]:
    port = _free_port()
    argv = [
        str(BIN / "rtrl-capture"), "--listen", f"127.0.0.1:{port}", "--engine", engine,
        "--events", f"file://{workdir}/events/", "--spool", str(workdir / "spool"),
        "--segment-age-s", "5",
    ]  # fmt: skip
    env = {
        **os.environ,
        "RTRL_MODEL_URI": model,
        "RTRL_CHECKPOINT_ID": "bench",
        "RTRL_ARM": "stable",
    }
    log = (workdir / "capture.log").open("wb")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    _wait(f"{url}/readyz", 120, proc)
    return url, proc


PATHS = ("direct", "direct+fields", "proxy")
# what the proxy asks the engine for on the client's behalf (chat): the engine-side cost
FIELDS = {"logprobs": True, "return_token_ids": True}


# No per-request seed: vLLM 0.32 on CPU kills its engine core when a seeded request's step is
# discarded under chunked prefill ("CPU Generator does not use offset"), which 64 concurrent
# streams reach.
async def _one(session: aiohttp.ClientSession, base: str, number: int, tokens: int,
               extra: dict[str, Any]) -> float:  # fmt: skip
    body = {
        "model": "tiny", "stream": True, "max_tokens": tokens, "ignore_eos": True,
        "messages": [{"role": "user", "content": f"Write function {number}."}],
        **extra,
    }  # fmt: skip
    started = time.perf_counter()
    async with session.post(f"{base}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        tail = b""
        async for data in resp.content.iter_any():
            tail = (tail + data)[-32:]
        assert tail.endswith(b"data: [DONE]\n\n")
    return time.perf_counter() - started


async def _round(
    base: str, concurrency: int, requests: int, tokens: int, *, first: int, extra: dict[str, Any]
) -> tuple[list[float], float]:
    """``requests`` requests with ``concurrency`` in flight; latencies and wall seconds."""
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        queue = iter(range(first, first + requests))
        latencies: list[float] = []

        async def worker() -> None:
            for number in queue:
                latencies.append(await _one(session, base, number, tokens, extra))

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return latencies, time.perf_counter() - started


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(
    engine: str, proxy: str, proxy_proc: psutil.Process, levels: list[int], *, rounds: int,
    tokens: int,
) -> list[dict[str, Any]]:  # fmt: skip
    """Per level: ``rounds`` rounds of each path in turn; each round's p50, p99 and tokens/s,
    and the proxy's ratios to direct within each round, reported as medians over rounds (on
    a shared machine one round's noise would swamp a pooled figure)."""
    bases = {"direct": (engine, {}), "direct+fields": (engine, FIELDS), "proxy": (proxy, {})}
    results = []
    number = 0
    for concurrency in levels:
        requests = concurrency * 2
        for base, extra in bases.values():  # warm-up
            asyncio.run(_round(base, concurrency, concurrency, tokens, first=10**6, extra=extra))
        per_round: dict[str, list[dict[str, float]]] = {p: [] for p in PATHS}
        cpu = 0.0
        for _ in range(rounds):
            for name in PATHS:
                base, extra = bases[name]
                before = sum(proxy_proc.cpu_times()[:2])
                lat, wall = asyncio.run(
                    _round(base, concurrency, requests, tokens, first=number, extra=extra)
                )
                if name == "proxy":
                    cpu += sum(proxy_proc.cpu_times()[:2]) - before
                number += requests
                per_round[name].append({
                    "p50": 1000 * statistics.median(lat), "p99": 1000 * _pct(lat, 0.99),
                    "tps": requests * tokens / wall,
                })  # fmt: skip
        row: dict[str, Any] = {"concurrency": concurrency, "rounds": rounds,
                               "requests_per_round": requests, "tokens": tokens}  # fmt: skip
        for name in PATHS:
            row[name] = {k: statistics.median(r[k] for r in per_round[name])
                         for k in ("p50", "p99", "tps")}  # fmt: skip
        for name in ("direct+fields", "proxy"):
            pairs = list(zip(per_round["direct"], per_round[name], strict=True))
            row[f"{name} vs direct"] = {
                "added_p50_ms": statistics.median(b["p50"] - a["p50"] for a, b in pairs),
                "added_p99_ms": statistics.median(b["p99"] - a["p99"] for a, b in pairs),
                "p50_ratio": statistics.median(b["p50"] / a["p50"] for a, b in pairs),
                "throughput_ratio": statistics.median(b["tps"] / a["tps"] for a, b in pairs),
                "throughput_ratio_range": [min(b["tps"] / a["tps"] for a, b in pairs),
                                           max(b["tps"] / a["tps"] for a, b in pairs)],
            }  # fmt: skip
        pairs = list(zip(per_round["direct+fields"], per_round["proxy"], strict=True))
        row["proxy vs direct+fields"] = {
            "added_p50_ms": statistics.median(b["p50"] - a["p50"] for a, b in pairs),
            "throughput_ratio": statistics.median(b["tps"] / a["tps"] for a, b in pairs),
        }
        row["proxy_cpu_ms_per_request"] = 1000 * cpu / (rounds * requests)
        results.append(row)
        print(json.dumps(row), file=sys.stderr)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", help="a running vLLM's base URL (model 'tiny')")
    parser.add_argument("--model-uri", default="", help="what that engine was started with")
    parser.add_argument("--start-engine", action="store_true")
    parser.add_argument("--levels", default="16,64")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-capture-") as tmp:
        workdir = Path(tmp)
        engine_proc = None
        if args.start_engine:
            engine, model, engine_proc = start_engine(workdir)
        elif args.engine:
            engine, model = args.engine.rstrip("/"), args.model_uri
        else:
            parser.error("--engine URL or --start-engine")
        proxy, proxy_proc = start_proxy(engine, model, workdir)
        load_before = os.getloadavg()
        try:
            levels = [int(x) for x in args.levels.split(",")]
            rows = measure(engine, proxy, psutil.Process(proxy_proc.pid), levels,
                           rounds=args.rounds, tokens=args.tokens)  # fmt: skip
        finally:
            proxy_proc.send_signal(signal.SIGTERM)
            proxy_proc.wait(120)
            if engine_proc is not None:
                engine_proc.stop()
        events = sum(pq.read_metadata(p).num_rows for p in (workdir / "events").rglob("*.parquet"))
        report = {"levels": rows, "events_shipped": events, "loadavg_before": load_before,
                  "loadavg_after": os.getloadavg(), "cpus": os.cpu_count()}  # fmt: skip
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(f"{'streams':>7} {'path':>14} {'p50':>9} {'p99':>9} {'tok/s':>7} "
              f"{'added p50':>10} {'added p99':>10} {'tok/s ratio':>11}")  # fmt: skip
        for r in rows:
            for name in PATHS:
                m = r[name]
                vs = r.get(f"{name} vs direct")
                extra = (f"{vs['added_p50_ms']:>+8.1f}ms {vs['added_p99_ms']:>+8.1f}ms "
                         f"{vs['throughput_ratio']:>11.3f}") if vs else ""  # fmt: skip
                print(f"{r['concurrency']:>7} {name:>14} {m['p50']:>7.1f}ms {m['p99']:>7.1f}ms "
                      f"{m['tps']:>7.0f} {extra}")  # fmt: skip
            own = r["proxy vs direct+fields"]
            print(f"{'':>7} the proxy itself (vs direct+fields): {own['added_p50_ms']:+.1f} ms at "
                  f"p50, throughput x{own['throughput_ratio']:.3f}; its CPU "
                  f"{r['proxy_cpu_ms_per_request']:.2f} ms per request")  # fmt: skip
        print(
            f"events shipped: {events}; load average before/after: {load_before} / "
            f"{report['loadavg_after']}; {os.cpu_count()} CPUs"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
