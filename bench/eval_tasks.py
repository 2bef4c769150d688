"""The tasks suite's sandbox overhead: tasks evaluated per second through the sandbox,
against the same tests run without it, side by side in one run.

Every task's known-correct solution runs against its unit tests:

  (a) in_process: ``exec`` of the program and the tests in a fresh namespace, in this
      process, one thread: no isolation at all, the cost of the tests alone. The issue's
      baseline: the goal is (s) within 1.5x of (a).
  (b) plain_process: one fresh ``python -I -S -B`` per task with the same files, no limits
      and no namespaces (what the sandbox cost before the fork server).
  (s) sandbox: :func:`rtrl_trainer.tasks.run_all` with one worker, as the eval step calls
      it: a sandbox server started for the call, then one forked, fully isolated process
      per task, one task at a time. The server's start is included.
  (w) sandbox_warm: the same tasks through an already started server (the per-task cost
      alone, i.e. (s) on a suite large enough to hide the start).
  (p) sandbox_parallel: ``run_all`` with ``--workers`` servers at once (what the eval step
      runs, ``taskWorkers``); against (a) this compares several cores with one.
  (q) sandbox_parallel_warm: (p) through already started servers.

Also measured, for the floor under any process-per-task sandbox: ``fork()`` + ``_exit(0)`` +
``waitpid`` from a bare ``python -I -S`` (no work in the child at all). The ratios printed
are sequential (s)/(a), (w)/(a), and (p)/(a) labelled with its workers.

    .venv/bin/python bench/eval_tasks.py [--repeat 5] [--workers 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rtrl_trainer import tasks
from rtrl_trainer.sandbox import Sandbox, pool, probe

_FORK_FLOOR = """
import os, time
n = 2000
for _ in range(200):
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
best = float("inf")
for _ in range(3):
    start = time.perf_counter()
    for _ in range(n):
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
    best = min(best, (time.perf_counter() - start) / n)
print(best)
"""


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


def _fork_floor_seconds() -> float:
    done = subprocess.run(
        [sys.executable, "-I", "-S", "-B", "-c", _FORK_FLOOR],
        capture_output=True,
        text=True,
        check=True,
    )
    return float(done.stdout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5, help="passes over the suite (best kept)")
    parser.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1))
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    args = parser.parse_args(argv)

    suite = tasks.load_suite()
    solutions = [t.solution for t in suite.tasks]
    n = len(suite.tasks)
    best: dict[str, float] = {}

    def measure(name: str, run: Callable[[], bool]) -> None:
        for _ in range(args.repeat):
            start = time.perf_counter()
            ok = run()
            seconds = time.perf_counter() - start
            if not ok:
                raise SystemExit(f"{name}: a known-correct solution failed")
            best[name] = min(best.get(name, float("inf")), seconds)

    measure("in_process", lambda: all(tasks.run_in_process(t, t.solution) for t in suite.tasks))
    measure("plain_process", lambda: all(_plain_process(t) for t in suite.tasks))
    measure("sandbox", lambda: all(r.passed for r in tasks.run_all(suite.tasks, solutions)))
    with Sandbox() as box:
        tasks.run_task(suite.tasks[0], solutions[0], sandbox=box)  # started, first fork done
        measure(
            "sandbox_warm",
            lambda: all(tasks.run_task(t, t.solution, sandbox=box).passed for t in suite.tasks),
        )
    measure(
        "sandbox_parallel",
        lambda: all(r.passed for r in tasks.run_all(suite.tasks, solutions, workers=args.workers)),
    )
    with pool(args.workers) as boxes, ThreadPoolExecutor(args.workers) as executor:

        def one(task: tasks.Task) -> bool:
            box = boxes.get()
            try:
                return tasks.run_task(task, task.solution, sandbox=box).passed
            finally:
                boxes.put(box)

        all(executor.map(one, suite.tasks))
        measure("sandbox_parallel_warm", lambda: all(executor.map(one, suite.tasks)))
    floor = _fork_floor_seconds()
    rates = {k: n / v for k, v in best.items()}
    per_task_us = {k: v / n * 1e6 for k, v in best.items()}
    isolation = probe()
    ratio = best["sandbox"] / best["in_process"]
    doc = {
        "tasks": n,
        "suite_version": suite.version,
        "workers": args.workers,
        "cpus": os.cpu_count(),
        "tasks_per_second": {k: round(v, 1) for k, v in rates.items()},
        "microseconds_per_task": {k: round(v, 1) for k, v in per_task_us.items()},
        "fork_exit_wait_floor_us": round(floor * 1e6, 1),
        "overhead_vs_in_process": round(ratio, 1),
        "overhead_warm_vs_in_process": round(best["sandbox_warm"] / best["in_process"], 1),
        "overhead_parallel_vs_in_process": round(best["sandbox_parallel"] / best["in_process"], 1),
        "overhead_parallel_warm_vs_in_process": round(
            best["sandbox_parallel_warm"] / best["in_process"], 1
        ),
        "speedup_vs_plain_process": round(best["plain_process"] / best["sandbox"], 1),
        "isolation": vars(isolation),
        "goal": "sandbox (sequential, server start included) / in-process (one thread) < 1.5",
        "goal_met": ratio < 1.5,
    }
    if args.json:
        print(json.dumps(doc))
    else:
        print(f"{n} tasks (suite {suite.version}), best of {args.repeat}; {os.cpu_count()} CPUs")
        print(f"isolation: {isolation}")
        for name, rate in rates.items():
            parallel = name.startswith("sandbox_parallel")
            label = f"{name} ({args.workers} workers)" if parallel else name
            print(f"  {label:36s} {rate:9.1f} tasks/s {per_task_us[name]:9.1f} us/task")
        print(f"  floor: fork+_exit+waitpid of a bare python: {floor * 1e6:.0f} us")
        print(
            f"  sandbox / in-process (sequential, the goal): {doc['overhead_vs_in_process']}x"
            " (goal < 1.5x)"
        )
        print(
            f"  sandbox warm / in-process (sequential):       {doc['overhead_warm_vs_in_process']}x"
        )
        print(
            f"  sandbox {args.workers} workers / in-process 1 thread:"
            f"      {doc['overhead_parallel_vs_in_process']}x"
        )
        print(
            f"  sandbox {args.workers} workers warm / in-process 1 thread:"
            f" {doc['overhead_parallel_warm_vs_in_process']}x"
        )
        print(f"  plain process / sandbox (speedup):            {doc['speedup_vs_plain_process']}x")
    return 0 if doc["goal_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
