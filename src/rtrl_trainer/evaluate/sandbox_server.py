"""The sandbox's fork server: run as ``python -I -S -B sandbox_server.py ROOT ...`` by
:class:`rtrl_trainer.evaluate.sandbox.Sandbox`, never imported by the evaluator.

Starting an interpreter per task costs ~8 ms, against ~60 µs for the tests of a task. So
the server starts once (per evaluation and worker), prepares what every task inherits, and
every task is a fresh process forked from it. What a task's process gets, in this order:

- a new session; stdin a ``/dev/null`` of its own, stdout/stderr size-capped memory files,
  the task's own two call pipes (fds 3 and 4, :mod:`rtrl_trainer.evaluate.grader`): made by
  the evaluator for this task alone and received with its request (``SCM_RIGHTS``), the
  server keeps no copy; nothing else open, so nothing the task sets on a descriptor (a
  pipe's size, a file's flags) reaches another task;
- where the server may switch users (root with CAP_SETUID/CAP_SETGID): an unused user id
  of its own, so nothing of the evaluator's can be signalled, traced or read;
- not dumpable; ``no_new_privs``; the rlimits (address space, CPU seconds, file size, open
  files, core dumps); the parent-death signal (a task never outlives its server);
- a **Landlock** domain (Linux 5.13+; the ruleset is built once, here): read access only
  to the interpreter's standard library and the shared libraries it maps — not to
  site-packages, where the suites and their solutions live, not to ``/proc``, ``/etc``,
  ``/tmp`` or any secret the evaluator names with ``--secret`` —, no write anywhere, no TCP
  bind or connect (ABI 4), and, ABI 6 (Linux 6.12), no signal to and no abstract socket of
  any process outside the domain. Landlock also forbids tracing such processes;
- a **seccomp** filter, an allow-list compiled by libseccomp (:mod:`sandbox_seccomp`; both
  programs built once, here): the calls a process computing alone needs and nothing else,
  so no new process or thread (the address-space cap is the cap of the whole task), no
  socket of any family, no ``execve``, ``ptrace`` or namespace, no scheduling, priority or
  affinity but its own, no file watches, ``fcntl`` and ``ioctl`` for descriptor flags and
  terminal queries only. Every other call fails with ``EPERM`` (``clone3`` with
  ``ENOSYS``, so the C library falls back to ``clone``, whose flags the filter can see).

None of this needs a privilege: it holds as the eval pod's uid 1000 with every capability
dropped. At start, a check child takes the same steps and then *attacks*: it tries to
signal and trace the server, read its ``/proc`` files and the secrets, open a socket of
each family, create a file in ``/tmp``, ``unshare`` and ``fork``, set the server's
scheduling and priority (to what they are) and a user's, watch a file. Each guarantee is
what it saw, not what was configured; the hello message carries them
(:class:`rtrl_trainer.evaluate.sandbox.Guarantees`) with the reason of each one missing,
and the evaluator fails closed on them.

Two kinds of request: ``run`` executes a program as ``__main__`` (its exit status is the
result); ``serve`` loads a completion's source as a module and answers calls of its entry
point over the call channel (:func:`_serve`) until the evaluator sends ``stop``; then the
task is killed. Only the standard library is used (plus :mod:`plain_values`,
:mod:`sandbox_seccomp` and :mod:`sandbox_shared`, from this directory; libseccomp through
``ctypes``). Protocol on stdin/stdout: 4-byte big-endian length
+ a :mod:`marshal`-ed dict (two trusted processes); a hello, then one response per
request; exit at end of input.

Why one file of ~900 lines, against the 400 of every other module: it is a standalone
script, not a module of the evaluator. Every module it imports is paid for at start-up and
is one more file a task's Landlock domain must be able to read, so it imports only the
standard library and the three small files beside it; and the steps above (the task's set-up,
the Landlock and seccomp rules, the check child's attacks, the request loop) are one
sequence that reads top to bottom, each step relying on the one before.
"""

from __future__ import annotations

import ctypes
import gc
import io
import marshal
import os
import resource
import select
import socket
import struct
import sys
import time
import types

# The two helpers of this directory (standard library only), on purpose: see above.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import plain_values
import sandbox_seccomp
import sandbox_shared

del sys.path[0]

PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_SECCOMP = 22
PR_CAPBSET_DROP = 24
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38
SECCOMP_MODE_FILTER = 2
SIGKILL = 9  # not from the signal module: it imports enum, and every module costs each fork
# Exit status of a child whose own setup failed (the error is on its stderr).
SETUP_FAILED = 121
# Task user ids: a random one far above any real account, one per server.
_UID_BASE = 1_500_000_000
_UID_SPAN = 500_000_000
_MAX_FD = 1 << 16
CALLS_FD, REPLIES_FD, RULESET_FD = 3, 4, 5
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
MAX_FRAME = 16 << 20

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_prctl = _libc.prctl
_prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
_prctl.restype = ctypes.c_int

# --- seccomp ---------------------------------------------------------------------------
# The allow-list and its compilation by libseccomp: sandbox_seccomp.py.


class _Fprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


# --- Landlock --------------------------------------------------------------------------

_LL_CREATE, _LL_ADD, _LL_RESTRICT = 444, 445, 446
_LL_VERSION = 1
_LL_RULE_PATH_BENEATH = 1
_FS_EXECUTE, _FS_READ_FILE, _FS_READ_DIR = 1 << 0, 1 << 2, 1 << 3
_FS_ALL_V1 = (1 << 13) - 1
_FS_REFER, _FS_TRUNCATE, _FS_IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
_NET_ALL = (1 << 0) | (1 << 1)  # BIND_TCP, CONNECT_TCP
_SCOPE_ALL = (1 << 0) | (1 << 1)  # ABSTRACT_UNIX_SOCKET, SIGNAL


def landlock_abi() -> int:
    """The kernel's Landlock ABI version; 0 without Landlock (or where seccomp denies it)."""
    abi = _libc.syscall(_LL_CREATE, None, 0, _LL_VERSION)
    return max(int(abi), 0)


def _secret_roots(secrets: list[str]) -> list[str]:
    """What tasks must never read: the site-packages dirs of this interpreter (the suites
    and their solutions are installed there), plus the evaluator's ``--secret`` paths."""
    import sysconfig

    found = set()
    prefixes = {sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix}
    for scheme in ("posix_prefix", "posix_local", "deb_system", "venv"):
        if scheme not in sysconfig.get_scheme_names():
            continue
        for prefix in prefixes:
            variables = {"base": prefix, "platbase": prefix, "installed_base": prefix}
            for key in ("purelib", "platlib"):
                found.add(sysconfig.get_path(key, scheme, variables))
    for prefix in prefixes:
        for sub in ("lib/python3/dist-packages", "local/lib/python3/dist-packages"):
            found.add(os.path.join(prefix, sub))
    found.update(secrets)
    return sorted({os.path.realpath(p) for p in found})


def _readable_roots() -> list[str]:
    """What a task needs to import the standard library: its dirs and the dirs of the
    shared libraries this process maps (extension modules load more from there)."""
    roots = {os.path.dirname(os.path.realpath(os.__file__))}
    roots.update(os.path.realpath(p) for p in sys.path if os.path.isdir(p))
    with open("/proc/self/maps") as f:
        for line in f:
            path = line.split(None, 5)[-1].strip() if line.count(" ") >= 5 else ""
            if path.startswith("/") and ".so" in os.path.basename(path):
                roots.add(os.path.dirname(os.path.realpath(path)))
    return sorted(roots)


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _ruleset(abi: int, hidden: list[str]) -> tuple[int, str]:
    """A Landlock ruleset fd for the tasks (read-only standard library, nothing else), or
    (-1, why not)."""
    if abi < 1:
        return -1, "Landlock is not available (kernel < 5.13, disabled, or denied by seccomp)"
    handled_fs = _FS_ALL_V1
    if abi >= 2:
        handled_fs |= _FS_REFER
    if abi >= 3:
        handled_fs |= _FS_TRUNCATE
    if abi >= 5:
        handled_fs |= _FS_IOCTL_DEV
    attr = struct.pack(
        "=QQQ", handled_fs, _NET_ALL if abi >= 4 else 0, _SCOPE_ALL if abi >= 6 else 0
    )
    size = 8 if abi < 4 else 16 if abi < 6 else 24
    buf = ctypes.create_string_buffer(attr, 24)
    fd = int(_libc.syscall(_LL_CREATE, buf, size, 0))
    if fd < 0:
        return -1, f"landlock_create_ruleset failed: {os.strerror(ctypes.get_errno())}"
    read_dir = _FS_READ_FILE | _FS_READ_DIR

    def allow(path: str) -> None:
        if any(_inside(h, path) for h in hidden):  # a secret inside: allow around it
            if any(_inside(path, h) for h in hidden):
                return
            try:
                entries = os.listdir(path)
            except OSError:
                return
            for name in entries:
                child = os.path.join(path, name)
                if os.path.isdir(child) and not os.path.islink(child):
                    allow(child)
                elif os.path.isfile(child) and not os.path.islink(child):
                    add(child, _FS_READ_FILE)
            return
        add(path, read_dir if os.path.isdir(path) else _FS_READ_FILE)

    def add(path: str, access: int) -> None:
        try:
            target = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            return
        rule = _PathBeneath(access, target)
        _libc.syscall(_LL_ADD, fd, _LL_RULE_PATH_BENEATH, ctypes.byref(rule), 0)
        os.close(target)

    for root in _readable_roots():
        allow(root)
    return fd, ""


