"""``rtrl-job analyze`` with the group-sequential plan: an analysis between two looks of the
plan repeats the last one, the novelty rule holds a promotion the first hours earned, past
maxDuration nothing is judged, the variance reduction is reported for new and returning
users, and ``sequentialTest: mixture`` is today's always-valid analysis."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from rtrl.core.shards import write_shards
from rtrl_trainer.cli import main
from tests.rtrl_trainer.helpers import T0, rows

SINCE = "2026-01-05T08:00:00Z"


def canary(
    seed: int, *, users: int = 1500, hours: float = 6.0, lift: float = 0.0,
    novelty: float = 0.0, history: bool = True,
) -> pa.Table:  # fmt: skip
    """Users assigned whole (half to each arm) from 08:00, each with their own rate and
    a request every ~20 minutes at their own offset; the canary's rate ``lift`` higher,
    and ``novelty`` higher still in each user's first two hours on it. ``history``: half of
    the users served by the baseline the day before (the rest are new)."""
    rng = np.random.default_rng(seed)
    p = np.clip(rng.beta(4.5, 5.5, users), 0.02, 0.98)
    arm = rng.random(users) < 0.5
    org = rng.integers(0, 20, users)
    tables = []
    start = rng.uniform(0, 0.5, users)  # hours
    for user in range(users):
        k = int(hours * 3)
        times = start[user] + np.arange(k) / 3 + rng.uniform(0, 0.05, k)
        times = times[times < hours]
        rate = p[user] * np.where(arm[user], 1 + lift, 1.0)
        if arm[user]:
            rate = rate * np.where(times - times[0] < 2.0, 1 + novelty, 1.0)
        tables.append((user, times, np.clip(rate, 0, 1)))
    created, ckpt, uid, edit, orgs = [], [], [], [], []
    for user, times, rate in tables:
        for t, r in zip(times, np.broadcast_to(rate, times.shape), strict=True):
            created.append(T0 + timedelta(hours=float(t)))
            ckpt.append("cand" if arm[user] else "base")
            uid.append(f"u{user}")
            edit.append(float(rng.random() < r))
            orgs.append(f"org{org[user]}")
        if history and user % 2 == 0:
            for h in range(12):
                created.append(T0 - timedelta(hours=20 - h))
                ckpt.append("base")
                uid.append(f"u{user}")
                edit.append(float(rng.random() < p[user]))
                orgs.append(f"org{org[user]}")
    n = len(created)
    return rows(
        n, interaction_id=[f"i{i:07d}" for i in range(n)], checkpoint_id=ckpt, user_id=uid,
        org=orgs, created_at=created, feedback_at=[c + timedelta(minutes=20) for c in created],
        edit_persisted=edit, latency_ms=(1000 * rng.lognormal(0, 0.3, n)).tolist(),
        dissatisfied_followup=(rng.random(n) < 0.1).tolist(),
        edits_proposed=(rng.random(n) < 0.8).astype(int).tolist(),
        asked_clarification=False,  # no question asked: no guardrail holds on noise
    )  # fmt: skip


def analyze(shards: Path, out: Path, now: str, *extra: str, config: str = "") -> dict[str, Any]:
    path = out.parent / f"{out.name}.yaml"
    path.write_text("rollout: {unit: user" + (", " + config if config else "") + "}\n")
    code = main([
        "analyze", "--shards", shards.as_uri() + "/", "--baseline", "base", "--canary", "cand",
        "--out", out.as_uri() + "/", "--since", SINCE, "--now", now, "--canary-weight", "50",
        "--config", str(path), *extra,
    ])  # fmt: skip
    assert code == 0
    doc: dict[str, Any] = json.loads((out / "analysis.json").read_text())
    return doc


@pytest.fixture(scope="module")
def lifted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("lifted")
    write_shards(canary(1, lift=0.15), root, partition_by=("checkpoint",))
    return root


def test_an_analysis_between_two_looks_repeats_the_last(lifted: Path, tmp_path: Path) -> None:
    rule = "analysis: {noveltyWindow: 2h}"  # the settled rows are compared too
    at = analyze(lifted, tmp_path / "a", "2026-01-05T13:00:00Z", config=rule)
    later = analyze(lifted, tmp_path / "b", "2026-01-05T13:14:59Z", config=rule)
    assert at["sequential"]["as_of"] == later["sequential"]["as_of"] == "2026-01-05T13:00:00Z"
    assert at["sequential"]["looks"] == 20
    assert at["sequential"]["fraction"] == pytest.approx(5 / 24)
    for key in ("decision", "reasons", "metrics", "settled", "srm", "baseline_samples"):
        assert at[key] == later[key], key
    # a big lift, five hours in: promoted, every interval a repeated one with its boundary
    assert at["decision"] == "promote", at["reasons"]
    primary = at["metrics"][0]
    assert primary["name"] == "edit_persistence" and primary["boundary"] > 2
    assert "repeated 98.7% CI" in at["reasons"][1]
    radius = primary["boundary"] * (primary["ci_high"] - primary["difference"])
    assert radius > 0 and at["settled"]["verdict"] == "better"


def test_new_and_returning_users_variance_reduction(lifted: Path, tmp_path: Path) -> None:
    doc = analyze(lifted, tmp_path / "a", "2026-01-05T13:00:00Z")
    primary = doc["metrics"][0]
    # returning users' own history explains much of their rate; new users get their org's
    assert primary["variance_reduction_returning"] > 0.2
    assert primary["variance_reduction_new"] is not None
    assert primary["variance_reduction_returning"] > primary["variance_reduction_new"]
    vr = doc["variance_reduction"]
    assert vr["units"]["edit_persistence"] == 1500
    assert vr["units_with_covariate"]["edit_persistence"] == 750  # the users with history


def test_a_novelty_is_held(tmp_path: Path) -> None:
    """+60% in each user's first two hours on the canary, nothing after: the whole canary
    looks better, the users past their first two hours do not; promotion is held."""
    root = tmp_path / "novel"
    write_shards(canary(2, novelty=0.6, hours=8.0), root, partition_by=("checkpoint",))
    doc = analyze(
        root, tmp_path / "a", "2026-01-05T15:00:00Z", config="analysis: {noveltyWindow: 2h}"
    )
    assert doc["metrics"][0]["verdict"] == "better"
    assert doc["settled"]["verdict"] == "inconclusive"
    assert doc["decision"] == "continue"
    assert doc["reasons"][0].startswith(
        "promotion held: edit_persistence significantly better, but not yet among the "
        "interactions of users past their first 2h in the canary"
    )
    # without the rule (noveltyWindow unset, the default) the same data are promoted
    off = analyze(root, tmp_path / "b", "2026-01-05T15:00:00Z")
    assert off["decision"] == "promote" and off["settled"] is None


def test_past_max_duration_nothing_is_judged(lifted: Path, tmp_path: Path) -> None:
    """maxDuration 4h, analysed at 5h with hold: every error of the plan is spent; intervals
    are still printed (with the last boundary of the plan), verdicts are not drawn."""
    doc = analyze(lifted, tmp_path / "a", "2026-01-05T13:00:00Z",
                  config="analysis: {maxDuration: 4h, inconclusive: hold}")  # fmt: skip
    assert doc["decision"] == "continue"
    primary = doc["metrics"][0]
    assert primary["verdict"] == "inconclusive" and primary["boundary"] is None
    assert primary["relative_ci_low"] < primary["relative_difference"] < primary["relative_ci_high"]
    assert "no verdict at this look" in doc["reasons"][1]


def test_mixture_is_todays_always_valid_analysis(lifted: Path, tmp_path: Path) -> None:
    doc = analyze(lifted, tmp_path / "a", "2026-01-05T13:07:00Z",
                  config="analysis: {sequentialTest: mixture}")  # fmt: skip
    assert doc["method"]["citation"].startswith("Johari")
    assert doc["sequential"]["looks"] == 1
    assert doc["sequential"]["as_of"] == "2026-01-05T13:07:00Z"  # any moment: now
    assert "always-valid" in doc["reasons"][1] and "boundary" not in doc["metrics"][0]


def test_the_settled_rows_of_both_arms_start_with_their_step(tmp_path: Path) -> None:
    """An A/A with a daily drift: both arms' rates are 0.8 from 10:00 to 12:00 and 0.2
    after. The baseline's users have been on it since 08:00; the canary's were moved to it
    when its 50% step began at 10:00. Counted from each user's first row in the arm alone,
    the baseline's settled rows would start at 10:00 and the canary's at 12:00, and the
    drift between those hours would read as a 60% difference; counted from the step's
    start too, both arms' settled rows start at 12:00 and agree."""
    rng = np.random.default_rng(7)
    created, ckpt, uid, edit = [], [], [], []
    for user in range(600):
        on_canary = user % 2 == 1
        first = 2.0 if on_canary else 0.0  # hours after 08:00
        for t in first + np.arange((6.0 - first) * 3) / 3 + rng.uniform(0, 0.3):
            created.append(T0 + timedelta(hours=float(t)))
            ckpt.append("cand" if on_canary else "base")
            uid.append(f"u{user}")
            rate = 0.5 if t < 2.0 else 0.8 if t < 4.0 else 0.2
            edit.append(float(rng.random() < rate))
    n = len(created)
    root = tmp_path / "drift"
    table = rows(
        n, interaction_id=[f"i{i:07d}" for i in range(n)], checkpoint_id=ckpt, user_id=uid,
        created_at=created, feedback_at=[c + timedelta(minutes=20) for c in created],
        edit_persisted=edit, asked_clarification=False,
    )  # fmt: skip
    write_shards(table, root, partition_by=("checkpoint",))
    steps = ("--step", "2026-01-05T08:00:00Z=5", "--step", "2026-01-05T10:00:00Z=50")
    doc = analyze(root, tmp_path / "a", "2026-01-05T15:00:00Z", *steps,
                  config="analysis: {noveltyWindow: 2h}")  # fmt: skip
    settled = doc["settled"]
    late = [c >= T0 + timedelta(hours=4) for c in created]
    assert settled["baseline_samples"] == sum(
        c == "base" and k for c, k in zip(ckpt, late, strict=True)
    )
    assert settled["baseline"] == pytest.approx(0.2, abs=0.03)
    assert abs(settled["relative_difference"]) < 0.15, settled
