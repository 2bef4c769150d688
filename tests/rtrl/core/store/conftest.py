"""Fixtures for the object-store suite: on the moto S3 server of tests/conftest.py, a
fault-injecting HTTP proxy in front of it (:mod:`rtrl_localkube.s3faults`), and a
``make_store`` factory parametrised over both backends so every behaviour is checked on
``file://`` and ``s3://`` alike."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest

from rtrl.core.store import ObjectStore
from rtrl.core.store.local import LocalStore
from rtrl.core.store.s3 import S3Store
from rtrl_localkube.s3faults import FaultProxy, serve_fault_proxy

# Recognisable fake credentials: tests assert they never show up in an error.
ACCESS_KEY = "AKIATESTACCESSKEY000"
SECRET_KEY = "s3cr3t-DO-NOT-LEAK-0123456789abcdef"
SESSION_TOKEN = "t0ken-DO-NOT-LEAK-fedcba9876543210"


@pytest.fixture(autouse=True)
def aws_env(
    monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, str]:
    """Dummy credentials through the default chain, and nothing from the host's AWS config;
    returns the credentials so tests can assert they never appear in an error."""
    empty = tmp_path_factory.getbasetemp() / "no-aws-config"
    for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ROLE_ARN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    monkeypatch.setenv("AWS_SESSION_TOKEN", SESSION_TOKEN)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(empty))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(empty))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    return {
        "AWS_ACCESS_KEY_ID": ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        "AWS_SESSION_TOKEN": SESSION_TOKEN,
    }


@pytest.fixture
def fault_proxy(moto_endpoint: str) -> Iterator[tuple[FaultProxy, str]]:
    """(proxy, its endpoint URL), forwarding to the module's moto server."""
    with serve_fault_proxy(moto_endpoint) as served:
        yield served


def new_bucket(endpoint: str) -> str:
    name = f"rtrl-test-{uuid.uuid4().hex[:12]}"
    client = boto3.session.Session().client("s3", endpoint_url=endpoint)
    client.create_bucket(Bucket=name)
    client.close()
    return name


StoreFactory = Callable[..., ObjectStore]


@pytest.fixture(params=["file", "s3"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def make_store(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[StoreFactory]:
    """Build a fresh store of the test's backend; keyword arguments are S3Store options
    (ignored for ``file://``), e.g. ``page_size`` or ``multipart_threshold``."""
    stores: list[S3Store] = []

    def factory(**s3_options: Any) -> ObjectStore:
        if backend == "file":
            root = tmp_path / f"store-{uuid.uuid4().hex[:8]}"
            return LocalStore(root)
        endpoint = request.getfixturevalue("moto_endpoint")
        s3_options.setdefault("endpoint_url", endpoint)
        store = S3Store(new_bucket(endpoint), "runs/test-prefix", **s3_options)
        stores.append(store)
        return store

    yield factory
    for store in stores:
        store.client.close()


@pytest.fixture
def store(make_store: StoreFactory) -> ObjectStore:
    return make_store()
