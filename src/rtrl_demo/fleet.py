"""The demo's serving fleet: one ``python -m rtrl_demo.serve --requests`` process for the whole run.

A serving fleet stays up between the demo's ticks, and so does this process: each tick (and
the base model's pre-training) is one request to it, instead of a process that imports torch
and transformers for a few seconds of sampling (the import was most of a tick). The steps the
operator plans (stage, train, eval, analyze) still run as their own processes, as pods do.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from rtrl_localkube.podprocess import PodResult, pod_env, tail

# The model server's command line: this Python, so the same environment as the demo's.
SERVE = (sys.executable, "-m", "rtrl_demo.serve")


class ServingFleet:
    """Started on the first request; a request whose process died is failed, with its log,
    and the next request starts a new process."""

    def __init__(self, extra_env: Mapping[str, str], work: Path) -> None:
        self.env = pod_env(extra_env)
        self.work = work
        self.proc: subprocess.Popen[bytes] | None = None

    def _start(self) -> subprocess.Popen[bytes]:
        if self.proc is not None and self.proc.poll() is not None:
            self.close()
        if self.proc is None:
            self.work.mkdir(parents=True, exist_ok=True)
            with (self.work / "serving-fleet.log").open("ab") as log:
                self.proc = subprocess.Popen(
                    [*SERVE, "--requests"],
                    env=self.env,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=log,
                    cwd=self.work,
                )
        return self.proc

    def run(
        self, argv: list[str], log: Path, on_tick: Callable[[float], None] | None = None
    ) -> PodResult:
        """``python -m rtrl_demo.serve ARGV``, its output in ``log``."""
        proc = self._start()
        assert proc.stdin is not None and proc.stdout is not None
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_bytes(b"")
        started = time.monotonic()
        request = json.dumps({"argv": argv, "log": os.fspath(log)}) + "\n"
        try:
            proc.stdin.write(request.encode())
            proc.stdin.flush()
            reply = b""
            while not reply.endswith(b"\n"):
                ready, _, _ = select.select([proc.stdout], [], [], 0.2)
                if ready:
                    chunk = os.read(proc.stdout.fileno(), 4096)
                    if not chunk:
                        break
                    reply += chunk
                if on_tick is not None:
                    on_tick(time.monotonic() - started)
        except BrokenPipeError:
            reply = b""
        seconds = time.monotonic() - started
        if not reply.endswith(b"\n"):
            code = proc.wait()
            fleet = tail(self.work / "serving-fleet.log")
            return PodResult(1, log, seconds, f"the serving fleet exited {code}\n{fleet}")
        exit_code = int(json.loads(reply)["exit"])
        return PodResult(exit_code, log, seconds, tail(log) if exit_code else "")

    def close(self) -> None:
        if self.proc is None:
            return
        if self.proc.stdin is not None:
            with contextlib.suppress(BrokenPipeError):
                self.proc.stdin.close()  # end of requests: it exits
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self.proc = None
