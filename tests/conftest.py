"""Shared test fixtures and paths: the repository, console scripts, and a real HTTP S3
endpoint (moto) for every suite that talks to S3."""

from __future__ import annotations

import logging
import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest
from moto.server import ThreadedMotoServer

from rtrl_localkube.tools import OPEN_POLICY_ENV

# the session's real vLLM engine: the ``vllm_engine`` fixture (tests/vllm_engine.py)
pytest_plugins = ["tests.vllm_engine"]

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

# The operators the tests start (in-process, or as children inheriting this environment)
# run under the policy of a machine of one user, who writes the RLCycles and is the admin
# (rtrl.core.api.policy.UNRESTRICTED); the tests of the tenancy policy pass their own.
os.environ.setdefault(*next(iter(OPEN_POLICY_ENV.items())))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Where the workers of ``make test`` (pytest-xdist, ``--dist loadgroup``) run each test:
    a module's tests on one worker, so its module-scoped fixtures (a demo run, a moto server)
    start once; and every test of the session's vLLM engine on one worker, so the engine
    starts once. Without xdist the marker is inert."""
    for item in items:
        fixtures = getattr(item, "fixturenames", ())
        group = "vllm-engine" if "vllm_engine" in fixtures else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


def console_script(name: str) -> str:
    """Path of a console script of this project's environment (rtrl, rtrl-job, ...)."""
    path = BIN / name
    assert path.exists(), f"{name} is not installed in {BIN}; run `make test`"
    return os.fspath(path)


@pytest.fixture(scope="module")
def moto_endpoint() -> Iterator[str]:
    """A real HTTP S3 endpoint; shared by a module's tests, each using its own bucket."""
    werkzeug = logging.getLogger("werkzeug")
    level = werkzeug.level
    werkzeug.setLevel(logging.ERROR)  # one INFO line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()
        werkzeug.setLevel(level)


@pytest.fixture
def s3_bucket(
    moto_endpoint: str, monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory
) -> str:
    """A fresh bucket on the moto endpoint. Dummy credentials and the endpoint come from the
    environment (``AWS_ENDPOINT_URL``), as in a pod, so subprocesses such as ``rtrl-job``
    reach it too; nothing comes from the host's AWS configuration."""
    empty = tmp_path_factory.getbasetemp() / "no-aws-config"
    for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL_S3", "AWS_ROLE_ARN", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_endpoint)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(empty))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(empty))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    name = f"test-{uuid.uuid4().hex[:12]}"
    client = boto3.session.Session().client("s3", endpoint_url=moto_endpoint)
    client.create_bucket(Bucket=name)
    client.close()
    return name
