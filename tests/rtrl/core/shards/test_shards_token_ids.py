"""Token ids outside the model's vocabulary are quarantined at the door.

A negative id, or one at or beyond the vocabulary of the checkpoint that will be trained,
cannot be embedded: before this check such a row passed ``rtrl shards validate`` and the
stage, and the trainer then failed on it at every retry. Negative ids are invalid whatever
the vocabulary; the upper bound is the parent checkpoint's ``config.json`` ``vocab_size``,
given to ``rtrl shards validate`` as ``--vocab-size N`` or ``--checkpoint URI``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import pyarrow as pa
import pytest

from rtrl.core.shards import ValidatingReader, validate
from rtrl.core.shards.cli import add_shards_parser, run_validate
from rtrl.core.shards.vocabulary import VocabularyError, read_vocab_size, vocab_size_of
from rtrl.core.store import MANIFEST_NAME
from rtrl.core.store.local import LocalStore
from tests.rtrl.core.shards.helpers import replace, set_cell, table, write

VOCAB = 260


def _bad_set(root: Path) -> Path:
    """One file of 20 rows: row 3 has prompt id -5, row 11 completion id VOCAB + 1, row 16
    completion id VOCAB (the first id beyond it); every other id is below VOCAB."""
    t = table(20)
    for name in ("prompt_ids", "completion_ids"):
        small = [[i % VOCAB for i in ids] for ids in t[name].to_pylist()]
        t = replace(t, name, pa.array(small, pa.list_(pa.int32())))
    t = set_cell(t, "prompt_ids", 3, [7, -5, 9])
    lengths = [len(x) for x in t["completion_ids"].to_pylist()]
    t = set_cell(t, "completion_ids", 11, [VOCAB + 1] * lengths[11])
    t = set_cell(t, "completion_ids", 16, [1] * (lengths[16] - 1) + [VOCAB])
    return write(t, root / "checkpoint=ckpt-1" / "part-0.parquet")


def test_a_negative_id_is_quarantined_whatever_the_vocabulary(tmp_path: Path) -> None:
    _bad_set(tmp_path)
    report = validate(tmp_path)
    (file,) = report.files
    assert report.rows_by_reason == {"token_out_of_range": 1}
    assert file.examples == {"token_out_of_range": [3]}
    assert (file.status, file.rows_good) == ("bad", 19)
    assert report.vocab_size is None


def test_ids_at_or_beyond_the_vocabulary_are_quarantined(tmp_path: Path) -> None:
    _bad_set(tmp_path)
    reader = ValidatingReader(tmp_path, vocab_size=VOCAB, batch_size=8)
    kept = [i for batch in reader for i in batch.column("interaction_id").to_pylist()]
    (file,) = reader.report.files
    assert file.rows_by_reason == {"token_out_of_range": 3}
    assert file.examples == {"token_out_of_range": [3, 11, 16]}
    expected = table(20)["interaction_id"].to_pylist()
    assert kept == [i for n, i in enumerate(expected) if n not in (3, 11, 16)]
    # The last id inside the vocabulary is good: VOCAB + 1 bounds nothing that VOCAB does not.
    assert validate(tmp_path, vocab_size=VOCAB + 2).rows_by_reason == {"token_out_of_range": 1}


def test_an_id_in_a_row_that_fails_another_check_counts_under_both(tmp_path: Path) -> None:
    t = set_cell(table(5), "prompt_ids", 2, [-1])
    t = set_cell(t, "completion_logprobs", 2, [0.5] * len(t["completion_ids"][2]))
    write(t, tmp_path / "a.parquet")
    report = validate(tmp_path)
    assert report.rows_by_reason == {"logprob_positive": 1, "token_out_of_range": 1}
    assert report.rows_bad == 1


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="rtrl")
    add_shards_parser(parser.add_subparsers())
    return parser.parse_args(argv)


def _checkpoint(root: Path, config: object, *, manifest: bool = True) -> str:
    """A checkpoint prefix with this ``config.json`` (and a manifest listing it)."""
    root.mkdir(parents=True)
    data = json.dumps(config).encode() if not isinstance(config, bytes) else config
    (root / "config.json").write_bytes(data)
    if manifest:
        entry = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        (root / MANIFEST_NAME).write_text(
            json.dumps({"version": 1, "files": {"config.json": entry}})
        )
    return root.as_uri() + "/"


def test_validate_reports_the_rows_with_the_vocabulary_given(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _bad_set(tmp_path / "shards")
    shards = str(tmp_path / "shards")
    args = _args("shards", "validate", shards, "--vocab-size", str(VOCAB))
    assert run_validate(args) == 1
    lines = capsys.readouterr().out.splitlines()
    url = (tmp_path / "shards").as_uri() + "/checkpoint=ckpt-1/part-0.parquet"
    assert lines[0] == (
        f"{url}: 3 of 20 rows bad: token_out_of_range=3 "
        f"(token_out_of_range: row 3: prompt_ids has token id -5, outside [0, {VOCAB}))"
    )
    assert lines[-1] == "  token_out_of_range: 3 rows in 1 files"

    model = _checkpoint(tmp_path / "models" / "ckpt-1", {"model_type": "gpt2", "vocab_size": VOCAB})
    assert run_validate(_args("shards", "validate", shards, "--checkpoint", model, "--json")) == 1
    doc = json.loads(capsys.readouterr().out)
    assert (doc["vocab_size"], doc["rows_by_reason"]) == (VOCAB, {"token_out_of_range": 3})
    assert doc["files"][0]["examples"] == {"token_out_of_range": [3, 11, 16]}

    # Without a vocabulary only the negative id is out.
    assert run_validate(_args("shards", "validate", shards, "--json")) == 1
    assert json.loads(capsys.readouterr().out)["rows_by_reason"] == {"token_out_of_range": 1}


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (b"{not json", "config.json is not JSON"),
        ({"model_type": "gpt2"}, "config.json has no vocab_size"),
        ({"vocab_size": 0}, "config.json: vocab_size must be a positive integer, got 0"),
        ({"vocab_size": "260"}, "config.json: vocab_size must be a positive integer, got '260'"),
    ],
    ids=["not-json", "no-vocab-size", "zero", "string"],
)
def test_an_unusable_checkpoint_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], config: object, message: str
) -> None:
    _bad_set(tmp_path / "shards")
    model = _checkpoint(tmp_path / "model", config)
    args = _args("shards", "validate", str(tmp_path / "shards"), "--checkpoint", model)
    assert run_validate(args) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"rtrl shards validate: checkpoint {model}: {message}"


def test_a_checkpoint_without_config_and_conflicting_flags(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _bad_set(tmp_path / "shards")
    empty = tmp_path / "empty"
    empty.mkdir()
    args = _args(
        "shards", "validate", str(tmp_path / "shards"), "--checkpoint", empty.as_uri() + "/"
    )
    assert run_validate(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"rtrl shards validate: checkpoint {empty.as_uri()}/: no config.json")
    for bad in (["--vocab-size", "0"], ["--vocab-size", "5", "--checkpoint", "file:///x/"]):
        with pytest.raises(SystemExit) as caught:
            _args("shards", "validate", "/x", *bad)
        assert caught.value.code == 2


def test_the_vocabulary_is_read_as_the_trainer_reads_it(tmp_path: Path) -> None:
    """transformers' ``get_text_config()``: a composite model's text part, named
    ``text_config``, ``decoder``, ``generator`` or ``text_encoder``, else the top level."""
    assert vocab_size_of({"vocab_size": 50_257}) == 50_257
    composite = {"model_type": "llava", "text_config": {"vocab_size": 32_064}, "vocab_size": 9}
    assert vocab_size_of(composite) == 32_064
    assert vocab_size_of({"decoder": {"vocab_size": 7}, "encoder": {"vocab_size": 9}}) == 7
    with pytest.raises(VocabularyError, match="ambiguous: text_encoder, text_config"):
        vocab_size_of({"text_config": {"vocab_size": 1}, "text_encoder": {"vocab_size": 2}})
    with pytest.raises(VocabularyError, match="text_config has no vocab_size"):
        vocab_size_of({"text_config": {}, "vocab_size": 3})


def test_the_config_is_checked_against_its_manifest(tmp_path: Path) -> None:
    uri = _checkpoint(tmp_path / "m", {"vocab_size": VOCAB})
    store = LocalStore(tmp_path / "m")
    assert read_vocab_size(store) == VOCAB
    (tmp_path / "m" / "config.json").write_text(json.dumps({"vocab_size": 2 * VOCAB}))
    with pytest.raises(VocabularyError, match=r"config\.json does not match its manifest"):
        read_vocab_size(store)
    # A base model registered by hand, without a manifest, is read as it is.
    _checkpoint(tmp_path / "hand", {"vocab_size": 7}, manifest=False)
    assert read_vocab_size(LocalStore(tmp_path / "hand")) == 7
    assert uri.startswith("file://")
