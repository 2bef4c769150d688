"""Shared test fixtures and paths."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


def console_script(name: str) -> str:
    """Path of a console script of this project's environment (rtrl, rtrl-job, ...)."""
    path = BIN / name
    assert path.exists(), f"{name} is not installed in {BIN}; run `make test`"
    return os.fspath(path)
