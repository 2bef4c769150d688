"""The stage and the rows' sampling: the sampling columns travel into the staged set, rows
whose log-probs cannot be matched are refused and counted (not quarantined), and the
fidelity gate quarantines a partition whose logged log-probs the serving checkpoint does
not reproduce (another checkpoint served it, or its temperature is mislabelled) while a
bfloat16 engine's rounding passes."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import torch

from rtrl.core.shards import write_shards
from rtrl.core.store import open_store
from tests.rtrl.core.shards.helpers import write
from tests.rtrl_trainer.helpers import T0, by_id, rows, run_stage, training_set
from tests.rtrl_trainer.trainset import VOCAB, save_parent, tiny_gpt2

PARTITION = "checkpoint=ckpt-1/date=2026-01-05/hour=08"
P, R = "processed_logprobs", "raw_logprobs"


def _sampling(t: pa.Table, **columns: list[Any]) -> pa.Table:
    types = {"temperature": pa.float32(), "top_p": pa.float32(), "top_k": pa.int32(),
             "logprobs_mode": pa.string(), "serving_dtype": pa.string()}  # fmt: skip
    for name, values in columns.items():
        t = t.append_column(name, pa.array(values, types[name]))
    return t


def test_unmatched_rows_are_refused_and_counted_not_quarantined(tmp_path: Path) -> None:
    t = _sampling(
        rows(6),
        temperature=[None, 0.7, 0.7, 1.0, 0.0, 0.7],
        top_p=[None, 0.9, None, 0.9, None, None],
        top_k=[None, 20, None, None, None, None],
        logprobs_mode=[None, P, R, None, P, None],
    )
    write(t, tmp_path / "shards" / PARTITION / "part-0.parquet")
    code, doc = run_stage(tmp_path / "shards", tmp_path / "out")
    assert code == 0, doc
    assert doc["refused"] == {"greedy": 1, "raw_logprobs_tempered": 2, "raw_logprobs_truncated": 1}
    assert doc["quarantined"] == {} and doc["rows_bad"] == 0  # not bad data
    assert doc["interactions_used"] == 2
    assert doc["message"].endswith(
        "; 4 refused (log-probs not of the sampled distribution: greedy=1, "
        "raw_logprobs_tempered=2, raw_logprobs_truncated=1)"
    )
    staged = by_id(training_set(tmp_path / "out"))
    assert sorted(staged) == ["i00000", "i00001"]
    # The sampling travels with the row, for the trainer.
    one = staged["i00001"]
    assert (one["temperature"], one["top_p"], one["top_k"], one["logprobs_mode"]) == (
        pytest.approx(0.7),
        pytest.approx(0.9),
        20,
        P,
    )
    assert staged["i00000"]["temperature"] is None  # null: temperature 1


def test_refused_rows_are_named_when_the_set_is_insufficient(tmp_path: Path) -> None:
    t = _sampling(rows(3), temperature=[0.7] * 3, logprobs_mode=[R] * 3)
    write(t, tmp_path / "shards" / PARTITION / "part-0.parquet")
    code, doc = run_stage(tmp_path / "shards", tmp_path / "out")
    assert code == 0 and not doc["sufficient"]
    assert doc["message"].endswith(
        "; 3 refused (log-probs not of the sampled distribution: raw_logprobs_tempered=3)"
    )


def test_impossible_sampling_values_are_quarantined(tmp_path: Path) -> None:
    t = _sampling(rows(4), temperature=[1.0, -1.0, 1.0, 1.0], logprobs_mode=[R, R, "x", R])
    write(t, tmp_path / "shards" / PARTITION / "part-0.parquet")
    code, doc = run_stage(tmp_path / "shards", tmp_path / "out", "--max-bad-fraction", "0.5")
    assert code == 0, doc
    assert doc["quarantined"] == {"sampling_out_of_range": 1, "unknown_logprobs_mode": 1}
    assert doc["interactions_used"] == 2


# --- the fidelity gate ----------------------------------------------------------------------


def _peaked(seed: int) -> Any:
    """A tiny GPT-2 whose distributions are far from uniform (temperature matters)."""
    model = tiny_gpt2(seed=seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)  # tied to the embeddings
    return model.eval()


@torch.no_grad()
def _served(
    model: Any, n: int, *, hour: int, temperature: float, seed: int, dtype: torch.dtype
) -> list[dict[str, Any]]:
    """``n`` completions sampled from ``model`` at ``temperature`` (in ``dtype``, as an
    engine with those weights would), with the processed log-prob of each token."""
    generator = torch.Generator().manual_seed(seed)
    served_by = model.to(dtype)
    out = []
    for i in range(n):
        ids = torch.randint(3, VOCAB, (6,), generator=generator).tolist()
        prompt, logprobs = list(ids), []
        for _ in range(10):
            logits = served_by(input_ids=torch.tensor([ids])).logits[0, -1].float()
            logp = torch.log_softmax(logits / temperature, -1)
            token = int(torch.multinomial(logp.exp(), 1, generator=generator))
            ids.append(token)
            logprobs.append(float(logp[token]))
        out.append(
            {
                "interaction_id": f"h{hour}-{i:03d}",
                "created_at": T0 + timedelta(hours=hour - 8, minutes=i),
                "prompt_ids": prompt,
                "completion_ids": ids[len(prompt) :],
                "completion_logprobs": logprobs,
            }
        )
    model.to(torch.float32)
    return out


def _shards(parts: list[list[dict[str, Any]]], labels: list[dict[str, Any]]) -> pa.Table:
    tables = []
    for part, label in zip(parts, labels, strict=True):
        n = len(part)
        columns = {key: [r[key] for r in part] for key in part[0]}
        t = rows(n, **columns, completion_mask=[[True] * 10] * n)
        tables.append(_sampling(t, **{k: [v] * n for k, v in label.items()}))
    return pa.concat_tables(tables)


@pytest.fixture(scope="module")
def gate_world(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ckpt-1 (saved at models/ckpt-1) and an hour of rows per case: 08 served by ckpt-1
    at T=0.7 in float32, 09 by another checkpoint, 10 at T=0.7 but labelled 1.0, 11 by
    ckpt-1 at T=0.7 in bfloat16 (an engine's rounding)."""
    root = tmp_path_factory.mktemp("gate")
    serving, other = _peaked(seed=1), _peaked(seed=2)
    save_parent(open_store(root.as_uri() + "/"), "models/ckpt-1", serving, root)
    n = 12
    parts = [
        _served(serving, n, hour=8, temperature=0.7, seed=8, dtype=torch.float32),
        _served(other, n, hour=9, temperature=0.7, seed=9, dtype=torch.float32),
        _served(serving, n, hour=10, temperature=0.7, seed=10, dtype=torch.float32),
        _served(serving, n, hour=11, temperature=0.7, seed=11, dtype=torch.bfloat16),
    ]
    labels = [
        {"temperature": 0.7, "logprobs_mode": P, "serving_dtype": "float32"},
        {"temperature": 0.7, "logprobs_mode": P, "serving_dtype": "float32"},
        {"temperature": 1.0, "logprobs_mode": P, "serving_dtype": "float32"},
        {"temperature": 0.7, "logprobs_mode": P, "serving_dtype": "bfloat16"},
    ]
    write_shards(_shards(parts, labels), root / "shards")
    return root