# --- the server ------------------------------------------------------------------------


def _task_uid() -> int | None:
    """An unused user id for this server's tasks, or None where we cannot switch users."""
    if os.geteuid() != 0:
        return None
    uid = _UID_BASE + int.from_bytes(os.urandom(4), "big") % _UID_SPAN
    try:
        maps = []
        for name in ("/proc/self/uid_map", "/proc/self/gid_map"):
            with open(name) as f:
                maps.append([[int(x) for x in line.split()] for line in f if line.strip()])
    except OSError:
        return None
    if all(any(inside <= uid < inside + n for inside, _, n in ranges) for ranges in maps):
        return uid
    return None


GUARANTEES = sandbox_shared.GUARANTEES


class Server:
    def __init__(
        self,
        secrets: list[str],
        task_user: bool,
        evaluator: int | None,
        pipes: socket.socket,
        without: set[str],
    ) -> None:
        self.hidden = _secret_roots(secrets)
        self.evaluator = evaluator
        self.pipes = pipes
        self.uid = _task_uid() if task_user else None
        self.abi = 0 if "landlock" in without else landlock_abi()
        self.ruleset, self.landlock_reason = _ruleset(self.abi, self.hidden)
        if "landlock" in without:
            self.landlock_reason = "Landlock left out (--without=landlock)"
        self.filters: dict[bool, bytes | None] = {True: None, False: None}
        self.seccomp: dict[str, object] = {"reason": "seccomp left out (--without=seccomp)"}
        if "seccomp" not in without:
            try:  # libseccomp builds both programs once, here; each task installs one
                self.filters = {f: sandbox_seccomp.compile_filter(f) for f in (True, False)}
                self.seccomp = {
                    "generator": f"libseccomp {sandbox_seccomp.version()}",
                    "allowed": sorted(sandbox_seccomp.rules(True)),
                    "instructions": len(self.filters[True] or b"") // 8,
                    "sha256": sandbox_seccomp.fingerprint(self.filters[True] or b""),
                }
            except sandbox_seccomp.SeccompUnavailableError as exc:
                self.seccomp = {"reason": str(exc)}
        # The check child sets the server's scheduling and priority to what they are.
        self.scheduling = (os.sched_getscheduler(0), os.sched_getparam(0))
        self.nice = os.getpriority(os.PRIO_PROCESS, 0)
        _prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        self.guarantees, self.reasons = self._check()
        if self.uid is not None and not self.guarantees.get("_setup", False):
            self.uid = None  # the task user cannot run here: check again without it
            self.guarantees, self.reasons = self._check()
        self.guarantees.pop("_setup", None)

    # The check child: the task's setup, then every attack a guarantee is about.
    def _check(self) -> tuple[dict[str, bool], dict[str, str]]:
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            doc: dict[str, object] = {}
            try:
                os.close(read_end)
                check_limits = {
                    "memory_bytes": 256 << 20,
                    "cpu_seconds": 5,
                    "output_bytes": 1 << 16,
                    "open_files": 64,
                }
                ruleset = os.dup(self.ruleset) if self.ruleset >= 0 else -1
                _setup(self, _rlimits(check_limits), True, ruleset)
                # A task imports the standard library: its user must be able to read it
                # (a task user cannot, where the interpreter lives under a 0700 /root).
                with open(os.path.join(os.path.dirname(os.__file__), "types.py"), "rb") as f:
                    f.read(1)
                doc = _attack(self.hidden, self.evaluator)
                doc.update(_attack_the_host(self.scheduling, self.nice))
                doc["_setup"] = True
            except BaseException as exc:
                doc = {"_setup": False, "_error": f"{type(exc).__name__}: {exc}"}
            finally:
                os.write(write_end, marshal.dumps(doc))
                os._exit(0)
        os.close(write_end)
        data = b""
        while chunk := os.read(read_end, 1 << 16):
            data += chunk
        os.close(read_end)
        os.waitpid(pid, 0)
        for directory in _WRITABLE:  # what the check child created where it could
            try:  # noqa: SIM105 - contextlib is not imported: the server imports little
                os.unlink(os.path.join(directory, f".rtrl-check-{pid}"))
            except OSError:
                pass
        found: dict[str, object] = marshal.loads(data) if data else {"_setup": False}
        held = {name: found.get(name) is None for name in GUARANTEES}
        reasons = {name: str(found[name]) for name in GUARANTEES if found.get(name) is not None}
        if not found.get("_setup"):
            held = dict.fromkeys(GUARANTEES, False)
            reasons = dict.fromkeys(GUARANTEES, f"task setup failed: {found.get('_error')}")
        if self.ruleset < 0:
            for name in ("suite_unreadable", "no_fs_writes"):
                if not held[name]:
                    reasons[name] += f" ({self.landlock_reason})"
        if self.filters[True] is None:
            for name in ("no_network", "no_namespaces", "no_scheduling", "no_watching"):
                if not held[name]:
                    reasons[name] += f" ({self.seccomp['reason']})"
        held["_setup"] = bool(found.get("_setup"))
        return held, reasons

    def hello(self) -> dict[str, object]:
        return {
            "pid": os.getpid(),
            "uid": self.uid,
            "landlock_abi": self.abi,
            "seccomp": self.seccomp,
            "guarantees": self.guarantees,
            "reasons": self.reasons,
        }

    def run(
        self, request: dict[str, object], requests: int, responses: int
    ) -> dict[str, object] | None:
        op = request["op"]
        if op == "stop":  # a stop that came after the wall clock had ended the task
            return None
        # A serve request's pipes first, whatever else is wrong with it: left unread, they
        # would be the next task's.
        channel = self._task_pipes() if op == "serve" else None
        try:
            source = request["source"]
            entry = request.get("entry_point")
            if op not in ("run", "serve") or not isinstance(source, bytes):
                raise ValueError(f"bad request: op {op!r}")
            limits: dict[str, int] = request["limits"]  # type: ignore[assignment]
            rlimits = _rlimits(limits)
            no_fork = limits["processes"] <= 1
            out = os.memfd_create("stdout")
            err = os.memfd_create("stderr")
            start = time.perf_counter()
            pid = os.fork()
            if pid == 0:  # pragma: no cover - the child never returns
                _child(self, op, source, entry, rlimits, no_fork, out, err, channel)
        finally:
            for fd in channel or ():  # the task's alone from now on
                os.close(fd)
        wall = float(limits["wall_seconds"])
        if op == "serve":
            timed_out = self._serve_until_stop(pid, requests, responses, start + wall)
        else:
            timed_out = _wait_exit(pid, wall)
        self._kill_task(pid)
        _, status = os.waitpid(pid, 0)
        self._reap()
        seconds = time.perf_counter() - start
        cap = limits["output_bytes"]
        stdout = os.pread(out, cap + 1, 0)
        stderr = os.pread(err, cap + 1, 0)
        os.close(out)
        os.close(err)
        memory_capped = self.guarantees["memory_capped"] and (no_fork or self.uid is not None)
        return {
            "returncode": os.waitstatus_to_exitcode(status),
            "timed_out": timed_out,
            "stdout": stdout[:cap],
            "stderr": stderr[:cap],
            # RLIMIT_FSIZE stops the memory files at the cap (the task gets EFBIG)
            "truncated": len(stdout) >= cap or len(stderr) >= cap,
            "seconds": seconds,
            "guarantees": {**self.guarantees, "memory_capped": memory_capped},
        }

    def _task_pipes(self) -> tuple[int, int]:
        """The two pipe ends the evaluator sent with a serve request (it sends them first)."""
        self.pipes.setblocking(False)
        try:
            _, fds, _, _ = socket.recv_fds(self.pipes, 1, 2)
        except BlockingIOError:
            fds = []
        finally:
            self.pipes.setblocking(True)
        if len(fds) != 2:
            for fd in fds:
                os.close(fd)
            raise ValueError("bad request: a serve request without its two pipes")
        return fds[0], fds[1]

    @staticmethod
    def _serve_until_stop(pid: int, requests: int, responses: int, deadline: float) -> bool:
        """While a completion serves calls: wait for the evaluator's ``stop``; if the task
        exits first, say so at once (the evaluator is waiting for a reply that will never
        come), then still wait for the stop. True if the wall clock ran out first."""
        pidfd = os.pidfd_open(pid)
        try:
            watched = [requests, pidfd]
            while True:
                left = deadline - time.perf_counter()
                ready, _, _ = select.select(watched, [], [], max(left, 0))
                if not ready:
                    return True
                if requests in ready:
                    _read_frame(requests)
                    return False
                _send(responses, {"event": "exited"})
                watched = [requests]
        finally:
            os.close(pidfd)

    def _kill_task(self, pid: int) -> None:
        """Kill the task and everything it started, whatever session or group it moved to."""
        try:  # noqa: SIM105 - contextlib is not imported: the server imports little
            os.kill(pid, SIGKILL)
        except ProcessLookupError:
            pass
        if self.uid is None:
            return
        # As the task's user (the saved uid stays root), kill(-1) reaches exactly the
        # processes of that user, nothing else; then back to root (one thread only).
        os.setresuid(self.uid, self.uid, 0)
        try:
            os.kill(-1, SIGKILL)
        except ProcessLookupError:
            pass
        finally:
            os.setresuid(0, 0, 0)

    def _reap(self) -> None:
        """Kill and reap whatever the task left behind (only where it may fork). The server
        is the subreaper, so each orphan comes back here as a child: until none is left,
        kill the children and wait."""
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                for child in _children():
                    try:  # noqa: SIM105
                        os.kill(child, SIGKILL)
                    except ProcessLookupError:
                        pass
                try:
                    os.waitpid(-1, 0)
                except ChildProcessError:
                    return


