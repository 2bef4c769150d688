"""Which interactions the stage step selects: the serving checkpoint's, matured, in the
window, in the population, not yet staged, deduplicated; previous-checkpoint rows up to the
off-policy cap; rolled-back checkpoints never. Each rule on hand-made rows with exact
counts in stage.json."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pyarrow as pa

from rtrl.core.shards import write_shards
from tests.rtrl.core.shards.helpers import write
from tests.rtrl_trainer.helpers import NOW, T0, by_id, ids, rows, run_stage, training_set


def _concat(*tables: pa.Table) -> pa.Table:
    return pa.concat_tables(tables)


def test_only_the_serving_checkpoints_partition_is_read(tmp_path: Path) -> None:
    data = _concat(
        rows(4),
        rows(3, checkpoint_id="ckpt-2", interaction_id=["x0", "x1", "x2"]),
    )
    write_shards(data, tmp_path / "shards", partition_by=["checkpoint"])
    code, doc = run_stage(tmp_path / "shards", tmp_path / "out")
    assert code == 0
    assert doc["files_total"] == 1  # checkpoint=ckpt-2/ was never listed
    assert doc["rows_read"] == 4
    assert ids(training_set(tmp_path / "out")) == ["i00000", "i00001", "i00002", "i00003"]
    assert doc["excluded"] == {}
    assert doc["on_policy_fraction"] == 1.0


def test_rows_of_other_checkpoints_in_unpartitioned_files_are_excluded(tmp_path: Path) -> None:
    data = _concat(
        rows(3),
        rows(2, checkpoint_id="ckpt-2", interaction_id=["x0", "x1"]),
        rows(1, checkpoint_id="ckpt-0", interaction_id=["r0"]),
    )
    write(data, tmp_path / "shards" / "part-0.parquet")
    code, doc = run_stage(tmp_path / "shards", tmp_path / "out", "--exclude-checkpoint", "ckpt-0")
    assert code == 0
    assert ids(training_set(tmp_path / "out")) == ["i00000", "i00001", "i00002"]
    assert doc["excluded"] == {"other_checkpoint": 2, "rolled_back": 1}
    assert doc["quarantined"] == {}


def test_maturity_cutoff_and_feedback(tmp_path: Path) -> None:
    cutoff = NOW - timedelta(hours=1)
    created = [
        cutoff - timedelta(minutes=5),  # ready
        cutoff,  # exactly at the cutoff: ready
        cutoff + timedelta(seconds=1),  # too recent, although its feedback is in
        cutoff - timedelta(minutes=5),  # no feedback yet: immature
        cutoff - timedelta(minutes=5),  # feedback after --now: immature
        cutoff - timedelta(minutes=5),  # feedback exactly at --now: ready
    ]
    feedback = [
        created[0] + timedelta(minutes=1),
        created[1] + timedelta(minutes=1),
        created[2] + timedelta(minutes=1),
        None,
        NOW + timedelta(seconds=1),
        NOW,
    ]
    write_shards(rows(6, created_at=created, feedback_at=feedback), tmp_path / "shards")
    code, doc = run_stage(tmp_path / "shards", tmp_path / "out")
    assert code == 0
    assert ids(training_set(tmp_path / "out")) == ["i00000", "i00001", "i00005"]
    assert (doc["too_recent"], doc["immature"]) == (1, 2)
    assert doc["cutoff"] == "2026-01-05T11:00:00Z"
    assert doc["next_since"] == "2026-01-05T12:00:00Z"


def test_maturity_flag_overrides(tmp_path: Path) -> None:
    created = [NOW - timedelta(minutes=m) for m in (90, 40, 10)]
    feedback = [c + timedelta(minutes=5) for c in created]
    write_shards(rows(3, created_at=created, feedback_at=feedback), tmp_path / "shards")
    code, doc = run_stage(tmp_path / "shards", tmp_path / "out", "--maturity", "30m")
    assert code == 0
    assert doc["interactions_used"] == 2
    assert (doc["too_recent"], doc["maturity"]) == (1, "30m")


def test_window(tmp_path: Path) -> None:
    created = [NOW - timedelta(hours=h) for h in (30, 23, 2)]
    feedback = [c + timedelta(minutes=5) for c in created]
    write_shards(rows(3, created_at=created, feedback_at=feedback), tmp_path / "shards")
    config = tmp_path / "c.yaml"
    config.write_text("data: {window: 24h}\n")
    code, doc = run_stage(tmp_path / "shards", tmp_path / "out", "--config", str(config))
    assert code == 0
    assert ids(training_set(tmp_path / "out")) == ["i00001", "i00002"]
    assert doc["excluded"] == {"outside_window": 1}
    assert doc["window_start"] == "2026-01-04T12:00:00Z"


def test_since_stages_every_interaction_exactly_once(tmp_path: Path) -> None:
    """Two consecutive cycles, the second with --since = the first's next_since: every row
    is staged once, in the cycle in which it became ready, late feedback included."""
    first_now, second_now = NOW, NOW + timedelta(hours=5)
    created = [
        T0,  # ready in cycle 1
        T0 + timedelta(hours=2),  # ready in cycle 1
        NOW - timedelta(minutes=30),  # too recent for cycle 1
        T0,  # feedback arrives late, after cycle 1
        T0,  # feedback never arrives
        NOW + timedelta(hours=1),  # created after cycle 1
    ]
    feedback = [
        created[0] + timedelta(minutes=10),
        created[1] + timedelta(minutes=10),
        created[2] + timedelta(minutes=10),
        NOW + timedelta(hours=2),
        None,
        created[5] + timedelta(minutes=10),
    ]
    write_shards(rows(6, created_at=created, feedback_at=feedback), tmp_path / "shards")
    code, first = run_stage(tmp_path / "shards", tmp_path / "c1")
    assert code == 0
    assert ids(training_set(tmp_path / "c1")) == ["i00000", "i00001"]
    assert (first["too_recent"], first["immature"]) == (2, 2)
    code, second = run_stage(
        tmp_path / "shards",
        tmp_path / "c2",
        "--since",
        first["next_since"],
        now=second_now.isoformat(),
    )
    assert code == 0
    assert ids(training_set(tmp_path / "c2")) == ["i00002", "i00003", "i00005"]
    assert second["excluded"] == {"already_staged": 2}
    assert (second["immature"], second["since"]) == (1, first["next_since"])
    assert first_now < second_now


def test_population_orgs_and_exclusions(tmp_path: Path) -> None:
    orgs = ["acme", "globex", None, "initech", "acme"]
    write_shards(rows(5, org=orgs), tmp_path / "shards")
    config = tmp_path / "c.yaml"
    config.write_text("data: {population: {orgs: [acme, initech]}}\n")
    code, doc = run_stage(tmp_path / "shards", tmp_path / "o1", "--config", str(config))
    assert code == 0
    assert ids(training_set(tmp_path / "o1")) == ["i00000", "i00003", "i00004"]
    assert doc["excluded"] == {"population": 2}

    config.write_text("data: {population: {excludeOrgs: [acme]}}\n")
    code, doc = run_stage(tmp_path / "shards", tmp_path / "o2", "--config", str(config))
    assert ids(training_set(tmp_path / "o2")) == ["i00001", "i00002", "i00003"]
    assert doc["excluded"] == {"population": 2}


def _with_previous(tmp_path: Path, on: int = 90, previous: int = 50) -> Path:
    shards = tmp_path / "shards"
    write_shards(rows(on), shards)
    old = rows(
        previous,
        checkpoint_id="ckpt-0",
        interaction_id=[f"p{i:05d}" for i in range(previous)],
        completion_logprobs=[[-1.5, -2.5]] * previous,
    )
    write_shards(old, shards)
    return shards


def test_previous_checkpoint_is_admitted_up_to_the_cap(tmp_path: Path) -> None:
    shards = _with_previous(tmp_path)
    config = tmp_path / "c.yaml"
    config.write_text("data: {maxOffPolicyFraction: 0.1}\n")
    args = ("--config", str(config), "--previous-checkpoint", "ckpt-0")
    code, doc = run_stage(shards, tmp_path / "out", *args)
    assert code == 0
    # off / (90 + off) <= 0.1 -> 10 of the 50 eligible previous rows.
    assert (doc["interactions_used"], doc["off_policy_interactions"]) == (100, 10)
    assert doc["on_policy_fraction"] == 0.9
    assert doc["eligible"] == {"on_policy": 90, "previous": 50}
    assert doc["excluded"] == {"off_policy_cap": 40}
    out = training_set(tmp_path / "out")
    previous = [row for row in out.to_pylist() if not row["on_policy"]]
    assert len(previous) == 10
    assert {row["checkpoint_id"] for row in previous} == {"ckpt-0"}
    # The logged log-probs travel unchanged: the trainer importance-weights with them.
    assert all(row["completion_logprobs"] == [-1.5, -2.5] for row in previous)
    # The same ten on a rerun (chosen by id hash, not by order or time).
    run_stage(shards, tmp_path / "again", *args)
    assert ids(training_set(tmp_path / "again")) == ids(out)


def test_an_off_policy_fraction_of_one_admits_every_previous_row(tmp_path: Path) -> None:
    shards = _with_previous(tmp_path, on=5, previous=20)
    config = tmp_path / "c.yaml"
    config.write_text("data: {maxOffPolicyFraction: 1}\n")
    args = ("--config", str(config), "--previous-checkpoint", "ckpt-0")
    code, doc = run_stage(shards, tmp_path / "out", *args)
    assert code == 0
    assert (doc["interactions_used"], doc["off_policy_interactions"]) == (25, 20)
    assert doc["on_policy_fraction"] == 0.2
    assert "off_policy_cap" not in doc["excluded"]


def test_previous_rows_need_a_positive_off_policy_fraction(tmp_path: Path) -> None:
    shards = _with_previous(tmp_path)
    code, doc = run_stage(shards, tmp_path / "out", "--previous-checkpoint", "ckpt-0")
    assert code == 0
    assert doc["interactions_used"] == 90
    assert doc["rows_read"] == 90  # the previous checkpoint's partition is not even listed


def test_a_rolled_back_checkpoint_is_never_admitted(tmp_path: Path) -> None:
    shards = _with_previous(tmp_path)
    config = tmp_path / "c.yaml"
    config.write_text("data: {maxOffPolicyFraction: 0.5}\n")
    code, doc = run_stage(
        shards,
        tmp_path / "out",
        "--config",
        str(config),
        "--previous-checkpoint",
        "ckpt-0",
        "--exclude-checkpoint",
        "ckpt-0",
    )
    assert code == 0
    assert doc["off_policy_interactions"] == 0
    assert doc["eligible"]["previous"] == 0
    assert set(training_set(tmp_path / "out").column("checkpoint_id").to_pylist()) == {"ckpt-1"}


def test_duplicate_ids_are_staged_once(tmp_path: Path) -> None:
    shards = tmp_path / "shards" / "checkpoint=ckpt-1"
    write(rows(3), shards / "part-0.parquet")
    write(rows(3, edit_persisted=1.0), shards / "part-1.parquet")  # a retried upload
    code, doc = run_stage(tmp_path / "shards", tmp_path / "out", "--max-bad-fraction", "1")
    assert code == 0
    out = training_set(tmp_path / "out")
    assert ids(out) == ["i00000", "i00001", "i00002"]
    assert {row["reward"] for row in out.to_pylist()} == {0.0}  # the first copy is kept
    assert doc["quarantined"] == {"duplicate_interaction_id": 3}


def test_a_row_contradicting_its_partition_is_quarantined(tmp_path: Path) -> None:
    data = rows(4, checkpoint_id=["ckpt-1", "ckpt-2", "ckpt-1", "ckpt-1"])
    write(data, tmp_path / "shards" / "checkpoint=ckpt-1" / "part-0.parquet")
    code, doc = run_stage(tmp_path / "shards", tmp_path / "out", "--max-bad-fraction", "0.5")
    assert code == 0
    assert ids(training_set(tmp_path / "out")) == ["i00000", "i00002", "i00003"]
    assert doc["quarantined"] == {"checkpoint_mismatch": 1}
    assert (doc["rows_bad"], doc["files_bad"], doc["bad_fraction"]) == (1, 1, 0.25)
    (bad,) = doc["quarantined_files"]
    assert bad["rows_by_reason"] == {"checkpoint_mismatch": 1}


def test_checkpoint_id_may_come_from_the_path(tmp_path: Path) -> None:
    data = rows(3).drop_columns(["checkpoint_id"])
    write(data, tmp_path / "shards" / "checkpoint=ckpt-1" / "part-0.parquet")
    code, doc = run_stage(tmp_path / "shards", tmp_path / "out")
    assert code == 0
    assert doc["interactions_used"] == 3
    assert set(training_set(tmp_path / "out").column("checkpoint_id").to_pylist()) == {"ckpt-1"}


def test_selected_rows_carry_their_tokens(tmp_path: Path) -> None:
    data = rows(
        2,
        prompt_ids=[[7, 8], [9]],
        completion_ids=[[1, 2, 3], [4]],
        completion_logprobs=[[-0.1, -0.2, -0.3], [0.0]],
        completion_mask=[[True, False, True], [True]],
        org=["acme", None],
    )
    write_shards(data, tmp_path / "shards")
    run_stage(tmp_path / "shards", tmp_path / "out")
    out = by_id(training_set(tmp_path / "out"))
    assert out["i00000"]["prompt_ids"] == [7, 8]
    assert out["i00000"]["completion_ids"] == [1, 2, 3]
    assert out["i00000"]["completion_logprobs"] == [-0.1, -0.2, -0.3] or all(
        abs(a - b) < 1e-6
        for a, b in zip(out["i00000"]["completion_logprobs"], [-0.1, -0.2, -0.3], strict=True)
    )
    assert out["i00000"]["completion_mask"] == [True, False, True]
    assert (out["i00001"]["org"], out["i00001"]["sample_weight"]) == (None, 1.0)
    assert all(row["on_policy"] for row in out.values())
