"""The tasks' seccomp filter: an allow-list, compiled by libseccomp.

A task computes alone: it reads the standard library, allocates, keeps time, answers calls
on its own two pipes and writes its two memory files. Only the system calls that needs are
on the list below; every other one fails with ``EPERM`` (``clone3`` with ``ENOSYS``, so the
C library falls back to ``clone``, whose flags a filter can see), including calls no one
has thought of yet and calls added to the kernel later. The list names calls, never
numbers: libseccomp (``libseccomp.so.2``, the library behind Docker's, systemd's and
Chromium's filters; Debian's ``libseccomp2``, which apt itself depends on) resolves the
names for this architecture, checks the architecture (a call through another ABI, x32 or
i386, kills the process) and assembles the BPF program. This module only drives it, through
``ctypes``, as its Python binding would; the server (``python -I -S``: standard library
only) loads it from this directory and builds the two programs once, at start.

What is *not* on the list, on purpose: any socket (``socket``, ``socketpair``: a task's
pipes are all it talks through, and a pathname UNIX socket is a node's runtime or bus);
scheduling, priority or affinity of any process but the task itself (``pid`` 0 only, never
``PRIO_USER`` or ``PRIO_PGRP``); watching files (``inotify``, ``fanotify``, and
``fcntl(F_NOTIFY)``: a watch on a hidden path shows it exists and when it is read); new
processes and threads (``clone``, ``fork``: one process, so the address-space cap is the
cap of the whole task; with ``processes`` > 1, ``fork`` and ``clone`` without namespace
flags); ``execve``; ``ptrace``; namespaces, mounts, keyrings, ``bpf``, ``io_uring``, System
V and POSIX IPC, ``memfd_create``, ``userfaultfd``, ``perf_event_open``; ``fcntl`` beyond
descriptor flags (no pipe sizes, leases, locks or owners) and ``ioctl`` beyond the
terminal and ``FIO*`` queries Python makes on its own descriptors; ``open`` for anything
but reading, and every call that changes a file (``unlink``, ``rename``, ``mkdir``,
``chmod``, ``truncate``...): Landlock already forbids writes, this holds without it.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import hashlib
import os
import termios
from typing import NamedTuple


class Arg(NamedTuple):
    """A condition on argument number ``position``: ``(arg & mask) == value``."""

    position: int
    value: int
    mask: int = 0xFFFFFFFF  # the arguments compared are C ints: the kernel reads 32 bits


# Rules: a call name and None (any arguments) or alternatives, each a tuple of conditions
# that must all hold.
Rule = tuple[tuple[Arg, ...], ...] | None
_SELF = ((Arg(0, 0),),)  # the first argument is a pid: 0, the task itself
_PR_GET_DUMPABLE, _PR_GET_NAME, _PR_GET_SECCOMP, _PR_CAPBSET_READ, _PR_GET_NO_NEW_PRIVS = (
    3,
    16,
    21,
    23,
    39,
)  # <linux/prctl.h>: no standard module names them
_IOCTLS = (
    termios.TCGETS,
    termios.TIOCGWINSZ,
    termios.FIONREAD,
    termios.FIONBIO,
    termios.FIOCLEX,
    termios.FIONCLEX,
)
_FCNTLS = (
    fcntl.F_DUPFD,
    fcntl.F_DUPFD_CLOEXEC,
    fcntl.F_GETFD,
    fcntl.F_SETFD,
    fcntl.F_GETFL,
    fcntl.F_SETFL,
)
# Open flags that write, create or truncate (O_TMPFILE includes O_DIRECTORY: its own bit).
_WRITING = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_WRITING |= os.O_TMPFILE & ~os.O_DIRECTORY
# CLONE_NEWTIME, NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET (<linux/sched.h>)
CLONE_NAMESPACES = 0x80 | 0x20000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000
CLONE_NAMESPACES |= 0x20000000 | 0x40000000

_ANY: Rule = None
ALLOWED: dict[str, Rule] = {
    # its own descriptors: the two pipes, the memory files, /dev/null, what it opens
    **dict.fromkeys(
        ("read", "readv", "pread64", "preadv", "preadv2", "write", "writev", "pwrite64"),
        _ANY,
    ),
    **dict.fromkeys(("pwritev", "pwritev2", "lseek", "close", "close_range"), _ANY),
    **dict.fromkeys(("dup", "dup2", "dup3", "poll", "ppoll", "select", "pselect6"), _ANY),
    "fcntl": tuple((Arg(1, cmd),) for cmd in _FCNTLS),
    "ioctl": tuple((Arg(1, request, 0xFFFFFFFF),) for request in _IOCTLS),
    # paths, under Landlock's rules (read the standard library, write nothing), opened for
    # reading only (openat2's flags are behind a pointer: not on the list)
    "open": ((Arg(1, 0, _WRITING),),),
    "openat": ((Arg(2, 0, _WRITING),),),
    **dict.fromkeys(("stat", "lstat", "fstat", "newfstatat", "statx"), _ANY),
    **dict.fromkeys(("access", "faccessat", "faccessat2", "readlink", "readlinkat"), _ANY),
    **dict.fromkeys(("getdents64", "getcwd", "chdir", "fchdir", "umask"), _ANY),
    # memory (capped by RLIMIT_AS)
    **dict.fromkeys(("brk", "mmap", "munmap", "mremap", "mprotect", "madvise"), _ANY),
    # time
    **dict.fromkeys(("clock_gettime", "clock_getres", "gettimeofday", "time"), _ANY),
    **dict.fromkeys(("nanosleep", "clock_nanosleep", "alarm", "setitimer", "getitimer"), _ANY),
    # signals: Landlock scopes them to the task's own domain (checked: separate_identity)
    **dict.fromkeys(
        ("rt_sigaction", "rt_sigprocmask", "rt_sigreturn", "rt_sigpending", "sigaltstack"),
        _ANY,
    ),
    **dict.fromkeys(("rt_sigsuspend", "rt_sigtimedwait", "pause", "kill", "tkill"), _ANY),
    "tgkill": _ANY,
    # who and where it is
    **dict.fromkeys(
        ("getpid", "getppid", "gettid", "getuid", "geteuid", "getgid", "getegid"), _ANY
    ),
    **dict.fromkeys(("getgroups", "getresuid", "getresgid", "getpgrp", "capget"), _ANY),
    **dict.fromkeys(("uname", "getrusage", "times", "getrandom", "getcpu"), _ANY),
    "getpgid": _SELF,
    "getsid": _SELF,
    "prctl": tuple(
        (Arg(0, option),)
        for option in (
            _PR_GET_DUMPABLE,
            _PR_GET_NAME,
            _PR_GET_SECCOMP,
            _PR_CAPBSET_READ,
            _PR_GET_NO_NEW_PRIVS,
        )
    ),
    # its own resource limits, scheduling and priority only
    "prlimit64": _SELF,
    "getpriority": ((Arg(0, os.PRIO_PROCESS), Arg(1, 0)),),
    "setpriority": ((Arg(0, os.PRIO_PROCESS), Arg(1, 0)),),
    **dict.fromkeys(
        ("sched_getaffinity", "sched_setaffinity", "sched_getscheduler", "sched_setscheduler"),
        _SELF,
    ),
    **dict.fromkeys(("sched_getparam", "sched_setparam", "sched_getattr", "sched_setattr"), _SELF),
    "sched_yield": _ANY,
    # locks of its own memory, and the end
    **dict.fromkeys(("futex", "set_robust_list", "rseq", "exit", "exit_group"), _ANY),
}
# With Limits.processes > 1: new processes, none in a new namespace (threads included).
FORKING: dict[str, Rule] = {
    **dict.fromkeys(("fork", "vfork", "wait4", "waitid", "set_tid_address"), _ANY),
    "clone": ((Arg(0, 0, CLONE_NAMESPACES),),),
}
# Denied with ENOSYS rather than EPERM: the C library then falls back to ``clone``.
FALL_BACK = ("clone3",)

# <seccomp.h>
_ACT_KILL_PROCESS = 0x80000000
_ACT_ALLOW = 0x7FFF0000
_ACT_ERRNO = 0x00050000
_FLTATR_ACT_BADARCH = 2
_FLTATR_CTL_OPTIMIZE = 8
_CMP_MASKED_EQ = 7


class _ArgCmp(ctypes.Structure):
    _fields_ = [
        ("arg", ctypes.c_uint),
        ("op", ctypes.c_int),
        ("datum_a", ctypes.c_uint64),
        ("datum_b", ctypes.c_uint64),
    ]


class _Version(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint), ("minor", ctypes.c_uint), ("micro", ctypes.c_uint)]


class SeccompUnavailableError(RuntimeError):
    """libseccomp is missing or refused the filter: tasks get no filter, and the check
    names the guarantees that are then missing."""


def _library() -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL("libseccomp.so.2", use_errno=True)
    except OSError as exc:
        raise SeccompUnavailableError(
            f"libseccomp.so.2 cannot be loaded ({exc}): install libseccomp2"
        ) from None
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    lib.seccomp_attr_set.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [
        ctypes.c_void_p,
        ctypes.c_uint32,
        ctypes.c_int,
        ctypes.c_uint,
        ctypes.POINTER(_ArgCmp),
    ]
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.seccomp_version.restype = ctypes.POINTER(_Version)
    return lib


def version() -> str:
    """libseccomp's version, e.g. ``2.5.4``."""
    found = _library().seccomp_version().contents
    return f"{found.major}.{found.minor}.{found.micro}"


