"""One serving tick of ``rtrl demo`` through the inlet, next to the same tick sampled
in-process as the demo did before the inlet, side by side in one run.

The same visits (``--users`` users for ``--minutes`` simulated minutes, one arm) are served
``--repeats`` times each way, interleaved so that both see the same machine load:

- **in-process** (the baseline: the demo's old path): the model samples every prompt in
  batches in this process (:func:`rtrl_demo.engine.sample`) and the sim judges each answer;
  nothing crosses a socket and nothing is made durable;
- **inlet** (today's path): each visit is a ``POST /v1/completions`` through a real
  ``rtrl-capture`` sidecar to the demo's model server (dynamic batching), the users' feedback
  is POSTed to a real ``rtrl-feedback``, and the tick ends when the sidecar has shipped
  every event to the events store (``file://``).

The arm and the feedback service are started once, before the timed runs, as the demo's
fleet keeps them up across ticks. Reported: seconds per tick each way, visits per second,
and the inlet's time over the baseline's.

    .venv/bin/python bench/demo_tick.py [--users 2000] [--minutes 20] [--repeats 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "2")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--users", type=int, default=2000)
    parser.add_argument("--minutes", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--pretrain-steps", type=int, default=50)
    parser.add_argument(
        "--concurrency", type=int, nargs="+", help="the users' requests in flight (each a path)"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from rtrl_demo import sim
    from rtrl_demo.engine import Row, sample
    from rtrl_demo.inlet import Inlet
    from rtrl_demo.scenario import T0
    from rtrl_demo.serve import _load, build_base
    from rtrl_demo.users import CONCURRENCY, Visit, interact

    levels = args.concurrency or [CONCURRENCY]

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        base = (root / "models" / "demo-0").as_uri() + "/"
        build_base(base, 0, args.pretrain_steps)
        model = _load(base, root)
        rng = random.Random(0)
        visits = []
        for user in sim.make_users(args.users, 0):
            for _ in range(
                sum(rng.random() < user.rate * args.minutes / 60 / 20 for _ in range(20))
            ):
                created = T0 + timedelta(minutes=rng.uniform(0, args.minutes))
                visits.append(Visit(user, sim.make_task(rng), created, 0, rng.randrange(2**62)))

        def in_process() -> None:
            rows = [Row(list(v.task.prompt), sim.MAX_NEW_TOKENS, False, v.seed) for v in visits]
            sample(model, rows)
            for v, row in zip(visits, rows, strict=True):
                sim.judge(v.task, v.user, row.tokens, random.Random(f"judge:{v.seed}"))

        events = (root / "events").as_uri() + "/"
        inlet = Inlet(root / "work", os.environ)
        try:
            feedback, token = inlet.feedback_service(events)
            env = {"RTRL_CAPTURE_EVENTS": events, "RTRL_CHECKPOINT_ID": "demo-0",
                   "RTRL_MODEL_URI": base, "RTRL_ARM": "stable"}  # fmt: skip
            arm = inlet.arm("demo-0", base, "stable", env, lambda _: model)

            def through_inlet(concurrency: int) -> Callable[[], None]:
                def run() -> None:
                    interact(visits, [(arm.url, arm.name)], feedback, token,
                             concurrency=concurrency)  # fmt: skip
                    inlet.drain()

                return run

            paths = [("in_process", in_process)]
            paths += [(f"inlet c{c}" if len(levels) > 1 else "inlet", through_inlet(c))
                      for c in levels]  # fmt: skip
            times: dict[str, list[float]] = {name: [] for name, _ in paths}
            for _ in range(args.repeats):
                for name, run in paths:
                    started = time.perf_counter()
                    run()
                    times[name].append(time.perf_counter() - started)
        finally:
            inlet.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "visits": len(visits),
        "seconds": times,
        "median_seconds": med,
        "visits_per_second": {k: len(visits) / v for k, v in med.items()},
        "over_in_process": {k: v / med["in_process"] for k, v in med.items()},
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"{len(visits)} visits per tick ({args.users} users, {args.minutes} min)")
        for k, runs in times.items():
            print(f"  {k:<11} {med[k]:7.2f} s/tick  {len(visits) / med[k]:8.0f} visits/s  "
                  f"{med[k] / med['in_process']:4.1f}x in-process  "
                  f"(runs: {', '.join(f'{t:.2f}' for t in runs)})")  # fmt: skip
        print(f"  load average {result['load_average'][0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
