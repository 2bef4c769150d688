"""What serving LoRA adapters costs (issue 34): engine throughput with adapters against
none, and a routing table's change through the capture sidecar under load, in one run.

The base is the tiny model of :mod:`rtrl_localkube.tinymodel` (float32) on a real vLLM
from ``.venv-vllm``; the adapters are rank ``--rank`` LoRAs on every linear layer, made
with PEFT (random ``lora_B``: their cost does not depend on what they learned) and
committed with the manifest and lineage ``rtrl-job train`` writes (``kind: adapter``,
``base``, ``baseDigest``), so the sidecar checks and loads them as it would a trained one.

1. **engine**: completions of ``--tokens`` tokens (``ignore_eos``) from ``--concurrency``
   closed-loop streams. ``no LoRA``: an engine started without ``--enable-lora`` (the
   baseline a user has today), measured first, alone; then one engine with LoRA on and
   ``--max-loras`` 32 holding 32 adapters, with the requests naming the base (``base``)
   or spread round-robin over 1, 8 or 32 adapters, the cases taking turns round after
   round. Tokens/s and p50 per case (medians over rounds), ratios against ``no LoRA`` and
   ``base``.
2. **swap**: the real ``rtrl-capture`` with ``--adapters`` in front of the LoRA engine, one
   organisation's users sending requests throughout (``--concurrency`` streams). The table
   is changed ``--swaps`` times to an adapter not yet in the engine (what "published" to
   "serving a share of the org's traffic" takes: download, checks, load, swap), and once to
   a promotion of a loaded one; seconds from the file change to the table in effect, and
   every request that failed (an error or a status other than 200) over the whole run.

Goals (issue 34): published to serving < 10 s on the tiny model; 0 failed requests.

    .venv/bin/python bench/adapters.py [--rounds 3] [--concurrency 16] [--tokens 32] [--json]
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
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.capture import _wait

from rtrl.core.api.adapter import base_digest
from rtrl.core.store import open_store
from rtrl_localkube import tinymodel
from rtrl_localkube.engine import Engine, EngineSpec
from rtrl_localkube.processes import free_port

BIN = Path(sys.executable).parent
PROMPT = [256, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]
ADAPTED = (1, 8, 32)


def make_adapters(base: Path, root: Path, count: int, rank: int) -> list[str]:
    """``count`` adapters committed under ``root`` (``a0``, ``a1``, ...): their URIs."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    manifest = open_store(base.as_uri() + "/").committed("")
    assert manifest is not None
    digest = base_digest({n: str(e["sha256"]) for n, e in manifest.files.items()})
    uris = []
    for i in range(count):
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear",
                            lora_dropout=0.0, task_type="CAUSAL_LM")  # fmt: skip
        adapted = get_peft_model(model, config)
        torch.manual_seed(i)
        with torch.no_grad():
            for name, p in adapted.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.05)
        out = root / f"a{i}"
        adapted.save_pretrained(out)
        (out / "README.md").unlink(missing_ok=True)
        files = {p.name: p for p in out.iterdir() if p.is_file()}
        store = open_store(out.as_uri() + "/")
        store.commit("", files, {"kind": "adapter", "base": base.as_uri() + "/",
                                 "baseDigest": digest})  # fmt: skip
        uris.append(out.as_uri() + "/")
    return uris


async def _closed_loop(
    url: str, models: list[str], requests: int, streams: int, tokens: int
) -> tuple[list[float], float, int]:
    """(latency of each request, wall seconds, failures) of ``requests`` requests from
    ``streams`` streams, request i naming ``models[i % len(models)]``."""
    latencies: list[float] = []
    failures = 0
    queue = iter(range(requests))

    async def stream(session: aiohttp.ClientSession) -> None:
        nonlocal failures
        for i in queue:
            body = {"model": models[i % len(models)], "prompt": PROMPT, "max_tokens": tokens,
                    "temperature": 1.0, "ignore_eos": True}  # fmt: skip
            t0 = time.perf_counter()
            async with session.post(f"{url}/v1/completions", json=body) as resp:
                await resp.read()
                failures += resp.status != 200
            latencies.append(time.perf_counter() - t0)

    start = time.perf_counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        await asyncio.gather(*(stream(session) for _ in range(streams)))
    return latencies, time.perf_counter() - start, failures


def _case(url: str, models: list[str], args: argparse.Namespace) -> dict[str, float]:
    lat, wall, failed = asyncio.run(
        _closed_loop(url, models, args.requests, args.concurrency, args.tokens)
    )
    assert failed == 0, f"{failed} requests failed"
    return {"tps": args.requests * args.tokens / wall, "p50_ms": 1000 * statistics.median(lat)}


