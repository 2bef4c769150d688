"""The sandbox that runs model-written code, and the task suites' harness: known-correct and
known-wrong solutions (the rtrl tasks and HumanEval's 164), the grader's verdicts, limits
(loop, sleep, memory, output), and the fork server's life (a task cannot affect the next;
the server survives its tasks, and is restarted when it dies). The attacks written to game
or escape the suites are in test_eval_attacks.py."""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import pytest

from rtrl_trainer.evaluate import grader, plain_values, sandbox
from rtrl_trainer.evaluate import suite as tasks
from rtrl_trainer.evaluate.sandbox import run_python
from rtrl_trainer.evaluate.sandbox_types import Limits

FAST = Limits(wall_seconds=5, cpu_seconds=2, memory_bytes=256 << 20, output_bytes=16 << 10)


def _task(
    tests_src: str = "assert candidate(2) == 4\n", solution: str = "    return 2 * x\n"
) -> tasks.Task:
    return tasks.Task("t/0", "def double(x):\n", "double", tests_src, solution)


@pytest.mark.parametrize("name", [tasks.TASKS, tasks.HUMANEVAL])
def test_every_canonical_solution_passes_and_a_wrong_one_passes_nothing(name: str) -> None:
    """HumanEval's 164 canonical solutions score 164/164 through the sandbox and the
    grader, and ``return None`` scores 0; the same for the rtrl tasks."""
    suite = tasks.load(name)
    assert len(suite.tasks) == (164 if name == tasks.HUMANEVAL else 34)
    results = tasks.run_all(suite, [t.solution for t in suite.tasks], limits=FAST, workers=2)
    failed = {
        t.task_id: (r.status, r.details.get("reason"), r.stderr[-300:])
        for t, r in zip(suite.tasks, results, strict=True)
        if not r.passed
    }
    assert not failed
    wrong = tasks.run_all(suite, ["    return None\n"] * len(suite.tasks), limits=FAST, workers=2)
    assert sum(r.passed for r in wrong) == 0
    assert {r.status for r in wrong} == {"failed"}


def test_humaneval_solutions_of_other_tasks_fail() -> None:
    """A known-wrong answer that is real code: each task given its neighbour's solution."""
    suite = tasks.load_humaneval()
    shifted = [suite.tasks[(i + 1) % len(suite.tasks)].solution for i in range(len(suite.tasks))]
    results = tasks.run_all(suite, shifted, limits=FAST, workers=2)
    assert sum(r.passed for r in results) == 0


def test_correct_wrong_raising_and_broken_completions() -> None:
    assert tasks.run_task(_task(), "    return 2 * x\n", FAST).status == "ok"
    wrong = tasks.run_task(_task(), "    return x + 1\n", FAST)
    assert wrong.status == "failed" and wrong.details["reason"] == "AssertionError"
    broken = tasks.run_task(_task(), "    return (\n", FAST)
    assert broken.status == "failed" and "SyntaxError" in broken.details["reason"]
    raising = tasks.run_task(_task(), "    raise KeyError('no')\n", FAST)
    assert raising.status == "failed" and "KeyError" in raising.details["reason"]


def test_a_test_that_expects_an_exception_sees_the_completions_exception() -> None:
    tests_src = (
        "try:\n    candidate(-1)\n    raise AssertionError('no error')\n"
        "except ValueError:\n    pass\n"
    )
    raising = "    if x < 0:\n        raise ValueError('negative')\n    return 2 * x\n"
    task = _task(tests_src, raising)
    assert tasks.run_task(task, raising, FAST).passed
    assert not tasks.run_task(task, "    return 2 * x\n", FAST).passed


def test_values_cross_as_plain_data_only() -> None:
    value = [1, -0.0, float("inf"), "s", b"\x00", (1, (2,)), {1: "a", (2, 3): [None]}, {4}]
    value.append(frozenset({5}))
    value.append(complex(1, -2))
    back = plain_values.loads(plain_values.dumps(value))
    assert back == value and [type(v) for v in back] == [type(v) for v in value]
    assert plain_values.loads(plain_values.dumps(float("nan"))) != 0  # nan, still a float

    class Sly(str):
        pass

    for bad in (Sly("x"), object(), [[[]]] * 1 + [_deep(100)]):
        with pytest.raises(plain_values.PlainValueError):
            plain_values.dumps(bad)
    for data in (b'{"x": 1}', b'{"t": 1}', b"[NaN]", b"not json", b'{"s": [[1]]}', b"1" * 5000):
        with pytest.raises(plain_values.PlainValueError):
            plain_values.loads(data)


