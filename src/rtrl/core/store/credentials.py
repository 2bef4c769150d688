"""Storage credentials as files: a step pod's ``storage.credentialsSecret`` is mounted as a
directory, and the S3 store reads the keys from there each time one is built, so they never
sit in the environment that every child process inherits (the eval step runs model-written
code). Nothing here puts a credential in a message or a repr."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from rtrl.core.store.base import StoreError

__all__ = [
    "ACCESS_KEY_FILE",
    "CREDENTIALS_DIR_ENV",
    "SECRET_KEY_FILE",
    "SESSION_TOKEN_FILE",
    "FileCredentials",
    "file_credentials",
]

# The directory of a step's credential files (the credentialsSecret volume); the name is the
# one rtrl.planning.manifests.jobs puts in every step pod's env.
CREDENTIALS_DIR_ENV = "RTRL_STORAGE_CREDENTIALS_DIR"
ACCESS_KEY_FILE = "AWS_ACCESS_KEY_ID"
SECRET_KEY_FILE = "AWS_SECRET_ACCESS_KEY"
SESSION_TOKEN_FILE = "AWS_SESSION_TOKEN"  # optional: temporary credentials


@dataclass(frozen=True)
class FileCredentials:
    """Credentials read from files; the repr shows none of them."""

    access_key_id: str = field(repr=False)
    secret_access_key: str = field(repr=False)
    session_token: str | None = field(default=None, repr=False)


def _read_credential(path: Path) -> str | None:
    """The file's text, surrounding whitespace stripped; None if there is no such file."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise StoreError(
            f"storage credentials: cannot read {path}: {exc.strerror or type(exc).__name__}"
        ) from None
    try:
        return raw.decode().strip()
    except UnicodeDecodeError:
        raise StoreError(f"storage credentials: {path} is not UTF-8 text") from None


def _required_credential(path: Path) -> str:
    value = _read_credential(path)
    if value is None:
        raise StoreError(
            f"storage credentials: {path} does not exist ({CREDENTIALS_DIR_ENV} names "
            f"{path.parent}; the credentials Secret needs the key {path.name})"
        )
    if not value:
        raise StoreError(f"storage credentials: {path} is empty")
    return value


def file_credentials(directory: str | os.PathLike[str] | None = None) -> FileCredentials | None:
    """The credentials in ``directory`` (default ``$RTRL_STORAGE_CREDENTIALS_DIR``): files
    ``AWS_ACCESS_KEY_ID`` and ``AWS_SECRET_ACCESS_KEY``, and ``AWS_SESSION_TOKEN`` if there
    is one, surrounding whitespace stripped. None when no directory is set (boto3's default
    chain applies). Read anew on each call, so a rotated Secret applies to the next store
    built. StoreError names a file that is missing, unreadable or empty, never a value."""
    if directory is None:
        directory = os.environ.get(CREDENTIALS_DIR_ENV) or None
        if directory is None:
            return None
    root = Path(directory)
    return FileCredentials(
        access_key_id=_required_credential(root / ACCESS_KEY_FILE),
        secret_access_key=_required_credential(root / SECRET_KEY_FILE),
        session_token=_read_credential(root / SESSION_TOKEN_FILE) or None,
    )