def _post(url: str, path: str, doc: dict[str, Any]) -> None:
    request = urllib.request.Request(url + path, data=json.dumps(doc).encode(),
                                     headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(request, timeout=120) as resp:
        assert resp.status == 200


def engine_cases(base: Path, uris: list[str], work: Path, args: argparse.Namespace) -> dict:
    """Throughput without LoRA, then with LoRA on: the base, and 1, 8, 32 adapters."""
    spec = EngineSpec(model=str(base), served_model_name="tiny")
    with Engine(spec, work / "engine-nolora.log") as engine:
        _case(engine.root_url, ["tiny"], args)  # warm-up
        plain = [_case(engine.root_url, ["tiny"], args) for _ in range(args.rounds)]
    lora_spec = EngineSpec(model=str(base), served_model_name="tiny",
                           max_lora_rank=args.rank, max_loras=max(ADAPTED))  # fmt: skip
    engine = Engine(lora_spec, work / "engine-lora.log").start()
    for i, uri in enumerate(uris[: max(ADAPTED)]):
        _post(engine.root_url, "/v1/load_lora_adapter",
              {"lora_name": f"a{i}", "lora_path": uri.removeprefix("file://")})  # fmt: skip
    cases = {"base": ["tiny"], **{f"{n} adapters": [f"a{i}" for i in range(n)] for n in ADAPTED}}
    for models in cases.values():
        _case(engine.root_url, models, args)  # warm-up: every adapter in use once
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, models in cases.items():
            runs[name].append(_case(engine.root_url, models, args))
    out: dict[str, Any] = {"engine": engine, "cases": {}}
    med = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
           for name, rs in {"no LoRA": plain, **runs}.items()}  # fmt: skip
    for name, m in med.items():
        out["cases"][name] = {**m, "tps_vs_no_lora": m["tps"] / med["no LoRA"]["tps"],
                              "tps_vs_base": m["tps"] / med["base"]["tps"]}  # fmt: skip
    return out


def swaps(
    engine: Engine, base: Path, uris: list[str], work: Path, args: argparse.Namespace
) -> dict:
    """Table changes through the real sidecar under load: seconds to apply, failures."""
    table = work / "adapters.json"

    def write(name: str, uri: str) -> None:
        doc = {"orgs": {"acme": {"stable": {"name": name, "checkpoint": name, "uri": uri}}}}
        staged = table.with_suffix(".next")
        staged.write_text(json.dumps(doc))
        os.replace(staged, table)

    fresh = uris[max(ADAPTED) :]  # never loaded into the engine yet
    write("s0", fresh[0])
    port = free_port()
    argv = [str(BIN / "rtrl-capture"), "--listen", f"127.0.0.1:{port}",
            "--engine", engine.root_url, "--events", (work / "events").as_uri() + "/",
            "--spool", str(work / "spool"), "--adapters", str(table),
            "--adapter-dir", str(work / "adapter-dir")]  # fmt: skip
    env = {**os.environ, "RTRL_MODEL_URI": base.as_uri() + "/", "RTRL_CHECKPOINT_ID": "base"}
    with (work / "capture.log").open("wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        _wait(f"{url}/readyz", 120, proc)
        stop, counts = threading.Event(), {"sent": 0, "failed": 0}

        def load(worker: int) -> None:
            i = 0
            while not stop.is_set():
                request = urllib.request.Request(
                    f"{url}/v1/completions",
                    data=json.dumps({"model": "tiny", "prompt": PROMPT,
                                     "max_tokens": args.tokens}).encode(),
                    headers={"Content-Type": "application/json", "X-Rtrl-Org": "acme",
                             "X-Rtrl-User": f"u{worker}-{i % 5}"},
                )  # fmt: skip
                try:
                    with urllib.request.urlopen(request, timeout=120) as resp:
                        resp.read()
                        counts["failed"] += resp.status != 200
                except Exception:
                    counts["failed"] += 1
                counts["sent"] += 1
                i += 1

        threads = [threading.Thread(target=load, args=(w,)) for w in range(args.concurrency)]
        for t in threads:
            t.start()
        seconds: list[float] = []
        steps = [(f"s{k}", fresh[k]) for k in range(1, args.swaps + 1)] + [("s0", fresh[0])]
        for name, uri in steps:
            time.sleep(1.0)
            before = _metric(url, "rtrl_capture_adapter_tables_total", 'result="applied"')
            t0 = time.monotonic()
            write(name, uri)
            while _metric(url, "rtrl_capture_adapter_tables_total", 'result="applied"') == before:
                time.sleep(0.02)
            seconds.append(time.monotonic() - t0)
        time.sleep(1.0)
        stop.set()
        for t in threads:
            t.join(120)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    return {"new_adapter_s": seconds[:-1], "promotion_s": seconds[-1], **counts}


def _metric(url: str, name: str, labels: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(f"{name}{{{labels}}} "):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=64, help="requests per case and round")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--swaps", type=int, default=3, help="changes to a new adapter")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rtrl-bench-adapters-") as tmp:
        work = Path(tmp)
        base = work / "tiny"
        tinymodel.publish(base.as_uri() + "/")
        uris = make_adapters(base, work / "adapters", max(ADAPTED) + args.swaps + 1, args.rank)
        result = engine_cases(base, uris, work, args)
        engine = result.pop("engine")
        try:
            result["swap"] = swaps(engine, base, uris, work, args)
        finally:
            engine.stop()
    result["settings"] = {k: v for k, v in vars(args).items() if k != "json"}
    result["loadavg_1m"] = os.getloadavg()[0]
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{args.concurrency} streams, {args.tokens} tokens, rank {args.rank}, "
          f"{args.rounds} rounds of {args.requests} requests")  # fmt: skip
    for name, m in result["cases"].items():
        print(
            f"  {name:<12} {m['tps']:>7.0f} tokens/s  p50 {m['p50_ms']:>6.1f} ms  "
            f"x{m['tps_vs_no_lora']:.3f} of no LoRA, x{m['tps_vs_base']:.3f} of base"
        )
    s = result["swap"]
    new = ", ".join(f"{x:.2f}" for x in s["new_adapter_s"])
    print(
        f"  swap: a new adapter in effect after {new} s; a promotion after "
        f"{s['promotion_s']:.2f} s; {s['failed']} of {s['sent']} requests failed"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
