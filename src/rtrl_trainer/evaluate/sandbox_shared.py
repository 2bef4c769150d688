"""What both sides of the sandbox share, the evaluator's (:mod:`rtrl_trainer.evaluate.sandbox`) and
the sandbox server's: the names of the guarantees the server checks, and a pipe helper.
Standard library only: the server, ``python -I -S``, loads this module from its own
directory."""

from __future__ import annotations

import os

# Checked by the server's check child (sandbox_server._attack); meanings in sandbox_types.py.
GUARANTEES = (
    "separate_identity",
    "no_ptrace",
    "no_network",
    "memory_capped",
    "suite_unreadable",
    "no_fs_writes",
    "no_namespaces",
)


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
