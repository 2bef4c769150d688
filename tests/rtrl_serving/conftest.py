"""Fixtures of the serving side's tests: ``rtrl-capture`` run as the real console script in
front of the session's real vLLM engine (``vllm_engine``, tests/vllm_engine.py), its events
shipped to the engine's S3 (moto over HTTP), where the model it serves lives too.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import boto3
import pytest

from rtrl_localkube.processes import die_with_parent, free_port
from tests.conftest import BIN


def _wait_http(url: str, timeout: float, proc: subprocess.Popen[bytes] | None, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
            raise RuntimeError(f"{url}: the process exited ({proc.returncode}):\n{tail}")
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as resp:
            if resp.status == 200:
                return
        time.sleep(0.5)
    tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
    raise RuntimeError(f"{url} not ready after {timeout:.0f} s:\n{tail}")


def stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, wait: float = 60.0) -> int:
    """Signal the process group; SIGKILL if it outlives ``wait``. Returns its exit status."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(wait)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    return proc.returncode


def s3_env(endpoint: str) -> dict[str, str]:
    """The environment of a process that reaches moto as a pod reaches S3."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_ENDPOINT_URL=endpoint,
        AWS_CONFIG_FILE="/dev/null",
        AWS_SHARED_CREDENTIALS_FILE="/dev/null",
        AWS_EC2_METADATA_DISABLED="true",
    )
    return env


def new_bucket(endpoint: str) -> str:
    name = f"test-{uuid.uuid4().hex[:12]}"
    client = boto3.session.Session().client(
        "s3", endpoint_url=endpoint, aws_access_key_id="testing",
        aws_secret_access_key="testing", region_name="us-east-1",
    )  # fmt: skip
    client.create_bucket(Bucket=name)
    client.close()
    return name


@dataclass
class Capture:
    """A running ``rtrl-capture``: its URL, process, spool directory and log."""

    url: str
    proc: subprocess.Popen[bytes]
    spool: Path
    log: Path
    events: str

    def stop(self, sig: int = signal.SIGTERM, wait: float = 60.0) -> int:
        return stop(self.proc, sig, wait)

    def metric(self, name: str, **labels: str) -> float:
        """A sample of /metrics (0 when absent)."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        total = 0.0
        for line in text.splitlines():
            if line.startswith("#") or " " not in line:
                continue
            key, value = line.rsplit(" ", 1)
            base, _, rest = key.partition("{")
            found = ",".join(sorted(rest.rstrip("}").split(","))) if rest else ""
            if base == name and (not labels or found == want):
                total += float(value)
        return total


_STARTED: list[subprocess.Popen[bytes]] = []


@pytest.fixture(autouse=True)
def _no_capture_outlives_its_test() -> Iterator[None]:
    """A proxy a test started and did not stop (it failed half-way) is killed after it."""
    before = len(_STARTED)
    yield
    for proc in _STARTED[before:]:
        stop(proc, signal.SIGKILL, wait=10)
    del _STARTED[before:]


def start_capture(
    engine_url: str,
    events: str,
    spool: Path,
    env: dict[str, str],
    *,
    model_uri: str | None,
    extra: list[str] | None = None,
    checkpoint: str = "ckpt-1",
    arm: str = "stable",
    ready: str = "/readyz",
) -> Capture:
    """``rtrl-capture`` as a process of its own (its own group, so signals reach it alone)."""
    port = free_port()
    spool.mkdir(parents=True, exist_ok=True)
    log = spool.parent / f"{spool.name}-capture-{port}.log"
    proc_env = {**env, "RTRL_CHECKPOINT_ID": checkpoint, "RTRL_ARM": arm,
                "RTRL_RLCYCLE": "demo", "POD_NAME": "serving-7f9c-abcde"}  # fmt: skip
    if model_uri is not None:
        proc_env["RTRL_MODEL_URI"] = model_uri
    argv = [
        str(BIN / "rtrl-capture"), "--listen", f"127.0.0.1:{port}", "--engine", engine_url,
        "--events", events, "--spool", str(spool), "--logprobs-mode", "processed_logprobs",
        "--serving-dtype", "float32", *(extra or []),
    ]  # fmt: skip
    with log.open("ab") as out:
        proc = subprocess.Popen(
            die_with_parent(argv), stdout=out, stderr=subprocess.STDOUT, env=proc_env,
            start_new_session=True,
        )  # fmt: skip
    _STARTED.append(proc)
    url = f"http://127.0.0.1:{port}"
    _wait_http(f"{url}{ready}", 120.0, proc, log)
    return Capture(url, proc, spool, log, events)


__all__ = ["Capture", "new_bucket", "s3_env", "start_capture", "stop"]
