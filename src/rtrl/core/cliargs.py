"""Argument types shared by the command lines (``rtrl``, ``rtrl-job``): a bad number is a
usage error naming what was expected, with argparse's exit status 2."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TypeVar

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
    """A number in [0, 1]."""
    return _checked(text, float, lambda v: 0.0 <= v <= 1.0, "a fraction between 0 and 1")
