"""The sandbox's fork server: run as ``python -I -S -B sandbox_server.py ROOT`` by
:class:`rtrl_trainer.sandbox.Sandbox`, never imported by the evaluator.

Starting an interpreter per task costs ~8 ms, against ~60 µs for the tests of a task. So
the per-process, inheritable part of the sandbox is set up once, here, and every task gets
a fresh process by ``fork`` from this already-isolated interpreter:

- once (inherited by every task): isolated mode (``-I -S -B``), an empty environment,
  new network, IPC and mount namespaces where the kernel lets us (every mount read-only, a
  fresh size-limited tmpfs on ``ROOT`` for the work dirs; an interpreter under a
  directory others cannot enter, like ``/root``, is made reachable by covering that
  directory with a tmpfs holding only bind mounts of the library dirs), ``no_new_privs``,
  an empty capability bounding set, and this process as the child subreaper (orphans of a
  task come back here);
- per task, here: a fresh work dir (same path every time: ``HOME`` and ``TMPDIR`` point at
  it, so the environment is set once), with the task's files, owned by the task's user;
- per task, in the forked child: a new session, stdout/stderr to size-capped memory
  files, every other descriptor closed, a separate unprivileged user id (``setresuid``: no
  capabilities left, ``RLIMIT_NPROC`` enforced, nothing of the server's writable, cannot
  signal or trace the server), not dumpable, killed if the server dies, the rlimits (CPU,
  address space, file size, open files, processes, core dumps); then the program runs in
  the child's ``__main__`` and the child exits;
- after each task, here: the wall-clock kill, then every process of the task's user id is
  killed (``kill(-1)`` as that user, which reaches nothing else) and reaped, and the work
  dir removed, before the result goes back. So no process of one task outlives it.

Where the task user cannot be used (its id is not mapped, or it cannot read the
interpreter), tasks run as root without capabilities, each in a mount namespace of its
own where only its work dir is writable, and what a task leaves behind is found among
the server's children (a /proc scan, only when there are any) and killed. Where this
process is not privileged at all (no root / CAP_SYS_ADMIN), the namespaces and the user
switch are skipped, the limits still hold, and the hello message says which protections
are in force (a startup check runs the tasks' credential change once and looks). Only the
standard library is used: the server runs with ``-I -S`` and never sees the evaluator's
packages. Protocol on stdin/stdout: 4-byte big-endian length + a :mod:`marshal`-ed
dict; the server sends a hello, then one response per request, and exits at end of input.

Every page a task's process touches is copied on write (a few µs each on a VM), so the
child's path is kept short: what can be prepared once (environment, stdio objects, the
work dir's path) is prepared in the server, and the server imports little (the protocol
is :mod:`marshal`, built in, between two trusted processes).
"""

from __future__ import annotations

import ctypes
import gc
import io
import marshal
import os
import resource
import select
import sys
import time

CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
CLONE_NEWIPC = 0x08000000
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
# Not from the signal module: it imports enum, and every module makes each fork dearer.
SIGKILL = 9
PR_CAPBSET_READ = 23
PR_CAPBSET_DROP = 24
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38
PR_GET_NO_NEW_PRIVS = 39
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
# Exit status of a child whose own setup failed (the error is on its stderr).
SETUP_FAILED = 121
# Task user ids: a random one far above any real account, one per server.
_UID_BASE = 1_500_000_000
_UID_SPAN = 500_000_000
_MAX_FD = 1 << 16
WORK = "w"

_libc = ctypes.CDLL(None, use_errno=True)
_prctl = _libc.prctl
_prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
_prctl.restype = ctypes.c_int


def _mount_points() -> list[tuple[str, int]]:
    """(mount point, flags to keep) of every mount, parents first."""
    points: list[tuple[str, int]] = []
    with open("/proc/self/mountinfo", "rb") as f:
        for line in f:
            parts = line.split()
            target = parts[4].decode().replace("\\040", " ")
            options = parts[5].decode().split(",")
            keep = (
                (MS_NOSUID if "nosuid" in options else 0)
                | (MS_NODEV if "nodev" in options else 0)
                | (MS_NOEXEC if "noexec" in options else 0)
            )
            points.append((target, keep))
    points.sort(key=lambda p: p[0].count("/"))
    return points


