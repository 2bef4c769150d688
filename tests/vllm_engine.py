"""One real vLLM engine per test session: the ``vllm_engine`` fixture (a pytest plugin that
tests/conftest.py loads).

The engine serves the tiny model of :mod:`rtrl_localkube.tinymodel`, published by rtrl's
store code to a session S3 (moto's ThreadedMotoServer) and loaded by vLLM from
``--model s3://...`` through runai-model-streamer, as a cluster's engine loads a
checkpoint rtrl published. Flags: ``--dtype float32``, ``--logprobs-mode
processed_logprobs``, the hermes tool parser (``rtrl_localkube.engine``).

Cost: the engine takes 1-5 minutes to start on 2 cores. It starts once per session, and
only when a selected test uses ``vllm_engine`` (directly or through another fixture): at
the end of collection it begins starting in the background, so the tests that run before
the first one that needs it pay nothing; that one waits for the rest. It is stopped at the
end of the session. Its log is ``<pytest basetemp>/vllm/engine.log``.

Without ``.venv-vllm`` (``make vllm``; ``make test`` installs it) the tests that use it are
skipped, and under ``CI=true`` they fail.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import boto3
import pytest
from moto.server import ThreadedMotoServer

from rtrl_localkube.engine import (
    START_TIMEOUT_SECONDS,
    Engine,
    EngineError,
    EngineSpec,
    check_installed,
    s3_env,
)

if TYPE_CHECKING:
    import openai

FIXTURE = "vllm_engine"
BUCKET = "rtrl-models"
MODEL_PREFIX = "tiny/checkpoints/tiny-0/"
SERVED_MODEL_NAME = "tiny"
DTYPE = "float32"
LOGPROBS_MODE = "processed_logprobs"
# moto takes any keys; these are the engine's and the publisher's, never the host's
ACCESS_KEY, SECRET_KEY, REGION = "testing", "testing", "us-east-1"


@dataclass(frozen=True)
class VllmEngine:
    """The session's engine, as tests see it."""

    base_url: str  # the OpenAI API: http://127.0.0.1:PORT/v1
    root_url: str  # /health, /metrics, ...
    served_model_name: str
    model_uri: str  # s3://rtrl-models/tiny/checkpoints/tiny-0/ (committed, with its manifest)
    model_dir: Path  # a local copy of the committed files, checked against the manifest
    dtype: str
    logprobs_mode: str
    s3_endpoint: str  # the session's S3 (moto), where model_uri lives
    s3_env: dict[str, str]  # AWS_* for a process that reads model_uri
    log_path: Path
    startup_seconds: float  # the engine's, from start to /health answering
    publish_seconds: float  # building and committing the model

    def client(self, **kwargs: Any) -> openai.OpenAI:
        """The official OpenAI client, pointed at the engine."""
        import openai

        return openai.OpenAI(base_url=self.base_url, api_key="unused", **kwargs)


class EngineSession:
    """Starts the engine on a thread that lives for the whole session: the engine is
    started with ``setpriv --pdeathsig``, tied to the thread that starts it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.ready = threading.Event()
        self.finish = threading.Event()
        self.result: VllmEngine | None = None
        self.error: str | None = None
        self.unavailable: str | None = None
        self.moto: ThreadedMotoServer | None = None
        self.thread: threading.Thread | None = None

    def begin(self) -> None:
        try:
            check_installed()
        except EngineError as exc:
            self.unavailable = str(exc)
            self.ready.set()
            return
        self.thread = threading.Thread(target=self._run, name="vllm-engine", daemon=True)
        self.thread.start()

    def get(self) -> VllmEngine:
        if self.thread is None and self.unavailable is None:
            self.begin()
        if not self.ready.wait(START_TIMEOUT_SECONDS + 300):
            pytest.fail("the vLLM engine did not start in time")
        if self.unavailable is not None:
            if os.environ.get("CI"):
                pytest.fail(self.unavailable)
            pytest.skip(self.unavailable)
        if self.error is not None:
            pytest.fail(self.error, pytrace=False)
        assert self.result is not None
        return self.result

    def close(self) -> None:
        self.finish.set()
        if self.thread is not None:
            self.thread.join(60)
        if self.moto is not None:
            self.moto.stop()

    def _run(self) -> None:
        engine: Engine | None = None
        try:
            engine = self._start()
        except Exception as exc:
            detail = str(exc) if isinstance(exc, EngineError) else traceback.format_exc()
            self.error = f"the session's vLLM engine did not start: {detail}"
        finally:
            self.ready.set()
        self.finish.wait()
        if engine is not None:
            engine.stop()

    def _start(self) -> Engine:
        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self.moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.moto.start()
        host, port = self.moto.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        env = {
            **s3_env(endpoint, ACCESS_KEY, SECRET_KEY, REGION),
            # nothing from the host's AWS configuration
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        }
        client = boto3.session.Session().client(
            "s3",
            endpoint_url=endpoint,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name=REGION,
        )
        client.create_bucket(Bucket=BUCKET)
        client.close()
        uri = f"s3://{BUCKET}/{MODEL_PREFIX}"
        model_dir = self.root / "model"
        started = time.monotonic()
        publish = subprocess.run(
            [sys.executable, "-m", "rtrl_localkube.tinymodel", uri, "--copy-to", str(model_dir)],
            env={**os.environ, **env, "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"},
            capture_output=True,
            text=True,
        )
        if publish.returncode != 0:
            raise EngineError(f"publishing the tiny model failed:\n{publish.stderr[-3000:]}")
        publish_seconds = time.monotonic() - started
        spec = EngineSpec(
            model=uri,
            served_model_name=SERVED_MODEL_NAME,
            dtype=DTYPE,
            logprobs_mode=LOGPROBS_MODE,
            env=env,
        )
        engine = Engine(spec, self.root / "engine.log").start()
        assert engine.startup_seconds is not None
        self.result = VllmEngine(
            base_url=engine.base_url,
            root_url=engine.root_url,
            served_model_name=SERVED_MODEL_NAME,
            model_uri=uri,
            model_dir=model_dir,
            dtype=DTYPE,
            logprobs_mode=LOGPROBS_MODE,
            s3_endpoint=endpoint,
            s3_env=env,
            log_path=engine.log_path,
            startup_seconds=engine.startup_seconds,
            publish_seconds=publish_seconds,
        )
        return engine


_SESSION_KEY = pytest.StashKey[EngineSession]()


def _session(config: pytest.Config) -> EngineSession:
    session = config.stash.get(_SESSION_KEY, None)
    if session is None:
        # pytest's own temporary-directory factory (what tmp_path_factory returns)
        root = config._tmp_path_factory.mktemp("vllm", numbered=False)  # type: ignore[attr-defined]
        session = EngineSession(root)
        config.stash[_SESSION_KEY] = session
        config.add_cleanup(session.close)
    return session


def pytest_collection_finish(session: pytest.Session) -> None:
    """Begin starting the engine as soon as a selected test is known to need it."""
    if any(FIXTURE in getattr(item, "fixturenames", ()) for item in session.items):
        _session(session.config).begin()


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    session = config.stash.get(_SESSION_KEY, None)
    if session is not None and session.result is not None:
        result = session.result
        terminalreporter.write_line(
            f"vLLM engine: model published in {result.publish_seconds:.1f}s, engine ready in "
            f"{result.startup_seconds:.1f}s (log {result.log_path})"
        )


@pytest.fixture(scope="session")
def vllm_engine(pytestconfig: pytest.Config) -> VllmEngine:
    """The session's real vLLM engine (see the module docstring)."""
    return _session(pytestconfig).get()
