"""The eval step when the candidate, or the candidate and the parent, are LoRA adapters as
``rtrl-job train --adapter-*`` publishes them: each is loaded on the base its manifest
names (its tokenizer the base's), the replay suite scores base + adapter, not the base,
and an adapter whose base's files changed since it was trained is refused, naming the
base. Tiny Llama base, adapters published without training
(tests/rtrl_trainer/trainset.py ``save_adapter``), the held-out set from the real stage
step, the step run in-process on the replay suite only."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from rtrl.core.shards import synthetic_interactions, write_shards
from rtrl.core.store import open_store
from rtrl_trainer.cli import main
from tests.rtrl_trainer.trainset import VOCAB, save_adapter, save_parent, tiny_llama

CONFIG = """\
eval:
  suites: [replay]
  gates: [{metric: replay.kl, maxRegression: 0.05}]
evaluator: {replayMaxRows: 12, resamples: 200}
"""


def _uri(path: Path) -> str:
    return path.as_uri() + "/"


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """models/base (with a tokenizer) and two adapters on it (adapters/a1, a2); an adapter
    whose base was recommitted with other weights after it was published (adapters/moved);
    a held-out set staged from ckpt-1's interactions."""
    root = tmp_path_factory.mktemp("eval-adapter")
    store = open_store(_uri(root))
    base = tiny_llama(seed=1)
    with torch.no_grad():  # far from uniform: an adapter's change shows
        base.lm_head.weight.mul_(4.0)
    save_parent(store, "models/base", base, root, tokenizer_size=250)
    for name, seed in (("a1", 3), ("a2", 4)):
        save_adapter(store, f"adapters/{name}", base, _uri(root / "models/base"), root, seed=seed)
    save_parent(store, "models/moving", base, root)
    save_adapter(store, "adapters/moved", base, _uri(root / "models/moving"), root, seed=5)
    save_parent(store, "models/moving", tiny_llama(seed=2), root)  # the base changed
    write_shards(
        synthetic_interactions(
            40, seed=5, checkpoint_id="ckpt-1", tokens=8, prompt_tokens=(4, 8),
            vocab_size=VOCAB, duration=timedelta(minutes=30),
        ),
        root / "interactions",
    )  # fmt: skip
    code = main(
        [
            "stage", "--shards", _uri(root / "interactions"), "--checkpoint", "ckpt-1",
            "--out", _uri(root / "stage"), "--now", "2026-01-06T00:00:00Z",
            "--min-interactions", "4", "--heldout-fraction", "0.5",
        ]
    )  # fmt: skip
    assert code == 0
    (root / "rlcycle.yaml").write_text(CONFIG)
    return root


def _eval(world: Path, candidate: str, parent: str) -> tuple[int, dict[str, Any]]:
    out = world / "evals" / f"{candidate.replace('/', '-')}--{parent.replace('/', '-')}"
    code = main(
        [
            "eval", "--candidate", _uri(world / candidate), "--parent", _uri(world / parent),
            "--out", _uri(out), "--heldout", _uri(world / "stage"),
            "--config", str(world / "rlcycle.yaml"),
        ]
    )  # fmt: skip
    result = out / "eval.json"
    return code, json.loads(result.read_text()) if result.exists() else {}


def _metrics(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {m["metric"]: m for m in doc["metrics"]}


def test_a_candidate_adapter_is_evaluated_on_the_parents_base(world: Path) -> None:
    code, doc = _eval(world, "adapters/a1", "models/base")
    assert code == 0, doc
    metrics = _metrics(doc)
    assert doc["suites"]["replay"]["rows"] > 0
    # base + adapter, not the base: far from the parent, the trust region's gate fails
    assert metrics["replay.kl"]["candidate"] > 0.05
    assert abs(metrics["replay.loglik"]["difference"]) > 0.05
    assert doc["passed"] is False and doc["message"] == "failed gate(s): replay.kl"
    # the same adapter against itself: the same model, twice
    code, same = _eval(world, "adapters/a1", "adapters/a1")
    assert code == 0 and same["passed"] is True
    assert _metrics(same)["replay.kl"]["candidate"] == pytest.approx(0.0, abs=1e-5)
    loglik = _metrics(same)["replay.loglik"]
    assert loglik["candidate"] == pytest.approx(metrics["replay.loglik"]["candidate"], abs=1e-6)


def test_a_candidate_adapter_against_a_parent_adapter_on_one_base(world: Path) -> None:
    code, doc = _eval(world, "adapters/a2", "adapters/a1")
    assert code == 0, doc
    metrics = _metrics(doc)
    assert metrics["replay.kl"]["candidate"] > 0.05
    # the parent is a1 on the base (its log-likelihood, as a1 scored as a candidate)
    _, first = _eval(world, "adapters/a1", "models/base")
    a1 = _metrics(first)["replay.loglik"]
    assert metrics["replay.loglik"]["parent"] == pytest.approx(a1["candidate"], abs=1e-6)
    assert metrics["replay.loglik"]["parent"] != pytest.approx(a1["parent"], abs=1e-3)


def test_an_adapter_is_loaded_with_its_bases_tokenizer(world: Path, tmp_path: Path) -> None:
    from rtrl_trainer.evaluate.model import Checkpoint

    store = open_store(_uri(world / "adapters/a1"))
    checkpoint = Checkpoint.fetch(store, tmp_path / "candidate", "candidate", None)
    assert checkpoint.base is not None
    assert checkpoint.base.uri.rstrip("/") == _uri(world / "models/base").rstrip("/")
    assert {f"base/{n}" for n in checkpoint.base.files} < set(checkpoint.files)
    model = checkpoint.load("candidate")
    assert model.tokenizer is not None and len(model.tokenizer) == 250
    assert model.vocab == VOCAB


def test_an_adapter_whose_base_changed_is_refused_naming_the_base(
    world: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    moved = _uri(world / "adapters/moved").rstrip("/")
    base = _uri(world / "models/moving")
    for candidate, parent, label in (
        ("adapters/moved", "models/base", "candidate"),
        ("adapters/a1", "adapters/moved", "parent"),
    ):
        code, doc = _eval(world, candidate, parent)
        assert code == 1 and doc == {}
        err = capsys.readouterr().err
        assert f"eval: cannot evaluate: {label} adapter {moved}" in err, err
        assert f"was trained on other files than base {base}" in err, err
