"""What the stage's fidelity gate costs: ``rtrl-job stage`` on the same shards with the gate
on and off, side by side in one run (and, given ``--baseline-job``, the stage of another
checkout, e.g. the one before the sampling columns existed, with no gate).

The shards are bench/stage.py's synthetic interactions (1M by default, ~100 completion and
100-300 prompt tokens each, over three hourly partitions); the serving checkpoint is a
tiny GPT-2 (2 layers, width 64) with the shards' 32,000-token vocabulary, published as
``--parent``. Its log-probs are not the shards' (they are synthetic), so the gate's bounds
are opened wide in the config file: every partition passes, and pass 1 does the same work
in both runs. What differs is the gate itself: listing the partitions, reading the sample
(``sampleRows`` per partition, a few pages per file), importing torch and transformers,
loading the model, one forward pass per sampled row. Each stage runs in a fresh process,
best of ``--repeat``.

    .venv/bin/python bench/stage_fidelity.py [--rows 1000000] [--sample-rows 32]
        [--baseline-job /path/to/other/.venv/bin/rtrl-job] [--json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import stage as stage_bench

from rtrl.core.api.rlcycle import FidelitySpec

GATE_OPEN = """data:
  fidelity:
    sampleRows: {rows}
    maxMeanAbsDelta: 100
    maxUnsupportedFraction: 1
"""


def _parent(directory: Path) -> str:
    """A tiny GPT-2 over the synthetic shards' vocabulary, saved as a checkpoint."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=32_000, n_positions=512,
                        bos_token_id=1, eos_token_id=2)  # fmt: skip
    GPT2LMHeadModel(config).save_pretrained(directory)
    return directory.as_uri() + "/"


def _stage(job: str, root: Path, work: Path, extra: list[str]) -> dict[str, Any]:
    out = work / "staged"
    command = [
        job, "stage", "--shards", root.as_uri() + "/", "--checkpoint", stage_bench.CHECKPOINT,
        "--out", out.as_uri() + "/", "--now", stage_bench.NOW, "--min-interactions", "1",
        "--work-dir", str(work), *extra,
    ]  # fmt: skip
    done, seconds, rss = stage_bench._run_child(command)
    if done.returncode:
        raise SystemExit(f"stage failed ({done.returncode}): {done.stderr[-2000:]}")
    doc = json.loads((out / "stage.json").read_text())
    shutil.rmtree(out)
    return {
        "seconds": seconds,
        "peak_rss_bytes": rss,
        "rows_read": doc["rows_read"],
        "interactions_used": doc["interactions_used"],
        "timing": doc["timing"],
        "fidelity": doc.get("fidelity"),
    }


def _best(runs: list[dict[str, Any]]) -> dict[str, Any]:
    best = min(runs, key=lambda r: float(r["seconds"]))
    return {**best, "peak_rss_bytes": max(int(r["peak_rss_bytes"]) for r in runs)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--sample-rows", type=int, default=FidelitySpec().sample_rows)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--baseline-job", help="another checkout's rtrl-job (run without a gate)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    job = stage_bench._rtrl_job()
    with tempfile.TemporaryDirectory(prefix="rtrl-bench-fidelity-") as tmp:
        work = Path(tmp)
        root = work / "shards"
        dataset = stage_bench._write(root, args.rows, seed=0)
        parent = _parent(work / "parent")
        config = work / "gate.yaml"
        config.write_text(GATE_OPEN.format(rows=args.sample_rows))
        on = ["--parent", parent, "--config", str(config)]
        off = ["--parent", parent, "--fidelity-sample-rows", "0"]
        results: dict[str, Any] = {"dataset": dataset, "sample_rows": args.sample_rows}
        runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": [], "baseline": []}
        for _ in range(args.repeat):  # interleaved: the machine's load falls on both alike
            runs["off"].append(_stage(job, root, work, off))
            runs["on"].append(_stage(job, root, work, on))
            if args.baseline_job:
                runs["baseline"].append(_stage(args.baseline_job, root, work, []))
        for name, measured in runs.items():
            if measured:
                results[name] = _best(measured)
    gate = results["on"]["fidelity"]
    assert gate["checked"] and gate["partitions_quarantined"] == 0, gate
    results["ratio_on_over_off"] = results["on"]["seconds"] / results["off"]["seconds"]
    if "baseline" in results:
        results["ratio_off_over_baseline"] = (
            results["off"]["seconds"] / results["baseline"]["seconds"]
        )
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    data = results["dataset"]
    print(f"shards: {data['rows']:,} interactions in {data['files']} files; gate: "
          f"{gate['partitions']} partitions, {gate['overall']['rows']} rows, "
          f"{gate['overall']['tokens']:,} tokens recomputed")  # fmt: skip
    for name, label in (("baseline", "stage of --baseline-job (no gate)"),
                        ("off", "stage, gate off"), ("on", "stage, gate on")):  # fmt: skip
        if name in results:
            r = results[name]
            print(f"  {label:34} {r['seconds']:6.2f} s  pass 1 {r['timing']['select_seconds']:5.2f}"
                  f" s  peak RSS {r['peak_rss_bytes'] / 1e6:5.0f} MB")  # fmt: skip
    print(f"gate's own time (stage.json fidelity.seconds): {gate['seconds']:.2f} s")
    print(f"ratio gate on / off: {results['ratio_on_over_off']:.2f}x")
    if "ratio_off_over_baseline" in results:
        print(f"ratio gate off / baseline: {results['ratio_off_over_baseline']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
