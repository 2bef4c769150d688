"""S3 credentials from files: a step pod gets its credentials Secret mounted as files under
``RTRL_STORAGE_CREDENTIALS_DIR`` instead of as environment variables (the eval step runs
model-written code). Against the moto server, with no credentials in the environment."""

from __future__ import annotations

import os
import traceback
import uuid
from pathlib import Path

import boto3
import pytest

from rtrl.core.store import StoreError, open_store, read_committed_json
from rtrl.core.store.credentials import CREDENTIALS_DIR_ENV, file_credentials
from rtrl.core.store.s3 import S3Store

FILE_ACCESS_KEY = "AKIAFROMFILE00000000"
FILE_SECRET = "f1le-s3cr3t-DO-NOT-LEAK-abcdef0123"
FILE_TOKEN = "f1le-t0ken-DO-NOT-LEAK-3210fedcba"


def write_credentials(directory: Path, **files: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for name, value in files.items():
        path = directory / name
        path.unlink(missing_ok=True)
        path.write_text(value)
        path.chmod(0o440)  # the mode the step pod's Secret volume gives them
    return directory


@pytest.fixture
def bucket(moto_endpoint: str) -> str:
    """A fresh bucket, made with the suite's environment credentials (conftest.aws_env)."""
    name = f"rtrl-creds-{uuid.uuid4().hex[:12]}"
    client = boto3.session.Session().client("s3", endpoint_url=moto_endpoint)
    client.create_bucket(Bucket=name)
    client.close()
    return name


@pytest.fixture
def creds_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bucket: str) -> Path:
    """Files as the Secret volume holds them (a trailing newline, as `kubectl create secret
    --from-file` keeps it), the variable naming them, and no credentials in the env."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    directory = write_credentials(
        tmp_path / "storage",
        AWS_ACCESS_KEY_ID=f"{FILE_ACCESS_KEY}\n",
        AWS_SECRET_ACCESS_KEY=f"{FILE_SECRET}\n",
    )
    monkeypatch.setenv(CREDENTIALS_DIR_ENV, os.fspath(directory))
    return directory


def used_credentials(store: S3Store) -> tuple[str, str, str | None]:
    creds = store.client._get_credentials()  # type: ignore[attr-defined]
    return creds.access_key, creds.secret_key, creds.token


def test_a_store_talks_to_s3_with_the_file_credentials(
    creds_dir: Path, bucket: str, moto_endpoint: str, tmp_path: Path
) -> None:
    store = open_store(f"s3://{bucket}/runs/", endpoint_url=moto_endpoint)
    assert isinstance(store, S3Store)
    store.put_bytes("a/b.txt", b"hello")
    assert store.get_bytes("a/b.txt") == b"hello"
    assert [info.key for info in store.list()] == ["a/b.txt"]
    assert used_credentials(store) == (FILE_ACCESS_KEY, FILE_SECRET, None)
    (tmp_path / "result.json").write_text('{"ok": true}')
    store.commit("", {"result.json": tmp_path / "result.json"})
    # how the operator reads a step's result document
    assert read_committed_json(f"s3://{bucket}/runs/result.json", endpoint_url=moto_endpoint) == {
        "ok": True
    }


def test_without_the_files_there_are_no_credentials_at_all(
    creds_dir: Path, bucket: str, moto_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the step pod's process has without the variable: nothing (so the test above
    proves the files were used)."""
    monkeypatch.delenv(CREDENTIALS_DIR_ENV)
    store = open_store(f"s3://{bucket}/runs/", endpoint_url=moto_endpoint)
    with pytest.raises(StoreError, match="no AWS credentials found"):
        store.put_bytes("x", b"1")