# Where the check child tries to create a file.
_WRITABLE = ("/tmp", "/dev/shm", "/var/tmp", os.environ.get("HOME", "/"))


def _attack(hidden: list[str], evaluator: int | None) -> dict[str, object]:
    """Run by the check child after the task setup: for each guarantee, what broke it."""
    import socket

    broken: dict[str, object] = {}
    server = os.getppid()
    effective = (ctypes.c_uint32 * 6)()
    header = (ctypes.c_uint32 * 2)(_LINUX_CAPABILITY_VERSION_3, 0)
    if _libc.capget(header, effective) != 0 or any(effective):
        broken["separate_identity"] = "a task keeps capabilities"
    for target in (server, evaluator):
        if target is None:
            continue
        try:
            os.kill(target, 0)
            broken["separate_identity"] = f"a task can signal pid {target}"
        except OSError:
            pass
        for name in ("environ", "mem"):
            try:
                with open(f"/proc/{target}/{name}", "rb") as f:
                    f.read(1)
                broken["separate_identity"] = f"a task can read /proc/{target}/{name}"
            except OSError:
                pass
        if _libc.ptrace(0x4206, target, None, None) == 0:  # PTRACE_SEIZE: does not stop it
            broken["no_ptrace"] = f"a task can ptrace pid {target}"
    for family, kind in (
        (socket.AF_INET, socket.SOCK_DGRAM),
        (socket.AF_INET6, socket.SOCK_DGRAM),
        (socket.AF_NETLINK, socket.SOCK_DGRAM),
        (socket.AF_UNIX, socket.SOCK_STREAM),  # a pathname one reaches the node's runtime
    ):
        try:
            socket.socket(family, kind).close()
            broken["no_network"] = f"a task can open a socket of family {family}"
        except OSError:
            pass
    try:
        for end in socket.socketpair():
            end.close()
        broken["no_network"] = "a task can make a socket pair"
    except OSError:
        pass
    for path in hidden:
        try:
            if os.path.isdir(path):
                os.listdir(path)
            else:
                with open(path, "rb") as f:
                    f.read(1)
            broken["suite_unreadable"] = f"a task can read {path}"
        except FileNotFoundError:
            pass
        except OSError:
            pass
    for directory in _WRITABLE:
        try:  # the server removes what this leaves (a task may not unlink)
            fd = os.open(
                os.path.join(directory, f".rtrl-check-{os.getpid()}"),
                os.O_WRONLY | os.O_CREAT | os.O_EXCL,
                0o600,
            )
        except OSError:
            continue
        os.close(fd)
        broken["no_fs_writes"] = f"a task can create files in {directory}"
    for flag in (0x10000000, 0x40000000, 0x00020000):  # NEWUSER, NEWNET, NEWNS
        if _libc.unshare(flag) == 0:
            broken["no_namespaces"] = f"a task can unshare({flag:#x})"
    try:
        child = os.fork()
        if child == 0:
            os._exit(0)
        os.waitpid(child, 0)
        broken["memory_capped"] = "a task can fork (its address-space cap is per process)"
    except OSError:
        pass
    if resource.getrlimit(resource.RLIMIT_AS)[0] == resource.RLIM_INFINITY:
        broken["memory_capped"] = "no address-space limit"
    return broken


