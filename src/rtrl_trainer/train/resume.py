"""Saving DeepSpeed state to the store every ``saveEverySteps`` steps, and resuming from it.

A pod of the train Job may be killed at any time (preemption, a node drained); the Job
starts it again with the same flags. The rerun resumes from the last committed state of a
run with the same fingerprint (same parent, data, learning settings and world size), or
starts over from the parent. The start-of-cycle log-probs are saved once with the first
state: a resumed run must use the parent's numbers, and the parent's weights are no
longer in the engine.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist

from rtrl.core.store import MANIFEST_NAME, ObjectStore, StoreError, join_key
from rtrl_trainer import checkpoint_io as cio
from rtrl_trainer.train.collectives import (
    Ranks,
    TrainAbortError,
    agree,
    broadcast,
    gather_dict,
    say,
)
from rtrl_trainer.train.config import TrainConfig, fingerprint_source
from rtrl_trainer.train.examples import Example
from rtrl_trainer.train.forward import start_logprobs
from rtrl_trainer.train.state import Data, Inputs, Progress

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine


def run_fingerprint(config: TrainConfig, inputs: Inputs, world_size: int) -> str:
    """What saved state must match to be resumed: the same parent (and base under an
    adapter), data, learning settings and world size (DeepSpeed cannot re-partition
    optimizer state)."""
    doc = {
        "parent": inputs.parent.files,
        "base": inputs.base.files if inputs.base is not None else None,
        "data": inputs.data.files,
        "settings": fingerprint_source(config),
        "world_size": world_size,
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def start_or_resume(
    engine: DeepSpeedEngine,
    store: ObjectStore,
    scratch: Path,
    *,
    config: TrainConfig,
    data: Data,
    ranks: Ranks,
    fingerprint: str,
    device: torch.device,
    keep_logits: bool,
) -> tuple[int, list[np.ndarray], Progress]:
    """(the last step done, the start-of-cycle log-probs, the progress so far): from the
    last state saved by this run, or computed once, before any update, under the parent.

    The start-of-cycle log-probs are at once the "old" policy of the PPO ratio (the policy
    at the start of the cycle) and the reference of the KL penalty (the parent), so no
    frozen copy of the model is kept.
    """
    start_step = 0
    messages: list[str] = []
    if ranks.is_main:
        start_step, messages = find_resume_step(store, fingerprint, data.schedule.total_steps)
    start_step = broadcast(start_step)
    for message in messages:
        say(message)
    if start_step:
        start_lp, progress = resume(
            engine, store, scratch, step=start_step, ranks=ranks, examples=data.examples
        )
        say(f"resumed from the state saved at step {start_step}")
        return start_step, start_lp, progress
    t0 = time.time()
    start_lp = start_logprobs(
        engine,
        examples=data.examples,
        schedule=data.schedule,
        rank=ranks.rank,
        device=device,
        keep_logits=keep_logits,
    )
    say(f"start-of-cycle log-probs in {time.time() - t0:.1f}s")
    saves = config.trainer.save_every_steps
    if saves and any(s % saves == 0 for s in range(1, data.schedule.total_steps)):
        save_start_logprobs(store, scratch, start_lp, ranks, fingerprint)
    return 0, start_lp, Progress()


def find_resume_step(
    store: ObjectStore, fingerprint: str, total_steps: int
) -> tuple[int, list[str]]:
    """The highest committed step saved by a run with this fingerprint (0: none), and
    what was ignored, in words."""
    steps = cio.committed_steps(store)
    if not steps:
        return 0, []
    start = store.committed(cio.START_LOGPROBS)
    if start is None or start.metadata.get("fingerprint") != fingerprint:
        return 0, [
            f"ignoring saved state under {store.url(cio.STATE_PREFIX)}/: it belongs to a run "
            "with another parent, data, settings or world size; starting from the parent"
        ]
    usable = [
        s
        for s, m in steps.items()
        if m.metadata.get("fingerprint") == fingerprint and s <= total_steps
    ]
    ignored = sorted(set(steps) - set(usable))
    messages = []
    if ignored:
        messages.append(
            f"ignoring saved state of step(s) {', '.join(map(str, ignored))}: other settings, "
            "world size, or beyond --max-steps"
        )
    return max(usable, default=0), messages


def save_state(
    engine: DeepSpeedEngine,
    store: ObjectStore,
    scratch: Path,
    *,
    step: int,
    ranks: Ranks,
    fingerprint: str,
    progress: Progress,
    started: float,
) -> None:
    """DeepSpeed state of ``step`` to ``_deepspeed/step-<N>/``: each rank uploads its own
    files, rank 0 commits the manifest, then the older steps are deleted."""
    local = scratch / "deepspeed"
    tag = f"step-{step}"
    prefix = cio.step_prefix(step)
    if ranks.is_main:
        store.delete(join_key(prefix, MANIFEST_NAME))
    client_state = {
        "rtrl": {
            "step": step,
            "fingerprint": fingerprint,
            "history": progress.history,
            "loop_seconds": progress.loop_seconds,
            "input_tokens": progress.input_tokens,
            "wall_seconds": progress.earlier_wall_seconds + time.time() - started,
        }
    }
    engine.save_checkpoint(str(local), tag=tag, client_state=client_state)
    everything = gather_dict(store.upload_files(prefix, cio.owned_files(local / tag, ranks.rank)))
    if ranks.is_main:
        metadata = {"step": step, "worldSize": ranks.world_size, "fingerprint": fingerprint}
        store.write_manifest(prefix, everything, metadata)
        for older in cio.committed_steps(store):
            if older < step:
                cio.delete_prefix(store, cio.step_prefix(older))
    dist.barrier()
    if ranks.local_rank == 0:
        shutil.rmtree(local / tag, ignore_errors=True)


def resume(
    engine: DeepSpeedEngine,
    store: ObjectStore,
    scratch: Path,
    *,
    step: int,
    ranks: Ranks,
    examples: Sequence[Example],
) -> tuple[list[np.ndarray], Progress]:
    """Load the state saved at ``step`` and the start-of-cycle log-probs."""
    tag = f"step-{step}"
    error = None
    try:
        manifest = store.committed(cio.step_prefix(step))
        if manifest is None:
            raise cio.InputError(f"saved state {store.url(cio.step_prefix(step))}/ vanished")
        names = cio.needed_files(manifest.files, ranks.rank, shared=ranks.local_rank == 0)
        cio.download(
            store,
            cio.step_prefix(step),
            {n: manifest.files[n] for n in names},
            scratch / "deepspeed" / tag,
            label="saved state",
            verify=True,
        )
        start_lp = load_start_logprobs(store, scratch, ranks, examples)
    except (cio.InputError, StoreError) as exc:
        error = str(exc)
    agree(error)
    dist.barrier()
    _, client = engine.load_checkpoint(str(scratch / "deepspeed"), tag=tag)
    saved = (client or {}).get("rtrl", {})
    if saved.get("step") != step:
        raise TrainAbortError(f"saved state at step {step} does not record its step; delete it")
    progress = Progress(
        history=list(saved.get("history", [])),
        loop_seconds=float(saved.get("loop_seconds", 0.0)),
        input_tokens=float(saved.get("input_tokens", 0.0)),
        earlier_wall_seconds=float(saved.get("wall_seconds", 0.0)),
    )
    return start_lp, progress


def _rank_file(ranks: Ranks) -> str:
    return f"rank-{ranks.rank:05d}-of-{ranks.world_size:05d}.npy"


def save_start_logprobs(
    store: ObjectStore, scratch: Path, values: Sequence[np.ndarray], ranks: Ranks, fingerprint: str
) -> None:
    """The start-of-cycle log-probs, one file per rank, committed once (see the module
    docstring for why)."""
    path = scratch / "start-logprobs" / _rank_file(ranks)
    path.parent.mkdir(parents=True, exist_ok=True)
    flat = np.concatenate(values) if values else np.zeros(0, np.float32)
    np.save(path, flat.astype(np.float32))
    if ranks.is_main:
        store.delete(join_key(cio.START_LOGPROBS, MANIFEST_NAME))
    dist.barrier()
    everything = gather_dict(store.upload_files(cio.START_LOGPROBS, {path.name: path}))
    if ranks.is_main:
        store.write_manifest(cio.START_LOGPROBS, everything, {"fingerprint": fingerprint})
    dist.barrier()


def load_start_logprobs(
    store: ObjectStore, scratch: Path, ranks: Ranks, examples: Sequence[Example]
) -> list[np.ndarray]:
    manifest = store.committed(cio.START_LOGPROBS)
    name = _rank_file(ranks)
    if manifest is None or name not in manifest.files:
        raise cio.InputError(f"saved state {store.url(cio.START_LOGPROBS)}/{name} is missing")
    dest = scratch / "start-logprobs"
    cio.download(
        store,
        cio.START_LOGPROBS,
        {name: manifest.files[name]},
        dest,
        label="saved state",
        verify=True,
    )
    flat = np.load(dest / name)
    lengths = [e.completion_length for e in examples]
    if len(flat) != sum(lengths):
        raise cio.InputError(
            f"saved state {store.url(cio.START_LOGPROBS)}/{name} has {len(flat)} values, "
            f"this rank's rows need {sum(lengths)}"
        )
    return [part.copy() for part in np.split(flat, np.cumsum(lengths)[:-1])]
