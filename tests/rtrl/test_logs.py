"""``rtrl operator --verbose`` logs rtrl's DEBUG records, never the libraries' that carry
secrets: botocore prints every request's headers at DEBUG, the signature among them."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from rtrl import logs
from rtrl.core.store import open_store

LIBRARIES = ("botocore", "boto3", "s3transfer", "urllib3", "kubernetes")
SECRET = "wJalrXUtnFEMI-K7MDENG-bPxRfiCYEXAMPLEKEY"


@pytest.fixture
def root_logger() -> Iterator[None]:
    """configure() replaces the root logger's handlers: put pytest's back afterwards."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    levels = {name: logging.getLogger(name).level for name in LIBRARIES}
    try:
        yield
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
        for name, old in levels.items():
            logging.getLogger(name).setLevel(old)


def test_verbose_logs_no_request_signature_nor_secret(
    s3_bucket: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    root_logger: None,
) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    logs.configure("text", verbose=True)
    logging.getLogger("rtrl.kube").debug("a debug line of rtrl's own")
    store = open_store(f"s3://{s3_bucket}/x/")
    store.put_bytes("a.txt", b"hello")
    assert store.get_bytes("a.txt") == b"hello"
    err = capsys.readouterr().err
    assert "a debug line of rtrl's own" in err
    assert "Signature=" not in err and "AWS4-HMAC-SHA256" not in err
    assert SECRET not in err
