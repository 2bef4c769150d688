"""Every attack on the tasks suites (bench/attacks.py) fails to pass and to escape,
run with the eval pod's identity: uid 1000, no capability at all (the operator's eval
Job: docs/eval.md). As root, the sandbox server and, in the end-to-end case, the whole
``rtrl-job eval --samples`` run are started through ``setpriv`` as that user, with a
secret in the evaluator's environment, a TCP listener on 127.0.0.1 and the evaluator's pid
handed to the attacks. The attacks of more than one sample (``attacks.sequences``) run in
order on one server; the grader's own properties (it reveals nothing, its replies are
bounded, what the seccomp filter lets through) are attacked here too."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from bench import attacks

from rtrl_localkube import pods
from rtrl_trainer.evaluate import sandbox
from rtrl_trainer.evaluate import suite as tasks
from rtrl_trainer.evaluate.sandbox_types import Limits

AS_ROOT = os.geteuid() == 0
# As uid 1000 the sandbox server needs an interpreter that user can run (this venv's may
# live under /root; the standard library is all it uses) and to reach this checkout. Where
# it cannot (a clone under a 0700 dir), the tests run as root without any capability: the
# pod's capabilities, not its user, and the same guarantees must hold (Landlock does not
# care who the task is).
SYSTEM_PYTHON = Path(f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}")
SITE = Path(sys.prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
SITE = SITE / "site-packages"
POD_UID = (
    1000
    if AS_ROOT
    and SYSTEM_PYTHON.exists()
    and pods.reachable_by(Path(sandbox.SERVER), 1000, {1000})
    and pods.reachable_by(SITE, 1000, {1000})
    else 0
)
POD_PYTHON = str(SYSTEM_PYTHON) if POD_UID else None
RUN_AS = (POD_UID, POD_UID) if AS_ROOT else None
LIMITS = Limits(wall_seconds=5, cpu_seconds=3, memory_bytes=512 << 20, output_bytes=64 << 10)
SECRET = f"rtrl-canary-{uuid.uuid4().hex}"


@pytest.fixture(scope="module")
def listener() -> Iterator[socket.socket]:
    with attacks.tcp_listener() as server:
        yield server


@pytest.fixture(scope="module")
def unix_listener() -> Iterator[socket.socket]:
    directory = Path(tempfile.mkdtemp(prefix="rtrl-attack-sock-"))
    try:
        with attacks.unix_listener(directory) as server:
            yield server
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="module")
def ctx(listener: socket.socket, unix_listener: socket.socket) -> attacks.Context:
    return attacks.Context(
        evaluator_pid=os.getpid(),
        port=listener.getsockname()[1],
        marker=f"rtrl-attack-{uuid.uuid4().hex}",
        secret=SECRET,
        suite_file=tasks.DEFAULT_SUITE,
        humaneval_file=tasks.humaneval_path(),
        unix_socket=unix_listener.getsockname(),
    )


@pytest.fixture(scope="module")
def pod_box() -> Iterator[sandbox.Sandbox]:
    secrets = [tasks.DEFAULT_SUITE, tasks.humaneval_path()]
    with sandbox.Sandbox(python=POD_PYTHON, run_as=RUN_AS, secrets=secrets) as box:
        yield box


def _no_side_effects(
    ctx: attacks.Context, listener: socket.socket, *pids: int, unix: socket.socket | None = None
) -> None:
    for where in ("/tmp", "/dev/shm", "/var/tmp"):
        for name in (ctx.marker, f"{ctx.marker}.sh"):
            assert not (Path(where) / name).exists(), f"an attack wrote {where}/{name}"
    with pytest.raises(BlockingIOError):
        listener.accept()  # nobody connected
    if unix is not None:
        with pytest.raises(BlockingIOError):
            unix.accept()
    for pid in pids:  # nobody moved the evaluator or the server to another scheduling class
        policy = os.sched_getscheduler(pid)
        if policy != os.SCHED_OTHER:
            os.sched_setscheduler(pid, os.SCHED_OTHER, os.sched_param(0))  # for the next tests
        assert policy == os.SCHED_OTHER, f"an attack set pid {pid}'s scheduling policy {policy}"


def test_every_guarantee_holds_with_the_eval_pods_identity(pod_box: sandbox.Sandbox) -> None:
    held = pod_box.guarantees
    assert held.missing() == [], held.reasons
    if AS_ROOT:  # the pod's identity cannot switch users: Landlock does what a uid would
        assert pod_box.hello["uid"] is None


@pytest.mark.parametrize(
    "name", list(attacks.attacks(attacks.Context(1, 1, "m", "s", Path("/x"), Path("/y"))))
)
def test_the_attack_fails_to_pass_and_to_escape(
    name: str,
    pod_box: sandbox.Sandbox,
    ctx: attacks.Context,
    listener: socket.socket,
    unix_listener: socket.socket,
) -> None:
    task = attacks.task()
    server_pid = pod_box.hello["pid"]
    result = tasks.run_task(task, attacks.attacks(ctx)[name], LIMITS, sandbox=pod_box)
    assert not result.passed, (result.status, result.details, result.stdout[-500:])
    _no_side_effects(ctx, listener, os.getpid(), server_pid, unix=unix_listener)
    os.kill(server_pid, 0)  # the sandbox server survived the attack (no SIGKILL landed)
    assert pod_box.hello["pid"] == server_pid
    assert SECRET not in result.stdout + result.stderr
    if name == "allocate_past_the_cap":
        assert result.status == "memory_limit"
    if name in attacks.ESCAPES:  # it tried, and was told no
        assert "denied" in result.stdout or result.details.get("reason"), result.stdout


def test_the_honest_completion_still_passes(pod_box: sandbox.Sandbox) -> None:
    task = attacks.task()
    result = tasks.run_task(task, task.solution, LIMITS, sandbox=pod_box)
    assert result.passed, result.details


@pytest.mark.parametrize("name", list(attacks.sequences(1)))
def test_no_sample_learns_from_or_harms_the_samples_before_it(name: str) -> None:
    """The samples of a sequence, graded in order on one sandbox server as the eval pod's
    user: the learner (which computes nothing) passes none of its 20, and the honest
    samples after the one that sets O_DIRECT on its reply pipe pass. (Before: the learner
    passed 17 of 20, and both honest samples timed out.)"""
    by_id = {t.task_id: t for t in tasks.load_suite().tasks}
    samples = attacks.sequences()[name]
    with sandbox.Sandbox(
        python=POD_PYTHON, run_as=RUN_AS, secrets=[tasks.DEFAULT_SUITE, tasks.humaneval_path()]
    ) as box:
        results = [
            tasks.run_task(by_id[task_id], completion, LIMITS, sandbox=box)
            for task_id, completion, _ in samples
        ]
    passed = [r.passed for r in results]
    assert passed == [must for _, _, must in samples], [
        (r.status, r.details.get("reason")) for r in results
    ]


def test_the_calls_a_completion_sees_do_not_depend_on_its_answers(
    pod_box: sandbox.Sandbox,
) -> None:
    """The grader makes every call of the tests whatever the answers: a completion that
    answers wrong sees the same calls, in the same order, as one that answers right, so
    which calls come tells it nothing. (Before: the wrong one saw only the first call.)"""
    task = attacks.task()
    seen = {}
    for answer in ("a + b", "0", "a - b"):
        completion = f"    print('call', a, b, flush=True)\n    return {answer}\n"
        result = tasks.run_task(task, completion, LIMITS, sandbox=pod_box)
        seen[answer] = (result.passed, result.stdout)
    assert seen["a + b"][0] and not seen["0"][0] and not seen["a - b"][0]
    assert seen["a + b"][1].count("call") == 3, seen
    assert seen["0"][1] == seen["a - b"][1] == seen["a + b"][1], seen


_MEASURE = """
import json, sys
from rtrl_trainer.evaluate import sandbox, suite as tasks
from rtrl_trainer.evaluate.sandbox_types import Limits