def _deep(n: int) -> list[object]:
    value: list[object] = []
    for _ in range(n):
        value = [value]
    return value


def test_infinite_loop_is_killed() -> None:
    result = run_python("while True:\n    pass\n", limits=Limits(wall_seconds=3, cpu_seconds=1))
    assert result.status in ("cpu_limit", "timeout")
    assert result.seconds < 3.5
    task = tasks.run_task(_task(), "    while True:\n        pass\n", Limits(wall_seconds=2))
    assert task.status in ("cpu_limit", "timeout") and task.seconds < 2.5


def test_sleeping_forever_hits_the_wall_clock() -> None:
    result = run_python("import time\ntime.sleep(60)\n", limits=Limits(wall_seconds=1))
    assert result.status == "timeout" and result.seconds < 2
    task = tasks.run_task(_task(), "    import time\n    time.sleep(60)\n", Limits(wall_seconds=1))
    assert task.status == "timeout" and task.seconds < 2


def test_memory_bomb_hits_the_memory_limit() -> None:
    bomb = "x = []\nwhile True:\n    x.append(bytearray(64 << 20))\n"
    result = run_python(bomb, limits=FAST)
    assert result.status == "memory_limit", result.stderr[-300:]
    task = tasks.run_task(_task(), "    return bytearray(1 << 30)\n", FAST)
    assert task.status == "memory_limit", task.details


def test_huge_output_is_capped() -> None:
    result = run_python("print('x' * 10_000_000)\n", limits=FAST)
    assert result.truncated and len(result.stdout) <= FAST.output_bytes
    assert result.status == "output_limit"


def test_a_huge_reply_fails_the_task_not_the_evaluator() -> None:
    task = tasks.run_task(_task(), "    return 'x' * (40 << 20)\n", Limits(memory_bytes=1 << 30))
    assert not task.passed


def test_environment_is_empty() -> None:
    os.environ["RTRL_SECRET_FOR_TEST"] = "leak"
    try:
        result = run_python("import os, json\nprint(json.dumps(dict(os.environ)))\n", limits=FAST)
    finally:
        del os.environ["RTRL_SECRET_FOR_TEST"]
    env = json.loads(result.stdout)
    assert "RTRL_SECRET_FOR_TEST" not in env and set(env) <= {"HOME", "TMPDIR", "LANG"}


def test_broken_suite_files_are_reported(tmp_path: Path) -> None:
    path = tmp_path / "tasks.jsonl"
    path.write_text('{"format": "rtrl-eval-tasks", "version": "x"}\n{"task_id": "a"\n')
    with pytest.raises(tasks.SuiteError, match=r"tasks.jsonl:2: not JSON"):
        tasks.load_suite(path)
    path.write_text('{"format": "rtrl-eval-tasks", "version": "x"}\n{"task_id": "a"}\n')
    with pytest.raises(tasks.SuiteError, match=r":2: prompt: missing"):
        tasks.load_suite(path)
    with pytest.raises(tasks.SuiteError, match="cannot read"):
        tasks.load_suite(tmp_path / "absent.jsonl")
    with pytest.raises(tasks.SuiteError, match="cannot read"):
        tasks.load_humaneval(path)
    with pytest.raises(tasks.SuiteError, match="unknown task suite 'mbpp'"):
        tasks.load("mbpp")


def test_samples_files_are_checked(tmp_path: Path) -> None:
    suite = tasks.load_humaneval()
    path = tmp_path / "samples.jsonl"
    path.write_text('{"task_id": "HumanEval/0", "completion": "    return 1\\n"}\n\n')
    assert tasks.load_samples(path, suite)[0].line == 1
    for text, problem in [
        ('{"task_id": "HumanEval/0"}\n', r":1: completion: missing"),
        ('{"task_id": "nope", "completion": ""}\n', r":1: task_id 'nope' is not in"),
        ("[1]\n", r":1: expected an object"),
        ("{\n", r":1: not JSON"),
        ("\n", "no samples"),
    ]:
        path.write_text(text)
        with pytest.raises(tasks.SuiteError, match=problem):
            tasks.load_samples(path, suite)


def test_extract_body_stops_at_the_next_top_level_statement() -> None:
    assert tasks.extract_body("    return 1\n\nprint('x')\n    y\n") == "    return 1\n\n"


