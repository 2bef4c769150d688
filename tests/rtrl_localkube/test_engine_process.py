"""The engine launcher's process handling (rtrl_localkube/engine.py), with a stand-in for the
server: a script that takes vLLM's command line and, like vLLM, runs a child process (its
EngineCore). The real engine is tests/rtrl_localkube/test_engine.py's."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from rtrl_localkube.engine import Engine, EngineError, EngineSpec, server_argv

SERVER = """\
import http.server, os, signal, subprocess, sys, time
args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
mode = os.environ["FAKE_MODE"]
# the "EngineCore": ignores SIGTERM, as a busy child may
child = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
open(os.environ["FAKE_PIDS"], "w").write(f"{os.getpid()} {child.pid}")
print("loading model", args[args.index("--model") + 1], flush=True)
if mode == "exit":
    print("RuntimeError: no such model", flush=True)
    sys.exit(3)
if mode == "hang":
    time.sleep(600)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


@pytest.fixture
def fake_python(tmp_path: Path) -> Path:
    script = tmp_path / "python"
    script.write_text(f"#!{sys.executable}\n{SERVER}")
    script.chmod(0o755)
    return script


def spec(tmp_path: Path, mode: str) -> EngineSpec:
    env = {"FAKE_MODE": mode, "FAKE_PIDS": str(tmp_path / "pids")}
    return EngineSpec(model="s3://models/tiny/", served_model_name="tiny", env=env)


def make(tmp_path: Path, mode: str, python: Path, **kwargs: Any) -> Engine:
    """An engine on the stand-in, with a short grace period (the child ignores SIGTERM)."""
    log = tmp_path / "engine.log"
    return Engine(spec(tmp_path, mode), log, python=python, grace=1.0, **kwargs)


def pids(tmp_path: Path) -> list[int]:
    deadline = time.monotonic() + 10
    while not (tmp_path / "pids").exists() or not (tmp_path / "pids").read_text():
        assert time.monotonic() < deadline, "the stand-in never started"
        time.sleep(0.05)
    return [int(p) for p in (tmp_path / "pids").read_text().split()]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited


def wait_dead(processes: list[int], seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while any(alive(p) for p in processes):
        assert time.monotonic() < deadline, f"still alive: {[p for p in processes if alive(p)]}"
        time.sleep(0.1)


def test_the_command_line_has_rtrls_flags() -> None:
    argv = server_argv(
        EngineSpec(model="s3://b/ckpt/", served_model_name="composer"), 8000, Path("/py")
    )
    assert argv[:3] == ["/py", "-m", "vllm.entrypoints.openai.api_server"]
    text = " ".join(argv)
    for flag in (
        "--model s3://b/ckpt/",
        "--served-model-name composer",
        "--dtype float32",
        "--logprobs-mode processed_logprobs",
        "--port 8000",
        "--enforce-eager",
        "--tool-call-parser hermes",
    ):
        assert flag in text


def test_missing_venv_says_how_to_install_it(tmp_path: Path) -> None:
    engine = make(tmp_path, "ok", tmp_path / "nowhere")
    with pytest.raises(EngineError, match=r"not installed .*run `make vllm`"):
        engine.start()


def test_a_server_that_exits_fails_with_its_log(tmp_path: Path, fake_python: Path) -> None:
    engine = make(tmp_path, "exit", fake_python)
    with pytest.raises(EngineError) as failure:
        engine.start()
    message = str(failure.value)
    assert "exited with status 3 before it was ready" in message
    assert "RuntimeError: no such model" in message  # the log's tail, quoted
    wait_dead(pids(tmp_path))  # its child too


def test_a_server_never_ready_times_out_and_is_stopped(tmp_path: Path, fake_python: Path) -> None:
    engine = make(tmp_path, "hang", fake_python, start_timeout=3)
    with pytest.raises(EngineError, match=r"not ready within 3s") as failure:
        engine.start()
    assert "loading model s3://models/tiny/" in str(failure.value)
    wait_dead(pids(tmp_path))


def test_ready_then_stop_kills_the_whole_group(tmp_path: Path, fake_python: Path) -> None:
    engine = make(tmp_path, "ok", fake_python)
    with engine:
        assert engine.healthy() and engine.startup_seconds is not None
        assert engine.base_url == f"http://127.0.0.1:{engine.port}/v1"
        server, child = pids(tmp_path)
        assert alive(server) and alive(child)
        started = time.monotonic()
        engine.stop()
    # the child ignored SIGTERM: the supervisor killed it after the grace period
    wait_dead([server, child], seconds=1.0)
    assert time.monotonic() - started < 10


def test_the_engine_dies_with_the_thread_that_started_it(tmp_path: Path, fake_python: Path) -> None:
    """A test run killed outright never reaches its teardown: the engine must not outlive
    it. The kernel signals the supervisor when the starting thread ends."""
    engine = make(tmp_path, "ok", fake_python)
    starter = threading.Thread(target=engine.start)
    starter.start()
    starter.join(60)
    assert engine.running()
    processes = pids(tmp_path)
    wait_dead(processes, seconds=10)  # SIGTERM, then SIGKILL after the grace period
    engine.stop()


def test_log_holds_the_command_line(tmp_path: Path, fake_python: Path) -> None:
    with make(tmp_path, "ok", fake_python) as engine:
        pass
    text = engine.log_path.read_text()
    assert text.startswith(f"$ {fake_python} -m vllm.entrypoints.openai")
