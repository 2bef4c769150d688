"""What a running train step shows: TensorBoard event files in the store, its progress
lines (steps, tokens/s, ETA), and the same progress as ``progress.json`` for the operator
(:mod:`rtrl.core.api.progress`), written with each upload of the event file.

TRL, OpenRLHF and verl users watch a run in TensorBoard, so rank 0 writes one scalar per
tag (:data:`TAGS`) per optimizer step, the step number being the global optimizer step,
with TensorBoard's own writer into scratch, and uploads the event file whole to
``<out>/tensorboard/`` (``tensorboard --logdir s3://.../tensorboard/`` reads it while the
run goes on): after the first step, after every saved state, at the end, and otherwise at
most every ``RTRL_TENSORBOARD_SECONDS`` (default 30) seconds. S3 has no append, so the bound
keeps the bytes uploaded in proportion to the run's length, not its square.

A killed pod may have uploaded steps after its last saved state; its successor repeats
them from that state. So before a run writes anything, the earlier runs' event files are
rewritten without the steps after the one it resumes from (and deleted when none are
left): the store never holds a step twice, nor a step of a trajectory that was discarded.
The event files are not part of the published checkpoint (its manifest lists only what
:mod:`.publish` commits) and :func:`~rtrl_trainer.checkpoint_io.fetch_checkpoint` never
reads them.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rtrl.core.api.checkpoint import StepProgress
from rtrl.core.api.progress import PROGRESS_FILE, ProgressDocument
from rtrl.core.store import ObjectStore, StoreError, join_key
from rtrl_trainer.checkpoint_io import TENSORBOARD_PREFIX
from rtrl_trainer.progress import Progress
from rtrl_trainer.train.collectives import Ranks, say
from rtrl_trainer.train.forward import step_line

UPLOAD_ENV = "RTRL_TENSORBOARD_SECONDS"
DEFAULT_UPLOAD_SECONDS = 30.0
# history key -> tag; the demo report reads these tags back: they are a contract. A key
# a step's history lacks has no scalar: mean_reward where the staged set has no rewards.
TAGS = {
    "loss": "train/loss",
    "kl": "train/kl",
    "clip_fraction": "train/clip_fraction",
    "truncation_fraction": "train/truncation_fraction",
    "mean_advantage": "train/mean_advantage",
    "mean_reward": "train/reward",
    "grad_norm": "train/grad_norm",
    "tokens": "train/tokens",
}
TOKENS_PER_SECOND = "train/tokens_per_second"
LEARNING_RATE = "train/learning_rate"
EVENT_FILE_MARK = "tfevents"


def upload_seconds() -> float:
    raw = os.environ.get(UPLOAD_ENV, "")
    try:
        return max(0.0, float(raw)) if raw else DEFAULT_UPLOAD_SECONDS
    except ValueError:
        return DEFAULT_UPLOAD_SECONDS


class RunEvents:
    """The event file and progress lines of one run (rank 0 writes; other ranks count)."""

    def __init__(
        self,
        store: ObjectStore,
        scratch: Path,
        *,
        ranks: Ranks,
        start_step: int,
        total_steps: int,
    ) -> None:
        self.store = store
        self.total = total_steps
        self.progress = Progress(
            "train", "training", total=total_steps, unit="steps", done=start_step,
            quiet=not ranks.is_main,
        )  # fmt: skip
        self.writer: Any = None
        self.every = upload_seconds()
        self.uploaded_at: float | None = None
        self.failed = False
        if not ranks.is_main:
            return
        self.directory = scratch / "tensorboard"
        # A restarted pod on the same node: the earlier run's file is in the store already.
        shutil.rmtree(self.directory, ignore_errors=True)
        self._guard(lambda: trim(store, start_step, scratch / "tensorboard-trim"))
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(self.directory))
        self.progress.start()
        self._guard(self.report)

    def record(self, metrics: dict[str, Any], *, learning_rate: float | None) -> None:
        """One optimizer step's scalars (``metrics``: its history entry) and line."""
        step = int(metrics["step"])
        last = step == self.total
        self.progress.update(step, detail=step_line(metrics, self.total), force=last)
        if self.writer is None:
            return
        for key, tag in TAGS.items():
            value = metrics.get(key)
            if value is not None:
                self.writer.add_scalar(tag, float(value), step)
        if metrics.get("tokens") and metrics.get("seconds"):
            self.writer.add_scalar(TOKENS_PER_SECOND, metrics["tokens"] / metrics["seconds"], step)
        if learning_rate is not None:
            self.writer.add_scalar(LEARNING_RATE, float(learning_rate), step)
        now = time.monotonic()
        if self.uploaded_at is None or now - self.uploaded_at >= self.every:
            self.upload()

    def upload(self) -> None:
        """Flush and upload the event file now (rank 0; a no-op elsewhere)."""
        if self.writer is None:
            return
        self.writer.flush()
        self.uploaded_at = time.monotonic()
        files = {
            join_key(TENSORBOARD_PREFIX, p.name): p
            for p in sorted(self.directory.iterdir())
            if EVENT_FILE_MARK in p.name
        }
        self._guard(lambda: [self.store.put_file(k, p) for k, p in files.items()])
        self._guard(self.report)

    def report(self) -> None:
        """Write ``progress.json``: how far the run is, for the Checkpoint's status."""
        self.store.put_bytes(PROGRESS_FILE, progress_document(self.progress))

    def close(self) -> None:
        """The last upload, and the end line."""
        self.upload()
        if self.writer is not None:
            self.writer.close()
            self.progress.end(
                f"training: done, {self.progress.done}/{self.total} steps; TensorBoard: "
                f"{self.store.url(TENSORBOARD_PREFIX)}/"
            )

    def _guard(self, action: Any) -> None:
        """Events are for watching: a store that fails here fails the run at its next save
        or at publishing, with that error; here it is said once."""
        try:
            action()
        except StoreError as exc:
            if not self.failed:
                where = self.store.url(TENSORBOARD_PREFIX)
                say(f"TensorBoard events not uploaded to {where}/: {exc}")
            self.failed = True


