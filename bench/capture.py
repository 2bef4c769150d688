"""What the capture proxy costs: latency added (p50, p99) and throughput lost against the same
vLLM called directly, at 16 and 64 concurrent streams, side by side in one run.

Paths (streamed chat completions of ``--tokens`` tokens each, ``ignore_eos`` so every one has
that length), all served by one engine started once: the engine directly (``direct``); the
engine directly with what the proxy adds to each request, in part (``direct+logprobs``,
``direct+token_ids``) and whole (``direct+fields``): the engine's share of the cost of
capture; nginx as a bare relay in front of the engine, the client asking for the fields
itself (``relay+fields``, where nginx is installed: what any hop in the request's path
costs); and the proxy (``proxy``). The fields are taken from the proxy's own rewrite
(:func:`rtrl_serving.capture.rewrite.rewrite`), so the bench follows what the proxy asks.

Placements (``--placements``): ``pinned`` is a pod's layout: the engine (every thread of its
process tree) on one CPU set in every path, the proxy and the load generator on the other
CPUs (a sidecar with a CPU request of its own); ``shared`` puts all three on every CPU, so
that the proxy's CPU is taken from the engine; ``split`` is ``pinned`` with the engine's API
server moved off its core's CPUs to the sidecar's, so that the forward passes no longer take
the CPU the API server needs to take requests (as on a GPU node, where they run on the GPU),
at the price of the API server sharing its CPUs with the proxy and the load generator. The
placements and paths take turns, round after round, so that drift in the machine's load hits
all alike. Per level, placement and path it reports latency per request (sent to last byte
received) at p50 and p99, tokens per second, and the CPU milliseconds per request of the
engine, the proxy and the load generator, as medians over the rounds; ratios against
``direct`` (and the proxy against ``direct+fields``) are taken within each round (medians,
with the range). The proxy runs as the real ``rtrl-capture`` console script, spooling to
local disk with its default commit window and shipping to a ``file://`` events store, as in
a pod; its events are counted at the end against the requests it served.

Loads: ``--levels`` are closed loop (so many streams, each sending its next request when
its last one ended: the engine's capacity, where every millisecond a request spends outside
the engine shrinks its batches); ``--rates`` are open loop (Poisson arrivals at a rate,
whatever the responses do: what a deployment serving many users sees).

Goal (issue 30): <= 2 ms added at p50, <= 5% throughput lost.

    .venv/bin/python bench/capture.py --start-engine [--levels 16,64] [--rounds 5]
        [--tokens 32] [--placements pinned,shared,split] [--engine-cpus 0] [--json]
    .venv/bin/python bench/capture.py --start-engine --levels 64 --tokens-spread 16
        # a closed loop whose streams end apart: lengths of 16-48 tokens
    .venv/bin/python bench/capture.py --start-engine --levels "" --rates 50,150
        # open loop: Poisson arrivals at 50 and 150 requests/s, --rate-seconds 4 a round
    .venv/bin/python bench/capture.py --engine http://127.0.0.1:8000 --engine-pid PID ...
    .venv/bin/python bench/capture.py --start-engine --profile proxy.prof --paths proxy
        # the proxy under cProfile (slower: for where its time goes, not for figures)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pyarrow.parquet as pq

from rtrl_localkube import tinymodel
from rtrl_localkube.engine import Engine, EngineSpec
from rtrl_serving.capture.rewrite import ENDPOINTS, rewrite

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


# The proxy's script under cProfile timed by its event loop thread's CPU time, not the wall
# clock: on a loaded machine wall time charges preemption to whatever function was running.
PROFILED = """
import cProfile, runpy, sys, time
out, sys.argv = sys.argv[1], sys.argv[2:]
profile = cProfile.Profile(time.thread_time)
try:
    profile.runcall(runpy.run_path, sys.argv[0], run_name="__main__")
except SystemExit:
    pass
finally:
    profile.dump_stats(out)