def peak_kb():  # this process's own peak (getrusage's maxrss outlives exec: the parent's)
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmHWM:")).split()[1])

spec = json.loads(sys.stdin.read())
task = next(t for t in tasks.load_suite().tasks if t.task_id == spec["task"])
limits = Limits(**spec["limits"])
run_as = tuple(spec["run_as"]) if spec["run_as"] else None
with sandbox.Sandbox(python=spec["python"], run_as=run_as) as box:
    tasks.run_task(task, task.solution, limits, sandbox=box)
    before = peak_kb()
    result = tasks.run_task(task, spec["completion"], limits, sandbox=box)
    after = peak_kb()
print(json.dumps({"grew_mb": (after - before) / 1024, "passed": result.passed,
                  "status": result.status, "reason": result.details.get("reason")}))
"""


def _evaluator_growth(completion: str) -> dict[str, object]:
    """Grade ``completion`` in a fresh evaluator process; how much its peak memory grew."""
    spec = {
        "task": attacks.TASK_ID,
        "completion": completion,
        "limits": {"wall_seconds": 20, "cpu_seconds": 10, "memory_bytes": 512 << 20},
        "python": POD_PYTHON,
        "run_as": RUN_AS,
    }
    out = subprocess.run(
        [sys.executable, "-c", _MEASURE],
        input=json.dumps(spec),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    return dict(json.loads(out.strip().splitlines()[-1]))


def test_a_reply_bomb_does_not_grow_the_evaluator(ctx: attacks.Context) -> None:
    """A 16 MB reply frame of empty lists: refused from its header, before a byte of it is
    decoded; the evaluator's peak memory does not move. (Before: +735 MB.)"""
    measured = _evaluator_growth(attacks.attacks(ctx)["nested_reply_bomb"])
    assert not measured["passed"]
    assert "reply" in str(measured["reason"]), measured
    assert float(measured["grew_mb"]) < 32, measured  # type: ignore[arg-type]


