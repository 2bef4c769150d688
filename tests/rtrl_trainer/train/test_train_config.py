"""The train step's config (rtrl_trainer.train.config) and the DeepSpeed config derived
from it: the RLCycle's own TrainingSpec in every accepted file form, flags over the file,
and a bad value rejected with exit 2 naming the field."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from rtrl.core.api.rlcycle import TrainingSpec
from rtrl_trainer.cli import main
from rtrl_trainer.spec_file import ConfigError
from rtrl_trainer.train.config import PLACEHOLDER_IMAGE, build_config, describe
from rtrl_trainer.train.deepspeed_config import deepspeed_config
from tests.conftest import REPO, console_script

URIS = {"parent": "s3://models/base/", "data": "s3://runs/c1/stage/", "out": "s3://models/c1/"}


def _write(tmp_path: Path, doc: object) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_defaults_are_the_api_defaults() -> None:
    config = build_config(**URIS)
    assert config.training.zero_stage == 2
    assert config.training.precision == "bf16"
    assert config.training.image == PLACEHOLDER_IMAGE
    assert config.trainer.save_every_steps == 50
    assert "image" not in describe(config)["training"]


def test_a_whole_rlcycle_manifest_is_a_config() -> None:
    config = build_config(**URIS, config_file=REPO / "examples" / "rlcycle.yaml")
    manifest = yaml.safe_load((REPO / "examples" / "rlcycle.yaml").read_text())
    expected = TrainingSpec.model_validate(manifest["spec"]["training"])
    assert config.training == expected
    assert config.training.activation_checkpointing is True


def test_a_spec_or_a_training_mapping_with_trainer_options(tmp_path: Path) -> None:
    spec = yaml.safe_load((REPO / "examples" / "rlcycle.yaml").read_text())["spec"]
    assert build_config(**URIS, config_file=_write(tmp_path, spec)).training.zero_stage == 2
    doc = {
        # YAML 1.1 reads 1e-6 as a string; the API server (YAML 1.2) reads a number.
        "training": {"zeroStage": 3, "learningRate": "1e-6", "precision": "fp32"},
        "trainer": {"saveEverySteps": 5, "maxSteps": 7},
    }
    config = build_config(**URIS, config_file=_write(tmp_path, doc))
    assert (config.training.zero_stage, config.training.learning_rate) == (3, 1e-6)
    assert (config.trainer.save_every_steps, config.trainer.max_steps) == (5, 7)


def test_flags_override_the_file(tmp_path: Path) -> None:
    path = _write(tmp_path, {"training": {"zero_stage": 3, "klCoef": 0.5}})
    config = build_config(
        **URIS,
        config_file=path,
        training_overrides={"zeroStage": 1},
        trainer_overrides={"maxSteps": 2},
    )
    assert config.training.zero_stage == 1
    assert config.training.kl_coef == 0.5
    assert config.trainer.max_steps == 2


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"spec": {"training": {"zeroStage": 4}}}, "config.yaml: spec.training.zeroStage: "),
        ({"training": {"zeroStage": 4}}, "config.yaml: training.zeroStage: "),
        ({"training": {"learningRte": 1}}, "training.learningRte: unknown field"),
        ({"trainer": {"saveEverySteps": -1}}, "trainer.saveEverySteps: "),
        ({"trainng": {}}, "trainng: unknown field"),
        ({"kind": "Checkpoint", "spec": {}}, "kind: expected RLCycle"),
        ([1, 2], "expected a mapping"),
    ],
)
def test_bad_config_names_the_field(tmp_path: Path, doc: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        build_config(**URIS, config_file=_write(tmp_path, doc))


def test_bad_flag_names_the_flag_and_the_field() -> None:
    with pytest.raises(ConfigError, match=r"--zero-stage \(training\.zeroStage\): "):
        build_config(**URIS, training_overrides={"zeroStage": 5})


@pytest.mark.parametrize(
    ("uris", "message"),
    [
        ({**URIS, "out": "gs://models/c1/"}, "--out: unsupported store URI"),
        ({**URIS, "out": URIS["parent"]}, "three different prefixes"),
        ({**URIS, "out": "s3://models/base/next/"}, "inside"),
    ],
)
def test_bad_uris(uris: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build_config(**uris)


def test_cli_exits_2_on_a_bad_config_without_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write(tmp_path, {"training": {"clipRatio": 3}})
    args = ["train", "--parent", URIS["parent"], "--data", URIS["data"], "--out", URIS["out"]]
    assert main([*args, "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rtrl-job train: ") and "training.clipRatio" in err
    assert main([*args, "--micro-batch-size", "0"]) == 2
    assert "--micro-batch-size (training.microBatchSize)" in capsys.readouterr().err


def test_an_adapter_from_the_file_or_the_flags(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No adapter unless asked; ``adapter: {}`` asks for the defaults; flags override the
    file's fields; a bad field, or ZeRO-3, exits 2 naming it."""
    assert build_config(**URIS).adapter is None
    doc = {"training": {"zeroStage": 2}, "adapter": {}}
    config = build_config(**URIS, config_file=_write(tmp_path, doc))
    assert config.adapter is not None
    assert (config.adapter.rank, config.adapter.alpha) == (8, 16)
    assert config.adapter.peft_target_modules() == "all-linear"
    doc["adapter"] = {"rank": 16, "targetModules": ["q_proj", "v_proj"]}
    config = build_config(**URIS, config_file=_write(tmp_path, doc), adapter_overrides={"rank": 4})
    assert config.adapter is not None and config.adapter.rank == 4
    assert config.adapter.peft_target_modules() == ["q_proj", "v_proj"]
    assert describe(config)["adapter"]["rank"] == 4
    args = ["train", "--parent", URIS["parent"], "--data", URIS["data"], "--out", URIS["out"]]
    assert main([*args, "--adapter-rank", "0"]) == 2
    assert "--adapter-rank (adapter.rank)" in capsys.readouterr().err
    assert main([*args, "--adapter-target-modules", "q_proj,v proj"]) == 2
    assert "--adapter-target-modules (adapter.targetModules[1])" in capsys.readouterr().err
    assert main([*args, "--adapter-rank", "4", "--zero-stage", "3"]) == 2
    assert "zeroStage: 3 cannot train an adapter" in capsys.readouterr().err


