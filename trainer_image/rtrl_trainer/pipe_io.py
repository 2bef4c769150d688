"""Pipe helpers shared by the evaluator's side of the sandbox and the sandbox server
(standard library only: the server, ``python -I -S``, loads this module from its own
directory)."""

from __future__ import annotations

import os


def drain(fd: int) -> None:
    """Empty a pipe of what a killed task wrote or left unread (non-blocking reads)."""
    os.set_blocking(fd, False)
    try:
        while os.read(fd, 1 << 16):
            pass
    except BlockingIOError:
        pass
    finally:
        os.set_blocking(fd, True)