def test_a_deeply_nested_reply_is_refused_before_it_is_decoded(pod_box: sandbox.Sandbox) -> None:
    """Nesting is counted on the raw bytes (strings skipped), so the decoder never sees it."""
    deep = (
        "    import os\n"
        "    body = b'{\"id\":1,\"value\":' + b'[' * 5000 + b'\"]]\"' + b']' * 5000 + b'}'\n"
        "    os.write(4, len(body).to_bytes(4, 'big') + body)\n"
        "    return a + b\n"
    )
    result = tasks.run_task(attacks.task(), deep, LIMITS, sandbox=pod_box)
    assert not result.passed
    assert "nested deeper than" in result.details["reason"], result.details


# Calls no task of a suite needs: each must fail (EPERM, or ENOSYS where the C library falls
# back), while getpid, which every task may make, still works. Numbers from libseccomp.
_NOT_ALLOWED = {
    "sysinfo": "buf",
    "epoll_create1": "0",
    "eventfd2": "0, 0",
    "pipe2": "buf, 0",
    "socketpair": "1, 1, 0, buf",
    "inotify_init1": "0",
    "timerfd_create": "1, 0",
    "personality": "0xffffffff",
    "flock": "0, 1",
}


def _syscall_numbers(names: list[str]) -> dict[str, int]:
    libseccomp = ctypes.CDLL("libseccomp.so.2")
    libseccomp.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    return {name: libseccomp.seccomp_syscall_resolve_name(name.encode()) for name in names}


def test_only_the_allow_list_gets_through(pod_box: sandbox.Sandbox) -> None:
    """The seccomp filter is an allow-list: a call that is not on it is denied, whatever
    it is. (Before, a deny list: each of these went through.)"""
    numbers = _syscall_numbers([*_NOT_ALLOWED, "getpid"])
    lines = [
        "import ctypes, json",
        "libc = ctypes.CDLL(None, use_errno=True)",
        "buf = ctypes.create_string_buffer(256)",
        "got = {}",
    ]
    for name, args in _NOT_ALLOWED.items():
        lines.append(f"got[{name!r}] = (libc.syscall({numbers[name]}, {args}), ctypes.get_errno())")
    lines.append(f"got['getpid'] = (libc.syscall({numbers['getpid']}), 0)")
    lines.append("print(json.dumps(got))")
    result = pod_box.run("\n".join(lines) + "\n", limits=LIMITS)
    assert result.status == "ok", result.stderr[-2000:]
    got = json.loads(result.stdout)
    assert got.pop("getpid")[0] > 0
    through = {
        k: v for k, v in got.items() if v[0] != -1 or v[1] not in (errno.EPERM, errno.ENOSYS)
    }
    assert not through, through


def test_forking_needs_a_separate_user_for_the_tree_wide_cap() -> None:
    """With more than one process allowed the address-space cap is per process, so the
    cap of the tree holds only through RLIMIT_NPROC of a user of the task's own; as the
    pod's user there is none, and the suite refuses to score."""
    suite = tasks.load_suite(limit=1)
    limits = Limits(wall_seconds=5, processes=4)
    with pytest.raises(tasks.UnsafeSandboxError, match="memory_capped"):
        tasks.run_all(
            suite, [suite.tasks[0].solution], limits=limits, python=POD_PYTHON, run_as=RUN_AS
        )


@pytest.mark.parametrize(
    ("without", "missing"),
    [
        ("landlock", {"separate_identity", "suite_unreadable"}),  # seccomp: no writes
        (
            "seccomp",
            {"no_network", "no_namespaces", "memory_capped", "no_scheduling", "no_watching"},
        ),
    ],
)
def test_a_node_without_a_protection_says_which_guarantees_are_gone(
    without: str, missing: set[str]
) -> None:
    held = sandbox.probe(
        python=POD_PYTHON, run_as=RUN_AS, without=[without], secrets=[tasks.DEFAULT_SUITE]
    )
    assert missing <= set(held.missing()), held.to_dict()
    for name in missing:
        assert held.reasons[name].startswith("a task can"), held.reasons[name]