def test_help_lists_the_flags() -> None:
    out = subprocess.run(
        [console_script("rtrl-job"), "train", "--help"], capture_output=True, text=True, cwd=REPO
    )
    assert out.returncode == 0
    for flag in ("--parent", "--data", "--out", "--config", "--zero-stage", "--save-every-steps",
                 "--adapter-rank", "--adapter-target-modules"):  # fmt: skip
        assert flag in out.stdout


@pytest.mark.parametrize(("stage", "precision"), [(0, "fp32"), (2, "bf16"), (3, "bf16")])
def test_deepspeed_config_follows_the_typed_config(stage: int, precision: str) -> None:
    spec = build_config(
        **URIS,
        training_overrides={
            "zeroStage": stage,
            "precision": precision,
            "microBatchSize": 2,
            "learningRate": 3e-6,
            "gradClip": 0.5,
        },
    ).training
    ds = deepspeed_config(spec, gradient_accumulation_steps=4, world_size=8, cuda=False)
    assert ds["train_batch_size"] == 2 * 4 * 8
    assert ds["train_micro_batch_size_per_gpu"] == 2
    assert ds["gradient_accumulation_steps"] == 4
    assert ds["gradient_clipping"] == 0.5
    assert ds["zero_optimization"]["stage"] == stage
    assert ds["bf16"] == {"enabled": precision == "bf16"}
    assert ds["optimizer"]["params"]["lr"] == 3e-6
    # torch's AdamW: nothing to compile, on CPU or in a runtime image.
    assert ds["optimizer"]["params"]["torch_adam"] is True
    if stage:
        assert ds["zero_optimization"]["overlap_comm"] is False
        assert deepspeed_config(spec, gradient_accumulation_steps=1, world_size=1, cuda=True)[
            "zero_optimization"
        ]["overlap_comm"]
