"""Absurd values given to ``rtrl-job stage`` are one-line usage errors naming the flag or
field and the allowed range, never a traceback (issue 19: ``--maturity=99999999999d`` and
``data.window: 3000000d`` overflowed a datetime, ``--heldout-fraction 1`` a uint64)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rtrl_trainer.cli import main
from rtrl_trainer.spec_file import ConfigError
from rtrl_trainer.stage.config import build_config
from tests.rtrl.core.shards.helpers import write
from tests.rtrl_trainer.helpers import NOW, rows, stage_args


def _stage(tmp_path: Path, *extra: str) -> list[str]:
    write(rows(3), tmp_path / "shards" / "checkpoint=ckpt-1" / "p.parquet")
    args = stage_args(tmp_path / "shards", tmp_path / "out", *extra)
    if "--heldout-fraction" in extra:  # the helper's own --heldout-fraction 0 goes
        at = args.index("--heldout-fraction")
        del args[at : at + 2]
    return args


@pytest.mark.parametrize(
    ("extra", "config", "message"),
    [
        (
            ("--maturity=99999999999d",),
            None,
            "--maturity (data.maturity): duration '99999999999d' is too long: the maximum is 365d",
        ),
        (
            (),
            "data: {window: 3000000d}\n",
            "data.window: duration '3000000d' is too long: the maximum is 365d",
        ),
    ],
)
def test_a_duration_beyond_its_maximum_is_a_config_error(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    extra: tuple[str, ...],
    config: str | None,
    message: str,
) -> None:
    if config is not None:
        (tmp_path / "c.yaml").write_text(config)
        extra = (*extra, "--config", str(tmp_path / "c.yaml"))
    code = main(_stage(tmp_path, *extra))
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("rtrl-job stage: ") and message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("value", ["1", "0.9", "nan", "inf", "-0.1"])
def test_a_heldout_fraction_that_leaves_nothing_to_train_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], value: str
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(_stage(tmp_path, "--heldout-fraction", value))
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"--heldout-fraction: expected a fraction between 0 and 0.5, not {value!r}" in err
    assert "Traceback" not in err


def test_build_config_holds_the_heldout_fraction_to_its_range() -> None:
    """Callers that build the config without the CLI get the same answer."""
    with pytest.raises(ConfigError, match=r"--heldout-fraction: must be between 0 and 0\.5"):
        build_config(
            config_file=None,
            checkpoint="ckpt-1",
            out="file:///data/out/",
            now=NOW,
            shards="file:///data/shards/",
            heldout_fraction=1.0,
        )


def test_the_largest_heldout_fraction_runs(tmp_path: Path) -> None:
    assert main(_stage(tmp_path, "--heldout-fraction", "0.5")) == 0
