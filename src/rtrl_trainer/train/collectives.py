"""This process among the ranks: who it is, how ranks agree, and who speaks.

Every rank of a run executes the same collectives in the same order; a rank that stops on
its own leaves the others waiting in one forever. So an error found by any rank is agreed
(:func:`agree`) and raised by all of them together, with the first rank's message, and only
rank 0 prints progress.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any, TypeVar

import torch.distributed as dist

from rtrl_trainer import progress
from rtrl_trainer.runner import EXIT_FAILED, one_line

T = TypeVar("T")


class TrainAbortError(Exception):
    """Training cannot go on: exit 1 with this message; nothing is published."""


@dataclass(frozen=True)
class Ranks:
    """This process's place in the run: global rank, rank on its node, and how many."""

    rank: int
    local_rank: int
    world_size: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def distributed_env(environ: MutableMapping[str, str]) -> Ranks:
    """The torchrun variables, filled in where this process is not launched by torchrun.

    Without RANK: one process per pod of an Indexed Job (rank = JOB_COMPLETION_INDEX, the
    pod template sets WORLD_SIZE, MASTER_ADDR, MASTER_PORT), or a single local process
    (DeepSpeed would otherwise look for MPI).
    """
    if "RANK" not in environ:
        index = environ.get("JOB_COMPLETION_INDEX")
        if index is not None and "WORLD_SIZE" in environ:
            environ["RANK"] = index
        else:
            environ["RANK"] = "0"
            environ["WORLD_SIZE"] = "1"
            environ.setdefault("MASTER_ADDR", "127.0.0.1")
            environ.setdefault("MASTER_PORT", str(_free_port()))
        environ.setdefault("LOCAL_RANK", "0")
    missing = [
        n for n in ("LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if not environ.get(n)
    ]
    if missing:
        raise TrainAbortError(
            f"RANK is set but {', '.join(missing)} is not: launch with torchrun, or set all of "
            "RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT"
        )
    return Ranks(int(environ["RANK"]), int(environ["LOCAL_RANK"]), int(environ["WORLD_SIZE"]))


def say(message: str, *, force: bool = False) -> None:
    """One progress line on stdout, from rank 0 only (unless ``force``)."""
    if force or not dist.is_initialized() or dist.get_rank() == 0:
        progress.note("train", message)


def fail(exc: BaseException) -> int:
    """The one stderr line of a failed run (this rank's), and its exit code."""
    print(f"rtrl-job train: {one_line(exc)}", file=sys.stderr)
    return EXIT_FAILED


def agree(error: str | None) -> None:
    """Every rank raises :class:`TrainAbortError` with the first error any rank found."""
    errors = gather(error)
    first = next((e for e in errors if e), None)
    if first:
        raise TrainAbortError(first)


def gather(value: T) -> list[T]:
    """``value`` of every rank, in rank order (on every rank)."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def gather_dict(part: dict[str, Any]) -> dict[str, Any]:
    """The union of every rank's ``part`` (e.g. the manifest entries each rank uploaded)."""
    everything: dict[str, Any] = {}
    for one in gather(part):
        everything.update(one)
    return everything


def broadcast(value: T) -> T:
    """Rank 0's ``value``, on every rank."""
    box: list[Any] = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]  # type: ignore[no-any-return]


def exit_now(code: int) -> None:
    """Leave at once (``os._exit``), output flushed: see loop.run for why."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
