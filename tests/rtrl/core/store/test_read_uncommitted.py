"""``read_committed_json(committed_only=False)``: how the operator reads the progress a
running step writes (progress.json) before anything under its prefix is committed, over
real HTTP to S3 (moto) and on a file:// store."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest

from rtrl.core.store import open_store, read_committed_json


@pytest.fixture
def s3_prefix(moto_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    for variable in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ROLE_ARN", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    name = f"b-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1").create_bucket(
        Bucket=name
    )
    yield f"s3://{name}/cycles/c-1/model/"


@pytest.mark.parametrize("where", ["s3", "file"])
def test_an_uncommitted_document_reads_only_when_asked(
    where: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    if where == "s3":
        prefix = request.getfixturevalue("s3_prefix")
        endpoint = request.getfixturevalue("moto_endpoint")
    else:
        prefix, endpoint = (tmp_path / "model").as_uri() + "/", None
    uri = f"{prefix}progress.json"
    # nothing written yet: None, not an error
    assert read_committed_json(uri, endpoint_url=endpoint, committed_only=False) is None
    open_store(prefix, endpoint_url=endpoint).put_bytes("progress.json", b'{"version": 1}')
    assert read_committed_json(uri, endpoint_url=endpoint, committed_only=False) == {"version": 1}
    assert read_committed_json(uri, endpoint_url=endpoint) is None  # a result waits for a commit
    open_store(prefix, endpoint_url=endpoint).put_bytes("progress.json", b"[1]")
    assert read_committed_json(uri, endpoint_url=endpoint, committed_only=False) == (
        "progress.json is not a JSON object"
    )
