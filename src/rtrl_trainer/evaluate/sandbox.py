"""Run untrusted Python (a model's completion) in a sandbox, from the evaluator's side.

The tasks suites execute code a candidate checkpoint wrote, and an RL system exists to find
reward hacks: a completion may loop, allocate, fork, exit early, read the suite's answers,
talk to the network, or attack the evaluator. Every task runs in a fresh process forked
from a *sandbox server* (:mod:`rtrl_trainer.evaluate.sandbox_server`, a ``python -I -S -B`` started
once per :class:`Sandbox`), isolated by Landlock, seccomp, rlimits and, where the server
may switch users, a user id of its own; none of it needs a privilege, so it holds in the
eval pod (uid 1000, every capability dropped). docs/eval.md describes the guarantees.

The server *checks* the guarantees when it starts, by attacking them from a child set up
as a task is (:class:`Guarantees`), and every result carries what held. The tasks suites
refuse to score where one is missing (:mod:`rtrl_trainer.evaluate.suite`), unless told otherwise.

What a run is given and returns (:class:`Limits`, :class:`Guarantees`, :class:`Result`)
is in :mod:`.sandbox_types`, a served completion's call channel in :mod:`.sandbox_channel`,
servers in a pool (a suite's tasks ``workers`` at a time) in :mod:`.sandbox_pool`.

Two ways to run code: :meth:`Sandbox.run` runs a program (its exit status is the result:
for the sandbox's own tests); :meth:`Sandbox.serve` loads a completion and lets the
evaluator call its function (:mod:`rtrl_trainer.evaluate.grader`): the verdict is the grader's,
never the completion's.
"""

from __future__ import annotations

import contextlib
import marshal
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rtrl_trainer.evaluate.sandbox_channel import Channel
from rtrl_trainer.evaluate.sandbox_types import NONE_HELD, Guarantees, Limits, Result, SandboxError

SERVER = Path(__file__).with_name("sandbox_server.py")
# How long past a task's own wall-clock limit we wait for the server before declaring it
# hung, killing it and starting a new one.
_SERVER_GRACE_SECONDS = 10.0


def _drop_to(uid: int, gid: int) -> list[str]:
    """``setpriv`` words that run the server as ``uid:gid`` with no capability at all (the
    eval pod's identity; for tests and local runs started as root)."""
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        raise SandboxError("setpriv (util-linux) is needed to run the sandbox as another user")
    return [
        setpriv,
        f"--reuid={uid}",
        f"--regid={gid}",
        "--clear-groups",
        "--inh-caps=-all",
        "--bounding-set=-all",
    ]


