"""``rtrl-job analyze`` on real shards: which rows count, quarantine, the committed
analysis.json and its schema, exit codes, idempotence."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from rtrl.core.api.checkpoint import MetricComparison
from rtrl.core.shards import write_shards
from rtrl.core.store.local import LocalStore
from rtrl_trainer.cli import main
from tests.conftest import REPO
from tests.rtrl_trainer.helpers import NOW_ISO, T0, rows

SINCE = "2026-01-05T08:00:00Z"


def arm(
    checkpoint: str,
    n: int,
    *,
    seed: int,
    edit: float = 0.6,
    edit_rate: float = 0.8,
    clarification: float = 0.05,
    start: timedelta = timedelta(0),
    **columns: Any,
) -> pa.Table:
    """``n`` interactions of ``checkpoint`` spread over 08:00-10:00 (matured at 12:00)."""
    rng = np.random.default_rng(seed)
    created = [T0 + start + timedelta(seconds=7200 * i / n) for i in range(n)]
    values: dict[str, Any] = {
        "interaction_id": [f"{checkpoint}-{i:06d}" for i in range(n)],
        "checkpoint_id": checkpoint,
        "created_at": created,
        "feedback_at": [c + timedelta(minutes=30) for c in created],
        "edit_persisted": (rng.random(n) < edit).astype(float).tolist(),
        "dissatisfied_followup": (rng.random(n) < 0.1).tolist(),
        "latency_ms": (1000 * rng.lognormal(0, 0.6, n)).tolist(),
        "tool_calls": 2,
        "invalid_tool_calls": (rng.random(n) < 0.05).astype(int).tolist(),
        "asked_clarification": (rng.random(n) < clarification).tolist(),
        "edits_proposed": (rng.random(n) < edit_rate).astype(int).tolist(),
    }
    values.update(columns)
    return rows(n, **values)


def write(root: Path, *tables: pa.Table) -> Path:
    write_shards(pa.concat_tables(tables), root, partition_by=("checkpoint",))
    return root


def analyze(shards: Path, out: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    code = main(
        [
            "analyze",
            "--shards",
            shards.as_uri() + "/",
            "--baseline",
            "base",
            "--canary",
            "cand",
            "--out",
            out.as_uri() + "/",
            "--now",
            NOW_ISO,
            "--since",
            SINCE,
            *extra,
        ]
    )
    path = out / "analysis.json"
    return code, json.loads(path.read_text()) if path.exists() else {}


@pytest.fixture(scope="module")
def ask_instead_of_edit(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("shards")
    return write(
        root,
        arm("base", 12_000, seed=1),
        arm("cand", 12_000, seed=2, edit_rate=0.56, clarification=0.10),
    )


def test_guardrail_trip_and_schema(ask_instead_of_edit: Path, tmp_path: Path) -> None:
    code, doc = analyze(ask_instead_of_edit, tmp_path / "out", "--canary-weight", "50")
    assert code == 0
    assert doc["decision"] == "rollback"
    assert doc["reasons"][0].startswith("guardrail tripped: edit_rate, clarification_rate")
    # the cause as fields (analysis.json version 2): what the operator notifies on
    assert doc["version"] == 2
    assert doc["cause"] == {"kind": "guardrail", "metrics": ["edit_rate", "clarification_rate"]}
    assert doc["baseline_samples"] == doc["canary_samples"] == 12_000
    assert doc["srm"]["mismatch"] is False and doc["srm"]["expected_canary_share"] == 0.5
    assert doc["method"]["citation"].startswith("Lan & DeMets")
    assert doc["sequential"]["test"] == "group-sequential"
    # 08:00 to 12:00 every 15 minutes: 16 looks, judged as of the last
    assert doc["sequential"]["looks"] == 16 and doc["sequential"]["as_of"] == NOW_ISO
    assert doc["now"] == NOW_ISO and doc["since"] == SINCE and doc["alpha"] == 0.05
    assert doc["quarantined"] == {}
    kinds = {m["name"]: m["kind"] for m in doc["metrics"]}
    assert kinds["edit_persistence"] == "goal" and kinds["clarification_rate"] == "guardrail"
    assert {"latency_ms", "invalid_tool_call_rate"} <= set(kinds)
    assert "latency_p95_ms" not in kinds  # no band configured by default
    for metric in doc["metrics"]:
        MetricComparison.model_validate({k: metric[k] for k in MetricComparison.model_fields})
        expected = {"better", "worse", "inconclusive", "tripped", "ok"}
        if metric["name"] == "feedback_missing_rate":  # every row's feedback arrived
            expected = {"too-few-events"}
        assert metric["verdict"] in expected, metric
        assert metric["ci_low"] <= metric["difference"] <= metric["ci_high"]
    manifest = LocalStore(tmp_path / "out").committed("")
    assert manifest is not None and set(manifest.files) == {"analysis.json"}
    assert manifest.metadata["decision"] == "rollback"


def test_idempotent(ask_instead_of_edit: Path, tmp_path: Path) -> None:
    _, first = analyze(ask_instead_of_edit, tmp_path / "a", "--canary-weight", "50")
    _, second = analyze(ask_instead_of_edit, tmp_path / "a", "--canary-weight", "50")
    first.pop("timing")
    second.pop("timing")
    assert first == second


def test_srm(tmp_path: Path) -> None:
    shards = write(tmp_path / "s", arm("base", 4_000, seed=1), arm("cand", 1_000, seed=2))
    code, doc = analyze(shards, tmp_path / "out", "--canary-weight", "5")
    assert code == 0 and doc["decision"] == "rollback"
    assert doc["reasons"][0].startswith("sample ratio mismatch: canary share 20.00% vs ")
    assert doc["srm"]["observed_canary_share"] == pytest.approx(0.2)
    assert doc["srm"]["mismatch"] is True and doc["srm"]["p_value"] < 0.001


def test_immature_and_outside_window_ignored(tmp_path: Path) -> None:
    late = arm("cand", 500, seed=3, start=timedelta(hours=3, minutes=30))  # after 11:00
    late = late.set_column(0, "interaction_id", pa.array([f"late{i}" for i in range(500)]))
    early = arm("cand", 300, seed=4, start=timedelta(hours=-3))  # before --since
    early = early.set_column(0, "interaction_id", pa.array([f"early{i}" for i in range(300)]))
    unripe = arm("base", 200, seed=5, feedback_at=None)
    unripe = unripe.set_column(0, "interaction_id", pa.array([f"unripe{i}" for i in range(200)]))
    shards = write(
        tmp_path / "s",
        arm("base", 1_000, seed=1),
        arm("cand", 1_000, seed=2),
        late,
        early,
        unripe,
        arm("other", 100, seed=6),
    )
    code, doc = analyze(shards, tmp_path / "out")
    assert code == 0
    assert doc["baseline_samples"] == 1_000 and doc["canary_samples"] == 1_000
    assert doc["excluded"] == {"before_since": 300, "immature": 200, "too_recent": 500}
    assert doc["srm"]["expected_canary_share"] is None  # no --canary-weight: not checked


def test_bad_rows_quarantined_and_too_many_fail(tmp_path: Path) -> None:
    bad = arm("cand", 50, seed=3, edit_persisted=2.0)  # out of range
    bad = bad.set_column(0, "interaction_id", pa.array([f"bad{i}" for i in range(50)]))
    shards = write(tmp_path / "s", arm("base", 1_000, seed=1), arm("cand", 1_000, seed=2), bad)
    code, doc = analyze(shards, tmp_path / "out")
    assert code == 1
    assert doc["ok"] is False and doc["decision"] == "continue"
    assert doc["cause"] == {"kind": "cannot-analyse", "metrics": []}
    assert doc["quarantined"] == {"signal_out_of_range": 50}
    assert doc["quarantined_by_arm"] == {"baseline": 0, "canary": 50}
    config = tmp_path / "c.yaml"
    config.write_text("data: {shards: x, maxBadFraction: 0.05}\n")
    code, doc = analyze(shards, tmp_path / "out2", "--config", str(config))
    assert code == 0 and doc["ok"] is True
    assert doc["canary_samples"] == 1_000 and doc["rows_bad"] == 50


def test_config_from_manifest(tmp_path: Path) -> None:
    shards = write(tmp_path / "s", arm("base", 300, seed=1), arm("cand", 300, seed=2))
    config = tmp_path / "rlc.yaml"
    config.write_text(
        "apiVersion: rtrl.io/v1alpha1\nkind: RLCycle\nmetadata: {name: c}\n"
        f"spec:\n  data: {{shards: '{shards.as_uri()}/', maturity: 30m}}\n"
        "  rollout: {analysis: {alpha: 0.1, inconclusive: hold}}\n"
    )
    out = tmp_path / "out"
    code = main(
        ["analyze", "--baseline", "base", "--canary", "cand", "--out", out.as_uri() + "/",
         "--now", NOW_ISO, "--config", str(config), "--max-duration-reached"]
    )  # fmt: skip
    doc = json.loads((out / "analysis.json").read_text())
    assert code == 0 and doc["alpha"] == 0.1 and doc["maturity"] == "30m"
    assert doc["decision"] == "continue"
    assert (
        doc["reasons"][0].startswith("inconclusive at maxDuration")
        and "policy hold" in (doc["reasons"][0])
    )


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": "src"}
    return subprocess.run(
        [sys.executable, "-m", "rtrl_trainer.cli", "analyze", *args],
        capture_output=True,
        text=True,
        env=env,
        check=False,
        cwd=REPO,
    )


def test_cli_exit_codes(tmp_path: Path) -> None:
    shards = write(tmp_path / "s", arm("base", 200, seed=1), arm("cand", 200, seed=2))
    out = (tmp_path / "out").as_uri() + "/"
    common = ["--shards", shards.as_uri() + "/", "--out", out, "--now", NOW_ISO]
    ok = run_cli(*common, "--baseline", "base", "--canary", "cand", "--canary-weight", "50")
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.splitlines()[-1].startswith("analyze: continue: ")
    assert json.loads((tmp_path / "out" / "analysis.json").read_text())["decision"] == "continue"
    same = run_cli(*common, "--baseline", "base", "--canary", "base")
    assert same.returncode == 2 and "--canary must differ" in same.stderr
    weight = run_cli(*common, "--baseline", "base", "--canary", "cand", "--canary-weight", "0")
    assert weight.returncode == 2
    config = tmp_path / "bad.yaml"
    config.write_text("rollout: {analysis: {alpha: 2}}\n")
    bad = run_cli(*common, "--baseline", "base", "--canary", "cand", "--config", str(config))
    assert bad.returncode == 2 and "rollout.analysis.alpha" in bad.stderr
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "checkpoint=cand").mkdir()
    (broken / "checkpoint=cand" / "part-0.parquet").write_bytes(b"not parquet")
    unreadable = run_cli(
        "--shards", broken.as_uri() + "/", "--out", out, "--now", NOW_ISO,
        "--baseline", "base", "--canary", "cand",
    )  # fmt: skip
    assert unreadable.returncode == 1, unreadable.stderr


def users_table(
    checkpoint: str, users: list[int], p: np.ndarray, *, seed: int, start: timedelta,
    hours: float, per_user: int = 6, prefix: str = "",
) -> pa.Table:  # fmt: skip
    """``per_user`` interactions of each of ``users`` (user ``u`` persists edits with
    probability ``p[u]``), spread over ``hours`` from 08:00 + ``start``."""
    rng = np.random.default_rng(seed)
    ids = np.repeat(np.asarray(users), per_user)
    n = ids.size
    created = [T0 + start + timedelta(seconds=3600 * hours * i / n) for i in range(n)]
    return rows(
        n,
        interaction_id=[f"{prefix}{checkpoint}-{i:06d}" for i in range(n)],
        checkpoint_id=checkpoint,
        user_id=[f"user-{u}" for u in ids],
        created_at=created,
        feedback_at=[c + timedelta(minutes=30) for c in created],
        edit_persisted=(rng.random(n) < p[ids]).astype(float).tolist(),
        latency_ms=(1000 * rng.lognormal(0, 0.6, n)).tolist(),
        tool_calls=2,
    )


def test_users_as_the_unit_with_steps_and_pre_exposure(tmp_path: Path) -> None:
    """Users assigned whole by bucket over two steps (20% from 08:00, 50% from 09:00), their
    own base rates, and the stable lineage's interactions before the canary."""
    rng = np.random.default_rng(11)
    p = rng.beta(1.0, 1.0, 400)  # very different users: the pre-exposure mean predicts them
    bucket = rng.integers(0, 100, 400)
    everyone = list(range(400))
    step1 = [u for u in everyone if bucket[u] < 20]
    step2 = [u for u in everyone if bucket[u] < 50]
    tables = [
        users_table("grand", everyone, p, seed=1, start=timedelta(hours=-6), hours=3),
        users_table("base", everyone, p, seed=2, start=timedelta(hours=-3), hours=3),
        users_table("cand", step1, p, seed=3, start=timedelta(0), hours=1, prefix="s1"),
        users_table("base", [u for u in everyone if u not in step1], p, seed=4,
                    start=timedelta(0), hours=1, prefix="s1"),
        users_table("cand", step2, p, seed=5, start=timedelta(hours=1), hours=1, prefix="s2"),
        users_table("base", [u for u in everyone if u not in step2], p, seed=6,
                    start=timedelta(hours=1), hours=1, prefix="s2"),
        # too recent for feedback, but assigned: a new user on the canary at 11:50
        users_table("cand", [400], np.append(p, 0.5), seed=7,
                    start=timedelta(hours=3, minutes=50), hours=0.1, per_user=1, prefix="new"),
        # a user the router sent to both arms during step 2
        users_table("base", [step2[0]], p, seed=8, start=timedelta(hours=1, minutes=30),
                    hours=0.1, per_user=1, prefix="leak"),
    ]  # fmt: skip
    shards = write(tmp_path / "s", *tables)
    config = tmp_path / "rollout.yaml"
    config.write_text("rollout: {unit: user}\n")
    code, doc = analyze(
        shards, tmp_path / "out", "--config", str(config),
        "--step", "2026-01-05T08:00:00Z=20", "--step", "2026-01-05T09:00:00Z=50",
        "--pre-exposure-from", "grand",
    )  # fmt: skip
    assert code == 0, doc
    assert doc["unit"] == "user"
    assert [s["canary_share"] for s in doc["steps"]] == [20, 50]
    steps = doc["srm"]["steps"]
    assert steps[0]["canary_units"] == len(step1)
    assert steps[0]["baseline_units"] == 400 - len(step1)
    assert steps[1]["canary_units"] == len(step2) + 1  # the new user counts at once
    assert steps[1]["units_in_both_arms"] == 1
    assert doc["srm"]["units_in_both_arms"] == 1 and doc["srm"]["unit"] == "user"
    vr = doc["variance_reduction"]
    assert vr["pre_exposure_from"] == ["base", "grand"]
    assert vr["pre_exposure_rows"] == 2 * 400 * 6
    assert vr["units_with_covariate"]["edit_persistence"] == 400
    rows_ = {m["name"]: m for m in doc["metrics"]}
    assert rows_["edit_persistence"]["variance_reduction"] > 0.3
    assert (
        -1
        < rows_["edit_persistence"]["relative_ci_low"]
        < 0
        < rows_["edit_persistence"]["relative_ci_high"]
    )
    # without the covariates the same interval is wider
    config.write_text("rollout: {unit: user, analysis: {varianceReduction: false}}\n")
    code, plain = analyze(
        shards, tmp_path / "plain", "--config", str(config),
        "--step", "2026-01-05T08:00:00Z=20", "--step", "2026-01-05T09:00:00Z=50",
    )  # fmt: skip
    assert code == 0
    wide = {m["name"]: m for m in plain["metrics"]}["edit_persistence"]
    assert wide["variance_reduction"] == 0
    width = (
        rows_["edit_persistence"]["relative_ci_high"] - rows_["edit_persistence"]["relative_ci_low"]
    )
    assert wide["relative_ci_high"] - wide["relative_ci_low"] > 1.3 * width


