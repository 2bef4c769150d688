"""One real vLLM engine per test session: the ``vllm_engine`` fixture, and ``tiny_model``, the
model it serves (a pytest plugin that tests/conftest.py loads).

The engine serves the tiny model of :mod:`rtrl_localkube.tinymodel`, published by rtrl's
store code to a session S3 (moto's ThreadedMotoServer) and loaded by vLLM from
``--model s3://...`` through runai-model-streamer, as a cluster's engine loads a
checkpoint rtrl published. Flags: ``--dtype float32``, ``--logprobs-mode
processed_logprobs``, the hermes tool parser, LoRA adapters loaded at run time up to rank
:data:`MAX_LORA_RANK` (``rtrl_localkube.engine``).

Cost: the engine takes 1-5 minutes to start on 2 cores, the model ~10-90 s to build. Both
happen once per session, and only when a selected test uses ``vllm_engine`` (or, for the
model alone, ``tiny_model``), directly or through another fixture: at the end of
collection they begin in the background, so the tests that run before the first one that
needs them pay nothing; that one waits for the rest. The engine is stopped at the end of
the session. Its log is ``<pytest basetemp>/vllm/engine.log``.

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
from collections.abc import Iterator
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

ENGINE_FIXTURE, MODEL_FIXTURE = "vllm_engine", "tiny_model"
BUCKET = "rtrl-models"
MODEL_PREFIX = "tiny/checkpoints/tiny-0/"
SERVED_MODEL_NAME = "tiny"
DTYPE = "float32"
LOGPROBS_MODE = "processed_logprobs"
# LoRA on: adapters rtrl trains are loaded into the running engine
# (tests/rtrl_serving/capture/test_adapter_routing.py); requests naming the base use none
MAX_LORA_RANK = 8
# moto takes any keys; these are the engine's and the publisher's, never the host's
ACCESS_KEY, SECRET_KEY, REGION = "testing", "testing", "us-east-1"


@dataclass(frozen=True)
class TinyModel:
    """The tiny model committed to the session's S3, as a cluster's store holds a checkpoint."""

    uri: str  # s3://rtrl-models/tiny/checkpoints/tiny-0/ (committed, with its manifest)
    directory: Path  # a local copy of the committed files, checked against the manifest
    s3_endpoint: str  # the session's S3 (moto)
    s3_env: dict[str, str]  # AWS_* and the streamer's settings for a process that reads uri
    publish_seconds: float  # building and committing it


@dataclass(frozen=True)
class VllmEngine:
    """The session's engine, as tests see it."""

    base_url: str  # the OpenAI API: http://127.0.0.1:PORT/v1
    root_url: str  # /health, /metrics, ...
    served_model_name: str
    model: TinyModel  # what it serves, loaded from model.uri
    dtype: str
    logprobs_mode: str
    log_path: Path
    startup_seconds: float  # from start to /health answering

    @property
    def model_uri(self) -> str:
        return self.model.uri

    @property
    def model_dir(self) -> Path:
        return self.model.directory

    @property
    def s3_endpoint(self) -> str:
        """The session's S3 (moto over HTTP): the model the engine serves, and the events."""
        return self.model.s3_endpoint

    def client(self, **kwargs: Any) -> openai.OpenAI:
        """The official OpenAI client, pointed at the engine. Kept until the session ends
        and closed then: a client dropped with its pool open is an unclosed socket that
        the garbage collector reports in whichever test runs at that moment."""
        import openai

        client = openai.OpenAI(base_url=self.base_url, api_key="unused", **kwargs)
        _CLIENTS.append(client)
        return client


_CLIENTS: list[openai.OpenAI] = []


