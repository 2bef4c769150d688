"""Run untrusted Python (a model's completion plus its unit tests) in a sandbox.

The tasks suite executes code a candidate checkpoint wrote; a bad checkpoint may write an
infinite loop, a memory bomb, or code that talks to the network or overwrites files.

Every task runs in a fresh process, forked from a *sandbox server* (:mod:`sandbox_server`,
a ``python -I -S -B`` started once per :class:`Sandbox`, i.e. once per evaluation and
worker) instead of a fresh interpreter per task: starting an interpreter costs ~8 ms, the
tests of a task ~60 µs. What is per-process and inheritable is set up once in the server:

- isolated mode (no site-packages, no bytecode files), an empty environment;
- where the kernel lets us (root, or CAP_SYS_ADMIN): new network, IPC and mount
  namespaces. The network namespace has only a down loopback, so nothing can be reached.
  In the mount namespace every mount is remounted read-only, and a fresh size-limited
  tmpfs holds the work dirs;
- ``no_new_privs`` and an empty capability bounding set; the server is the subreaper of
  everything its tasks start.

Per task, the forked child gets a new session, a fresh work dir (``HOME`` and ``TMPDIR``),
stdout/stderr in memory files capped by ``RLIMIT_FSIZE``, every other descriptor closed,
its own unprivileged user id (so no capability, nothing else writable, and
``RLIMIT_NPROC`` enforced), and the rlimits: CPU seconds, address space (memory), file
size, open files, processes. A wall-clock timeout kills the task; then every process of
the task's user id is killed and reaped and the work dir removed before the next task
starts, so a task cannot leave anything behind for another (a fresh process per task:
monkeypatching builtins or modules dies with it).

Where namespaces or the user switch are not permitted, the run still happens with the
limits above and the result says which protections were missing (:class:`Isolation`):
``network_isolated``, ``fs_isolated``, ``capabilities_dropped``, ``separate_user``. The
protections in force are reported with every result, so eval.json records what held where
the suite ran.
"""

from __future__ import annotations

import contextlib
import marshal
import os
import queue
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

SERVER = Path(__file__).with_name("sandbox_server.py")
# How long past a task's own wall-clock limit we wait for the server before declaring it
# hung, killing it and starting a new one.
_SERVER_GRACE_SECONDS = 10.0
_T = TypeVar("_T")


@dataclass(frozen=True)
class Limits:
    """Resource limits of one sandboxed run."""

    wall_seconds: float = 10.0
    cpu_seconds: int = 5
    memory_bytes: int = 512 << 20
    output_bytes: int = 64 << 10
    open_files: int = 64
    processes: int = 512


@dataclass(frozen=True)
class Isolation:
    """Which protections were in force (see the module docstring)."""

    network_isolated: bool
    fs_isolated: bool
    capabilities_dropped: bool
    separate_user: bool = False


