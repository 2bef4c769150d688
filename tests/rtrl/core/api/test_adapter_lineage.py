"""What ties an adapter to its base (``base_digest``): the base's model files, whoever
computes it (the trainer from the files it fetched, the sidecar from the base's whole
manifest), so an adapter is served exactly where it was trained."""

from __future__ import annotations

from rtrl.core.api.adapter import base_digest

MODEL = {"config.json": "a" * 64, "model.safetensors": "b" * 64}


def test_the_digest_is_the_model_files_alone() -> None:
    whole_manifest = {
        **MODEL,
        "train.json": "c" * 64,
        "tensorboard/events.out.tfevents.1": "d" * 64,
        "_deepspeed/step-4/mp_rank_00_model_states.pt": "e" * 64,
    }
    assert base_digest(whole_manifest) == base_digest(MODEL)
    assert base_digest(dict(reversed(list(MODEL.items())))) == base_digest(MODEL)


def test_any_change_of_a_model_file_changes_it() -> None:
    assert base_digest({**MODEL, "model.safetensors": "f" * 64}) != base_digest(MODEL)
    assert base_digest({**MODEL, "tokenizer.json": "0" * 64}) != base_digest(MODEL)
    assert base_digest({"config.json": "a" * 64}) != base_digest(MODEL)
