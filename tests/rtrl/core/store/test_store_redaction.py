"""Store errors never show a URL's secrets (issue 19, finding 6): an endpoint such as
``http://KEY:SECRET@host``, or a presigned query string, is neither in a store error's text,
nor in its traceback, nor in a log line. Before, botocore's "Could not connect to the
endpoint URL" carried the endpoint whole into the StoreError."""

from __future__ import annotations

import logging
import traceback
from typing import Any

import boto3
import pytest
from botocore.config import Config

from rtrl.core.store import (
    ObjectNotFound,
    StoreError,
    open_store,
    parse_store_uri,
    read_committed_json,
    redact,
)
from rtrl.core.store.s3 import S3Store
from rtrl_localkube.s3faults import FaultProxy

SECRET = "pa55-DO-NOT-LEAK-7f3e"
USER = "KEYID-DO-NOT-LEAK"
# Nothing listens on port 9 of 127.0.0.1: every request fails to connect.
DEAD = f"http://{USER}:{SECRET}@127.0.0.1:9"
PRESIGNED = (
    "https://bucket.s3.amazonaws.com/key?X-Amz-Algorithm=AWS4-HMAC-SHA256"
    f"&X-Amz-Credential={USER}%2F20260105%2Fus-east-1%2Fs3%2Faws4_request"
    f"&X-Amz-Security-Token={SECRET}-token&X-Amz-Signature={SECRET}0abc&X-Amz-Expires=60"
)


def _shown(exc: BaseException, caplog: pytest.LogCaptureFixture) -> str:
    """Everything a person could see of a failure: its message, its traceback with every
    cause, and the log lines written meanwhile."""
    return "\n".join([str(exc), repr(exc), *traceback.format_exception(exc), caplog.text])


@pytest.fixture
def logs(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    # What the operator and the steps log at their default level, and rtrl's own debug lines.
    caplog.set_level(logging.INFO)
    caplog.set_level(logging.DEBUG, logger="rtrl")
    return caplog


def test_an_endpoint_with_credentials_is_refused_without_showing_them(
    logs: pytest.LogCaptureFixture,
) -> None:
    with pytest.raises(StoreError) as info:
        open_store("s3://bucket/runs/", endpoint_url=DEAD).get_bytes("stage.json")
    shown = _shown(info.value, logs)
    assert SECRET not in shown and USER not in shown
    assert str(info.value).startswith("endpoint URL http://***@127.0.0.1:9 has credentials")
    # The same from the environment, as a step pod gets spec.storage.endpoint.
    with pytest.MonkeyPatch.context() as env:
        env.setenv("AWS_ENDPOINT_URL", DEAD)
        assert isinstance(read_committed_json("s3://bucket/runs/stage.json"), str)
        message = read_committed_json("s3://bucket/runs/stage.json")
    assert isinstance(message, str) and "credentials" in message and SECRET not in message


def test_a_failing_request_to_such_an_endpoint_shows_no_secret(
    logs: pytest.LogCaptureFixture,
) -> None:
    """A client built on the endpoint elsewhere (``client=``) bypasses the refusal: the
    failure is botocore's, whose message repeats the endpoint URL; the store redacts it."""
    client = boto3.session.Session().client(
        "s3",
        endpoint_url=DEAD,
        region_name="us-east-1",
        config=Config(retries={"mode": "standard", "total_max_attempts": 1}, connect_timeout=2),
    )
    store = S3Store("bucket", "runs", client=client)
    for operation in (
        lambda: store.get_bytes("stage.json"),
        lambda: store.put_bytes("stage.json", b"{}"),
        lambda: list(store.list()),
        lambda: store.exists("stage.json"),
    ):
        with pytest.raises(StoreError) as info:
            operation()
        shown = _shown(info.value, logs)
        assert SECRET not in shown and USER not in shown, shown
        assert "http://***@127.0.0.1:9" in str(info.value)  # where it failed, still said
    client.close()


def test_a_busy_endpoint_with_credentials_in_its_url_shows_none(
    fault_proxy: tuple[FaultProxy, str], logs: pytest.LogCaptureFixture
) -> None:
    """Through the fault proxy (the endpoint reachable, every request answered 503)."""
    proxy, endpoint = fault_proxy
    proxy.fail(lambda *_: True, times=-1)
    with_userinfo = endpoint.replace("http://", f"http://{USER}:{SECRET}@")
    client = boto3.session.Session().client(
        "s3", endpoint_url=with_userinfo, config=Config(retries={"total_max_attempts": 2})
    )
    with pytest.raises(StoreError) as info:
        S3Store("bucket", client=client).put_bytes("x", b"1")
    assert "503" in str(info.value)
    shown = _shown(info.value, logs)
    assert SECRET not in shown and USER not in shown
    client.close()


def test_redact_hides_userinfo_and_presigned_queries() -> None:
    assert redact(DEAD + "/bucket/key") == "http://***@127.0.0.1:9/bucket/key"
    shown = redact(f"GET {PRESIGNED} failed")
    assert SECRET not in shown and USER not in shown
    assert "X-Amz-Signature=***" in shown and "X-Amz-Credential=***" in shown
    assert "X-Amz-Expires=60" in shown and "https://bucket.s3.amazonaws.com/key?" in shown
    # Nothing else changes: plain URIs, paths, e-mail-like text.
    for plain in ("s3://bucket/runs/stage.json", "file:///data/a@b/c", "user@example.com"):
        assert redact(plain) == plain


def test_store_errors_and_uri_errors_are_redacted_whoever_raises_them() -> None:
    errors: list[Any] = [StoreError(f"get {PRESIGNED}"), ObjectNotFound(f"{DEAD}/x: no such")]
    for error in errors:
        assert SECRET not in str(error) and SECRET not in repr(error)
    for uri in (PRESIGNED, f"s3://{USER}:{SECRET}@bucket/p/"):
        with pytest.raises(ValueError) as info:
            parse_store_uri(uri)
        assert SECRET not in str(info.value) and USER not in str(info.value)
