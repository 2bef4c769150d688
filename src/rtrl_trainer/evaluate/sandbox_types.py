"""What a sandboxed run is given and what it returns, on the evaluator's side: the limits
of a task, the guarantees the server's check held (:data:`GUARANTEE_MEANING`), a task's
result, and the errors of a run. Shared by :mod:`.sandbox` (the server), :mod:`.sandbox_channel`
(a served completion's call channel) and the graders."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from rtrl_trainer.evaluate.plain_values import MAX_DEPTH
from rtrl_trainer.evaluate.sandbox_shared import GUARANTEES

# What one reply of a served completion may be, checked on its raw bytes before it is
# decoded (the suites' largest honest reply is 200 bytes and 50 items): its size, its items
# (values, keys included) and nesting on the wire (a value nested MAX_DEPTH deep, each
# container a tagged object, in the reply's own object); and what all the replies of one
# task may add up to, as they are kept until the tests run.
MAX_REPLY_BYTES = 1 << 20
MAX_REPLY_ITEMS = 100_000
MAX_REPLY_DEPTH = 3 * MAX_DEPTH + 2
MAX_TASK_REPLY_BYTES = 16 << 20

GUARANTEE_MEANING = {
    "separate_identity": "a task cannot signal the evaluator or read its /proc files",
    "no_ptrace": "a task cannot trace the evaluator or the sandbox server",
    "no_network": "a task cannot open a socket of any family (UNIX included)",
    "memory_capped": "the memory cap holds for a task's whole process tree",
    "suite_unreadable": "a task cannot read the suites, their solutions or the secrets",
    "no_fs_writes": "a task cannot write anywhere (/tmp, /dev/shm included)",
    "no_namespaces": "a task cannot create namespaces (unshare, clone flags)",
    "no_scheduling": "a task cannot change the scheduling, priority or CPU affinity of any "
    "process but itself (nor of its user's processes)",
    "no_watching": "a task cannot watch files or directories (inotify, fanotify, F_NOTIFY)",
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