def test_steps_must_be_in_order(tmp_path: Path) -> None:
    shards = write(tmp_path / "s", arm("base", 100, seed=1), arm("cand", 100, seed=2))
    code, _ = analyze(
        shards, tmp_path / "out",
        "--step", "2026-01-05T09:00:00Z=20", "--step", "2026-01-05T08:30:00Z=50",
    )  # fmt: skip
    assert code == 2


def test_date_partitions_before_the_pre_exposure_window_are_not_read(tmp_path: Path) -> None:
    old = arm("base", 500, seed=9, start=timedelta(days=-30))
    old = old.set_column(0, "interaction_id", pa.array([f"old{i}" for i in range(500)]))
    table = pa.concat_tables([arm("base", 1_000, seed=1), arm("cand", 1_000, seed=2), old])
    write_shards(table, tmp_path / "s", partition_by=("checkpoint", "date"))
    code, doc = analyze(tmp_path / "s", tmp_path / "out")
    assert code == 0
    assert doc["rows_read"] == 2_000  # the month-old partition was never opened
    assert doc["baseline_samples"] == doc["canary_samples"] == 1_000


def test_sessions_as_the_unit(tmp_path: Path) -> None:
    """``unit: session`` clusters by a ``session_id`` column; a file without it cannot be
    used and is quarantined, never analysed with the wrong unit."""
    base, cand = arm("base", 600, seed=1), arm("cand", 600, seed=2)
    sessions = [f"s{i // 6}" for i in range(600)]  # six interactions per session
    base = base.append_column("session_id", pa.array(sessions))
    cand = cand.append_column("session_id", pa.array([f"c{s}" for s in sessions]))
    root = tmp_path / "s"
    write_shards(pa.concat_tables([base, cand]), root, partition_by=("checkpoint",))
    config = tmp_path / "rollout.yaml"
    config.write_text("rollout: {unit: session}\n")
    code, doc = analyze(root, tmp_path / "out", "--config", str(config), "--canary-weight", "50")
    assert code == 0, doc
    assert doc["srm"]["unit"] == "session"
    assert doc["srm"]["baseline_units"] == doc["srm"]["canary_units"] == 100
    # without the column: every file quarantined, the analysis cannot run
    plain = tmp_path / "plain"
    write(plain, arm("base", 600, seed=1), arm("cand", 600, seed=2))
    code, doc = analyze(plain, tmp_path / "out2", "--config", str(config))
    assert code == 1
    assert doc["ok"] is False and doc["files_bad"] == doc["files_total"] == 2


