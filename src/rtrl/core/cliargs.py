"""Argument types shared by the command lines (``rtrl``, ``rtrl-job``): a bad number is a
usage error naming what was expected, with argparse's exit status 2."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TypeVar
from urllib.parse import urlsplit

N = TypeVar("N", int, float)


def _checked(text: str, kind: Callable[[str], N], accept: Callable[[N], bool], expected: str) -> N:
    """``text`` as ``kind`` when ``accept`` holds of it, else a usage error naming what was
    expected."""
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, not {text!r}") from None
    if not accept(value):
        raise argparse.ArgumentTypeError(f"expected {expected}, not {text!r}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1."""
    return _checked(text, int, lambda v: v >= 1, "a positive integer")


def non_negative_int(text: str) -> int:
    """An integer >= 0."""
    return _checked(text, int, lambda v: v >= 0, "a non-negative integer")


def fraction(text: str) -> float:
    """A number in [0, 1] (never NaN: it compares false with both bounds)."""
    return _checked(text, float, lambda v: 0.0 <= v <= 1.0, "a fraction between 0 and 1")


def fraction_up_to(high: float) -> Callable[[str], float]:
    """The argparse type of a number in [0, ``high``], for a share that must leave the
    rest something (a held-out share of 1 would leave nothing to train on)."""

    def parse(text: str) -> float:
        return _checked(
            text, float, lambda v: 0.0 <= v <= high, f"a fraction between 0 and {high:g}"
        )

    parse.__name__ = f"fraction_up_to_{high:g}"
    return parse


def endpoint_url(text: str) -> str:
    """An S3-compatible endpoint: an http(s) URL with a host, and no credentials, query or
    fragment. Refused without repeating it: what a pasted URL holds besides its host may
    be a secret (``http://KEY:SECRET@host``, a presigned query)."""
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise argparse.ArgumentTypeError("expected an http(s) URL, e.g. http://minio:9000")
    if "@" in parts.netloc:
        raise argparse.ArgumentTypeError(
            "must not hold credentials (user:password@): they come from the credentials "
            "files, the environment or the pod's role"
        )
    if parts.query or parts.fragment:
        raise argparse.ArgumentTypeError("must not have a query or fragment")
    try:
        parts.port  # noqa: B018 (urllib checks the port when it is asked for it)
    except ValueError:
        raise argparse.ArgumentTypeError("has a port that is not a number") from None
    if any(c.isspace() for c in text):
        raise argparse.ArgumentTypeError("must not contain whitespace")
    return text
