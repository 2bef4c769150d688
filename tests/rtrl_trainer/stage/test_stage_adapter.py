"""The stage step when the serving checkpoint (``--parent``) is a LoRA adapter, as
``rtrl-job train --adapter-*`` publishes one: the vocabulary is its base's, the fidelity
gate recomputes the logged log-probs with base + adapter (so rows an engine logged while
serving the adapter pass, rows logged under the base alone fail), and an adapter whose
base's files changed since it was trained is refused, naming the base.

The rows are built as tests/rtrl_trainer/stage/test_stage_sampling.py builds the gate's:
completions sampled at T=0.7 with the processed log-prob of each token; the adapter is
published without training (tests/rtrl_trainer/trainset.py ``save_adapter``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from rtrl.core.shards import write_shards
from rtrl.core.store import open_store
from tests.rtrl_trainer.helpers import run_stage, training_set
from tests.rtrl_trainer.stage.test_stage_sampling import READY, _served, _shards
from tests.rtrl_trainer.trainset import VOCAB, save_adapter, save_parent, tiny_llama

LABEL = {"temperature": 0.7, "logprobs_mode": "processed_logprobs", "serving_dtype": "float32"}


def _peaked_llama(seed: int) -> Any:
    """A tiny Llama whose distributions are far from uniform (temperature matters)."""
    model = tiny_llama(seed=seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    return model.eval()


def _uri(path: Path) -> str:
    return path.as_uri() + "/"


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A base (models/base), an adapter on it (adapters/a1), an adapter whose base was
    recommitted with other weights after it was published (adapters/moved), and two hours
    of ckpt-1's rows: 08 served by base + a1, 09 by the base alone."""
    root = tmp_path_factory.mktemp("stage-adapter")
    store = open_store(_uri(root))
    base = _peaked_llama(seed=1)
    save_parent(store, "models/base", base, root)
    served = save_adapter(store, "adapters/a1", base, _uri(root / "models/base"), root, seed=3)
    save_parent(store, "models/moving", base, root)
    save_adapter(store, "adapters/moved", base, _uri(root / "models/moving"), root, seed=4)
    save_parent(store, "models/moving", _peaked_llama(seed=2), root)  # the base changed
    n = 8
    parts = [
        _served(served, n, hour=8, temperature=0.7, seed=8, dtype=torch.float32),
        _served(base, n, hour=9, temperature=0.7, seed=9, dtype=torch.float32),
    ]
    write_shards(_shards(parts, [LABEL, LABEL]), root / "shards")
    return root


def test_the_gate_recomputes_with_the_adapter_on_its_base(world: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    parent = _uri(world / "adapters/a1")
    code, doc = run_stage(
        world / "shards", out, "--parent", parent, "--max-bad-fraction", "0.6", *READY
    )
    assert code == 0, doc
    assert doc["vocab_size"] == VOCAB  # the base's config.json: an adapter has none
    gate = doc["fidelity"]
    assert gate["checked"] and (gate["partitions"], gate["partitions_checked"]) == (2, 2)
    hours = {p["partition"][-2:]: p for p in gate["by_partition"]}
    # logged while serving base + adapter: the recomputed numbers, to float32 rounding
    assert hours["08"]["quarantined"] is None
    assert hours["08"]["mean_abs_delta"] < 1e-4, hours["08"]
    # logged under the base alone: far off, quarantined
    assert hours["09"]["mean_abs_delta"] > 3 * gate["max_mean_abs_delta"], hours["09"]
    assert hours["09"]["quarantined"].startswith("mean |delta| ")
    staged = training_set(out).column("interaction_id").to_pylist()
    assert sorted(staged) == [f"h8-{i:03d}" for i in range(8)]


def test_an_adapter_whose_base_changed_is_refused_naming_the_base(
    world: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Refused before any row is read, whether the gate runs or not: the vocabulary and
    the log-probs would be another model's."""
    parent = _uri(world / "adapters/moved")
    for extra in ((), ("--fidelity-sample-rows", "0")):
        code, doc = run_stage(world / "shards", tmp_path / "out", "--parent", parent, *extra)
        assert code == 1 and doc == {}
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"stage: --parent adapter {parent.rstrip('/')}"), err
        assert f"trained on other files than base {_uri(world / 'models/moving')}" in err, err