# --- the fork server: one sandbox server, a fresh process per task ---------------------------


def test_a_task_cannot_affect_the_next_one() -> None:
    """Each task is a fresh process: monkeypatching builtins or the import system changes
    nothing for the next, and a task can leave no process and no file behind."""
    poison = (
        "import builtins, os, sys\n"
        "builtins.len = lambda x: 0\n"
        "sys.modules['json'] = None\n"
        "try:\n"
        "    os.fork()\n"
        "except OSError:\n"
        "    print('no fork')\n"
    )
    check = "import json\nassert len('abc') == 3\nprint('clean')\n"
    with sandbox.Sandbox() as box:
        first = box.run(poison, limits=FAST)
        assert first.status == "ok" and first.stdout == "no fork\n", first.stderr
        result = box.run(check, limits=FAST)
        assert result.status == "ok" and result.stdout == "clean\n", result.stderr
        assert tasks.run_task(_task(), "    return x + 1\n", FAST, sandbox=box).status == "failed"
        assert tasks.run_task(_task(), "    return 2 * x\n", FAST, sandbox=box).passed


def test_the_server_survives_its_tasks_and_is_restarted_when_it_dies() -> None:
    with sandbox.Sandbox() as box:
        killer = "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n"
        result = box.run(killer, limits=FAST)
        assert result.status == "failed" and "PermissionError" in result.stderr
        crash = box.run("import os\nos.abort()\n", limits=FAST)
        assert crash.status == "killed" and crash.returncode < 0
        # The server dies while a program runs, then while a completion is served (killed
        # mid-task, so the outcome does not depend on when the death is noticed).
        _kill_soon(box)
        again = box.run("import time\ntime.sleep(3)\n", limits=FAST)
        assert again.status == "killed" and "died" in again.details["error"]
        assert box.run("print('ok')\n", limits=FAST).stdout == "ok\n"
        _kill_soon(box)
        slow = "    import time\n    time.sleep(3)\n    return 2 * x\n"
        assert tasks.run_task(_task(), slow, FAST, sandbox=box).status == "killed"
        assert tasks.run_task(_task(), "    return 2 * x\n", FAST, sandbox=box).passed


def _kill_soon(box: sandbox.Sandbox) -> None:
    threading.Timer(0.5, os.kill, (box.hello["pid"], signal.SIGKILL)).start()


def test_a_completion_that_exits_mid_test_fails_at_once() -> None:
    """No wall-clock wait for a reply that will never come: the server says the task
    exited."""
    result = tasks.run_task(_task(), "    import os\n    os._exit(0)\n", Limits(wall_seconds=30))
    assert result.status == "failed" and result.seconds < 5, result.details


def test_the_guarantees_match_what_the_task_sees() -> None:
    probe = (
        "import ctypes, os, resource\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "caps = (ctypes.c_uint32 * 6)()\n"
        "libc.capget((ctypes.c_uint32 * 2)(0x20080522, 0), caps)\n"
        "print(os.getuid(), libc.prctl(39, 0, 0, 0, 0), libc.prctl(3, 0, 0, 0, 0),"
        " resource.getrlimit(resource.RLIMIT_AS)[0], sum(caps))\n"
    )
    with sandbox.Sandbox() as box:
        result = box.run(probe, limits=FAST)
        uid, nnp, dumpable, address_space, capabilities = result.stdout.split()
        assert nnp == "1" and dumpable == "0" and int(address_space) == FAST.memory_bytes
        assert capabilities == "0"  # even where the server runs as root
        assert result.guarantees.missing() == [], result.guarantees.reasons
        assert (uid != "0") == (box.hello["uid"] is not None)


def test_pool_runs_tasks_in_parallel_in_order() -> None:
    suite = tasks.load_suite(limit=6)
    completions = [t.solution if i % 2 else "    return None\n" for i, t in enumerate(suite.tasks)]
    results = tasks.run_all(suite, completions, limits=FAST, workers=3)
    assert [r.passed for r in results] == [bool(i % 2) for i in range(6)]


def test_the_grader_records_the_calls_it_made() -> None:
    with sandbox.Sandbox() as box:
        result = grader.grade(
            box,
            prompt="def double(x):\n",
            completion="    return 2 * x\n",
            tests="for i in range(50):\n    assert candidate(i) == 2 * i\n",
            entry_point="double",
            solution="    return x + x\n",
            limits=FAST,
        )
    assert result.passed and result.details["calls"] == 50