class EngineSession:
    """Publishes the model, then (when asked) starts the engine, on a thread that lives for
    the whole session: the engine is started with ``setpriv --pdeathsig``, which is tied to
    the thread that starts it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.published = threading.Event()
        self.want_engine = threading.Event()
        self.ready = threading.Event()
        self.finish = threading.Event()
        self.model: TinyModel | None = None
        self.engine: VllmEngine | None = None
        self.error: str | None = None
        self.unavailable: str | None = None
        self.moto: ThreadedMotoServer | None = None
        self.thread: threading.Thread | None = None

    def begin(self, *, engine: bool) -> None:
        if engine:
            self.want_engine.set()
        if self.thread is not None or self.unavailable is not None:
            return
        try:
            check_installed()
        except EngineError as exc:
            self.unavailable = str(exc)
            self.published.set()
            self.ready.set()
            return
        self.thread = threading.Thread(target=self._run, name="vllm-engine", daemon=True)
        self.thread.start()

    def get_model(self) -> TinyModel:
        self.begin(engine=False)
        self._wait(self.published)
        assert self.model is not None
        return self.model

    def get_engine(self) -> VllmEngine:
        self.begin(engine=True)
        self._wait(self.ready)
        assert self.engine is not None
        return self.engine

    def _wait(self, event: threading.Event) -> None:
        if not event.wait(START_TIMEOUT_SECONDS + 300):
            pytest.fail("the session's tiny model or vLLM engine did not start in time")
        if self.unavailable is not None:
            if os.environ.get("CI"):
                pytest.fail(self.unavailable)
            pytest.skip(self.unavailable)
        if self.error is not None:
            pytest.fail(self.error, pytrace=False)

    def close(self) -> None:
        self.finish.set()
        if self.thread is not None:
            self.thread.join(60)
        if self.moto is not None:
            self.moto.stop()

    def _run(self) -> None:
        engine: Engine | None = None
        try:
            self.model = self._publish()
            self.published.set()
            while not (self.want_engine.wait(1) or self.finish.is_set()):
                pass
            if not self.finish.is_set():
                engine = self._start(self.model)
        except Exception as exc:
            detail = str(exc) if isinstance(exc, EngineError) else traceback.format_exc()
            self.error = f"the session's vLLM engine did not start: {detail}"
        finally:
            self.published.set()
            self.ready.set()
        self.finish.wait()
        if engine is not None:
            engine.stop()

    def _publish(self) -> TinyModel:
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
        directory = self.root / "model"
        started = time.monotonic()
        publish = subprocess.run(
            [sys.executable, "-m", "rtrl_localkube.tinymodel", uri, "--copy-to", str(directory)],
            env={**os.environ, **env, "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"},
            capture_output=True,
            text=True,
        )
        if publish.returncode != 0:
            raise EngineError(f"publishing the tiny model failed:\n{publish.stderr[-3000:]}")
        return TinyModel(uri, directory, endpoint, env, time.monotonic() - started)

    def _start(self, model: TinyModel) -> Engine:
        spec = EngineSpec(
            model=model.uri,
            served_model_name=SERVED_MODEL_NAME,
            dtype=DTYPE,
            logprobs_mode=LOGPROBS_MODE,
            env=model.s3_env,
            max_lora_rank=MAX_LORA_RANK,
        )
        engine = Engine(spec, self.root / "engine.log").start()
        assert engine.startup_seconds is not None
        self.engine = VllmEngine(
            base_url=engine.base_url,
            root_url=engine.root_url,
            served_model_name=SERVED_MODEL_NAME,
            model=model,
            dtype=DTYPE,
            logprobs_mode=LOGPROBS_MODE,
            log_path=engine.log_path,
            startup_seconds=engine.startup_seconds,
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
    """Begin as soon as a selected test is known to need the engine (or only the model)."""
    names = [set(getattr(item, "fixturenames", ())) for item in session.items]
    if any(ENGINE_FIXTURE in n for n in names):
        _session(session.config).begin(engine=True)
    elif any(MODEL_FIXTURE in n for n in names):
        _session(session.config).begin(engine=False)


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    session = config.stash.get(_SESSION_KEY, None)
    if session is None:
        return
    if session.model is not None:
        line = f"tiny model: published in {session.model.publish_seconds:.1f}s"
        if session.engine is not None:
            line += (
                f"; vLLM engine ready in {session.engine.startup_seconds:.1f}s "
                f"(log {session.engine.log_path})"
            )
        terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def tiny_model(pytestconfig: pytest.Config) -> TinyModel:
    """The tiny model committed to the session's S3 (no engine is started for it)."""
    return _session(pytestconfig).get_model()


@pytest.fixture(scope="session")
def vllm_engine(pytestconfig: pytest.Config) -> Iterator[VllmEngine]:
    """The session's real vLLM engine (see the module docstring)."""
    yield _session(pytestconfig).get_engine()
    while _CLIENTS:
        _CLIENTS.pop().close()
