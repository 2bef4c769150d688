"""S3 errors as :class:`StoreError`: one line naming the operation and the URI, the error
code, status and retries botocore reports, and nothing secret (no request, no credential, no
URL's userinfo or presigned query; a cause that would print one is left off)."""

from __future__ import annotations

from boto3.exceptions import RetriesExceededError as Boto3RetriesExceededError
from botocore.exceptions import ClientError, NoCredentialsError
from s3transfer.exceptions import RetriesExceededError

from rtrl.core.redaction import redact
from rtrl.core.store.base import ObjectNotFound, StoreError
from rtrl.core.store.credentials import CREDENTIALS_DIR_ENV
from rtrl.core.store.retries import BODY_ATTEMPTS_ENV, RetrySettings

__all__ = [
    "DOWNLOAD_RETRIES_EXCEEDED",
    "chained",
    "find_client_error",
    "redacted_already",
    "store_error",
]

# A download whose ranges broke off more often than its tries allow: s3transfer's error, or
# boto3's copy of it (download_file raises that one).
DOWNLOAD_RETRIES_EXCEEDED = (RetriesExceededError, Boto3RetriesExceededError)
# Error codes S3 (and compatibles) use for an absent key; HEAD has no body, so only "404".
_NOT_FOUND_CODES = frozenset({"NoSuchKey", "404", "NotFound"})


def store_error(exc: Exception, action: str, uri: str, settings: RetrySettings) -> StoreError:
    """A boto error as the StoreError to raise, naming the URI; never the request itself,
    which carries the signature and security token in its headers."""
    client_error = find_client_error(exc)
    if client_error is not None:
        error = client_error.response.get("Error", {})
        meta = client_error.response.get("ResponseMetadata", {})
        code = str(error.get("Code") or "Unknown")
        status = meta.get("HTTPStatusCode", "?")
        if code in _NOT_FOUND_CODES:
            return chained(ObjectNotFound(f"{uri}: no such object"), exc)
        detail = str(error.get("Message") or "").strip()
        retries = meta.get("RetryAttempts")
        message = f"{action} {uri} failed: {code} (HTTP {status})"
        if detail:
            message += f": {detail[:200]}"
        if retries:
            message += f" (after {retries} {'retry' if retries == 1 else 'retries'})"
        if code in ("403", "AccessDenied") and action == "head":
            message += " (S3 answers 403 for a missing key without s3:ListBucket)"
        return chained(StoreError(message), exc)
    if isinstance(exc, NoCredentialsError):
        return chained(
            StoreError(
                f"{action} {uri} failed: no AWS credentials found (the files of "
                f"${CREDENTIALS_DIR_ENV}, environment variables, shared config, or the "
                "pod's service-account role)"
            ),
            exc,
        )
    if isinstance(exc, DOWNLOAD_RETRIES_EXCEEDED):
        last = getattr(exc, "last_exception", None)
        return chained(
            StoreError(
                f"{action} {uri} failed: the download broke off "
                f"{settings.body_attempts} times ({type(last).__name__}; "
                f"{BODY_ATTEMPTS_ENV} sets the tries)"
            ),
            exc,
        )
    return chained(StoreError(f"{action} {uri} failed: {type(exc).__name__}: {exc}"), exc)


def find_client_error(exc: BaseException) -> ClientError | None:
    """The ClientError in ``exc``'s chain (boto3's upload wrapper keeps one as context)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, ClientError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def chained(error: StoreError, cause: BaseException) -> StoreError:
    """``error`` with ``cause`` as its cause, unless some message in the cause's chain
    carries a secret :func:`redact` would hide (botocore's "Could not connect to the endpoint
    URL" repeats the URL whole): then with no cause shown, since a traceback prints them."""
    error.__suppress_context__ = True
    error.__cause__ = cause if redacted_already(cause) else None
    return error


def redacted_already(exc: BaseException) -> bool:
    """Whether no message in ``exc``'s chain has anything :func:`redact` would hide."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        text = str(current)
        if redact(text) != text:
            return False
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return True
