"""Checkpoints between store and scratch (rtrl_trainer.checkpoint_io): a parent is verified
against its manifest or checksummed on first use, a corrupt file is named, DeepSpeed files
go to the rank that owns them, and published files are world-readable."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from rtrl.core.store import ObjectStore
from rtrl.core.store.local import LocalStore
from rtrl_trainer import checkpoint_io as cio


def _parent(store: ObjectStore, tmp_path: Path, *, commit: bool) -> None:
    files = {}
    for name, data in {
        "config.json": b'{"model_type": "gpt2"}',
        "model.safetensors": b"weights",
        "tokenizer.json": b"{}",
    }.items():
        path = tmp_path / "src" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        files[name] = path
    if commit:
        store.commit("", files)
    else:
        for name, path in files.items():
            store.put_file(name, path)


def test_a_committed_parent_is_verified(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "parent")
    _parent(store, tmp_path, commit=True)
    fetched = cio.fetch_checkpoint(store, tmp_path / "scratch")
    assert fetched.manifest == "verified"
    assert set(fetched.files) == {"config.json", "model.safetensors", "tokenizer.json"}
    assert (tmp_path / "scratch" / "model.safetensors").read_bytes() == b"weights"
    assert cio.has_tokenizer(fetched.files)


def test_a_tampered_file_is_named(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "parent")
    _parent(store, tmp_path, commit=True)
    store.put_bytes("model.safetensors", b"weightz")  # same size, other bytes
    with pytest.raises(
        cio.InputError, match=r"model\.safetensors: sha256 [0-9a-f]+ does not match"
    ):
        cio.fetch_checkpoint(store, tmp_path / "scratch")
    assert not (tmp_path / "scratch" / "model.safetensors").exists()


def test_a_parent_without_manifest_is_checksummed_on_first_use(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "parent")
    _parent(store, tmp_path, commit=False)
    # A run's own files next to a checkpoint are not part of it: never fetched or listed.
    store.put_bytes("tensorboard/events.out.tfevents.1.host", b"events")
    store.put_bytes("_deepspeed/step-1/mp_rank_00_model_states.pt", b"state")
    first = cio.fetch_checkpoint(store, tmp_path / "scratch")
    assert first.manifest == "first-use"
    assert "checksummed" in first.notes[0]
    assert set(first.files) == {"config.json", "model.safetensors", "tokenizer.json"}
    assert not (tmp_path / "scratch" / "tensorboard").exists()
    manifest = store.committed("")
    assert manifest is not None
    assert {n: e["sha256"] for n, e in manifest.files.items()} == first.files
    # From now on it is verified like any committed checkpoint.
    assert cio.fetch_checkpoint(store, tmp_path / "scratch2").manifest == "verified"


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ({}, "no such checkpoint"),
        ({"model.safetensors": b"w"}, "not a Hugging Face checkpoint"),
        ({"config.json": b"{}"}, "no model weights"),
    ],
)
def test_missing_parent_is_named(tmp_path: Path, files: dict[str, bytes], message: str) -> None:
    store = LocalStore(tmp_path / "parent")
    for name, data in files.items():
        store.put_bytes(name, data)
    with pytest.raises(cio.InputError, match=message) as caught:
        cio.fetch_checkpoint(store, tmp_path / "scratch")
    assert store.uri in str(caught.value)


def test_uncommitted_prefix_is_absent(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "data")
    store.put_bytes("stage.json", b"{}")
    with pytest.raises(cio.InputError, match="not committed"):
        cio.fetch_committed(store, tmp_path / "scratch", label="staged training set")


def test_deepspeed_files_go_to_their_owner(tmp_path: Path) -> None:
    names = [
        "mp_rank_00_model_states.pt",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
        "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ]
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    assert set(cio.owned_files(tmp_path, 0)) == set(names[:2])
    assert set(cio.owned_files(tmp_path, 1)) == set(names[2:])
    assert cio.needed_files(names, 1, shared=False) == names[2:]
    assert cio.needed_files(names, 1, shared=True) == [names[0], *names[2:]]


def test_distributed_commit_and_delete(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "out")
    (tmp_path / "a").write_bytes(b"a")
    entries = store.upload_files("_deepspeed/step-3", {"a": tmp_path / "a"})
    assert store.committed("_deepspeed/step-3") is None  # files alone are not a commit
    store.write_manifest("_deepspeed/step-3", entries, {"step": 3})
    assert set(cio.committed_steps(store)) == {3}
    cio.delete_prefix(store, "_deepspeed/step-3")
    assert cio.committed_steps(store) == {}
    assert list(store.list("_deepspeed/")) == []


def test_published_files_are_world_readable(tmp_path: Path) -> None:
    out = tmp_path / "publish"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"w")
    os.chmod(out / "model.safetensors", 0o600)  # what safetensors writes
    files = cio.checkpoint_files(out)
    assert stat.S_IMODE((out / "model.safetensors").stat().st_mode) == 0o644
    assert set(files) == {"model.safetensors"}


def test_copy_parent_files_skips_weights_and_what_the_child_has(tmp_path: Path) -> None:
    parent_dir = tmp_path / "parent"
    parent_dir.mkdir()
    names = ["config.json", "model.safetensors", "tokenizer.json", "train.json", "chat.jinja"]
    for name in names:
        (parent_dir / name).write_text(json.dumps(name))
    fetched = cio.Fetched(
        uri="file:///p/", directory=parent_dir, files=dict.fromkeys(names, ""), manifest="verified"
    )
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("{}")
    assert cio.copy_parent_files(fetched, out) == ["chat.jinja", "tokenizer.json"]
    assert (out / "config.json").read_text() == "{}"