"""


def start_proxy(
    engine: str, model: str, workdir: Path, profile: Path | None = None
) -> tuple[str, subprocess.Popen[bytes]]:
    """The real ``rtrl-capture`` (under cProfile, writing ``profile`` at exit, if given)."""
    port = _free_port()
    argv = [
        str(BIN / "rtrl-capture"), "--listen", f"127.0.0.1:{port}", "--engine", engine,
        "--events", f"file://{workdir}/events/", "--spool", str(workdir / "spool"),
        "--segment-age-s", "5",
    ]  # fmt: skip
    if profile is not None:
        argv = [sys.executable, "-c", PROFILED, str(profile), *argv]
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


def _added_fields() -> dict[str, Any]:
    """What the proxy adds to a plain streamed chat request, from its own rewrite."""
    plain = {"model": "tiny", "stream": True}
    rw = rewrite(ENDPOINTS["/v1/chat/completions"], json.dumps(plain).encode())
    return {k: v for k, v in json.loads(rw.body).items() if k not in plain}


NGINX_CONF = """
daemon off;
master_process off;
worker_processes 1;
pid {work}/nginx.pid;
error_log {work}/nginx-error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {work}/nginx-body;
    proxy_temp_path {work}/nginx-proxy;
    fastcgi_temp_path {work}/nginx-fastcgi;
    uwsgi_temp_path {work}/nginx-uwsgi;
    scgi_temp_path {work}/nginx-scgi;
    upstream engine {{ server {engine}; keepalive 256; }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://engine;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_request_buffering off;
            proxy_read_timeout 600s;
        }}
    }}
}}
"""


def start_relay(engine: str, workdir: Path) -> tuple[str, subprocess.Popen[bytes]]:
    """nginx as a bare relay in front of the engine (one process, streaming unbuffered,
    keep-alive to the engine): what any hop in front of the engine costs, the strongest
    baseline for a sidecar that must sit in the request's path."""
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    if not Path(nginx).exists():
        raise SystemExit("--paths relay+fields needs nginx (Debian: apt-get install nginx-light)")
    port = _free_port()
    conf = workdir / "nginx.conf"
    conf.write_text(NGINX_CONF.format(work=workdir, engine=engine.split("//", 1)[1], port=port))
    log = (workdir / "nginx.log").open("wb")
    proc = subprocess.Popen([nginx, "-c", str(conf), "-p", str(workdir)], stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    _wait(f"{url}/health", 60, proc)
    return url, proc


FIELDS = _added_fields()
# name: (where the client sends it: the engine, the capture proxy or the relay; the fields
# the client adds)
PATHS: dict[str, tuple[str, dict[str, Any]]] = {
    "direct": ("engine", {}),
    "direct+logprobs": ("engine", {k: v for k, v in FIELDS.items() if k == "logprobs"}),
    "direct+token_ids": ("engine", {k: v for k, v in FIELDS.items() if k == "return_token_ids"}),
    "direct+fields": ("engine", FIELDS),
    "relay+fields": ("relay", FIELDS),
    "proxy": ("proxy", {}),
}


@dataclass(frozen=True)
class Placement:
    """Where the engine runs, and where the proxy and the load generator run."""

    name: str
    engine: frozenset[int]
    sidecar: frozenset[int]
    api: frozenset[int] | None = None  # the engine's API server, where not with its core


def placements(names: list[str], engine_cpus: str | None) -> list[Placement]:
    every = frozenset(os.sched_getaffinity(0))
    if engine_cpus:
        engine = frozenset(int(c) for c in engine_cpus.split(","))
    else:
        engine = frozenset(sorted(every)[:-1])
    out = []
    for name in names:
        if name == "shared":
            out.append(Placement(name, every, every))
        elif name in ("pinned", "split"):
            sidecar = every - engine
            if not engine or not sidecar or not engine <= every:
                raise SystemExit(
                    f"--engine-cpus {sorted(engine)}: must leave one of {sorted(every)}"
                )
            out.append(Placement(name, engine, sidecar, api=sidecar if name == "split" else None))
        else:
            raise SystemExit(f"--placements: {name!r} is not pinned, shared or split")
    return out


ENGINE_CORE = "VLLM::"  # the name vLLM gives its engine core's and workers' processes


class Tree:
    """A process and (with ``descendants``) its descendants: pinned to CPUs together, their
    CPU time summed."""

    def __init__(self, pid: int, *, descendants: bool = True) -> None:
        self.root = psutil.Process(pid)
        self.descendants = descendants
        self.procs: dict[int, psutil.Process] = {}
        self.refresh()

    def refresh(self) -> None:
        children = self.root.children(recursive=True) if self.descendants else []
        for proc in [self.root, *children]:
            self.procs.setdefault(proc.pid, proc)

    def pin(self, cpus: frozenset[int], *, unless: str | None = None) -> None:
        """Every thread of every process (a thread started later inherits its creator's),
        but those of processes whose name starts with ``unless``."""
        self.refresh()
        for proc in list(self.procs.values()):
            with contextlib.suppress(psutil.Error):
                if unless is not None and proc.name().startswith(unless):
                    continue
                for thread in proc.threads():
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.sched_setaffinity(thread.id, cpus)

    def cpu(self, prefix: str = "") -> float:
        """CPU seconds of the processes whose name starts with ``prefix``."""
        total = 0.0
        for proc in list(self.procs.values()):
            with contextlib.suppress(psutil.Error):
                if proc.name().startswith(prefix):
                    times = proc.cpu_times()
                    total += times.user + times.system
        return total


# No per-request seed: vLLM 0.32 on CPU kills its engine core when a seeded request's step is
# discarded under chunked prefill ("CPU Generator does not use offset"), which 64 concurrent
# streams reach.
def length(number: int, tokens: int, spread: int) -> int:
    """Request ``number``'s completion length: ``tokens``, or with ``--tokens-spread`` drawn
    from tokens +- spread by the request's number (the same in every path), so that a closed
    loop's streams end at different times, as agents' requests do."""
    if spread <= 0:
        return tokens
    return random.Random(number).randint(max(1, tokens - spread), tokens + spread)


async def _one(session: aiohttp.ClientSession, base: str, number: int, tokens: int,
               extra: dict[str, Any], *, spread: int = 0) -> float:  # fmt: skip
    body = {
        "model": "tiny", "stream": True, "max_tokens": length(number, tokens, spread),
        "ignore_eos": True,
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
    base: str,
    load: Load,
    requests: int,
    tokens: int,
    *,
    first: int,
    extra: dict[str, Any],
    spread: int = 0,
) -> tuple[list[float], float]:
    """``requests`` requests, ``load.streams`` in flight or arriving at ``load.rate``;
    latencies and wall seconds."""
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        if load.rate is not None:
            # open loop: Poisson arrivals, the same schedule in every round of every path
            gaps = random.Random(f"{load.rate}:{requests}")
            started = due = time.perf_counter()
            sent = []
            for number in range(first, first + requests):
                due += gaps.expovariate(load.rate)
                await asyncio.sleep(max(0.0, due - time.perf_counter()))
                sent.append(
                    asyncio.create_task(_one(session, base, number, tokens, extra, spread=spread))
                )
            done = await asyncio.gather(*sent)
            return list(done), time.perf_counter() - started
        queue = iter(range(first, first + requests))
        latencies: list[float] = []

        async def worker() -> None:
            for number in queue:
                latencies.append(await _one(session, base, number, tokens, extra, spread=spread))

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(load.streams)))
        return latencies, time.perf_counter() - started