def test_the_bases_canary_leaves_out_the_organisations_served_by_adapters(
    tmp_path: Path,
) -> None:
    """acme has an adapter of its own: on the stable pods its requests go to it (rows of
    the adapter's checkpoint, in neither arm), on the new base's canary pods the adapter is
    stale and acme gets the candidate. Judged on all rows, acme's users weigh on the canary
    arm alone (a sample ratio mismatch, and acme's own behaviour read as the candidate's);
    with ``--exclude-org acme`` both arms are the users the base serves."""
    shards = write(
        tmp_path / "s",
        arm("base", 3_000, seed=1, org="globex"),
        arm("cand", 3_000, seed=2, org="globex"),
        arm("cand", 1_500, seed=3, edit=0.2, org="acme",
            interaction_id=[f"a-{i:06d}" for i in range(1_500)]),
    )  # fmt: skip
    code, doc = analyze(shards, tmp_path / "all", "--canary-weight", "50")
    assert code == 0 and doc["decision"] == "rollback"
    code, doc = analyze(shards, tmp_path / "base", "--canary-weight", "50",
                        "--exclude-org", "acme")  # fmt: skip
    assert code == 0 and doc["decision"] == "continue", doc["reasons"]
    assert doc["excluded"]["other_orgs"] == 1_500
    assert (doc["baseline_samples"], doc["canary_samples"]) == (3_000, 3_000)
    code, doc = analyze(shards, tmp_path / "bad", "--org", "acme", "--exclude-org", "acme")
    assert code != 0