# Every row of the four hours (08-11, feedback ten minutes later) is ready at 12:00.
READY = ("--maturity", "1m")


def _gate(root: Path, out: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    parent = (root / "models" / "ckpt-1").as_uri() + "/"
    return run_stage(
        root / "shards", out, "--parent", parent, "--max-bad-fraction", "0.6", *READY, *extra
    )


def test_the_gate_quarantines_another_checkpoint_and_a_wrong_temperature(
    gate_world: Path, tmp_path: Path
) -> None:
    code, doc = _gate(gate_world, tmp_path / "out")
    assert code == 0, doc
    gate = doc["fidelity"]
    assert gate["checked"] and gate["checkpoint"] == "ckpt-1"
    assert (gate["partitions"], gate["partitions_checked"]) == (4, 4)
    hours = {p["partition"][-2:]: p for p in gate["by_partition"]}
    assert [h for h, p in sorted(hours.items()) if p["quarantined"]] == ["09", "10"]
    # float32, same checkpoint, same distribution: the logged numbers, to rounding
    assert hours["08"]["mean_abs_delta"] < 1e-5
    assert hours["08"]["is_weight"]["p01"] == pytest.approx(1, abs=1e-4)
    # the default sample: 8 rows of each partition's 12
    assert hours["08"]["serving_dtype"] == {"float32": 8}
    # bfloat16 rounding passes the default bound, and is visible
    assert 1e-4 < hours["11"]["mean_abs_delta"] < gate["max_mean_abs_delta"]
    assert hours["11"]["serving_dtype"] == {"bfloat16": 8}
    # another checkpoint, a mislabelled temperature: far beyond it
    for hour in ("09", "10"):
        assert hours[hour]["mean_abs_delta"] > 3 * gate["max_mean_abs_delta"], hours[hour]
        assert hours[hour]["quarantined"].startswith("mean |delta| ")
    # the tokens came from the sharper T=0.7: at the labelled T=1 they are less likely
    assert hours["10"]["mean_delta"] < 0
    assert gate["overall"]["rows"] == 32 and gate["overall"]["tokens"] == 320
    # Their rows are quarantined (bad rows: they count against maxBadFraction) ...
    assert doc["quarantined"] == {"fidelity": 24}
    assert doc["files_by_reason"] == {"fidelity": 2}
    assert doc["rows_bad"] == 24
    # ... and never staged.
    staged = training_set(tmp_path / "out").column("interaction_id").to_pylist()
    assert sorted(staged) == [f"h{h}-{i:03d}" for h in (11, 8) for i in range(12)]


def test_a_quarantined_partition_counts_against_max_bad_fraction(
    gate_world: Path, tmp_path: Path
) -> None:
    parent = (gate_world / "models" / "ckpt-1").as_uri() + "/"
    code, doc = run_stage(gate_world / "shards", tmp_path / "out", "--parent", parent, *READY)
    assert code == 1 and not doc["ok"]
    assert doc["message"].startswith("50% of rows are bad (limit 1%): fidelity=24")


def test_the_gate_is_off_with_no_sample_rows_or_without_the_parent(
    gate_world: Path, tmp_path: Path
) -> None:
    code, doc = _gate(gate_world, tmp_path / "off", "--fidelity-sample-rows", "0")
    assert code == 0
    assert doc["fidelity"] == {
        "checked": False,
        "reason": "data.fidelity.sampleRows is 0",
        "sample_rows": 0,
        "max_mean_abs_delta": 0.1,
        "max_unsupported_fraction": 0.02,
    }
    assert doc["quarantined"] == {} and doc["interactions_used"] == 48
    code, doc = run_stage(gate_world / "shards", tmp_path / "no-parent", *READY)
    assert code == 0
    assert doc["fidelity"]["reason"] == "no --parent: no serving checkpoint to recompute with"


def test_the_sample_is_bounded(gate_world: Path, tmp_path: Path) -> None:
    code, doc = _gate(gate_world, tmp_path / "out", "--fidelity-sample-rows", "3")
    assert code == 0
    assert [p["rows"] for p in doc["fidelity"]["by_partition"]] == [3, 3, 3, 3]
    assert doc["fidelity"]["partitions_quarantined"] == 2


def test_an_unloadable_serving_checkpoint_fails_the_stage_in_one_line(
    gate_world: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    parent = tmp_path / "config-only"
    parent.mkdir()
    (parent / "config.json").write_text('{"model_type": "gpt2", "vocab_size": 260}')
    code, _ = run_stage(gate_world / "shards", tmp_path / "out", "--parent", parent.as_uri() + "/")
    assert code == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("stage: fidelity gate: cannot load the serving checkpoint "), err
    assert "data.fidelity.sampleRows: 0 stages without the gate" in err
    assert "\n" not in err