def resolve(name: str) -> int:
    """The number of system call ``name`` on this architecture (libseccomp's table); a
    negative number where it has none here."""
    return int(_library().seccomp_syscall_resolve_name(name.encode()))


def rules(no_fork: bool) -> dict[str, Rule]:
    """The allow-list of a task: one process, or (``no_fork`` False) a process tree."""
    return dict(ALLOWED) if no_fork else {**ALLOWED, **FORKING}


def compile_filter(no_fork: bool) -> bytes:
    """The BPF program (``struct sock_filter[]``) for :func:`rules`, as libseccomp builds it;
    :class:`SeccompUnavailableError` if it cannot."""
    lib = _library()
    ctx = lib.seccomp_init(_ACT_ERRNO | errno.EPERM)
    if not ctx:
        raise SeccompUnavailableError("seccomp_init failed")
    try:
        _check(lib.seccomp_attr_set(ctx, _FLTATR_ACT_BADARCH, _ACT_KILL_PROCESS), "badarch")
        lib.seccomp_attr_set(ctx, _FLTATR_CTL_OPTIMIZE, 2)  # a binary tree (2.5+), if known
        for name, alternatives in rules(no_fork).items():
            for conditions in alternatives if alternatives is not None else ((),):
                _add(lib, ctx, _ACT_ALLOW, name, conditions)
        for name in FALL_BACK:
            _add(lib, ctx, _ACT_ERRNO | errno.ENOSYS, name, ())
        fd = os.memfd_create("seccomp-bpf", os.MFD_CLOEXEC)
        try:
            _check(lib.seccomp_export_bpf(ctx, fd), "seccomp_export_bpf")
            size = os.fstat(fd).st_size
            program = os.pread(fd, size, 0)
        finally:
            os.close(fd)
    finally:
        lib.seccomp_release(ctx)
    if not program or len(program) % 8:
        raise SeccompUnavailableError(
            f"libseccomp exported {len(program)} bytes, not a BPF program"
        )
    return program


def _add(lib: ctypes.CDLL, ctx: int, action: int, name: str, conditions: tuple[Arg, ...]) -> None:
    number = lib.seccomp_syscall_resolve_name(name.encode())
    if number == -1:  # unknown to this libseccomp: not allowed, which is fail-closed
        return
    compare = (_ArgCmp * max(len(conditions), 1))(
        *(_ArgCmp(c.position, _CMP_MASKED_EQ, c.mask, c.value) for c in conditions)
    )
    _check(lib.seccomp_rule_add_array(ctx, action, number, len(conditions), compare), name)


def _check(code: int, what: str) -> None:
    if code < 0:
        raise SeccompUnavailableError(f"libseccomp refused {what}: {os.strerror(-code)}")


def fingerprint(program: bytes) -> str:
    """A short hash of a program, so a run records which filter its tasks had."""
    return hashlib.sha256(program).hexdigest()[:16]
