"""Local processes as a cluster's own: started so that they die with the test run, stopped as
the kubelet stops a container (SIGTERM to the process group, SIGKILL after the grace period),
and the free ports they listen on."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess

DIE_WITH_PARENT = shutil.which("setpriv")  # util-linux
KILL_GRACE_SECONDS = 1.0


def die_with_parent(argv: list[str], sig: str = "KILL") -> list[str]:
    """``argv`` run so that it is killed when the thread that starts it dies: a test run
    killed outright reaches neither its teardown nor its atexit hook. SIGKILL by default:
    with etcd gone, the API server's graceful shutdown would wait for ever; ``sig="TERM"``
    for a process that stops its own children on SIGTERM. (util-linux's setpriv, not
    ``preexec_fn``, which is unsafe where threads run.)"""
    return [DIE_WITH_PARENT, "--pdeathsig", sig, "--", *argv] if DIE_WITH_PARENT else argv


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def kill_group(proc: subprocess.Popen[bytes], grace: float = KILL_GRACE_SECONDS) -> None:
    """SIGTERM the process group, then SIGKILL after ``grace`` seconds, as the kubelet does."""
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(wait)
            return


def check_stopped(
    what: str, things: str, alive: list[str], errors: list[str], *, stuck: bool
) -> None:
    """After a stand-in's ``stop()``: raise if it is ``stuck`` (``alive``: what still runs) or
    if it hit unexpected ``errors`` on the way, so that a test fails instead of leaking."""
    if stuck:
        raise RuntimeError(f"{what} did not stop ({things} still running: {alive})")
    if errors:
        raise RuntimeError(f"{what} failed:\n" + "\n".join(errors))