def test_file_credentials_win_over_the_environment(
    creds_dir: Path, monkeypatch: pytest.MonkeyPatch, moto_endpoint: str, bucket: str
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAFROMENVIRONMENT0")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "from-the-environment")
    store = open_store(f"s3://{bucket}/", endpoint_url=moto_endpoint)
    assert isinstance(store, S3Store)
    assert used_credentials(store)[:2] == (FILE_ACCESS_KEY, FILE_SECRET)


def test_a_session_token_file_is_used_when_present(
    creds_dir: Path, moto_endpoint: str, bucket: str
) -> None:
    write_credentials(creds_dir, AWS_SESSION_TOKEN=FILE_TOKEN)
    store = open_store(f"s3://{bucket}/", endpoint_url=moto_endpoint)
    assert isinstance(store, S3Store)
    assert used_credentials(store) == (FILE_ACCESS_KEY, FILE_SECRET, FILE_TOKEN)
    store.put_bytes("t", b"1")


def test_every_open_store_reads_the_files_again(
    creds_dir: Path, moto_endpoint: str, bucket: str
) -> None:
    first = open_store(f"s3://{bucket}/", endpoint_url=moto_endpoint)
    write_credentials(
        creds_dir, AWS_ACCESS_KEY_ID="AKIAROTATED000000000", AWS_SECRET_ACCESS_KEY="rotated"
    )
    second = open_store(f"s3://{bucket}/", endpoint_url=moto_endpoint)
    assert isinstance(first, S3Store) and isinstance(second, S3Store)
    assert used_credentials(first)[0] == FILE_ACCESS_KEY
    assert used_credentials(second)[:2] == ("AKIAROTATED000000000", "rotated")


def assert_clean(error: BaseException) -> None:
    rendered = "".join(traceback.format_exception(error))
    for secret in (FILE_ACCESS_KEY, FILE_SECRET, FILE_TOKEN):
        assert secret not in rendered


@pytest.mark.parametrize("missing", ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"])
def test_a_missing_file_is_a_clear_error_naming_it(
    creds_dir: Path, moto_endpoint: str, bucket: str, missing: str
) -> None:
    (creds_dir / missing).unlink()
    with pytest.raises(StoreError) as info:
        open_store(f"s3://{bucket}/", endpoint_url=moto_endpoint)
    message = str(info.value)
    assert str(creds_dir / missing) in message and "does not exist" in message
    assert CREDENTIALS_DIR_ENV in message and f"needs the key {missing}" in message
    assert_clean(info.value)


def test_an_empty_or_unreadable_file_is_a_clear_error(creds_dir: Path, bucket: str) -> None:
    write_credentials(creds_dir, AWS_SECRET_ACCESS_KEY="\n")
    with pytest.raises(StoreError, match=r"AWS_SECRET_ACCESS_KEY is empty") as info:
        open_store(f"s3://{bucket}/")
    assert_clean(info.value)
    write_credentials(creds_dir, AWS_SECRET_ACCESS_KEY=FILE_SECRET)
    (creds_dir / "AWS_ACCESS_KEY_ID").write_bytes(b"\xffnot text")
    with pytest.raises(StoreError, match=r"AWS_ACCESS_KEY_ID is not UTF-8 text") as info:
        open_store(f"s3://{bucket}/")
    assert_clean(info.value)
    (creds_dir / "AWS_ACCESS_KEY_ID").unlink()
    (creds_dir / "AWS_ACCESS_KEY_ID").mkdir()
    with pytest.raises(StoreError, match=r"cannot read .*AWS_ACCESS_KEY_ID: Is a directory"):
        open_store(f"s3://{bucket}/")


def test_a_file_without_read_permission_is_a_clear_error(
    creds_dir: Path, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    denied = creds_dir / "AWS_SECRET_ACCESS_KEY"
    if os.geteuid() == 0:  # root reads a file of mode 0000: refuse as the kernel would
        read_bytes = Path.read_bytes

        def refuse(self: Path) -> bytes:
            if self == denied:
                raise PermissionError(13, "Permission denied", os.fspath(self))
            return read_bytes(self)

        monkeypatch.setattr(Path, "read_bytes", refuse)
    denied.chmod(0)
    with pytest.raises(StoreError) as info:
        open_store(f"s3://{bucket}/")
    assert str(info.value) == f"storage credentials: cannot read {denied}: Permission denied"
    assert_clean(info.value)


def test_file_credentials_hide_their_values(creds_dir: Path) -> None:
    creds = file_credentials()
    assert creds is not None and creds.secret_access_key == FILE_SECRET
    assert FILE_SECRET not in repr(creds) and FILE_ACCESS_KEY not in repr(creds)
    assert file_credentials(creds_dir) == creds


def test_no_directory_means_the_default_chain(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CREDENTIALS_DIR_ENV, raising=False)
    assert file_credentials() is None
    monkeypatch.setenv(CREDENTIALS_DIR_ENV, "")
    assert file_credentials() is None
