"""The event files' rewind on resume (train/events.py), on a local store without DeepSpeed;
the events of real runs are tested in test_train_e2e.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from rtrl.core.store import open_store
from rtrl_trainer.train.events import trim


def _write(directory: Path, steps: range) -> Path:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(directory))
    for step in steps:
        writer.add_scalar("train/loss", float(step) / 10, step)
    writer.close()
    (path,) = directory.iterdir()
    return path


def _steps(store_root: Path) -> dict[str, list[int]]:
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    out = {}
    for path in sorted((store_root / "tensorboard").iterdir()):
        out[path.name] = [
            e.step for e in EventFileLoader(str(path)).Load() if e.HasField("summary")
        ]
    return out


def test_trim_keeps_the_steps_up_to_the_resumed_one(tmp_path: Path) -> None:
    root = tmp_path / "out"
    store = open_store(root.as_uri() + "/")
    first = _write(tmp_path / "a", range(1, 6))
    second = _write(tmp_path / "b", range(6, 8))
    store.put_file(f"tensorboard/{first.name}", first)
    store.put_file(f"tensorboard/{second.name}", second)
    store.put_bytes("tensorboard/notes.txt", b"not an event file: left alone")

    trim(store, 3, tmp_path / "scratch")
    assert _steps(root) == {first.name: [1, 2, 3], "notes.txt": []}
    # rewritten as written: TensorBoard still reads them as scalars, with their values
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(root / "tensorboard"))
    board.Reload()
    assert [(e.step, e.value) for e in board.Scalars("train/loss")] == [
        (1, pytest.approx(0.1)),
        (2, pytest.approx(0.2)),
        (3, pytest.approx(0.3)),
    ]

    trim(store, 3, tmp_path / "scratch")  # idempotent
    assert _steps(root) == {first.name: [1, 2, 3], "notes.txt": []}

    trim(store, 0, tmp_path / "scratch")  # a run that starts over: nothing earlier is kept
    assert _steps(root) == {"notes.txt": []}


def test_the_run_writes_its_progress_for_the_operator_with_each_upload(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """progress.json (rtrl.core.api.progress) beside the run's output: at the start, with
    each upload of the event file (the first step's, then at most every
    RTRL_TENSORBOARD_SECONDS) and at the end; the operator copies it into the status."""
    import json

    from rtrl.core.api.progress import ProgressDocument
    from rtrl_trainer.train.collectives import Ranks
    from rtrl_trainer.train.events import RunEvents

    monkeypatch.setenv("RTRL_TENSORBOARD_SECONDS", "3600")
    root = tmp_path / "out"
    store = open_store(root.as_uri() + "/")

    def progress() -> dict:
        doc = json.loads((root / "progress.json").read_bytes())
        return ProgressDocument.model_validate(doc).progress.model_dump()

    events = RunEvents(store, tmp_path / "scratch", ranks=Ranks(0, 0, 1), start_step=2,
                       total_steps=10)  # fmt: skip
    first = progress()
    assert (first["step"], first["done"], first["total"], first["unit"]) == (
        "train", 2, 10, "steps")  # resumed after step 2  # fmt: skip
    assert first["rate"] is None and first["eta_seconds"] is None
    metrics = {"loss": 0.1, "kl": 0.01, "clip_fraction": 0.0, "truncation_fraction": 0.0,
               "mean_advantage": 0.0, "grad_norm": 1.0, "tokens": 100, "seconds": 0.5}  # fmt: skip
    events.record({**metrics, "step": 3}, learning_rate=1e-3)  # the first upload
    third = progress()
    assert third["done"] == 3 and third["rate"] > 0 and third["eta_seconds"] >= 0
    assert third["updated_at"] >= first["updated_at"]
    events.record({**metrics, "step": 4}, learning_rate=1e-3)  # within the interval
    assert progress()["done"] == 3
    events.close()
    assert progress()["done"] == 4
