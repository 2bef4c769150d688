"""The stage step's configuration: the RLCycle's own DataSpec/RewardSpec from a whole
manifest, a spec, or a data/reward mapping (YAML or JSON); flags override the file; every
error is a usage error (exit 2) that names the field and where it came from."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from rtrl_trainer.cli import main
from rtrl_trainer.spec_file import ConfigError, parse_time
from rtrl_trainer.stage.config import StageConfig, build_config
from tests.conftest import REPO
from tests.rtrl.core.shards.helpers import write
from tests.rtrl_trainer.helpers import NOW, rows, run_stage, stage_args

SHARDS = "file:///data/shards/"
OUT = "file:///data/out/"


def _build(path: Path | None, **flags: Any) -> StageConfig:
    return build_config(config_file=path, checkpoint="ckpt-1", out=OUT, now=NOW, **flags)


def test_a_whole_rlcycle_manifest(tmp_path: Path) -> None:
    config = _build(REPO / "examples" / "rlcycle.yaml")
    assert config.data.shards == "s3://interactions/composer/"
    assert config.data.min_interactions == 200_000
    assert config.reward.asked_clarification == -0.2
    assert config.reward.baseline == "org"


def test_a_spec_a_mapping_and_json(tmp_path: Path) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        "target: {deployment: x, container: y}\nschedule: {interval: 5h}\n"
        f"data: {{shards: '{SHARDS}', maturity: 2h}}\nreward: {{latency: -0.5}}\n"
    )
    config = _build(spec)
    assert (config.data.maturity, config.reward.latency) == ("2h", -0.5)
    mapping = tmp_path / "m.json"
    mapping.write_text(json.dumps({"reward": {"clip": 2}}))
    config = _build(mapping, shards=SHARDS)
    assert (config.reward.clip, config.data.shards) == (2.0, SHARDS)
    assert config.data.maturity == "1h"
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert _build(empty, shards=SHARDS).reward.edit_persisted == 1.0


def test_flags_override_the_file(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(
        "data:\n  shards: s3://somewhere/x/\n  maturity: 2h\n  max_bad_fraction: 0.5\n"
        "  minInteractions: 7\n"
    )
    config = _build(path, shards=SHARDS, maturity="30m", max_bad_fraction=0.2, min_interactions=3)
    data = config.data
    assert (data.shards, data.maturity, data.max_bad_fraction, data.min_interactions) == (
        SHARDS,
        "30m",
        0.2,
        3,
    )
    assert config.cutoff == datetime(2026, 1, 5, 11, 30, tzinfo=UTC)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("reward: {clip: -1}", "c.yaml: reward.clip: Input should be greater than 0"),
        ("reward: {baseline: user}", "c.yaml: reward.baseline: Input should be 'batch' or 'org'"),
        (
            "reward: {editPersisted: 0, dissatisfiedFollowup: 0, latency: 0, invalidToolCall: 0}",
            "c.yaml: reward: at least one reward weight must be non-zero",
        ),
        ("data: {maturity: 5x}", "c.yaml: data.maturity: invalid duration '5x'"),
        ("data: {minInteractions: '100'}", "c.yaml: data.minInteractions: Input should be"),
        ("rewards: {clip: 1}", "c.yaml: rewards: unknown field"),
        ("reward: {clipp: 1}", "c.yaml: reward.clipp: unknown field"),
        ("data: [1, 2]", "c.yaml: data: expected a mapping"),
        (
            "apiVersion: rtrl.io/v1alpha1\nkind: RLCycle\nspec:\n  data: {maturity: 0s}\n",
            "c.yaml: spec.data.maturity: duration '0s' must be greater than zero",
        ),
        ("kind: Checkpoint\nspec: {}", "c.yaml: kind: expected RLCycle, got 'Checkpoint'"),
        ("data: {shards: 'http://x/'}", "c.yaml: data.shards: 'http://x/' must be an object"),
        ("{{{", "c.yaml: not valid YAML or JSON"),
    ],
)
def test_bad_config_files_name_the_field(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as error:
        _build(path, shards=SHARDS if "shards" not in text else None)
    assert message in str(error.value).replace(str(tmp_path) + "/", "")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({}, "data.shards: required: pass --shards URI or set data.shards"),
        ({"shards": "ftp://x/"}, "--shards (data.shards): 'ftp://x/' must be an object-store"),
        ({"shards": SHARDS, "maturity": "soon"}, "--maturity (data.maturity): invalid duration"),
        ({"shards": SHARDS, "ranks": 0}, "--ranks: must be at least 1"),
        (
            {"shards": SHARDS, "exclude_checkpoints": ["ckpt-1"]},
            "--checkpoint 'ckpt-1' is also given as --exclude-checkpoint",
        ),
        (
            {"shards": SHARDS, "previous_checkpoint": "ckpt-1"},
            "--previous-checkpoint must differ from --checkpoint",
        ),
        (
            {"shards": SHARDS, "since": datetime(2027, 1, 1, tzinfo=UTC)},
            "--since 2027-01-01T00:00:00Z is after --now",
        ),
        ({"shards": "file:///data/"}, "--out file:///data/out/ is inside the shard source"),
    ],
)
def test_bad_flags_name_the_flag(flags: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as error:
        _build(None, **flags)
    assert message in str(error.value)


def test_usage_errors_exit_2_through_the_cli(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write(rows(3), tmp_path / "shards" / "checkpoint=ckpt-1" / "p.parquet")
    config = tmp_path / "c.yaml"
    config.write_text("reward: {clip: 0}\n")
    code = main(stage_args(tmp_path / "shards", tmp_path / "out", "--config", str(config)))
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("rtrl-job stage: ") and "reward.clip" in err
    assert not (tmp_path / "out").exists()
    with pytest.raises(SystemExit) as exit_:
        main(stage_args(tmp_path / "shards", tmp_path / "out", "--max-bad-fraction", "2"))
    assert exit_.value.code == 2
    assert "--max-bad-fraction: expected a fraction between 0 and 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(stage_args(tmp_path / "shards", tmp_path / "out", now="yesterday"))
    assert "--now: 'yesterday' is not an ISO 8601 time" in capsys.readouterr().err


def test_a_config_file_drives_a_run(tmp_path: Path) -> None:
    write(rows(3, latency_ms=20_000.0), tmp_path / "shards" / "checkpoint=ckpt-1" / "p.parquet")
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"data": {"minInteractions": 3}, "reward": {"latency": -1}}))
    code, doc = run_stage(tmp_path / "shards", tmp_path / "out", "--config", str(config))
    assert code == 0
    assert doc["reward"]["mean"] == -2.0
    assert doc["reward_spec"]["latency"] == -1.0


def test_times() -> None:
    assert parse_time("2026-01-05T12:00:00Z") == NOW
    assert parse_time("2026-01-05T13:00:00+01:00") == NOW
    assert parse_time("2026-01-05T12:00:00") == NOW  # naive means UTC
    with pytest.raises(ValueError, match="not an ISO 8601 time"):
        parse_time("5 Jan")