def _namespaces(root: str, tmpfs_bytes: int) -> tuple[bool, bool]:
    """New network and IPC namespaces; a new mount namespace with every mount read-only
    and a fresh tmpfs on ``root``. Returns (network isolated, filesystem isolated)."""
    net = _libc.unshare(CLONE_NEWNET) == 0
    _libc.unshare(CLONE_NEWIPC)  # best effort: no System V IPC shared with the host
    fs = False
    if (
        _libc.unshare(CLONE_NEWNS) == 0
        and _libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) == 0
    ):
        options = f"size={tmpfs_bytes},mode=0711".encode()
        fs = _libc.mount(b"tmpfs", root.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, options) == 0
        if fs:
            _expose([p for p in sys.path if os.path.isdir(p)], root)
            for target, keep in _mount_points():
                if target == root:
                    continue
                flags = MS_REMOUNT | MS_BIND | MS_RDONLY | keep
                if _libc.mount(None, target.encode(), None, flags, None) != 0 and target == "/":
                    fs = False
    return net, fs


def _blocker(path: str) -> str | None:
    """The topmost ancestor of ``path`` that other users cannot traverse (e.g. ``/root``,
    mode 0700, when the interpreter lives under it), or None."""
    parts = path.split("/")
    for i in range(2, len(parts)):
        ancestor = "/".join(parts[:i])
        if not os.stat(ancestor).st_mode & 0o001:
            return ancestor
    return None


def _expose(paths: list[str], root: str) -> None:
    """Make ``paths`` (the interpreter's library dirs) reachable by the task user in this
    mount namespace: a blocking ancestor is covered by an empty tmpfs holding only bind
    mounts of those dirs. This also hides the rest of it (``/root``'s files, say) from
    the tasks. Best effort: the credential check says whether the task user can import."""
    blocked = [(p, b) for p in paths if (b := _blocker(p)) is not None]
    if not blocked or any(root.startswith(b + "/") for _, b in blocked):
        return
    staged = []
    for i, (path, _) in enumerate(blocked):
        stage = os.path.join(root, f".stage{i}")
        os.mkdir(stage, 0o700)
        if _libc.mount(path.encode(), stage.encode(), None, MS_BIND | MS_REC, None) == 0:
            staged.append((stage, path))
    for blocker in {b for _, b in blocked}:
        _libc.mount(b"tmpfs", blocker.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, b"mode=0755")
    for stage, path in staged:
        os.makedirs(path, 0o755, exist_ok=True)
        _libc.mount(stage.encode(), path.encode(), None, MS_BIND | MS_REC, None)
        _libc.umount2(stage.encode(), MNT_DETACH)
        os.rmdir(stage)


def _drop_bounding_set() -> bool:
    """Empty the bounding set and set no_new_privs (both inherited by every task). The
    server keeps its own permitted capabilities: it needs them to switch users and to
    clean up after a task."""
    for cap in range(64):
        _prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)  # EINVAL past the last capability
    nnp = _prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0
    return nnp and all(_prctl(PR_CAPBSET_READ, cap, 0, 0, 0) <= 0 for cap in range(64))


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


def _capabilities() -> tuple[int, ...]:
    header = (ctypes.c_uint32 * 2)(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)()
    if _libc.capget(header, data) != 0:
        return (-1,)
    return tuple(data)


def _can_import() -> bool:
    """Whether this process can read the standard library (a task user must)."""
    try:
        for path in sys.path:
            if os.path.isdir(path):
                os.listdir(path)
        with open(os.__file__, "rb") as f:
            f.read(1)
    except OSError:
        return False
    return True


def _drop_capabilities() -> None:
    header = (ctypes.c_uint32 * 2)(_LINUX_CAPABILITY_VERSION_3, 0)
    _libc.capset(header, (ctypes.c_uint32 * 6)())


def _private_work_dir(work: str) -> None:
    """Without a task user: a mount namespace of the task's own in which only its work
    dir is writable (what a separate user gives otherwise)."""
    root = os.path.dirname(work)
    if (
        _libc.unshare(CLONE_NEWNS) != 0
        or _libc.mount(work.encode(), work.encode(), None, MS_BIND, None) != 0
        or _libc.mount(
            None, root.encode(), None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV, None
        )
        != 0
    ):
        raise OSError(ctypes.get_errno(), "cannot make the work dir private")


