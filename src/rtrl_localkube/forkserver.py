"""A fork server: a process that has imported a program's modules once and forks a fresh child
for every start, so that a test can kill and restart that program (``rtrl operator``) dozens of
times without paying its imports each time (~1 s of CPU for kopf, kubernetes and pydantic).

Each child is a separate OS process with its own memory (a fork of a server that has run
nothing but imports: no thread, no event loop, no connection), its environment, working
directory and output file as asked, killed with SIGKILL like any process. The server is
generic: it preloads the modules it is told to, and each start names a ``module:function``
called with the argv (what a console script would call). The children die with the server
(PR_SET_PDEATHSIG), and the server dies with the thread that started it.

Protocol (JSON lines): the client writes ``{"call", "argv", "env", "cwd", "log"}``; the server
answers ``{"pid": N}`` and, when a child ends, ``{"exit": N, "status": S}`` (S as
``Popen.returncode``: negative for a signal).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rtrl_localkube.processes import die_with_parent

PR_SET_PDEATHSIG = 1


def _serve(preload: list[str]) -> None:
    for module in preload:
        importlib.import_module(module)
    out = os.dup(1)  # answers go here; fd 1 of every child is its log
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)

    def reap(*_: object) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            os.write(out, (json.dumps({"exit": pid, "status": code}) + "\n").encode())

    signal.signal(signal.SIGCHLD, reap)
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request)  # never returns
        os.write(out, (json.dumps({"pid": pid}) + "\n").encode())


def _child(request: dict[str, Any]) -> None:
    code = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.closerange(3, 1024)
        sys.stdin = open(0)  # noqa: SIM115 - the child's own for its life
        sys.stdout = open(1, "w", buffering=1)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1)  # noqa: SIM115
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        module, function = request["call"].split(":")
        sys.argv = [module, *request["argv"]]
        result = getattr(importlib.import_module(module), function)(request["argv"])
        code = int(result or 0)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


class Child:
    """A started child, with the parts of ``subprocess.Popen`` a test uses."""

    def __init__(self, server: ForkServer, pid: int) -> None:
        self.server = server
        self.pid = pid
        self.returncode: int | None = None
        self.ended = threading.Event()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self.ended.wait(timeout):
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class ForkServer:
    """The client: starts the server (``preload``: modules to import in it, in ``env``),
    then :meth:`spawn` children of it. Use as a context manager, or :meth:`close`.

    A child runs in the environment it is given, but what a module read from the
    environment at import time is what it read in the server (the ``kubernetes`` package
    reads ``KUBECONFIG`` then): give those variables to the server."""

    def __init__(
        self, preload: list[str], *, env: Mapping[str, str] | None = None,
        startup_timeout: float = 60,
    ) -> None:  # fmt: skip
        argv = [sys.executable, "-m", "rtrl_localkube.forkserver", *preload]
        self.proc = subprocess.Popen(
            die_with_parent(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            bufsize=1, env=None if env is None else dict(env),
        )  # fmt: skip
        self.children: dict[int, Child] = {}
        self._pids: list[int] = []
        self._lock = threading.Lock()
        self._spawned = threading.Condition(self._lock)
        self._early: dict[int, int] = {}  # exits that came before the pid was handed out
        threading.Thread(target=self._read, name="forkserver", daemon=True).start()
        started = time.monotonic()
        probe = self.spawn("rtrl_localkube.forkserver:_noop", [], env={}, cwd=Path.cwd(),
                           log=Path(os.devnull))  # fmt: skip
        probe.wait(max(1.0, startup_timeout - (time.monotonic() - started)))
        self.startup_seconds = time.monotonic() - started

    def __enter__(self) -> ForkServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            message = json.loads(line)
            with self._lock:
                if "pid" in message:
                    self._pids.append(int(message["pid"]))
                    self._spawned.notify_all()
                    continue
                pid, status = int(message["exit"]), int(message["status"])
                child = self.children.get(pid)
                if child is None:
                    self._early[pid] = status
                    continue
            child.returncode = status
            child.ended.set()

    def spawn(
        self, call: str, argv: list[str], *, env: Mapping[str, str], cwd: Path, log: Path
    ) -> Child:
        """A child that runs ``call`` (``module:function``) with ``argv``, its environment
        exactly ``env``, in ``cwd``, its output appended to ``log``."""
        request = {"call": call, "argv": argv, "env": dict(env), "cwd": os.fspath(cwd),
                   "log": os.fspath(log)}  # fmt: skip
        assert self.proc.stdin is not None
        with self._lock:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            if not self._spawned.wait_for(lambda: self._pids, timeout=30):
                raise RuntimeError(f"the fork server did not start {call}")
            pid = self._pids.pop(0)
            child = self.children[pid] = Child(self, pid)
            early = self._early.pop(pid, None)
        if early is not None:
            child.returncode = early
            child.ended.set()
        return child

    def close(self) -> None:
        for child in list(self.children.values()):
            child.kill()
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def _noop(argv: list[str]) -> int:
    """What :class:`ForkServer` starts first, to know the server has imported its modules."""
    return 0


if __name__ == "__main__":
    _serve(sys.argv[1:])
