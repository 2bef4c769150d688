"""The sandbox that runs model-written code, and the task suite's harness: known-correct
and known-wrong solutions, and code that tries to escape (infinite loop, memory bomb,
socket, writes outside its work dir, huge output)."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import pytest

from rtrl_trainer import sandbox, tasks
from rtrl_trainer.sandbox import Limits, run_python
from tests.conftest import REPO

ISOLATION = sandbox.probe()
FAST = Limits(wall_seconds=5, cpu_seconds=2, memory_bytes=256 << 20, output_bytes=16 << 10)


def _task(tests_src: str = "assert candidate(2) == 4\n") -> tasks.Task:
    return tasks.Task("t/0", "def double(x):\n", "double", tests_src, "    return 2 * x\n")


def test_the_shipped_suite_is_valid_and_every_solution_passes_in_the_sandbox() -> None:
    suite = tasks.load_suite()
    assert suite.version == "v1" and len(suite.tasks) >= 30
    results = tasks.run_all(suite.tasks, [t.solution for t in suite.tasks], limits=FAST, workers=2)
    failed = {
        t.task_id: r.stderr[-300:]
        for t, r in zip(suite.tasks, results, strict=True)
        if not r.passed
    }
    assert not failed
    assert all(tasks.run_in_process(t, t.solution) for t in suite.tasks)


def test_wrong_solutions_fail_every_task() -> None:
    suite = tasks.load_suite()
    results = tasks.run_all(
        suite.tasks, ["    return None\n"] * len(suite.tasks), limits=FAST, workers=2
    )
    assert [r.status for r in results] == ["failed"] * len(suite.tasks)


def test_correct_and_wrong_solution() -> None:
    assert tasks.run_task(_task(), "    return 2 * x\n", FAST).status == "ok"
    wrong = tasks.run_task(_task(), "    return x + 1\n", FAST)
    assert wrong.status == "failed" and "AssertionError" in wrong.stderr
    broken = tasks.run_task(_task(), "    return (\n", FAST)
    assert broken.status == "failed" and "SyntaxError" in broken.stderr


def test_infinite_loop_is_killed() -> None:
    result = run_python(
        {"m.py": "while True:\n    pass\n"}, "m.py", limits=Limits(wall_seconds=3, cpu_seconds=1)
    )
    assert result.status in ("cpu_limit", "timeout")
    assert result.seconds < 3.5


def test_sleeping_forever_hits_the_wall_clock() -> None:
    result = run_python(
        {"m.py": "import time\ntime.sleep(60)\n"}, "m.py", limits=Limits(wall_seconds=1)
    )
    assert result.status == "timeout" and result.seconds < 2


def test_forked_children_die_with_the_run() -> None:
    marker = "import os, time\nif os.fork() == 0:\n    time.sleep(60)\nelse:\n    time.sleep(60)\n"
    result = run_python({"m.py": marker}, "m.py", limits=Limits(wall_seconds=1))
    assert result.status == "timeout"


def test_memory_bomb_hits_the_memory_limit() -> None:
    bomb = "x = []\nwhile True:\n    x.append(bytearray(64 << 20))\n"
    result = run_python({"m.py": bomb}, "m.py", limits=FAST)
    assert result.status == "memory_limit", result.stderr[-300:]


def test_huge_output_is_capped() -> None:
    result = run_python({"m.py": "print('x' * 10_000_000)\n"}, "m.py", limits=FAST)
    assert result.truncated and len(result.stdout) <= FAST.output_bytes
    assert result.status == "output_limit"


def test_environment_is_empty() -> None:
    os.environ["RTRL_SECRET_FOR_TEST"] = "leak"
    try:
        code = "import os, json\nprint(json.dumps(dict(os.environ)))\n"
        result = run_python({"m.py": code}, "m.py", limits=FAST)
    finally:
        del os.environ["RTRL_SECRET_FOR_TEST"]
    env = json.loads(result.stdout)
    assert "RTRL_SECRET_FOR_TEST" not in env and set(env) <= {"HOME", "TMPDIR", "LANG"}


@pytest.mark.skipif(not ISOLATION.network_isolated, reason="no network namespace here")
def test_socket_cannot_reach_anything() -> None:
    code = (
        "import socket\n"
        "for addr in [('1.1.1.1', 53), ('127.0.0.1', 22)]:\n"
        "    try:\n"
        "        socket.create_connection(addr, timeout=1)\n"
        "    except OSError:\n"
        "        continue\n"
        "    raise SystemExit('connected to %s' % (addr,))\n"
        "print('isolated')\n"
    )
    result = run_python({"m.py": code}, "m.py", limits=FAST)
    assert result.status == "ok" and result.stdout.strip() == "isolated", result.stderr


@pytest.mark.skipif(not ISOLATION.fs_isolated, reason="no mount namespace here")
@pytest.mark.parametrize("where", ["/tmp", "repo", "/var/tmp", "home"])
def test_writes_outside_the_work_dir_fail_and_leave_nothing(where: str, tmp_path: Path) -> None:
    base = {"repo": str(REPO), "home": str(Path.home()), "/tmp": "/tmp", "/var/tmp": "/var/tmp"}[
        where
    ]
    target = Path(base) / f"rtrl-escape-{uuid.uuid4().hex}"
    code = f"import os\nopen({str(target)!r}, 'w').write('escaped')\n"
    result = run_python({"m.py": code}, "m.py", limits=FAST)
    assert result.status == "failed" and "Read-only file system" in result.stderr
    assert not target.exists()
    # ... and the work dir itself is writable
    ok = run_python({"m.py": "open('out.txt', 'w').write('fine')\n"}, "m.py", limits=FAST)
    assert ok.status == "ok", ok.stderr


@pytest.mark.skipif(not ISOLATION.capabilities_dropped, reason="capabilities not dropped here")
def test_the_child_cannot_remount_or_escape_its_namespaces() -> None:
    code = (
        "import ctypes\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "assert libc.mount(None, b'/', None, 32 | 4096, None) != 0\n"  # remount rw
        "assert libc.unshare(0x00020000) != 0\n"
        "print('contained')\n"
    )
    result = run_python({"m.py": code}, "m.py", limits=FAST)
    assert result.status == "ok" and "contained" in result.stdout, result.stderr


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


def test_extract_body_stops_at_the_next_top_level_statement() -> None:
    assert tasks.extract_body("    return 1\n\nprint('x')\n    y\n") == "    return 1\n\n"


def test_without_namespaces_the_run_still_has_its_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where unshare is not permitted (no CAP_SYS_ADMIN), the run goes ahead with its
    rlimits and says which protections it lacked."""

    class NoNamespaces:
        def unshare(self, flags: int) -> int:
            return -1

        def __getattr__(self, name: str) -> object:
            return getattr(sandbox._LIBC, name)

    monkeypatch.setattr(sandbox, "_lib", NoNamespaces)
    result = run_python({"m.py": "print('ran')\n"}, "m.py", limits=FAST)
    assert result.status == "ok" and result.stdout == "ran\n"
    assert result.isolation == sandbox.Isolation(False, False, False)
    bomb = run_python({"m.py": "x = bytearray(1 << 30)\n"}, "m.py", limits=FAST)
    assert bomb.status == "memory_limit"
