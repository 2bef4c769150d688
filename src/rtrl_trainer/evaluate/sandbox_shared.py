"""What both sides of the sandbox share, the evaluator's (:mod:`rtrl_trainer.evaluate.sandbox`) and
the sandbox server's: the names of the guarantees the server checks.
Standard library only: the server, ``python -I -S``, loads this module from its own
directory."""

from __future__ import annotations

# Checked by the server's check child (sandbox_server._attack); meanings in sandbox_types.py.
GUARANTEES = (
    "separate_identity",
    "no_ptrace",
    "no_network",
    "memory_capped",
    "suite_unreadable",
    "no_fs_writes",
    "no_namespaces",
    "no_scheduling",
    "no_watching",
)
