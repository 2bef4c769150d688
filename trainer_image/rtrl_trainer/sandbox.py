"""Run untrusted Python (a model's completion plus its unit tests) in a sandbox.

The tasks suite executes code a candidate checkpoint wrote; a bad checkpoint may write an
infinite loop, a memory bomb, or code that talks to the network or overwrites files. Each
run is a separate process (``python -I -S -B``: isolated mode, no site-packages, no
bytecode files) with:

- resource limits (``setrlimit``): CPU seconds, address space (memory), file size (which
  also caps stdout/stderr: they go to files), open files, and processes;
- a wall-clock timeout, after which the whole process group is killed;
- an empty environment (``HOME`` and ``TMPDIR`` point into the work dir) and a fresh
  temporary working directory;
- where the kernel lets us (root, or CAP_SYS_ADMIN): new network and mount namespaces. The
  network namespace has only a down loopback, so nothing can be reached. In the mount
  namespace every mount is remounted read-only except the work dir, and the child then
  drops every capability (bounding set included, ``no_new_privs``), so it cannot remount
  anything writable again. Where that is not permitted, the run still happens with the
  limits above, and the result says ``network_isolated: false`` / ``fs_isolated: false``.

The protections in force are reported with every result (:class:`Isolation`), so eval.json
records what held where the suite ran.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
PR_SET_NO_NEW_PRIVS = 38
PR_CAPBSET_DROP = 24
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
# Exit status the child uses when its own isolation setup failed after it was required.
_SETUP_FAILED = 121


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


@dataclass
class Result:
    """The outcome of one run. ``status`` is ``ok`` (exit 0), ``failed`` (non-zero exit),
    ``timeout`` (wall clock), ``cpu_limit``, ``memory_limit``, ``output_limit`` or
    ``killed`` (another signal)."""

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


_LIBC = ctypes.CDLL(None, use_errno=True)


def _lib() -> ctypes.CDLL:
    return _LIBC


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


def _drop_capabilities(libc: ctypes.CDLL) -> bool:
    for cap in range(64):
        libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)  # EINVAL past the last capability
    header = (ctypes.c_uint32 * 2)(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)()
    ok = libc.capset(header, data) == 0
    no_new_privs: bool = libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0
    return no_new_privs and ok


def _isolate(work: str, limits: Limits, report: int, mounts: list[tuple[str, int]]) -> None:
    """In the child, before exec: namespaces, read-only mounts, capabilities, limits.
    Writes three flag bytes (network, fs, caps) to ``report``."""
    libc = _lib()
    os.setsid()
    net = libc.unshare(CLONE_NEWNET) == 0
    fs = False
    if (
        libc.unshare(CLONE_NEWNS) == 0
        and libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) == 0
    ):
        fs = libc.mount(work.encode(), work.encode(), None, MS_BIND, None) == 0
        if fs:
            for target, keep in mounts:
                if target == work:
                    continue
                flags = MS_REMOUNT | MS_BIND | MS_RDONLY | keep
                if libc.mount(None, target.encode(), None, flags, None) != 0 and target == "/":
                    fs = False
    caps = _drop_capabilities(libc) if (net or fs) else False
    os.write(report, bytes([net, fs, caps]))
    os.close(report)
    os.chdir(work)
    os.umask(0o077)
    for name, value in (
        (resource.RLIMIT_AS, limits.memory_bytes),
        (resource.RLIMIT_FSIZE, limits.output_bytes),
        (resource.RLIMIT_NOFILE, limits.open_files),
        (resource.RLIMIT_NPROC, limits.processes),
        (resource.RLIMIT_CORE, 0),
    ):
        _limit(name, value, value)
    # SIGXCPU at the soft limit (reported as cpu_limit), SIGKILL a second later.
    _limit(resource.RLIMIT_CPU, limits.cpu_seconds, limits.cpu_seconds + 1)


def _limit(name: int, soft: int, hard: int) -> None:
    """Lower a limit; never above the current hard limit (which only root may raise)."""
    _, current = resource.getrlimit(name)
    if current != resource.RLIM_INFINITY:
        hard = min(hard, current)
        soft = min(soft, hard)
    resource.setrlimit(name, (soft, hard))


def run_python(
    files: dict[str, str],
    main: str,
    *,
    limits: Limits | None = None,
    python: str | None = None,
) -> Result:
    """Write ``files`` (name -> source) into a fresh work dir and run ``main`` there."""
    limits = limits or Limits()
    root = Path(tempfile.mkdtemp(prefix="rtrl-sandbox-"))
    try:
        work = root / "work"
        work.mkdir()
        for name, text in files.items():
            (work / name).write_text(text)
        out_path, err_path = root / "stdout", root / "stderr"
        read_end, write_end = os.pipe()
        env = {"HOME": str(work), "TMPDIR": str(work), "LANG": "C.UTF-8"}
        argv = [python or sys.executable, "-I", "-S", "-B", main]
        mounts = _mount_points()  # read here: the child should do as little as possible
        start = time.perf_counter()
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen(
                argv,
                cwd=work,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                pass_fds=(write_end,),
                # Only async-signal-safe work between fork and exec would be ideal; the
                # child calls libc through ctypes and setrlimit, which take no locks that
                # another thread of the parent could hold.
                preexec_fn=lambda: _isolate(str(work), limits, write_end, mounts),  # noqa: PLW1509
            )
            os.close(write_end)
            # A blocking wait and a timer that kills the group: Popen.wait(timeout) polls
            # with growing sleeps, which costs more than the sandbox itself on short runs.
            expired = threading.Event()

            def expire() -> None:
                expired.set()
                _kill_group(proc.pid)

            timer = threading.Timer(limits.wall_seconds, expire)
            timer.start()
            try:
                returncode = proc.wait()
            finally:
                timer.cancel()
            timed_out = expired.is_set()
            _kill_group(proc.pid)  # anything the test left behind
        flags = os.read(read_end, 3)
        os.close(read_end)
        seconds = time.perf_counter() - start
        isolation = Isolation(*(bool(b) for b in flags.ljust(3, b"\0")))
        stdout, out_truncated = _read_capped(out_path, limits.output_bytes)
        stderr, err_truncated = _read_capped(err_path, limits.output_bytes)
        status = _status(returncode, timed_out, stderr, out_truncated or err_truncated)
        return Result(
            status=status,
            returncode=returncode,
            stdout=stdout,
            stderr=stderr,
            truncated=out_truncated or err_truncated,
            seconds=seconds,
            isolation=isolation,
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _read_capped(path: Path, cap: int) -> tuple[str, bool]:
    with open(path, "rb") as f:
        data = f.read(cap + 1)
    return data[:cap].decode("utf-8", "replace"), len(data) >= cap


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