def test_one_organisations_adapter_canary_is_judged_on_its_rows_alone(tmp_path: Path) -> None:
    """An organisation's adapter is canaried on half of its users while the base serves
    every other organisation: the baseline's rows are everyone's, the canary's that org's.
    Judged on all rows, the canary's share looks like a sample ratio mismatch (and the other
    orgs' rates leak into the baseline); with ``--org`` only that org's rows count."""
    shards = write(
        tmp_path / "s",
        arm("base", 2_000, seed=1, org="acme"),
        arm("base", 6_000, seed=3, edit=0.4, org="globex",
            interaction_id=[f"g-{i:06d}" for i in range(6_000)]),
        arm("cand", 2_000, seed=2, org="acme"),
    )  # fmt: skip
    code, doc = analyze(shards, tmp_path / "all", "--canary-weight", "50")
    assert code == 0 and doc["decision"] == "rollback"
    assert doc["reasons"][0].startswith("sample ratio mismatch")
    code, doc = analyze(shards, tmp_path / "acme", "--canary-weight", "50", "--org", "acme")
    assert code == 0 and doc["decision"] == "continue", doc["reasons"]
    assert doc["org"] == "acme" and doc["excluded"]["other_orgs"] == 6_000
    assert (doc["baseline_samples"], doc["canary_samples"]) == (2_000, 2_000)
    assert doc["srm"]["mismatch"] is False
