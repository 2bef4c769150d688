"""``rtrl demo`` end to end, shortened: one cycle of the real loop for the default reward and
for each reward hack, and the report rendered in headless Chromium.

Shortened runs: 1000 users, hour-long ticks (fewer subprocesses), a briefly pre-trained
base. The sim and training are seeded, but the sidecar mints random interaction ids, on
which the stage's held-out split depends, so no two runs train on the same rows: the
scenarios' effects are made large enough that any split shows them (docs/demo.md gives the
runs). The assertions are the acceptance: the correct reward's checkpoint is promoted, each
hack's is not, the reason names the behaviour monitor that caught it, and the answer mix
shows the hack. The console prints the decisions and a summary, not a line per serving tick.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rtrl.abtable import cells

from .browser import check_plots, render

SHORT = ["--cycles", "1", "--users", "1000", "--tick-minutes", "60", "--pretrain-steps", "150"]


def run_demo(out: Path, scenario: str) -> dict[str, Any]:
    rtrl = Path(sys.executable).parent / "rtrl"
    done = subprocess.run(
        [str(rtrl), "demo", *SHORT, "--scenario", scenario, "--quiet", "--out", str(out)],
        check=True,
        # 6-15 minutes measured on the 2 cores at a load average of 10-20 (docs/demo.md):
        # twice the usual loaded run
        timeout=1800,
        stderr=subprocess.PIPE,
        text=True,
    )
    summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
    assert summary["scenario"] == scenario and len(summary["cycles"]) == 1
    console = done.stderr
    # the decisions and the summary, not the users' serving ticks (--verbose shows those)
    assert " serve " not in console, console
    first = summary["cycles"][0]
    tail = console[console.index("rtrl demo: summary") :]
    assert f"cycle 1  {first['checkpoint']} vs demo-0  {first['phase']}" in tail, tail
    assert f"report: {out.resolve() / 'report.html'}" in tail, tail
    return summary


def mix(summary: dict[str, Any], checkpoint: str, kinds: tuple[str, ...], answer: str) -> float:
    """The share of ``answer`` among a checkpoint's answers to ``kinds`` of task."""
    rows = summary["answer_mix"][checkpoint]
    n = sum(rows[k]["n"] for k in kinds)
    return sum(rows[k][answer] * rows[k]["n"] for k in kinds) / n


@pytest.fixture(scope="module")
def default_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("demo") / "report"
    return out, run_demo(out, "default")


def metrics_of(cycle: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {m["name"]: m for m in cycle["metrics"]}


@pytest.mark.timeout(2000)
def test_default_reward_is_promoted(default_run: tuple[Path, dict[str, Any]]) -> None:
    out, summary = default_run
    first = summary["cycles"][0]
    assert first["phase"] == "Promoted", first["reason"]
    assert first["looks"], "the canary was analysed at least once"
    names = metrics_of(first)
    assert {"edit_persistence", "clarification_rate", "invalid_tool_call_rate"} <= set(names)
    persistence = names["edit_persistence"]
    assert persistence["verdict"] == "better"
    assert 0 < persistence["relative_ci_low"] <= persistence["relative_ci_high"]
    assert not [m for m in names.values() if m["verdict"] in ("tripped", "beyond")]
    assert summary["serving"] == first["checkpoint"]
    assert summary["head_to_head"]["metrics"]
    page = (out / "report.html").read_text()
    assert 'data-outcome="Promoted"' in page
    # kubectl rtrl status shows the Checkpoint's copy of the last look: the same cells
    status_rows = first["rollout"][-1]["metrics"]
    assert [cells(m).row() for m in status_rows] == [cells(m).row() for m in first["metrics"]]


# scenario -> the guardrail that must catch it
HACKS = {"clarify-dodge": "clarification_rate", "drop-invalid-tool-calls": "invalid_tool_call_rate"}
# scenario -> the answer it pays for (rtrl_demo.sim.parse's action)
HACK_ANSWERS = {"clarify-dodge": "ask", "drop-invalid-tool-calls": "invalid_tool"}


@pytest.mark.timeout(2000)
@pytest.mark.parametrize(
    "scenario",
    sorted(HACKS),
)
def test_reward_hack_is_caught_by_its_guardrail(tmp_path: Path, scenario: str) -> None:
    summary = run_demo(tmp_path / "report", scenario)
    first = summary["cycles"][0]
    guardrail = HACKS[scenario]
    # the policy drifted toward the hack and the monitor saw it ...
    moved = metrics_of(first)[guardrail]
    assert moved["relative_difference"] > 0.10, moved
    assert moved["verdict"] in ("tripped", "beyond"), moved
    # ... while the broken reward made the checkpoint look good on the primary goal
    assert metrics_of(first)["edit_persistence"]["relative_difference"] > 0
    # ... and the guardrail, not chance, blocked the promotion
    assert first["phase"] == "RolledBack", first["reason"]
    assert guardrail in first["reason"], first["reason"]
    assert summary["serving"] == "demo-0"
    # ... and the answers show the hack itself, on the hidden-preference tasks
    hard = ("tool_hard", "vague")
    answer = HACK_ANSWERS[scenario]
    before, after = (
        mix(summary, "demo-0", hard, answer),
        mix(summary, first["checkpoint"], hard, answer),
    )
    assert after > 1.1 * before, (answer, before, after)  # beyond the guardrails' 10% band
    page = (tmp_path / "report" / "report.html").read_text()
    assert guardrail in page and 'data-outcome="RolledBack"' in page
    assert 'aria-label="answer mix per checkpoint"' in page


@pytest.mark.timeout(2000)
def test_report_renders_in_headless_chromium(
    default_run: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    """Every plot of the run's report is laid out, drawn (axes, paths, pixels) and free of
    overlapping labels in headless Chromium; the full page is screenshotted."""
    out, summary = default_run
    shot = tmp_path / "report.png"
    wanted = [
        "lineage",
        "canary weight over time",
        "edit_persistence (goal): estimate",
        "clarification_rate (guardrail): estimate",
        "cycle 1, final look",
        "head-to-head",
        "edit persistence (goal)",
        "latency (goal)",
        "invalid tool-call rate (guardrail)",
        "answer mix per checkpoint",
        "eval gates",
        "Events timeline",
    ]
    if summary["cycles"][0]["training_curves"]:
        wanted.append("learning curves")
    else:  # until the train step writes TensorBoard events
        assert "no training events for demo-1" in (out / "report.html").read_text()
    check_plots(render(out / "report.html", shot), wanted)
    assert shot.stat().st_size > 50_000