@dataclass
class Result:
    """The outcome of one run. ``status`` is ``ok`` (exit 0), ``failed`` (non-zero exit),
    ``timeout`` (wall clock), ``cpu_limit``, ``memory_limit``, ``output_limit`` or
    ``killed`` (another signal, or the sandbox server itself died: see ``details``)."""

    status: str
    returncode: int
    stdout: str
    stderr: str
    truncated: bool
    seconds: float
    isolation: Isolation
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.status == "ok"

    def to_dict(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["passed"] = self.passed
        return doc


class SandboxError(RuntimeError):
    """The sandbox server could not be started."""


class Sandbox:
    """One sandbox server: runs tasks one at a time, each in a fresh forked process.

    Use as a context manager (or call :meth:`close`). Not thread-safe: give each worker
    thread its own (:func:`pool`). If the server dies, the run in flight is reported as
    ``killed`` and the next run starts a new server.

    ``unprivileged`` starts the server without namespaces or a user switch, as it runs
    where the evaluator has no privileges; ``task_user=False`` without the user switch, as
    where the task user cannot read the interpreter (both for the tests on a privileged
    machine: they say which protections then remain).
    """

    def __init__(
        self, *, python: str | None = None, unprivileged: bool = False, task_user: bool = True
    ) -> None:
        self._python = python or sys.executable
        self._flags = [
            *(["--unprivileged"] if unprivileged else []),
            *([] if task_user else ["--no-task-user"]),
        ]
        self._proc: subprocess.Popen[bytes] | None = None
        self._root: str | None = None
        self.hello: dict[str, Any] = {}
        self._start()

    def _start(self) -> None:
        self._root = tempfile.mkdtemp(prefix="rtrl-sandbox-")
        argv = [self._python, "-I", "-S", "-B", str(SERVER), self._root, *self._flags]
        # The tasks' environment, set once: every task's work dir is ROOT/w (one at a time).
        work = os.path.join(self._root, "w")
        self._proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={"HOME": work, "TMPDIR": work, "LANG": "C.UTF-8"},
            cwd="/",
            start_new_session=True,
        )
        hello = self._receive(30.0)
        if hello is None:
            self._stop()
            raise SandboxError("the sandbox server did not start")
        self.hello = hello

    def _receive(self, timeout: float) -> dict[str, Any] | None:
        assert self._proc is not None and self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        header = _read_exact(fd, 4, timeout)
        if header is None:
            return None
        body = _read_exact(fd, int.from_bytes(header, "big"), timeout)
        return None if body is None else dict(marshal.loads(body))

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
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
            self._root = None

    def close(self) -> None:
        self._stop()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run(self, files: dict[str, str], main: str, limits: Limits | None = None) -> Result:
        """Write ``files`` (name -> source) into a fresh work dir and run ``main`` there."""
        limits = limits or Limits()
        if self._proc is None or self._proc.poll() is not None:
            self._stop()
            self._start()
        assert self._proc is not None and self._proc.stdin is not None
        request = marshal.dumps(
            {
                "files": {name: text.encode() for name, text in files.items()},
                "main": main,
                "limits": asdict(limits),
            }
        )
        reply: dict[str, Any] | None = None
        try:
            self._proc.stdin.write(len(request).to_bytes(4, "big") + request)
            self._proc.stdin.flush()
            reply = self._receive(limits.wall_seconds + _SERVER_GRACE_SECONDS)
        except OSError:
            reply = None
        if reply is None:  # the server died or hung: report it, start afresh next time
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
                Isolation(False, False, False),
                {"error": "the sandbox server died"},
            )
        if "error" in reply:
            raise ValueError(reply["error"])
        isolation = Isolation(**reply["isolation"])
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
            isolation=isolation,
        )


def _read_exact(fd: int, n: int, timeout: float) -> bytes | None:
    chunks: list[bytes] = []
    while n:
        ready, _, _ = select.select([fd], [], [], timeout)
        if not ready:
            return None
        chunk = os.read(fd, n)
        if not chunk:
            return None
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


@contextlib.contextmanager
def pool(size: int, *, python: str | None = None) -> Iterator[queue.SimpleQueue[Sandbox]]:
    """``size`` sandbox servers (started in parallel) in a queue: a worker takes one, runs
    a task, puts it back."""
    sandboxes: queue.SimpleQueue[Sandbox] = queue.SimpleQueue()
    started: list[Sandbox] = []
    lock = threading.Lock()

    def start() -> None:
        box = Sandbox(python=python)
        with lock:
            started.append(box)

    try:
        if size == 1:
            start()
        else:
            threads = [threading.Thread(target=start) for _ in range(size)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if len(started) < size:
                raise SandboxError("a sandbox server did not start")
        for box in started:
            sandboxes.put(box)
        yield sandboxes
    finally:
        for box in started:  # all servers exit at once, then wait for each
            box._hang_up()
        for box in started:
            box.close()


def map_in_pool(
    size: int, items: Sequence[_T], run: Callable[[Sandbox, _T], Result]
) -> list[Result]:
    """``run(sandbox, item)`` for every item, ``size`` at a time, results in order."""
    from concurrent.futures import ThreadPoolExecutor

    size = max(1, min(size, len(items)))
    with pool(size) as boxes:
        if size <= 1:
            box = boxes.get()
            return [run(box, item) for item in items]

        def one(item: _T) -> Result:
            box = boxes.get()
            try:
                return run(box, item)
            finally:
                boxes.put(box)

        with ThreadPoolExecutor(max_workers=size) as executor:
            return list(executor.map(one, items))


def run_python(
    files: dict[str, str],
    main: str,
    *,
    limits: Limits | None = None,
    python: str | None = None,
    sandbox: Sandbox | None = None,
) -> Result:
    """Write ``files`` (name -> source) into a fresh work dir and run ``main`` there, in
    ``sandbox`` or in a sandbox server started for this one run."""
    if sandbox is not None:
        return sandbox.run(files, main, limits)
    with Sandbox(python=python) as box:
        return box.run(files, main, limits)


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


def probe() -> Isolation:
    """The protections a run gets on this machine."""
    return run_python({"main.py": "pass\n"}, "main.py").isolation