def _attack_the_host(scheduling: tuple[int, os.sched_param], nice: int) -> dict[str, object]:
    """Run by the check child after the task setup: move the server's scheduling and
    priority (to the values they have: nothing changes if it works), reach every process
    of a user, watch a file. Each guarantee broken says how."""
    import errno

    broken: dict[str, object] = {}
    server = os.getppid()
    policy, param = scheduling
    try:
        os.sched_setscheduler(server, policy, param)
        broken["no_scheduling"] = f"a task can set the scheduling policy of pid {server}"
    except OSError:
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, server, nice)
        broken["no_scheduling"] = f"a task can set the priority of pid {server}"
    except OSError:
        pass
    try:
        os.sched_setaffinity(server, os.sched_getaffinity(0))
        broken["no_scheduling"] = f"a task can set the CPU affinity of pid {server}"
    except OSError:
        pass
    try:  # a user with no process: ESRCH once the call gets through, EPERM if it does not
        os.setpriority(os.PRIO_USER, 0x7FFFFFF0, nice)
        broken["no_scheduling"] = "a task can set the priority of a user's processes"
    except OSError as exc:
        if exc.errno == errno.ESRCH:
            broken["no_scheduling"] = "a task can set the priority of a user's processes"
    fd = _libc.inotify_init1(os.O_CLOEXEC)
    if fd >= 0:
        os.close(fd)
        broken["no_watching"] = "a task can watch files (inotify)"
    try:
        stdlib = os.open(os.path.dirname(os.__file__), os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        stdlib = -1
    if stdlib >= 0:
        f_notify, dn_access = 1026, 0x1  # <linux/fcntl.h>
        if _libc.fcntl(stdlib, f_notify, dn_access) == 0:
            broken["no_watching"] = "a task can watch directories (fcntl F_NOTIFY)"
        os.close(stdlib)
    return broken


def _children() -> list[int]:
    """The pids of this process's children (a /proc scan, only after a task that left
    processes behind)."""
    me = os.getpid()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        if int(stat[stat.rindex(b")") + 2 :].split()[1]) == me:
            found.append(int(name))
    return found


def _rlimits(limits: dict[str, int]) -> list[tuple[int, tuple[int, int]]]:
    """The task's (resource, (soft, hard)) limits, computed before the fork (the server's
    hard limits are the child's): never above a hard limit, which only root may raise.
    With more than one process allowed, the address-space cap is shared out between them
    (and the process count is enforced through the task's own user id)."""
    processes = max(1, int(limits.get("processes", 1)))
    memory = limits["memory_bytes"] // processes
    wanted = (
        (resource.RLIMIT_AS, memory, memory),
        (resource.RLIMIT_FSIZE, limits["output_bytes"], limits["output_bytes"]),
        (resource.RLIMIT_NOFILE, limits["open_files"], limits["open_files"]),
        (resource.RLIMIT_NPROC, processes, processes),
        (resource.RLIMIT_CORE, 0, 0),
        # SIGXCPU at the soft limit (reported as cpu_limit), SIGKILL a second later.
        (resource.RLIMIT_CPU, limits["cpu_seconds"], limits["cpu_seconds"] + 1),
    )
    result = []
    for name, soft, hard in wanted:
        if name == resource.RLIMIT_NPROC and processes <= 1:
            continue  # no fork at all (seccomp); NPROC would count the user's other processes
        current = resource.getrlimit(name)[1]
        capped = hard if current == resource.RLIM_INFINITY else min(hard, current)
        result.append((name, (min(soft, capped), capped)))
    return result


def _setup(
    server: Server, rlimits: list[tuple[int, tuple[int, int]]], no_fork: bool, ruleset: int
) -> None:
    """The task's isolation (module docstring), in the forked child."""
    uid = server.uid
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)  # the kernel clears every capability
    else:  # the server's own user (root, maybe): no capability left either
        _libc.capset((ctypes.c_uint32 * 2)(_LINUX_CAPABILITY_VERSION_3, 0), (ctypes.c_uint32 * 6)())
    for cap in range(64):  # an empty bounding set (EPERM without CAP_SETPCAP: none to drop)
        _prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)
    # A credential change resets the parent-death signal and dumpability: set them after.
    _prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0)
    _prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    if _prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "no_new_privs")
    os.chdir("/")
    os.umask(0o077)
    for name, soft_hard in rlimits:
        resource.setrlimit(name, soft_hard)
    if ruleset >= 0:
        if _libc.syscall(_LL_RESTRICT, ruleset, 0) != 0:
            raise OSError(ctypes.get_errno(), "landlock_restrict_self")
        os.close(ruleset)
    program = server.filters[no_fork]
    if program is not None:
        code = ctypes.create_string_buffer(program, len(program))
        fprog = _Fprog(len(program) // 8, ctypes.addressof(code))
        if _prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(fprog), 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "seccomp")


