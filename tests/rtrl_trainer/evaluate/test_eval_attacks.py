"""Every attack on the tasks suites (bench/attacks.py) fails to pass and to escape,
run with the eval pod's identity: uid 1000, no capability at all (the operator's eval
Job: docs/eval.md). As root, the sandbox server and, in the end-to-end case, the whole
``rtrl-job eval --samples`` run are started through ``setpriv`` as that user, with a
secret in the evaluator's environment, a TCP listener on 127.0.0.1 and the evaluator's pid
handed to the attacks."""

from __future__ import annotations

import contextlib
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
def ctx(listener: socket.socket) -> attacks.Context:
    return attacks.Context(
        evaluator_pid=os.getpid(),
        port=listener.getsockname()[1],
        marker=f"rtrl-attack-{uuid.uuid4().hex}",
        secret=SECRET,
        suite_file=tasks.DEFAULT_SUITE,
        humaneval_file=tasks.humaneval_path(),
    )


@pytest.fixture(scope="module")
def pod_box() -> Iterator[sandbox.Sandbox]:
    secrets = [tasks.DEFAULT_SUITE, tasks.humaneval_path()]
    with sandbox.Sandbox(python=POD_PYTHON, run_as=RUN_AS, secrets=secrets) as box:
        yield box


def _no_side_effects(ctx: attacks.Context, listener: socket.socket) -> None:
    for where in ("/tmp", "/dev/shm", "/var/tmp"):
        for name in (ctx.marker, f"{ctx.marker}.sh"):
            assert not (Path(where) / name).exists(), f"an attack wrote {where}/{name}"
    with pytest.raises(BlockingIOError):
        listener.accept()  # nobody connected


def test_every_guarantee_holds_with_the_eval_pods_identity(pod_box: sandbox.Sandbox) -> None:
    held = pod_box.guarantees
    assert held.missing() == [], held.reasons
    if AS_ROOT:  # the pod's identity cannot switch users: Landlock does what a uid would
        assert pod_box.hello["uid"] is None


@pytest.mark.parametrize(
    "name", list(attacks.attacks(attacks.Context(1, 1, "m", "s", Path("/x"), Path("/y"))))
)
def test_the_attack_fails_to_pass_and_to_escape(
    name: str, pod_box: sandbox.Sandbox, ctx: attacks.Context, listener: socket.socket
) -> None:
    task = attacks.task()
    server_pid = pod_box.hello["pid"]
    result = tasks.run_task(task, attacks.attacks(ctx)[name], LIMITS, sandbox=pod_box)
    assert not result.passed, (result.status, result.details, result.stdout[-500:])
    _no_side_effects(ctx, listener)
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
        ("landlock", {"separate_identity", "suite_unreadable", "no_fs_writes"}),
        ("seccomp", {"no_network", "no_namespaces", "memory_capped"}),
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
    ctx: attacks.Context, listener: socket.socket
) -> None:
    """``rtrl-job eval --samples`` itself runs as uid 1000 without capabilities, with the
    store's secret in its environment: the attacks read, signal and trace *it*."""
    work = Path(tempfile.mkdtemp(prefix="rtrl-attacks-"))
    try:
        work.chmod(0o777)
        samples = work / "samples.jsonl"
        names = attacks.write_samples(samples, ctx)
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
            proc.pid, ctx.port, ctx.marker, SECRET, ctx.suite_file, ctx.humaneval_file
        )
        attacks.write_samples(samples, own)
        out, err = proc.communicate("go\n", timeout=300)
        assert proc.returncode == 0, err[-3000:]
        summary = json.loads(out.strip().splitlines()[-1])
        assert summary["sandbox"]["missing"] == [], summary["sandbox"]
        text = (work / "samples.jsonl_results.jsonl").read_text()
        rows = [json.loads(line) for line in text.splitlines()]
        verdicts = dict(zip(names, (r["passed"] for r in rows), strict=True))
        assert verdicts.pop("honest") is True
        assert not any(verdicts.values()), {k: v for k, v in verdicts.items() if v}
        assert summary["passed"] == 1 and summary["samples"] == len(names)
        assert SECRET not in text + out + err
        _no_side_effects(ctx, listener)
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
