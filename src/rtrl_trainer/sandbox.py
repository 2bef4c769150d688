"""Run untrusted Python (a model's completion) in a sandbox, from the evaluator's side.

The tasks suites execute code a candidate checkpoint wrote, and an RL system exists to find
reward hacks: a completion may loop, allocate, fork, exit early, read the suite's answers,
talk to the network, or attack the evaluator. Every task runs in a fresh process forked
from a *sandbox server* (:mod:`rtrl_trainer.sandbox_server`, a ``python -I -S -B`` started
once per :class:`Sandbox`), isolated by Landlock, seccomp, rlimits and, where the server
may switch users, a user id of its own; none of it needs a privilege, so it holds in the
eval pod (uid 1000, every capability dropped). docs/eval.md describes the guarantees.

The server *checks* the guarantees when it starts, by attacking them from a child set up
as a task is (:class:`Guarantees`), and every result carries what held. The tasks suites
refuse to score where one is missing (:mod:`rtrl_trainer.tasks`), unless told otherwise.

Two ways to run code: :meth:`Sandbox.run` runs a program (its exit status is the result:
for the sandbox's own tests); :meth:`Sandbox.serve` loads a completion and lets the
evaluator call its function (:mod:`rtrl_trainer.grader`): the verdict is the grader's,
never the completion's.
"""

from __future__ import annotations

import contextlib
import json
import marshal
import os
import queue
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from rtrl_trainer import sandbox_shared
from rtrl_trainer.sandbox_shared import GUARANTEES

SERVER = Path(__file__).with_name("sandbox_server.py")
# How long past a task's own wall-clock limit we wait for the server before declaring it
# hung, killing it and starting a new one.
_SERVER_GRACE_SECONDS = 10.0
MAX_FRAME = 16 << 20
_T = TypeVar("_T")

GUARANTEE_MEANING = {
    "separate_identity": "a task cannot signal the evaluator or read its /proc files",
    "no_ptrace": "a task cannot trace the evaluator or the sandbox server",
    "no_network": "a task cannot open a network socket",
    "memory_capped": "the memory cap holds for a task's whole process tree",
    "suite_unreadable": "a task cannot read the suites, their solutions or the secrets",
    "no_fs_writes": "a task cannot write anywhere (/tmp, /dev/shm included)",
    "no_namespaces": "a task cannot create namespaces (unshare, clone flags)",
}


@dataclass(frozen=True)
class Limits:
    """Resource limits of one sandboxed task. ``memory_bytes`` caps the task's whole tree:
    with ``processes`` 1 (the default) a task may not fork at all and it is the process's
    address-space cap; with more, each process gets ``memory_bytes / processes`` and the
    count is enforced through the task's own user id (which needs CAP_SETUID)."""

    wall_seconds: float = 10.0
    cpu_seconds: int = 5
    memory_bytes: int = 512 << 20
    output_bytes: int = 64 << 10
    open_files: int = 64
    processes: int = 1


@dataclass(frozen=True)
class Guarantees:
    """What the server's check child could not break (see :data:`GUARANTEE_MEANING`), and
    for each one it could, what it did."""

    held: dict[str, bool]
    reasons: dict[str, str] = field(default_factory=dict)

    def missing(self) -> list[str]:
        return [name for name in GUARANTEES if not self.held.get(name, False)]

    def to_dict(self) -> dict[str, Any]:
        return {"held": dict(self.held), "missing": self.missing(), "reasons": dict(self.reasons)}


NONE_HELD = Guarantees(dict.fromkeys(GUARANTEES, False), {"all": "no sandbox server ran"})


