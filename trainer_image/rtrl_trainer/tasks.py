"""The ``tasks`` eval suite: small executable Python tasks written for rtrl.

A suite file is JSON Lines: a header ``{"format": "rtrl-eval-tasks", "version": ...}`` and
one task per line (``task_id``, ``prompt`` — a signature and docstring —, ``entry_point``,
``tests`` — Python asserting on ``candidate`` —, and ``solution``, a known-correct body
used to test the harness and by the benchmark). The candidate completes each prompt; the
program ``prompt + completion`` runs against the task's tests in the sandbox
(:mod:`rtrl_trainer.sandbox`). A task passes when the test process exits 0.

The suite is versioned and shipped in the package (``eval_tasks/<version>/tasks.jsonl``);
eval.json records its version and sha256, so results are only compared across cycles
that ran the same suite.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rtrl_trainer.sandbox import Limits, Result, Sandbox, map_in_pool, run_python

SUITE_FORMAT = "rtrl-eval-tasks"
DEFAULT_SUITE = Path(__file__).parent / "eval_tasks" / "v1" / "tasks.jsonl"
_FIELDS = ("task_id", "prompt", "entry_point", "tests", "solution")


class SuiteError(ValueError):
    """The suite file is missing or malformed; the message names the file and line."""


@dataclass(frozen=True)
class Task:
    task_id: str
    prompt: str
    entry_point: str
    tests: str
    solution: str


@dataclass(frozen=True)
class Suite:
    path: Path
    version: str
    sha256: str
    tasks: tuple[Task, ...]


def load_suite(path: Path = DEFAULT_SUITE, *, limit: int | None = None) -> Suite:
    """Read and check a suite file; ``limit`` keeps its first tasks (for quick runs)."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise SuiteError(f"task suite {path}: cannot read: {exc.strerror}") from None
    lines = data.decode("utf-8", "replace").splitlines()
    if not lines:
        raise SuiteError(f"task suite {path}: empty")
    try:
        header = json.loads(lines[0])
    except json.JSONDecodeError as exc:
        raise SuiteError(f"task suite {path}:1: not JSON: {exc.msg}") from None
    if not isinstance(header, dict) or header.get("format") != SUITE_FORMAT:
        raise SuiteError(f"task suite {path}:1: expected a header with format {SUITE_FORMAT!r}")
    version = header.get("version")
    if not isinstance(version, str) or not version:
        raise SuiteError(f"task suite {path}:1: header has no version")
    tasks: list[Task] = []
    seen: set[str] = set()
    for number, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        try:
            doc = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SuiteError(f"task suite {path}:{number}: not JSON: {exc.msg}") from None
        if not isinstance(doc, dict):
            raise SuiteError(f"task suite {path}:{number}: expected an object")
        for name in _FIELDS:
            if not isinstance(doc.get(name), str) or not doc[name]:
                raise SuiteError(f"task suite {path}:{number}: {name}: missing or not a string")
        if doc["task_id"] in seen:
            raise SuiteError(f"task suite {path}:{number}: duplicate task_id {doc['task_id']!r}")
        if not doc["entry_point"].isidentifier():
            raise SuiteError(f"task suite {path}:{number}: entry_point is not an identifier")
        seen.add(doc["task_id"])
        tasks.append(Task(*(doc[name] for name in _FIELDS)))
    if not tasks:
        raise SuiteError(f"task suite {path}: no tasks")
    if limit is not None:
        tasks = tasks[:limit]
    return Suite(path, version, hashlib.sha256(data).hexdigest(), tuple(tasks))


def test_program(task: Task) -> str:
    """The test driver run next to ``solution.py`` (isolated mode leaves the script's
    directory off ``sys.path``, so the driver puts the work dir there itself)."""
    return (
        "import sys\nsys.path.insert(0, '.')\n"
        f"from solution import {task.entry_point} as candidate\n\n{task.tests}\n"
    )


def run_task(
    task: Task, completion: str, limits: Limits | None = None, *, sandbox: Sandbox | None = None
) -> Result:
    """Run ``prompt + completion`` against the task's tests in the sandbox (``sandbox``, or
    a sandbox server started for this one run)."""
    files = {"solution.py": task.prompt + completion, "test_solution.py": test_program(task)}
    return run_python(files, "test_solution.py", limits=limits, sandbox=sandbox)


def run_in_process(task: Task, completion: str) -> bool:
    """The same tests, unsandboxed, in this process (the benchmark's baseline only: never
    use on untrusted code)."""
    namespace: dict[str, Any] = {"__name__": "solution"}
    try:
        exec(compile(task.prompt + completion, "solution.py", "exec"), namespace)
        exec(compile(task.tests, "tests.py", "exec"), {"candidate": namespace[task.entry_point]})
    except Exception:
        return False
    return True


def run_all(
    tasks: Sequence[Task],
    completions: Sequence[str],
    *,
    limits: Limits | None = None,
    workers: int = 1,
    runner: Callable[[Task, str, Limits | None], Result] = run_task,
) -> list[Result]:
    """Run every task (``workers`` sandboxes at a time), results in task order.

    With the default runner, ``workers`` sandbox servers are started once for the whole
    call and every task is a fresh process forked from one of them."""
    pairs = list(zip(tasks, completions, strict=True))
    if runner is run_task:
        return map_in_pool(
            max(1, workers), pairs, lambda box, tc: run_task(tc[0], tc[1], limits, sandbox=box)
        )
    if workers <= 1:
        return [runner(t, c, limits) for t, c in zip(tasks, completions, strict=True)]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(
            pool.map(lambda tc: runner(tc[0], tc[1], limits), zip(tasks, completions, strict=True))
        )


def extract_body(completion: str) -> str:
    """The function body of a completion: generation stops at the first line that is not
    indented (a new top-level statement), as a code model continues past the function."""
    kept: list[str] = []
    for line in completion.splitlines(keepends=True):
        if line.strip() and not line.startswith((" ", "\t")):
            break
        kept.append(line)
    return "".join(kept)