def progress_document(progress: Progress) -> bytes:
    """``progress.json``'s bytes for a :class:`Progress` now."""
    doc = ProgressDocument(
        progress=StepProgress(
            step="train",
            done=progress.done,
            total=progress.total,
            unit=progress.unit,
            rate=progress.rate(),
            eta_seconds=progress.eta(),
            elapsed_seconds=round(progress.elapsed(), 3),
            updated_at=datetime.now(UTC),
        )
    )
    return (json.dumps(doc.to_k8s(), sort_keys=True) + "\n").encode()


def trim(store: ObjectStore, keep_through: int, scratch: Path) -> None:
    """Rewrite the event files under ``tensorboard/`` without the scalars of steps after
    ``keep_through``; delete those left with none (see the module docstring)."""
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.summary.writer.record_writer import RecordWriter

    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    for info in list(store.list(f"{TENSORBOARD_PREFIX}/")):
        if EVENT_FILE_MARK not in info.key:
            continue
        path = scratch / info.key.rsplit("/", 1)[-1]
        store.get_file(info.key, path)
        # The records' own bytes: EventFileLoader would hand back scalars migrated to
        # tensors, which TensorBoard's EventAccumulator no longer lists as scalars.
        records = [(r, Event.FromString(r)) for r in RawEventFileLoader(str(path)).Load()]
        kept = [r for r, e in records if not e.HasField("summary") or e.step <= keep_through]
        if len(kept) == len(records):
            continue
        if not any(Event.FromString(r).HasField("summary") for r in kept):
            store.delete(info.key)
            continue
        with path.open("wb") as sink:
            writer = RecordWriter(sink)
            for record in kept:
                writer.write(record)
        store.put_file(info.key, path)
    shutil.rmtree(scratch, ignore_errors=True)