def _child(  # noqa: PLR0917
    server: Server,
    op: object,
    source: bytes,
    entry: object,
    rlimits: list[tuple[int, tuple[int, int]]],
    no_fork: bool,
    out: int,
    err: int,
    channel: tuple[int, int] | None,
) -> None:
    """The forked task: isolate, run, exit. Never returns. Every descriptor it keeps is its
    own: a /dev/null opened here, its memory files, its pipes (none for ``run``)."""
    try:
        os.setsid()
        # The sources all lie above 5 (the server holds 0-5 open), so no dup2 below
        # overwrites one that is still to be copied.
        null = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(err, 2)
        if channel is not None:
            os.dup2(channel[0], CALLS_FD)
            os.dup2(channel[1], REPLIES_FD)
        ruleset = -1
        if server.ruleset >= 0:
            ruleset = os.dup2(server.ruleset, RULESET_FD)
        os.closerange(CALLS_FD if channel is None else RULESET_FD, RULESET_FD)
        os.closerange(RULESET_FD if ruleset < 0 else RULESET_FD + 1, _MAX_FD)
        _setup(server, rlimits, no_fork, ruleset)
    except BaseException as exc:
        try:
            os.write(2, f"sandbox: task setup failed: {exc!r}\n".encode())
        finally:
            os._exit(SETUP_FAILED)
    if op == "serve":
        os._exit(_serve(source, str(entry)))
    os._exit(_run_main(source))