@pytest.mark.skipif(not AS_ROOT, reason="needs root to take the eval pod's identity")
def test_scoring_the_attacks_end_to_end_as_the_eval_pods_user(
    ctx: attacks.Context, listener: socket.socket, unix_listener: socket.socket
) -> None:
    """``rtrl-job eval --samples`` itself runs as uid 1000 without capabilities, with the
    store's secret in its environment: the attacks read, signal and trace *it*."""
    work = Path(tempfile.mkdtemp(prefix="rtrl-attacks-"))
    try:
        work.chmod(0o777)
        samples = work / "samples.jsonl"
        expected = attacks.write_samples(samples, ctx)
        samples.chmod(0o644)
        boot = (
            "import site, sys; site.addsitedir(sys.argv.pop(1)); "
            "from rtrl_trainer.cli import main; sys.argv[0] = 'rtrl-job'; sys.exit(main())"
        )
        env = {"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "AWS_SECRET_ACCESS_KEY": SECRET}
        # The evaluator waits for a line on stdin, so the samples can name its pid.
        proc = subprocess.Popen(
            [
                *sandbox._drop_to(POD_UID, POD_UID),
                POD_PYTHON or sys.executable,
                "-c",
                f"import sys; sys.stdin.readline(); {boot}",
                str(SITE),
                "eval",
                "--samples",
                str(samples),
                "--suite",
                "tasks",
            ],
            env=env,
            cwd="/",
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        own = attacks.Context(
            proc.pid,
            ctx.port,
            ctx.marker,
            SECRET,
            ctx.suite_file,
            ctx.humaneval_file,
            unix_socket=ctx.unix_socket,
        )
        attacks.write_samples(samples, own)
        out, err = proc.communicate("go\n", timeout=300)
        assert proc.returncode == 0, err[-3000:]
        summary = json.loads(out.strip().splitlines()[-1])
        assert summary["sandbox"]["missing"] == [], summary["sandbox"]
        text = (work / "samples.jsonl_results.jsonl").read_text()
        rows = [json.loads(line) for line in text.splitlines()]
        wrong = {
            name: row["result"]
            for (name, must_pass), row in zip(expected, rows, strict=True)
            if row["passed"] != must_pass
        }
        assert not wrong, wrong
        assert summary["samples"] == len(expected)
        assert summary["passed"] == sum(must for _, must in expected)
        assert SECRET not in text + out + err
        _no_side_effects(ctx, listener, unix=unix_listener)
    finally:
        shutil.rmtree(work, ignore_errors=True)


GET_THROUGH = (
    "tcp_to_localhost",
    "write_tmp_and_shm",
    "read_suite_file",
    "read_humaneval_solutions",
    "signal_evaluator_and_server",
)


def test_without_landlock_and_seccomp_the_attacks_get_through(
    ctx: attacks.Context, listener: socket.socket
) -> None:
    """The attacks are real: with the two protections left out, each of these passes its
    task (and the guarantees say so), so the tests above can fail."""
    task = attacks.task()
    secrets = [tasks.DEFAULT_SUITE, tasks.humaneval_path()]
    completions = attacks.attacks(ctx)
    try:
        with sandbox.Sandbox(
            python=POD_PYTHON, run_as=RUN_AS, secrets=secrets, without=["landlock", "seccomp"]
        ) as box:
            assert set(box.guarantees.missing()) >= {"no_network", "no_fs_writes"}
            passed = {
                name: tasks.run_task(task, completions[name], LIMITS, sandbox=box).passed
                for name in (*GET_THROUGH, "exec_a_shell")
            }
        assert all(passed[name] for name in GET_THROUGH), passed
        assert (Path("/tmp") / ctx.marker).exists()
        assert (Path("/tmp") / f"{ctx.marker}.sh").exists()  # exec replaced the task
        connection, _ = listener.accept()
        connection.close()
    finally:
        for where in ("/tmp", "/dev/shm", "/var/tmp"):
            (Path(where) / ctx.marker).unlink(missing_ok=True)
            (Path(where) / f"{ctx.marker}.sh").unlink(missing_ok=True)
        with contextlib.suppress(BlockingIOError):
            while True:
                listener.accept()[0].close()


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the x32 ABI is x86_64's")
def test_a_call_through_another_abi_kills_the_task(pod_box: sandbox.Sandbox) -> None:
    """getpid through the x32 ABI (its number with bit 30 set), which a filter written for
    x86_64's numbers alone would not see: libseccomp's program kills the process."""
    getpid = _syscall_numbers(["getpid"])["getpid"]
    program = (
        "import ctypes\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        f"print(libc.syscall({getpid}), flush=True)\n"
        f"print('through', libc.syscall({getpid} | 0x40000000), flush=True)\n"
    )
    result = pod_box.run(program, limits=LIMITS)
    assert result.returncode == -31 and "through" not in result.stdout, result  # SIGSYS
