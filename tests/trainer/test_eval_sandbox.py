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


def test_without_privileges_the_run_still_has_its_limits() -> None:
    """Where unshare and setuid are not permitted (no root / CAP_SYS_ADMIN), the run goes
    ahead with its rlimits and says which protections it lacked."""
    with sandbox.Sandbox(unprivileged=True) as box:
        result = box.run({"m.py": "print('ran')\n"}, "m.py", limits=FAST)
        assert result.status == "ok" and result.stdout == "ran\n"
        assert result.isolation == sandbox.Isolation(False, False, False, False)
        bomb = box.run({"m.py": "x = bytearray(1 << 30)\n"}, "m.py", limits=FAST)
        assert bomb.status == "memory_limit"
        loop = box.run({"m.py": "while True:\n    pass\n"}, "m.py", Limits(wall_seconds=1))
        assert loop.status == "timeout"


# --- the fork server: one sandbox server, a fresh process per task ---------------------------

MODES = [pytest.param(True, id="task-user"), pytest.param(False, id="root-without-caps")]


def _box(task_user: bool) -> sandbox.Sandbox:
    box = sandbox.Sandbox(task_user=task_user)
    if not task_user and ISOLATION.separate_user and not box.hello["isolation"]["fs_isolated"]:
        box.close()
        pytest.skip("no mount namespace here")
    return box


@pytest.mark.parametrize("task_user", MODES)
def test_a_task_cannot_affect_the_next_one(task_user: bool) -> None:
    """Each task is a fresh process with a fresh work dir: monkeypatching builtins or the
    import system, files left in $HOME, and a daemon that outlives the task (new session,
    double fork) trying to overwrite the next task's files change nothing for the next."""
    poison = (
        "import builtins, os, sys, time\n"
        "builtins.len = lambda x: 0\n"
        "sys.modules['json'] = None\n"
        "open(os.path.join(os.environ['HOME'], 'left.txt'), 'w').write('x')\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        while True:\n"
        "            for name in ('test_solution.py', 'pwned.txt'):\n"
        "                try:\n"
        "                    open(name, 'w').write('raise SystemExit(0)\\n')\n"
        "                except OSError:\n"
        "                    pass\n"
        "            time.sleep(0.001)\n"
        "    os._exit(0)\n"
        "os.wait()\n"
    )
    check = (
        "import json, os, time\n"
        "time.sleep(0.3)\n"
        "assert len('abc') == 3\n"
        "assert sorted(os.listdir('.')) == ['m.py'], os.listdir('.')\n"
        "print('clean')\n"
    )
    with _box(task_user) as box:
        assert box.run({"m.py": poison}, "m.py", limits=FAST).status == "ok"
        result = box.run({"m.py": check}, "m.py", limits=FAST)
        assert result.status == "ok" and result.stdout == "clean\n", result.stderr
        # the suite's own harness, after the daemon had its chance
        task = _task()
        assert tasks.run_task(task, "    return x + 1\n", FAST, sandbox=box).status == "failed"


@pytest.mark.parametrize("task_user", MODES)
def test_the_server_survives_its_tasks_and_is_restarted_when_it_dies(task_user: bool) -> None:
    with _box(task_user) as box:
        killer = "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n"
        result = box.run({"m.py": killer}, "m.py", limits=FAST)
        if task_user and ISOLATION.separate_user:  # another user: not allowed to signal it
            assert result.status == "failed" and "PermissionError" in result.stderr
        else:  # the same user: the server dies, the run says so, the next one gets a new one
            assert result.status in ("killed", "failed")
        crash = box.run({"m.py": "import os\nos.abort()\n"}, "m.py", limits=FAST)
        assert crash.status == "killed" and crash.returncode < 0
        os.kill(box.hello["pid"], 9)
        again = box.run({"m.py": "print('ok')\n"}, "m.py", limits=FAST)
        assert again.status == "killed" and "died" in again.details["error"]
        assert box.run({"m.py": "print('ok')\n"}, "m.py", limits=FAST).stdout == "ok\n"


def test_the_isolation_report_matches_what_the_task_sees() -> None:
    probe = (
        "import os\n"
        "status = dict(l.split(':', 1) for l in open('/proc/self/status'))\n"
        "print(os.getuid(), int(status['CapEff'], 16), int(status['CapBnd'], 16),"
        " status['NoNewPrivs'].strip())\n"
    )
    result = run_python({"m.py": probe}, "m.py", limits=FAST)
    uid, eff, bounding, nnp = result.stdout.split()
    if result.isolation.capabilities_dropped:
        assert eff == bounding == "0" and nnp == "1"
    if result.isolation.separate_user:
        assert uid != "0"
    else:
        assert uid == str(os.getuid())


def test_pool_runs_tasks_in_parallel_in_order() -> None:
    suite = tasks.load_suite(limit=6)
    completions = [t.solution if i % 2 else "    return None\n" for i, t in enumerate(suite.tasks)]
    results = tasks.run_all(suite.tasks, completions, limits=FAST, workers=3)
    assert [r.passed for r in results] == [bool(i % 2) for i in range(6)]


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"task_user": False}, {"unprivileged": True}],
    ids=["task-user", "root-without-caps", "unprivileged"],
)
def test_a_work_dir_made_unremovable_does_not_break_the_next_task(kwargs: dict[str, bool]) -> None:
    code = "import os\nos.makedirs('a/b')\nopen('a/b/f', 'w').write('x')\nos.chmod('a/b', 0)\n"
    with sandbox.Sandbox(**kwargs) as box:
        assert box.run({"m.py": code + "os.chmod('a', 0)\n"}, "m.py", limits=FAST).passed
        listing = box.run({"m.py": "import os\nprint(os.listdir('.'))\n"}, "m.py", limits=FAST)
        assert listing.stdout == "['m.py']\n", listing.stderr
