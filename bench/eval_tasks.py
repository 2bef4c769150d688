"""The tasks suite's sandbox overhead: tasks evaluated per second through the sandbox,
against the same tests run without it, side by side in one run.

Every task's known-correct solution runs against its unit tests:

  (a) in-process: ``exec`` of the program and the tests in a fresh namespace, in this
      process: no isolation at all, the cost of the tests alone;
  (b) plain process: one fresh ``python -I -S -B`` per task with the same files, no limits
      and no namespaces: the cheapest way to run untrusted code in a separate process, and
      the honest baseline for a sandbox (a crash, an infinite loop or ``os._exit`` in (a)
      takes the evaluator down with it);
  (s) sandbox: :func:`rtrl_trainer.tasks.run_task`, one process per task with rlimits,
      network and mount namespaces, read-only mounts, dropped capabilities, output caps;
  (p) sandbox with ``--workers`` sandboxes at a time (what the eval step runs).

Goal: (s) within 1.5x of (b). (s) against (a) is printed too; it is dominated by starting
an interpreter (~10 ms), which no process-based sandbox avoids.

    .venv/bin/python bench/eval_tasks.py [--repeat 3] [--workers 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rtrl_trainer import tasks
from rtrl_trainer.sandbox import probe


def _plain_process(task: tasks.Task) -> bool:
    with tempfile.TemporaryDirectory(prefix="rtrl-bench-") as tmp:
        work = Path(tmp)
        (work / "solution.py").write_text(task.prompt + task.solution)
        (work / "test_solution.py").write_text(tasks.test_program(task))
        done = subprocess.run(
            [sys.executable, "-I", "-S", "-B", "test_solution.py"],
            cwd=work,
            env={"HOME": tmp, "TMPDIR": tmp},
            capture_output=True,
            check=False,
        )
        return done.returncode == 0


def _rate(n: int, seconds: float) -> float:
    return n / seconds if seconds > 0 else float("inf")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3, help="passes over the suite (best kept)")
    parser.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1))
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    args = parser.parse_args(argv)

    suite = tasks.load_suite()
    solutions = [t.solution for t in suite.tasks]
    n = len(suite.tasks)
    best: dict[str, float] = {}

    def measure(name: str, run: object) -> None:
        for _ in range(args.repeat):
            start = time.perf_counter()
            ok = run()  # type: ignore[operator]
            seconds = time.perf_counter() - start
            if not ok:
                raise SystemExit(f"{name}: a known-correct solution failed")
            best[name] = min(best.get(name, float("inf")), seconds)

    measure("in_process", lambda: all(tasks.run_in_process(t, t.solution) for t in suite.tasks))
    measure("plain_process", lambda: all(_plain_process(t) for t in suite.tasks))
    measure("sandbox", lambda: all(r.passed for r in tasks.run_all(suite.tasks, solutions)))
    measure(
        "sandbox_parallel",
        lambda: all(r.passed for r in tasks.run_all(suite.tasks, solutions, workers=args.workers)),
    )
    rates = {k: _rate(n, v) for k, v in best.items()}
    isolation = probe()
    doc = {
        "tasks": n,
        "suite_version": suite.version,
        "workers": args.workers,
        "cpus": os.cpu_count(),
        "tasks_per_second": {k: round(v, 1) for k, v in rates.items()},
        "overhead_vs_plain_process": round(best["sandbox"] / best["plain_process"], 2),
        "overhead_vs_in_process": round(best["sandbox"] / best["in_process"], 1),
        "isolation": vars(isolation) if hasattr(isolation, "__dict__") else str(isolation),
        "goal_met": best["sandbox"] / best["plain_process"] < 1.5,
    }
    if args.json:
        print(json.dumps(doc))
    else:
        print(f"{n} tasks (suite {suite.version}), best of {args.repeat}; isolation: {isolation}")
        for name, rate in rates.items():
            print(f"  {name:17s} {rate:9.1f} tasks/s")
        print(f"  sandbox / plain process: {doc['overhead_vs_plain_process']}x (goal < 1.5x)")
        print(f"  sandbox / in-process:    {doc['overhead_vs_in_process']}x")
    return 0 if doc["goal_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