@dataclass(frozen=True)
class Load:
    """Closed loop (``streams`` clients, each sending its next request when its last one
    ended: the engine's capacity) or open loop (requests arriving at ``rate`` per second
    whatever the responses do: what a deployment serving many users sees)."""

    streams: int = 0
    rate: float | None = None

    @property
    def label(self) -> str:
        return f"{self.rate:g}/s" if self.rate is not None else str(self.streams)

    def requests(self, per_stream: int, seconds: float) -> int:
        """Requests in one round."""
        if self.rate is not None:
            return max(16, round(self.rate * seconds))
        return self.streams * per_stream


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class Processes:
    engine: Tree
    proxy: Tree
    client: Tree  # this process alone (the proxy is its child): the load generator
    relay: Tree | None = None

    def place(self, placement: Placement) -> None:
        self.engine.pin(placement.engine)
        if placement.api is not None:
            self.engine.pin(placement.api, unless=ENGINE_CORE)
        self.proxy.pin(placement.sidecar)
        self.client.pin(placement.sidecar)
        if self.relay is not None:
            self.relay.pin(placement.sidecar)

    def cpu(self) -> tuple[float, float, float, float]:
        """CPU seconds: the engine, of which its core (vLLM's ``VLLM::EngineCore`` and
        ``VLLM::Worker`` processes: scheduling, the forward pass, sampling; the rest is its
        API server: requests, detokenizing, building and writing responses), the sidecars (the
        proxy, and nginx where it runs: each path uses one of them), the
        load generator."""
        engine = self.engine.cpu()
        sidecar = self.proxy.cpu() + (self.relay.cpu() if self.relay is not None else 0.0)
        return engine, self.engine.cpu(ENGINE_CORE), sidecar, self.client.cpu()