@dataclass
class Result:
    """The outcome of one task. ``status``: ``ok`` (passed), ``failed`` (non-zero exit, or
    the grader's tests failed), ``timeout`` (wall clock), ``cpu_limit``, ``memory_limit``,
    ``output_limit`` or ``killed`` (another signal, or the server died: see ``details``)."""

    status: str
    returncode: int
    stdout: str
    stderr: str
    truncated: bool
    seconds: float
    guarantees: Guarantees
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.status == "ok"

    def to_dict(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["guarantees"] = self.guarantees.to_dict()
        doc["passed"] = self.passed
        return doc


class SandboxError(RuntimeError):
    """The sandbox server could not be started."""


class CandidateGone(BaseException):
    """The completion's process ended (or its channel broke) while a call was in flight.
    A BaseException: a test's ``except Exception`` must not swallow it."""


class CallTimeout(BaseException):
    """The task's wall clock ran out while waiting for the completion."""


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
        self._calls = -1
        self._replies = -1
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
        calls_r, self._calls = os.pipe()
        self._replies, replies_w = os.pipe()
        argv = [
            *self._prefix,
            self._python,
            "-I",
            "-S",
            "-B",
            str(SERVER),
            f"--channel={calls_r},{replies_w}",
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
                pass_fds=(calls_r, replies_w),
                start_new_session=True,
            )
        finally:
            os.close(calls_r)
            os.close(replies_w)
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
        for fd in (self._calls, self._replies):
            if fd >= 0:
                os.close(fd)
        self._calls = self._replies = -1

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
        ``channel.result``."""
        limits = limits or Limits()
        self._ensure_started()
        assert self._proc is not None and self._proc.stdout is not None
        sandbox_shared.drain(self._replies)  # what an earlier task wrote and nobody read
        deadline = time.monotonic() + limits.wall_seconds
        channel = Channel(self._calls, self._replies, self._proc.stdout.fileno(), deadline)
        request = {
            "op": "serve",
            "source": source.encode(),
            "entry_point": entry_point,
            "limits": asdict(limits),
        }
        sent = True
        try:
            self._send(request)
        except OSError:
            sent = False
            channel.gone = True
        try:
            yield channel
        finally:
            if sent:
                with contextlib.suppress(OSError):
                    self._send({"op": "stop"})
            channel.result = self._result(limits)


class Channel:
    """The evaluator's end of a served completion: :meth:`call` sends plain arguments and
    returns the plain value that came back (or raises what the completion raised)."""

    def __init__(self, calls: int, replies: int, server: int, deadline: float) -> None:
        self._calls = calls
        self._replies = replies
        self._server = server
        self.deadline = deadline
        self._seq = 0
        self.gone = False
        self.result: Result | None = None
        self.calls = 0

    def _frame(self) -> dict[str, Any]:
        """The next frame from the completion, within the deadline."""
        header = self._read(4)
        size = int.from_bytes(header, "big")
        if size > MAX_FRAME:
            raise CandidateGone(f"a reply of {size} bytes (the cap is {MAX_FRAME})")
        body = self._read(size)
        try:
            doc = json.loads(body)
        except ValueError as exc:
            raise CandidateGone(f"a reply that is not JSON: {exc}") from None
        if not isinstance(doc, dict):
            raise CandidateGone("a reply that is not an object")
        return doc

    def _read(self, n: int) -> bytes:
        chunks: list[bytes] = []
        while n:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise CallTimeout
            ready, _, _ = select.select([self._replies, self._server], [], [], left)
            if self._replies in ready:
                chunk = os.read(self._replies, min(n, 1 << 20))
                if not chunk:
                    raise CandidateGone("the sandbox server is gone")
                chunks.append(chunk)
                n -= len(chunk)
            elif ready:  # the server says the task exited
                self.gone = True
                raise CandidateGone("the completion's process exited")
        return b"".join(chunks)

    def ready(self) -> dict[str, Any]:
        """The completion's first frame: ``{"ready": True}`` or ``{"load_error": ...}``."""
        if self.gone:
            raise CandidateGone("the sandbox server is gone")
        while True:
            doc = self._frame()
            if doc.get("id") == 0:
                return doc

    def call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        from rtrl_trainer import plain_values

        if self.gone:
            raise CandidateGone("the completion's process exited")
        self._seq += 1
        self.calls += 1
        message = {
            "id": self._seq,
            "args": plain_values.encode(list(args)),
            "kwargs": plain_values.encode(kwargs),
        }
        data = json.dumps(message, allow_nan=False).encode()
        self._write(len(data).to_bytes(4, "big") + data)
        while True:
            doc = self._frame()
            if doc.get("id") == self._seq:
                return doc

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        os.set_blocking(self._calls, False)
        try:
            while view:
                left = self.deadline - time.monotonic()
                if left <= 0:
                    raise CallTimeout
                _, ready, _ = select.select([], [self._calls], [], left)
                if ready:
                    try:
                        view = view[os.write(self._calls, view) :]
                    except BlockingIOError:
                        continue
        finally:
            os.set_blocking(self._calls, True)


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


@contextlib.contextmanager
def pool(size: int, **options: Any) -> Iterator[queue.SimpleQueue[Sandbox]]:
    """``size`` sandbox servers (started in parallel) in a queue: a worker takes one, runs
    a task, puts it back. ``options`` go to :class:`Sandbox`."""
    sandboxes: queue.SimpleQueue[Sandbox] = queue.SimpleQueue()
    started: list[Sandbox] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def start() -> None:
        try:
            box = Sandbox(**options)
        except BaseException as exc:
            errors.append(exc)
            return
        with lock:
            started.append(box)

    try:
        threads = [threading.Thread(target=start) for _ in range(size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise SandboxError(f"a sandbox server did not start: {errors[0]}")
        for box in started:
            sandboxes.put(box)
        yield sandboxes
    finally:
        for box in started:  # all servers exit at once, then wait for each
            box._hang_up()
        for box in started:
            box.close()


def map_in_pool(
    size: int, items: Sequence[_T], run: Callable[[Sandbox, _T], Result], **options: Any
) -> list[Result]:
    """``run(sandbox, item)`` for every item, ``size`` at a time, results in order."""
    from concurrent.futures import ThreadPoolExecutor

    size = max(1, min(size, len(items)))
    with pool(size, **options) as boxes:
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