def _become_task_user(uid: int | None) -> None:
    """The credential change of every task (and of the startup check)."""
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)  # the kernel clears every capability
    else:
        _drop_capabilities()  # nothing to drop for an unprivileged server
    # A credential change resets the parent-death signal, so set it after: a task never
    # outlives a server that died.
    _prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0)


class Server:
    def __init__(self, root: str, privileged: bool, tmpfs_bytes: int, task_user: bool) -> None:
        self.root = root
        self.seq = 0
        self.work = os.path.join(root, WORK)
        self.network, self.fs = _namespaces(root, tmpfs_bytes) if privileged else (False, False)
        self.bounding = _drop_bounding_set() if privileged else False
        self.uid = _task_uid() if privileged and task_user else None
        if self.uid is not None:
            os.chmod(root, 0o711)  # tasks traverse to their own dir, list nothing
        _prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        self.devnull = os.open(os.devnull, os.O_RDWR)
        ok = self._check_credentials()
        if not ok and self.uid is not None:
            # The task user cannot run Python here: tasks stay root, without capabilities,
            # each in its own mount namespace where only its work dir is writable.
            self.uid = None
            ok = self._check_credentials()
        self.caps_dropped = ok and self.bounding
        self.private_mounts = self.fs and self.uid is None

    def _check_credentials(self) -> bool:
        """Run the tasks' credential change once in a child and check its outcome: no
        capability left and no_new_privs set (the kernel's rules make every task the same;
        each task still fails its setup if the switch fails)."""
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            ok = False
            try:
                _become_task_user(self.uid)
                ok = (
                    not any(_capabilities())
                    and _prctl(PR_GET_NO_NEW_PRIVS, 0, 0, 0, 0) == 1
                    and (self.uid is None or os.getresuid() == (self.uid,) * 3)
                    and _can_import()
                )
            finally:
                os.write(write_end, bytes([ok]))
                os._exit(0)
        os.close(write_end)
        os.waitpid(pid, 0)
        ok = os.read(read_end, 1) == b"\x01"
        os.close(read_end)
        return ok

    def hello(self) -> dict[str, object]:
        return {
            "pid": os.getpid(),
            "uid": self.uid,
            "isolation": self._isolation(),
        }

    def _isolation(self) -> dict[str, bool]:
        return {
            "network_isolated": self.network,
            "fs_isolated": self.fs,
            "capabilities_dropped": self.caps_dropped,
            "separate_user": self.uid is not None,
        }

    def run(self, request: dict[str, object]) -> dict[str, object]:
        limits: dict[str, int] = request["limits"]  # type: ignore[assignment]
        files: dict[str, bytes] = request["files"]  # type: ignore[assignment]
        main = str(request["main"])
        for name in (*files, main):
            if "/" in name or name in ("", ".", ".."):
                raise ValueError(f"not a plain file name: {name!r}")
        work = self.work
        if os.path.lexists(work):  # a task's leftovers that could not be removed
            self.seq += 1
            os.rename(work, os.path.join(self.root, f".left-{self.seq}"))
        os.mkdir(work, 0o700)
        try:
            self._write_files(work, files)
            rlimits = _rlimits(limits)
            out = os.memfd_create("stdout")
            err = os.memfd_create("stderr")
            start = time.perf_counter()
            pid = os.fork()
            if pid == 0:  # pragma: no cover - the child never returns
                _child(work, main, rlimits, out, err, self.devnull, self.uid, self.private_mounts)
            timed_out = self._wait(pid, limits["wall_seconds"], start)
            self._kill_task(pid)
            _, status = os.waitpid(pid, 0)
            self._reap()
            seconds = time.perf_counter() - start
            cap = limits["output_bytes"]
            stdout = os.pread(out, cap + 1, 0)
            stderr = os.pread(err, cap + 1, 0)
            os.close(out)
            os.close(err)
        finally:
            _rmtree(work)
        return {
            "returncode": os.waitstatus_to_exitcode(status),
            "timed_out": timed_out,
            "stdout": stdout[:cap],
            "stderr": stderr[:cap],
            "truncated": len(stdout) >= cap or len(stderr) >= cap,
            "seconds": seconds,
            "isolation": self._isolation(),
        }

    def _write_files(self, work: str, files: dict[str, bytes]) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        uid = self.uid
        if uid is not None:
            os.chown(work, uid, uid)
        for name, data in files.items():
            fd = os.open(os.path.join(work, name), flags, 0o644)
            try:
                if uid is not None:
                    os.fchown(fd, uid, uid)
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
            finally:
                os.close(fd)

    @staticmethod
    def _wait(pid: int, wall_seconds: float, start: float) -> bool:
        """Wait for the task to exit; True if the wall clock ran out first."""
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:  # kernel < 5.3: poll the child
            deadline = start + wall_seconds
            while os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
                if time.perf_counter() > deadline:
                    return True
                time.sleep(0.0005)
            return False
        try:
            ready, _, _ = select.select([pidfd], [], [], wall_seconds)
        finally:
            os.close(pidfd)
        return not ready

    def _kill_task(self, pid: int) -> None:
        """Kill the task and everything it started, whatever session or group it moved to."""
        try:  # noqa: SIM105 - contextlib is not imported: the server imports little
            os.killpg(pid, SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self.uid is None:
            return
        # As the task's user (the saved uid stays root), kill(-1) reaches exactly the
        # processes of that user, nothing else; then back to root. The server has one
        # thread, so no other thread ever runs with these credentials.
        os.setresuid(self.uid, self.uid, 0)
        try:
            os.kill(-1, SIGKILL)
        except ProcessLookupError:
            pass
        finally:
            os.setresuid(0, 0, 0)

    def _reap(self) -> None:
        """Kill and reap whatever the task left behind. The server is the subreaper, so
        each orphan of the task comes back here as a child: until none is left, kill the
        children (with a task user, kill(-1) already did) and wait. So nothing of a task
        is alive when the next one starts, whatever session or group it moved to."""
        while True:
            try:
                pid, _ = os.waitpid(-1, 0 if self.uid is not None else os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:  # children alive (no task user): find them, kill them, wait
                for child in _children():
                    try:  # noqa: SIM105
                        os.kill(child, SIGKILL)
                    except ProcessLookupError:
                        pass
                try:
                    os.waitpid(-1, 0)
                except ChildProcessError:
                    return


def _children() -> list[int]:
    """The pids of this process's children (a /proc scan: only after a task that left
    processes behind, and only without a task user)."""
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


def _rmtree(path: str) -> None:
    """Remove a work dir the task may have filled with anything (no symlink is followed;
    every process of the task is dead by now, so nothing changes under our feet). What
    cannot be removed is moved aside by the next run."""
    try:
        os.chmod(path, 0o700)  # a task may have made its own dirs unreadable
        entries = list(os.scandir(path))
    except OSError:
        return
    for entry in entries:
        try:
            if entry.is_dir(follow_symlinks=False):
                _rmtree(entry.path)
            else:
                os.unlink(entry.path)
        except OSError:
            pass
    try:  # noqa: SIM105
        os.rmdir(path)
    except OSError:
        pass


def _rlimits(limits: dict[str, int]) -> list[tuple[int, tuple[int, int]]]:
    """The task's (resource, (soft, hard)) limits, computed before the fork (the server's
    hard limits are the child's): never above a hard limit, which only root may raise."""
    wanted = (
        (resource.RLIMIT_AS, limits["memory_bytes"], limits["memory_bytes"]),
        (resource.RLIMIT_FSIZE, limits["output_bytes"], limits["output_bytes"]),
        (resource.RLIMIT_NOFILE, limits["open_files"], limits["open_files"]),
        (resource.RLIMIT_NPROC, limits["processes"], limits["processes"]),
        (resource.RLIMIT_CORE, 0, 0),
        # SIGXCPU at the soft limit (reported as cpu_limit), SIGKILL a second later.
        (resource.RLIMIT_CPU, limits["cpu_seconds"], limits["cpu_seconds"] + 1),
    )
    result = []
    for name, soft, hard in wanted:
        current = resource.getrlimit(name)[1]
        capped = hard if current == resource.RLIM_INFINITY else min(hard, current)
        result.append((name, (min(soft, capped), capped)))
    return result


def _child(  # noqa: PLR0917
    work: str,
    main: str,
    rlimits: list[tuple[int, tuple[int, int]]],
    out: int,
    err: int,
    devnull: int,
    uid: int | None,
    private_mounts: bool,
) -> None:
    """The forked task: isolate, run ``main``, exit. Never returns. Short on purpose: every
    page it touches is copied."""
    try:
        os.setsid()
        os.dup2(devnull, 0)
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.closerange(3, _MAX_FD)
        if private_mounts:
            _private_work_dir(work)
        _become_task_user(uid)
        # Not ptrace-able (nor /proc/<pid>/mem) by anything without CAP_SYS_PTRACE.
        _prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
        os.chdir(work)
        os.umask(0o077)
        for name, soft_hard in rlimits:
            resource.setrlimit(name, soft_hard)
    except BaseException as exc:
        try:
            os.write(2, f"sandbox: task setup failed: {exc!r}\n".encode())
        finally:
            os._exit(SETUP_FAILED)
    os._exit(_run_main(os.path.join(work, main)))


def _run_main(path: str) -> int:
    """Run ``path`` as ``__main__`` the way ``python path`` would; the exit status."""
    module = type(sys)("__main__")
    module.__file__ = path
    vars(module)["__builtins__"] = sys.modules["builtins"]
    sys.modules["__main__"] = module
    sys.argv = [path]
    code = 0
    try:
        with open(path, "rb") as f:
            source = f.read()
        exec(compile(source, path, "exec"), module.__dict__)
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException as exc:
        # The traceback starts at the program, as ``python path`` prints it.
        tb = exc.__traceback__
        exc.__traceback__ = tb.tb_next if tb is not None else None
        sys.excepthook(type(exc), exc, exc.__traceback__)
        code = 1
    try:
        threading = sys.modules.get("threading")
        if threading is not None:
            threading._shutdown()  # as the interpreter does at exit
        import atexit

        atexit._run_exitfuncs()
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = code or 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            code = code or 120  # as the interpreter does when flushing fails at exit
    return code


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


def _warm_up(root: str, rounds: int = 10) -> None:
    """Run what every task runs (write a module, import it from a directory on
    ``sys.path``, compile and exec a program) a few times here, then undo it: the
    interpreter specialises the bytecode of the import system and the compiler on the
    server's side once, instead of in every task (writing to code objects there copies
    their pages: a quarter of a task's page faults)."""
    directory = os.path.join(root, ".warm")
    os.mkdir(directory, 0o700)
    sys.path.insert(0, directory)
    try:
        for i in range(rounds):
            name = f"_rtrl_warm_up_{i}"
            path = os.path.join(directory, name + ".py")
            with open(path, "w") as f:
                f.write("def f(x):\n    return [2 * x for _ in range(3)]\n")
            program = (
                f"import sys\nfrom {name} import f as candidate\nassert candidate(2)[0] == 4\n"
            )
            exec(compile(program, os.path.join(directory, "main.py"), "exec"), {"__name__": "w"})
            sys.modules.pop(name, None)
            os.unlink(path)
    finally:
        sys.path.remove(directory)
        sys.path_importer_cache.pop(directory, None)
        os.rmdir(directory)


def _read_exact(fd: int, n: int) -> bytes | None:
    chunks = []
    while n:
        chunk = os.read(fd, n)
        if not chunk:
            return None
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def _send(fd: int, doc: dict[str, object]) -> None:
    data = marshal.dumps(doc)
    view = memoryview(len(data).to_bytes(4, "big") + data)
    while view:
        view = view[os.write(fd, view) :]


def main(argv: list[str]) -> int:
    root = argv[1]
    privileged = "--unprivileged" not in argv
    task_user = "--no-task-user" not in argv
    tmpfs_bytes = 256 << 20
    for arg in argv:
        if arg.startswith("--tmpfs-bytes="):
            tmpfs_bytes = int(arg.split("=", 1)[1])
    # The protocol keeps its own descriptors. 0-2 become /dev/null, and the stdio objects
    # every task inherits are made here, empty, once: the child only points fds 1 and 2
    # at its own memory files.
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
    server = Server(root, privileged, tmpfs_bytes, task_user)
    _warm_up(root)
    _send(responses, server.hello())
    # Nothing the server allocated so far is ever garbage: keep the collector (in every
    # task) from walking it and copying its pages.
    gc.freeze()
    while True:
        header = _read_exact(requests, 4)
        if header is None:
            return 0
        body = _read_exact(requests, int.from_bytes(header, "big"))
        if body is None:
            return 0
        try:
            reply = server.run(marshal.loads(body))
        except Exception as exc:  # a bad request: answer it, keep serving
            print(f"sandbox server: {type(exc).__name__}: {exc}", file=log)
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        _send(responses, reply)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