def _ratios(base: list[dict[str, float]], other: list[dict[str, float]]) -> dict[str, Any]:
    pairs = list(zip(base, other, strict=True))
    tps = [b["tps"] / a["tps"] for a, b in pairs]
    return {
        "added_p50_ms": statistics.median(b["p50"] - a["p50"] for a, b in pairs),
        "added_p99_ms": statistics.median(b["p99"] - a["p99"] for a, b in pairs),
        "throughput_ratio": statistics.median(tps),
        "throughput_ratio_range": [min(tps), max(tps)],
    }


def measure(
    bases: dict[str, str], procs: Processes, levels: list[Load], *,
    where: list[Placement], paths: list[str], rounds: int, tokens: int, per_stream: int,
    seconds: float, spread: int = 0,
) -> tuple[list[dict[str, Any]], int]:  # fmt: skip
    """Per level: ``rounds`` rounds of every placement and path in turn; the rows, and how
    many requests the proxy served."""
    results = []
    number = 0
    proxied = 0
    for load in levels:
        requests = load.requests(per_stream, seconds)
        warm = load.requests(1, 1.0)
        for placement in where:  # warm-up, and the placement's threads settled
            procs.place(placement)
            for name in paths:
                target, extra = PATHS[name]
                base = bases[target]
                asyncio.run(
                    _round(base, load, warm, tokens, first=10**6, extra=extra, spread=spread)
                )
                proxied += warm if target == "proxy" else 0
        per_round = {(p.name, n): [] for p in where for n in paths}  # type: ignore[var-annotated]
        loads = []
        for _ in range(rounds):
            for placement in where:
                procs.place(placement)
                for name in paths:
                    target, extra = PATHS[name]
                    base = bases[target]
                    before = procs.cpu()
                    lat, wall = asyncio.run(
                        _round(base, load, requests, tokens, first=number, extra=extra,
                               spread=spread)
                    )  # fmt: skip
                    served = sum(
                        length(n, tokens, spread) for n in range(number, number + requests)
                    )
                    after = procs.cpu()
                    number += requests
                    proxied += requests if target == "proxy" else 0
                    cpu = [1000 * (b - a) / requests for a, b in zip(before, after, strict=True)]
                    per_round[placement.name, name].append({
                        "p50": 1000 * statistics.median(lat), "p99": 1000 * _pct(lat, 0.99),
                        "tps": served / wall, "engine_cpu_ms": cpu[0],
                        "engine_core_cpu_ms": cpu[1], "proxy_cpu_ms": cpu[2],
                        "client_cpu_ms": cpu[3],
                    })  # fmt: skip
            loads.append(os.getloadavg()[0])
        for placement in where:
            row: dict[str, Any] = {
                "placement": placement.name, "engine_cpus": sorted(placement.engine),
                "sidecar_cpus": sorted(placement.sidecar), "concurrency": load.streams or None,
                "rate": load.rate, "load": load.label,
                "rounds": rounds, "requests_per_round": requests, "tokens": tokens,
                "tokens_spread": spread,
                "loadavg_1m": [min(loads), statistics.median(loads), max(loads)],
            }  # fmt: skip
            runs = {n: per_round[placement.name, n] for n in paths}
            for name in paths:
                row[name] = {k: statistics.median(r[k] for r in runs[name]) for k in runs[name][0]}
                if name != "direct" and "direct" in runs:
                    row[name]["vs direct"] = _ratios(runs["direct"], runs[name])
            if "proxy" in runs and "direct+fields" in runs:
                row["proxy vs direct+fields"] = _ratios(runs["direct+fields"], runs["proxy"])
            if "relay+fields" in runs and "direct+fields" in runs:
                row["relay vs direct+fields"] = _ratios(runs["direct+fields"], runs["relay+fields"])
            if "proxy" in runs and "relay+fields" in runs:
                row["proxy vs relay+fields"] = _ratios(runs["relay+fields"], runs["proxy"])
            results.append(row)
            print(json.dumps(row), file=sys.stderr)
    return results, proxied


