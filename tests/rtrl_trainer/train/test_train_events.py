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