class Sandbox:
    """One sandbox server: runs tasks one at a time, each in a fresh forked process.

    Use as a context manager (or call :meth:`close`). Not thread-safe: give each worker
    thread its own (:func:`pool`). If the server dies, the task in flight is reported as
    ``killed`` and the next one starts a new server.

    ``secrets``: paths no task may read (the suite files, credentials); the server hides
    them and checks that it did. ``task_user=False``: no user switch even where possible.
    ``run_as=(uid, gid)``: start the server as that user without capabilities (tests run
    it as the eval pod's uid 1000). ``without``: leave out ``landlock`` and/or ``seccomp``,
    to see what a node without them gives (the guarantees then say what is missing).
    """

    def __init__(
        self,
        *,
        python: str | None = None,
        secrets: Sequence[str | os.PathLike[str]] = (),
        task_user: bool = True,
        run_as: tuple[int, int] | None = None,
        without: Sequence[str] = (),
    ) -> None:
        self._python = python or sys.executable
        unknown = set(without) - {"landlock", "seccomp"}
        if unknown:
            raise ValueError(f"without: unknown protection(s) {sorted(unknown)}")
        self._flags = [
            *(f"--secret={os.fspath(s)}" for s in secrets),
            *([] if task_user else ["--no-task-user"]),
            *([f"--without={','.join(without)}"] if without else []),
        ]
        self._prefix = _drop_to(*run_as) if run_as is not None else []
        self._proc: subprocess.Popen[bytes] | None = None
        self._pipes: socket.socket | None = None  # hands each task's pipes to the server
        self.hello: dict[str, Any] = {}
        self.guarantees = NONE_HELD
        self._start()

    def guarantees_for(self, limits: Limits) -> Guarantees:
        """The guarantees a task with ``limits`` gets: the tree-wide memory cap needs a
        single process, or a user id of the task's own to count more (RLIMIT_NPROC)."""
        if limits.processes <= 1 or self.hello.get("uid") is not None:
            return self.guarantees
        return Guarantees(
            {**self.guarantees.held, "memory_capped": False},
            {
                **self.guarantees.reasons,
                "memory_capped": f"processes={limits.processes}: each process has its own "
                "address-space cap, and no user id of the task's own bounds their number "
                "(that needs CAP_SETUID)",
            },
        )

    def _start(self) -> None:
        self._pipes, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        argv = [
            *self._prefix,
            self._python,
            "-I",
            "-S",
            "-B",
            str(SERVER),
            f"--pipes={theirs.fileno()}",
            f"--evaluator={os.getpid()}",
            *self._flags,
        ]
        try:
            self._proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env={"HOME": "/", "TMPDIR": "/nonexistent", "LANG": "C.UTF-8"},
                cwd="/",
                pass_fds=(theirs.fileno(),),
                start_new_session=True,
            )
        finally:
            theirs.close()
        hello = self._receive(30.0)
        if hello is None:
            self._stop()
            raise SandboxError("the sandbox server did not start")
        self.hello = hello
        self.guarantees = Guarantees(dict(hello["guarantees"]), dict(hello["reasons"]))

    def _receive(self, timeout: float) -> dict[str, Any] | None:
        assert self._proc is not None and self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        header = _read_exact(fd, 4, deadline)
        if header is None:
            return None
        body = _read_exact(fd, int.from_bytes(header, "big"), deadline)
        return None if body is None else dict(marshal.loads(body))

    def _send(self, doc: dict[str, Any]) -> None:
        assert self._proc is not None and self._proc.stdin is not None
        data = marshal.dumps(doc)
        self._proc.stdin.write(len(data).to_bytes(4, "big") + data)
        self._proc.stdin.flush()

    def _hang_up(self) -> None:
        """Tell the server to exit (end of its input); :meth:`close` waits for it."""
        if self._proc is not None and self._proc.stdin is not None:
            with contextlib.suppress(OSError):
                self._proc.stdin.close()

    def _stop(self) -> None:
        self._hang_up()
        proc, self._proc = self._proc, None
        if proc is not None:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            assert proc.stdout is not None
            proc.stdout.close()
        if self._pipes is not None:
            self._pipes.close()
            self._pipes = None

    def close(self) -> None:
        self._stop()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _ensure_started(self) -> None:
        if self._proc is None or self._proc.poll() is not None:
            self._stop()
            self._start()

    def _result(self, limits: Limits) -> Result:
        """The server's report on the task just ended (skipping early exit notices)."""
        while True:
            try:
                reply = self._receive(limits.wall_seconds + _SERVER_GRACE_SECONDS)
            except OSError:
                reply = None
            if reply is None:  # the server died or hung: report it, start afresh next time
                assert self._proc is not None
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self._proc.pid, signal.SIGKILL)
                self._stop()
                return Result(
                    "killed",
                    -signal.SIGKILL,
                    "",
                    "",
                    False,
                    0.0,
                    NONE_HELD,
                    {"error": "the sandbox server died"},
                )
            if "event" not in reply:
                break
        if "error" in reply:
            raise ValueError(reply["error"])
        stderr = reply["stderr"].decode("utf-8", "replace")
        truncated = reply["truncated"]
        returncode = reply["returncode"]
        return Result(
            status=_status(returncode, reply["timed_out"], stderr, truncated),
            returncode=returncode,
            stdout=reply["stdout"].decode("utf-8", "replace"),
            stderr=stderr,
            truncated=truncated,
            seconds=reply["seconds"],
            guarantees=self.guarantees_for(limits),
        )

    def run(self, source: str, limits: Limits | None = None) -> Result:
        """Run ``source`` as a program (``__main__``) in a fresh task; its exit status is
        the result."""
        limits = limits or Limits()
        self._ensure_started()
        with contextlib.suppress(OSError):  # the server died: _result reports it
            self._send({"op": "run", "source": source.encode(), "limits": asdict(limits)})
        return self._result(limits)

    @contextlib.contextmanager
    def serve(
        self, source: str, entry_point: str, limits: Limits | None = None
    ) -> Iterator[Channel]:
        """Load ``source`` in a fresh task and yield a :class:`Channel` to call
        ``entry_point`` there; on exit the task is killed and its :class:`Result` is in
        ``channel.result``.

        The task's call pipes are made here for it alone and handed to the server with the
        request (``SCM_RIGHTS``); the server keeps no copy, and this side closes its ends
        when the task has ended, so nothing the task sets on them outlives it."""
        limits = limits or Limits()
        self._ensure_started()
        assert self._proc is not None and self._proc.stdout is not None
        assert self._pipes is not None
        calls_r, calls_w = os.pipe()
        replies_r, replies_w = os.pipe()
        deadline = time.monotonic() + limits.wall_seconds
        channel = Channel(calls_w, replies_r, self._proc.stdout.fileno(), deadline)
        request = {
            "op": "serve",
            "source": source.encode(),
            "entry_point": entry_point,
            "limits": asdict(limits),
        }
        sent = True
        try:
            socket.send_fds(self._pipes, [b"p"], [calls_r, replies_w])
            self._send(request)
        except OSError:
            sent = False
            channel.gone = True
        finally:
            os.close(calls_r)
            os.close(replies_w)
        try:
            yield channel
        finally:
            try:
                if sent:
                    with contextlib.suppress(OSError):
                        self._send({"op": "stop"})
                channel.result = self._result(limits)
            finally:
                os.close(calls_w)
                os.close(replies_r)


def _read_exact(fd: int, n: int, deadline: float) -> bytes | None:
    chunks: list[bytes] = []
    while n:
        ready, _, _ = select.select([fd], [], [], max(deadline - time.monotonic(), 0))
        if not ready:
            return None
        chunk = os.read(fd, n)
        if not chunk:
            return None
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def run_python(source: str, *, limits: Limits | None = None, **options: Any) -> Result:
    """Run ``source`` as a program in a sandbox server started for this one run."""
    with Sandbox(**options) as box:
        return box.run(source, limits)


def _status(returncode: int, timed_out: bool, stderr: str, truncated: bool) -> str:
    if timed_out:
        return "timeout"
    if returncode == 0:
        return "ok"
    if returncode == -signal.SIGXCPU:
        return "cpu_limit"
    if returncode == -signal.SIGXFSZ or truncated:
        return "output_limit"
    if "MemoryError" in stderr:
        return "memory_limit"
    if returncode < 0:
        return "killed"
    return "failed"


def probe(limits: Limits | None = None, **options: Any) -> Guarantees:
    """The guarantees a task with ``limits`` gets on this machine (a server's start-up
    check)."""
    with Sandbox(**options) as box:
        return box.guarantees_for(limits or Limits())
