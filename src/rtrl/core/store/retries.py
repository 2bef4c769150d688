"""How hard the S3 store retries: a busy S3 (503 SlowDown, bodies that break off mid-read) is
normal, and a step that gives up after a few tries fails a whole cycle for it.

Two budgets, because botocore's covers only half of a request:

- **botocore's retries** cover a request until its response headers (and any small XML body)
  have arrived: 5xx, throttling and connection errors, with exponential backoff and jitter.
  The standard AWS settings choose them, ``AWS_RETRY_MODE`` (``standard``, ``adaptive`` or
  ``legacy``) and ``AWS_MAX_ATTEMPTS`` (tries in all, the first included), from the
  environment or the AWS config file; where neither says, rtrl's defaults below apply
  (botocore's own, 3 tries, give up on a mildly busy S3).
- **body retries** (``RTRL_S3_BODY_ATTEMPTS``, tries in all) cover an object's body, which
  is read after botocore's loop has returned: a body that breaks off is fetched again,
  with exponential backoff and full jitter, for at most :data:`BODY_RETRY_BUDGET_S` in all.
"""

from __future__ import annotations

import http.client
import os
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, cast

from botocore.exceptions import IncompleteReadError, ReadTimeoutError, ResponseStreamingError
from urllib3.exceptions import ProtocolError

from rtrl.core.store.base import StoreError

__all__ = [
    "BODY_ATTEMPTS_ENV",
    "BODY_RETRY_BUDGET_S",
    "DEFAULT_BODY_ATTEMPTS",
    "DEFAULT_MAX_ATTEMPTS",
    "DEFAULT_RETRY_MODE",
    "MAX_ATTEMPTS_ENV",
    "RETRY_MODE_ENV",
    "RetryMode",
    "RetrySettings",
    "body_backoff",
    "broken_body",
    "retry_settings",
]

RetryMode = Literal["standard", "adaptive", "legacy"]
RETRY_MODES: tuple[RetryMode, ...] = ("standard", "adaptive", "legacy")

RETRY_MODE_ENV = "AWS_RETRY_MODE"
MAX_ATTEMPTS_ENV = "AWS_MAX_ATTEMPTS"
BODY_ATTEMPTS_ENV = "RTRL_S3_BODY_ATTEMPTS"

# rtrl's defaults where the environment and the AWS config file say nothing. Measured by
# bench/s3_faults.py (docs/benchmarks.md, "S3 faults").
DEFAULT_RETRY_MODE: RetryMode = "standard"
DEFAULT_MAX_ATTEMPTS = 10
DEFAULT_BODY_ATTEMPTS = 10
# Bounds on what the variables may ask for: a retry budget is time, and a typo such as
# AWS_MAX_ATTEMPTS=1000 would hold a step for hours on an S3 that is down.
MAX_ATTEMPTS_LIMIT = 50

# Backoff between body tries: full jitter over base * 2**(n-1), capped; and no new try once
# this long has passed since the first (a body that keeps breaking off, or keeps timing out
# after read_timeout, fails the operation in bounded time).
BODY_BACKOFF_BASE_S = 0.05
BODY_BACKOFF_CAP_S = 5.0
BODY_RETRY_BUDGET_S = 120.0

# What reading a body that broke off raises: botocore's streaming body errors, urllib3's and
# the socket's where they get through. s3transfer retries the same ones for downloads.
_BROKEN_BODY = (
    IncompleteReadError,
    ResponseStreamingError,
    ReadTimeoutError,
    ProtocolError,
    http.client.IncompleteRead,
    ConnectionError,
)


@dataclass(frozen=True)
class RetrySettings:
    """The retry budgets of one store (see the module's docstring)."""

    mode: RetryMode = DEFAULT_RETRY_MODE
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    body_attempts: int = DEFAULT_BODY_ATTEMPTS


def _attempts(name: str, value: object) -> int:
    try:
        number = int(str(value).strip())
    except ValueError:
        number = 0
    if not 1 <= number <= MAX_ATTEMPTS_LIMIT:
        raise StoreError(
            f"{name}={str(value)!r}: expected a whole number of tries from 1 to "
            f"{MAX_ATTEMPTS_LIMIT} (the first try included)"
        )
    return number


def retry_settings(
    config: Mapping[str, object] | None = None, environ: Mapping[str, str] | None = None
) -> RetrySettings:
    """The budgets from ``config`` (``retry_mode`` and ``max_attempts`` as botocore's
    configuration resolved them from ``AWS_RETRY_MODE``, ``AWS_MAX_ATTEMPTS`` or the AWS config
    file; None where unset) and ``RTRL_S3_BODY_ATTEMPTS`` in ``environ``; rtrl's defaults for
    what is unset. :class:`StoreError` naming the variable for a value out of range."""
    config = config or {}
    environ = os.environ if environ is None else environ
    mode = config.get("retry_mode")
    if mode is not None and str(mode).strip().lower() not in RETRY_MODES:
        raise StoreError(
            f"{RETRY_MODE_ENV}={str(mode)!r}: expected one of {', '.join(RETRY_MODES)}"
        )
    max_attempts = config.get("max_attempts")
    body = environ.get(BODY_ATTEMPTS_ENV, "").strip()
    return RetrySettings(
        mode=cast(RetryMode, str(mode).strip().lower()) if mode is not None else DEFAULT_RETRY_MODE,
        max_attempts=(
            _attempts(MAX_ATTEMPTS_ENV, max_attempts)
            if max_attempts is not None
            else DEFAULT_MAX_ATTEMPTS
        ),
        body_attempts=_attempts(BODY_ATTEMPTS_ENV, body) if body else DEFAULT_BODY_ATTEMPTS,
    )


def body_backoff(attempt: int, rng: random.Random | None = None) -> float:
    """Seconds to wait before body try ``attempt + 1``: full jitter (AWS's advice: retries
    of many readers spread out instead of arriving together) over an exponential cap."""
    ceiling = min(BODY_BACKOFF_CAP_S, BODY_BACKOFF_BASE_S * 2 ** (attempt - 1))
    return (rng or random).uniform(0.0, ceiling)


def broken_body(exc: BaseException) -> bool:
    """Whether ``exc``, raised while reading a response body, says the body broke off. Only
    for errors of the read itself: the same classes raised by the request (a refused
    connection, say) were botocore's to retry, and it has."""
    return isinstance(exc, _BROKEN_BODY)
