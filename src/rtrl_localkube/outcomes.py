"""What a scripted pod does instead of (or as) running its containers: the outcomes tests
give :meth:`Kubelet.script <rtrl_localkube.kubelet.Kubelet.script>` and
:meth:`JobRunner.script <rtrl_localkube.job_runner.JobRunner.script>`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Run:
    """Execute the containers locally (the default)."""


@dataclass(frozen=True)
class Succeed:
    """Exit 0 without running; ``before(job)`` runs first with the pod's Job (e.g. to write
    the step's result files), or with the pod itself when no Job owns it."""

    before: Callable[[dict[str, Any]], None] | None = None


@dataclass(frozen=True)
class Fail:
    """End every attempt with this container termination."""

    reason: str = "Error"
    message: str = ""
    exit_code: int = 1


@dataclass(frozen=True)
class Hang:
    """Stay running until the pod is deleted."""


Outcome = Run | Succeed | Fail | Hang