def _module(name: str, source: bytes, filename: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__file__ = filename
    vars(module)["__builtins__"] = sys.modules["builtins"]
    sys.modules[name] = module
    # Tracebacks show the source without reading a file (a task reads no file of its own).
    import linecache

    text = source.decode("utf-8", "replace")
    linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
    return module


def _run_main(source: bytes) -> int:
    """Run ``source`` as ``__main__`` the way ``python main.py`` would; the exit status."""
    module = _module("__main__", source, "main.py")
    sys.argv = ["main.py"]
    code = 0
    try:
        exec(compile(source, "main.py", "exec"), module.__dict__)
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException as exc:
        tb = exc.__traceback__
        exc.__traceback__ = tb.tb_next if tb is not None else None
        sys.excepthook(type(exc), exc, exc.__traceback__)
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            code = code or 120
    return code


def _send_frame(fd: int, doc: dict[str, object]) -> None:
    import json

    data = json.dumps(doc, allow_nan=False, separators=(",", ":")).encode()
    view = memoryview(len(data).to_bytes(4, "big") + data)
    while view:
        view = view[os.write(fd, view) :]


def _describe(exc: BaseException) -> dict[str, object]:
    return {"raise": type(exc).__name__, "message": str(exc)[:1000]}


def _serve(source: bytes, entry: str) -> int:
    """Load the completion as module ``solution`` and answer calls of ``entry`` with plain
    values (:mod:`plain_values`) until the channel closes. Whatever the completion does to
    this process (exit, patch, print) only changes what it answers, never the verdict."""
    import json

    module = _module("solution", source, "solution.py")
    try:
        exec(compile(source, "solution.py", "exec"), module.__dict__)
        function = module.__dict__[entry]
        if not callable(function):
            raise TypeError(f"{entry} is not callable")
    except BaseException as exc:  # SystemExit included: a load that exits did not load
        tb = exc.__traceback__
        exc.__traceback__ = tb.tb_next if tb is not None else None
        sys.excepthook(type(exc), exc, exc.__traceback__)
        _send_frame(REPLIES_FD, {"id": 0, "load_error": _describe(exc)})
        return 1
    _send_frame(REPLIES_FD, {"id": 0, "ready": True})
    while True:
        frame = _read_frame(CALLS_FD)
        if frame is None:
            return 0
        call = json.loads(frame)
        reply: dict[str, object] = {"id": call["id"]}
        try:
            args = plain_values.loads(json.dumps(call["call"][0]).encode())
            kwargs = plain_values.loads(json.dumps(call["call"][1]).encode())
            reply["value"] = plain_values.encode(function(*args, **kwargs))
        except BaseException as exc:
            reply.update(_describe(exc))
        try:
            _send_frame(REPLIES_FD, reply)
        except ValueError as exc:  # not JSON after all (the completion patched encode)
            _send_frame(REPLIES_FD, {"id": call["id"], **_describe(exc)})


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    try:  # noqa: SIM105
        print(exc.code, file=sys.stderr)
    except BaseException:
        pass
    return 1


def _wait_exit(pid: int, wall_seconds: float) -> bool:
    """Wait for the task to exit; True if the wall clock ran out first."""
    pidfd = os.pidfd_open(pid)
    try:
        ready, _, _ = select.select([pidfd], [], [], wall_seconds)
    finally:
        os.close(pidfd)
    return not ready


def _read_exact(fd: int, n: int) -> bytes | None:
    chunks = []
    while n:
        chunk = os.read(fd, min(n, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def _read_frame(fd: int) -> bytes | None:
    header = _read_exact(fd, 4)
    if header is None:
        return None
    size = int.from_bytes(header, "big")
    if size > MAX_FRAME:
        return None
    return _read_exact(fd, size)


def _send(fd: int, doc: dict[str, object]) -> None:
    data = marshal.dumps(doc)
    view = memoryview(len(data).to_bytes(4, "big") + data)
    while view:
        view = view[os.write(fd, view) :]


def _warm_up(rounds: int = 10) -> None:
    """Run what every task runs (compile and exec a module, call through the codec) a few
    times here: the interpreter specialises that bytecode once, on the server's side,
    instead of in every task (writing to code objects there copies their pages)."""
    import json
    import linecache

    for _ in range(rounds):
        source = b"def f(x):\n    return [2 * x for _ in range(3)]\n"
        namespace: dict[str, object] = {}
        exec(compile(source, "solution.py", "exec"), namespace)
        value = namespace["f"](2)  # type: ignore[operator]
        plain_values.loads(json.dumps(plain_values.encode((value, {1: "a"}))).encode())
    linecache.cache.clear()


def main(argv: list[str]) -> int:
    task_user = "--no-task-user" not in argv
    secrets = [a.split("=", 1)[1] for a in argv if a.startswith("--secret=")]
    pipes = int(next(a.split("=", 1)[1] for a in argv if a.startswith("--pipes=")))
    # The protocol keeps its own descriptors. 0-2 become /dev/null, and the stdio objects
    # every task inherits are made here, empty, once.
    requests = os.dup(0)
    responses = os.dup(1)
    diagnostics = os.dup(2)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)
    streams = {
        "stdin": open(0, encoding="utf-8", closefd=False),  # noqa: SIM115
        "stdout": open(1, "w", encoding="utf-8", closefd=False),  # noqa: SIM115
        "stderr": open(  # noqa: SIM115
            2, "w", encoding="utf-8", errors="backslashreplace", buffering=1, closefd=False
        ),
    }
    for name, stream in streams.items():
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
    log = io.TextIOWrapper(io.FileIO(diagnostics, "w"), encoding="utf-8", line_buffering=True)
    evaluator = next((int(a.split("=", 1)[1]) for a in argv if a.startswith("--evaluator=")), None)
    without = {w for a in argv if a.startswith("--without=") for w in a[10:].split(",") if w}
    server = Server(secrets, task_user, evaluator, socket.socket(fileno=pipes), without)
    _warm_up()
    _send(responses, server.hello())
    # Nothing the server allocated so far is ever garbage: keep the collector (in every
    # task) from walking it and copying its pages.
    gc.freeze()
    while True:
        body = _read_frame(requests)
        if body is None:
            return 0
        try:
            reply = server.run(marshal.loads(body), requests, responses)
        except Exception as exc:  # a bad request: answer it, keep serving
            print(f"sandbox server: {type(exc).__name__}: {exc}", file=log)
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        if reply is not None:
            _send(responses, reply)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