def _print(rows: list[dict[str, Any]], paths: list[str]) -> None:
    print(f"{'placement':>9} {'load':>7} {'path':>16} {'p50':>9} {'p99':>9} {'tok/s':>6} "
          f"{'+p50':>8} {'+p99':>8} {'tok/s ratio':>17} {'engine':>7} {'(core)':>6} "
          f"{'proxy':>6} {'client':>6}  (CPU ms per request)")  # fmt: skip
    for r in rows:
        for name in paths:
            m = r[name]
            vs = m.get("vs direct")
            extra = (f"{vs['added_p50_ms']:>+7.1f} {vs['added_p99_ms']:>+7.1f}  "
                     f"{vs['throughput_ratio']:.3f} ({vs['throughput_ratio_range'][0]:.2f}-"
                     f"{vs['throughput_ratio_range'][1]:.2f})") if vs else " " * 35  # fmt: skip
            print(f"{r['placement']:>9} {r['load']:>7} {name:>16} {m['p50']:>7.1f}ms "
                  f"{m['p99']:>7.1f}ms {m['tps']:>6.0f} {extra} {m['engine_cpu_ms']:>7.2f} "
                  f"{m['engine_core_cpu_ms']:>6.2f} {m['proxy_cpu_ms']:>6.2f} "
                  f"{m['client_cpu_ms']:>6.2f}")  # fmt: skip
        for key, what in (("proxy vs direct+fields", "the proxy itself (vs direct+fields)"),
                          ("relay vs direct+fields", "a bare relay, nginx (vs direct+fields)"),
                          ("proxy vs relay+fields", "the proxy vs the relay")):  # fmt: skip
            own = r.get(key)
            if own:
                lo, hi = own["throughput_ratio_range"]
                print(f"{'':>17} {what}: {own['added_p50_ms']:+.1f} ms at p50, throughput "
                      f"x{own['throughput_ratio']:.3f} ({lo:.2f}-{hi:.2f}); "
                      f"load average {r['loadavg_1m']}")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", help="a running vLLM's base URL (model 'tiny')")
    parser.add_argument("--engine-pid", type=int, help="its process (the tree is pinned)")
    parser.add_argument("--model-uri", default="", help="what that engine was started with")
    parser.add_argument("--start-engine", action="store_true")
    parser.add_argument("--levels", default="16,64", help="closed loop: streams in flight")
    parser.add_argument("--rates", default="",
                        help="open loop: requests per second (Poisson arrivals)")  # fmt: skip
    parser.add_argument("--rate-seconds", type=float, default=4.0,
                        help="open loop: seconds of arrivals per round")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument(
        "--tokens-spread",
        type=int,
        default=0,
        help="each request's length drawn from tokens +- this",
    )
    parser.add_argument("--requests-per-stream", type=int, default=3,
                        help="requests per round: this many times the streams")  # fmt: skip
    parser.add_argument("--placements", default="pinned,shared")
    parser.add_argument("--engine-cpus", help="comma-separated; default all CPUs but the last")
    parser.add_argument("--paths", default=",".join(p for p in PATHS if p != "relay+fields"),
                        help=f"of {','.join(PATHS)} (relay+fields needs nginx)")  # fmt: skip
    parser.add_argument("--profile", type=Path, help="run the proxy under cProfile, to here")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    paths = args.paths.split(",")
    if unknown := [p for p in paths if p not in PATHS]:
        parser.error(f"--paths: {unknown} not among {list(PATHS)}")
    where = placements(args.placements.split(","), args.engine_cpus)
    every = frozenset(os.sched_getaffinity(0))  # before any placement
    with tempfile.TemporaryDirectory(prefix="bench-capture-") as tmp:
        workdir = Path(tmp)
        engine_proc = None
        if args.start_engine:
            engine, model, engine_proc = start_engine(workdir)
            engine_pid = engine_proc.pid
        elif args.engine and args.engine_pid:
            engine, model, engine_pid = args.engine.rstrip("/"), args.model_uri, args.engine_pid
        else:
            parser.error("--engine URL with --engine-pid PID, or --start-engine")
        assert engine_pid is not None
        proxy, proxy_proc = start_proxy(engine, model, workdir, args.profile)
        bases = {"engine": engine, "proxy": proxy}
        relay_proc = None
        if "relay+fields" in paths:
            bases["relay"], relay_proc = start_relay(engine, workdir)
        procs = Processes(
            Tree(engine_pid),
            Tree(proxy_proc.pid),
            Tree(os.getpid(), descendants=False),
            Tree(relay_proc.pid) if relay_proc is not None else None,
        )
        load_before = os.getloadavg()
        try:
            levels = [Load(streams=int(x)) for x in args.levels.split(",") if x]
            levels += [Load(rate=float(x)) for x in args.rates.split(",") if x]
            rows, proxied = measure(bases, procs, levels, where=where, paths=paths,
                                    rounds=args.rounds, tokens=args.tokens,
                                    per_stream=args.requests_per_stream,
                                    seconds=args.rate_seconds,
                                    spread=args.tokens_spread)  # fmt: skip
        finally:
            with contextlib.suppress(psutil.Error):
                procs.engine.pin(every)  # a running engine (--engine) gets every CPU back
            proxy_proc.send_signal(signal.SIGTERM)
            proxy_proc.wait(120)
            if relay_proc is not None:
                relay_proc.send_signal(signal.SIGQUIT)
                relay_proc.wait(30)
            if engine_proc is not None:
                engine_proc.stop()
        events = sum(pq.read_metadata(p).num_rows for p in (workdir / "events").rglob("*.parquet"))
        report = {"levels": rows, "events_shipped": events, "proxy_requests": proxied,
                  "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
                  "cpus": sorted(os.sched_getaffinity(0)), "fields": FIELDS}  # fmt: skip
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        _print(rows, paths)
        print(f"fields the proxy adds: {FIELDS}; events shipped: {events} of {proxied} proxied "
              f"requests; load average before/after: {load_before} / "
              f"{report['loadavg_after']}; CPUs {report['cpus']}")  # fmt: skip
    if args.profile is not None:
        import pstats

        pstats.Stats(str(args.profile)).sort_stats("tottime").print_stats(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
