"""The A/B table reads the same everywhere: ``kubectl rtrl status``, the demo's console and
its HTML report show the same change and interval for the same analysis rows, and the text
tables' columns line up whatever the values' widths (rtrl.abtable)."""

from __future__ import annotations

import copy
import html
import re
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from rtrl.abtable import (
    ABSOLUTE,
    ALIGN,
    HEADERS,
    KUBECTL_HEADERS,
    ab_table,
    cells,
    number,
    percent,
    render_table,
)
from rtrl.core.results import AnalysisCause, AnalysisResult, CauseKind, Decision
from rtrl.kubectl_plugin.render import render_status
from rtrl_demo.console import metrics_table
from rtrl_demo.report import write_report
from rtrl_demo.summary import analysis_metrics
from tests.rtrl.planning.test_plan import World, to_canary

# analysis.json's metric rows, awkward on purpose: a latency in the thousands, a rare event's
# tiny rate with an interval far wider than the rest, a zero baseline (no relative change:
# null), a too-few-events verdict.
ROWS: list[dict[str, Any]] = [
    {"name": "edit_persistence", "kind": "goal", "baseline": 0.456, "canary": 0.6801,
     "difference": 0.2235, "ci_low": 0.1437, "ci_high": 0.3033, "relative_difference": 0.4901,
     "relative_ci_low": 0.3152, "relative_ci_high": 0.6649, "verdict": "better",
     "higher_is_better": True, "alpha": 0.0133, "tau": 0.02, "baseline_samples": 4504,
     "canary_samples": 4441},
    {"name": "dissatisfied_followup_rate", "kind": "goal", "baseline": 0.284, "canary": 0.257,
     "difference": -0.027, "ci_low": -0.066, "ci_high": 0.012, "relative_difference": -0.095,
     "relative_ci_low": -0.232, "relative_ci_high": 0.042, "verdict": "inconclusive",
     "higher_is_better": False, "alpha": 0.0133, "tau": 0.03, "baseline_samples": 4504,
     "canary_samples": 4441},
    {"name": "latency_ms", "kind": "goal", "baseline": 1330.5, "canary": 1143.3,
     "difference": -187.2, "ci_low": -221.3, "ci_high": -153.2, "relative_difference": -0.14074,
     "relative_ci_low": -0.16633, "relative_ci_high": -0.11514, "verdict": "better",
     "higher_is_better": False, "alpha": 0.0133, "tau": 0.05, "baseline_samples": 4504,
     "canary_samples": 4441},
    {"name": "invalid_tool_call_rate", "kind": "guardrail", "baseline": 0.00042,
     "canary": 0.001235, "difference": 0.000815, "ci_low": -0.0079, "ci_high": 0.0095,
     "relative_difference": 1.941, "relative_ci_low": -0.973, "relative_ci_high": 22.155,
     "verdict": "beyond", "higher_is_better": False, "alpha": 0.01, "tau": 0.1,
     "baseline_samples": 1800, "canary_samples": 1790, "band": {"maxRelativeRise": 0.1}},
    {"name": "clarification_rate", "kind": "guardrail", "baseline": 0.0, "canary": 0.0021,
     "difference": 0.0021, "ci_low": -0.0004, "ci_high": 0.0046, "relative_difference": None,
     "relative_ci_low": None, "relative_ci_high": None, "verdict": "too-few-events",
     "higher_is_better": False, "alpha": 0.01, "tau": 0.1, "baseline_samples": 4504,
     "canary_samples": 4441, "band": {"maxRelativeRise": 0.1}},
]  # fmt: skip
# What every view must show for them: metric -> (old, new, change, interval, verdict)
SHOWN = {
    "edit_persistence": ("0.456", "0.680", "+49.0%", "[+31.5%, +66.5%]", "better"),
    "dissatisfied_followup_rate": ("0.284", "0.257", "-9.5%", "[-23.2%, +4.2%]", "inconclusive"),
    "latency_ms": ("1330.5", "1143.3", "-14.1%", "[-16.6%, -11.5%]", "better"),
    "invalid_tool_call_rate": ("0.00042", "0.0012", "+194.1%", "[-97.3%, +2215.5%]", "beyond"),
    "clarification_rate": ("0.000", "0.0021", "n/a", "n/a", "too-few-events"),
}
DOC = AnalysisResult.written(
    {
        "ok": True,
        "decision": Decision.CONTINUE,
        "cause": AnalysisCause(kind=CauseKind.HELD_BEYOND_BAND, metrics=["clarification_rate"]),
        "message": "edit_persistence significantly better, promotion held",
        "reasons": ["edit_persistence significantly better, promotion held"],
        "baseline": "composer-0",
        "canary": "composer-1",
        "baseline_samples": 4504,
        "canary_samples": 4441,
        "metrics": ROWS,
    }
)


def judged_checkpoint(doc: AnalysisResult) -> tuple[World, dict[str, Any]]:
    """A cycle of the planning core up to its first analysis, judged from ``doc``: the
    Checkpoint's status.rollout metrics as the operator's judge() writes them."""
    world = World()
    to_canary(world)
    world.now += timedelta(hours=1)
    world.reconcile()
    world.finish("analyze-0", result=doc.document())
    world.reconcile()
    return world, world.checkpoint("composer-1")


def assert_aligned(lines: list[str], table: list[list[str]]) -> None:
    """Each line holds its row's cells in order; left-aligned columns start, right-aligned
    ones end, at the same offset on every line, at least two spaces after the previous."""
    assert len(lines) == len(table)
    starts: list[set[int]] = [set() for _ in table[0]]
    ends: list[set[int]] = [set() for _ in table[0]]
    for line, row in zip(lines, table, strict=True):
        at = 0
        for i, cell in enumerate(row):
            found = line.find(cell, at)
            assert found >= 0, (cell, line)
            assert i == 0 or line[found - 2 : found] == "  ", (cell, line)
            starts[i].add(found)
            ends[i].add(found + len(cell))
            at = found + len(cell)
    for i, side in enumerate(ALIGN):
        positions = ends[i] if side == ">" else starts[i]
        assert len(positions) == 1, (i, table[0][i], positions, lines)


def expected_table(headers: tuple[str, ...]) -> list[list[str]]:
    return [list(headers), *[[name, *shown] for name, shown in SHOWN.items()]]


def test_the_same_intervals_in_kubectl_the_console_and_the_report(tmp_path: Path) -> None:
    world, ck = judged_checkpoint(DOC)
    status_rows = ck["status"]["rollout"][0]["metrics"]
    # judge() wrote camelCase and left the nulls out: the views must read that form too
    assert status_rows[3]["relativeCiHigh"] == 22.155
    assert "relativeDifference" not in status_rows[4] and "relative_ci_low" not in status_rows[4]
    assert status_rows[4]["verdict"] == "too-few-events"

    # kubectl rtrl status
    out = render_status(world.rlcycle, ck, "Candidate", world.now)
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.split()[:2] == ["METRIC", "BASELINE"])
    kubectl = lines[head : head + 1 + len(ROWS)]
    assert_aligned(kubectl, expected_table(KUBECTL_HEADERS))
    assert all(line.startswith("      ") for line in kubectl)
    assert ABSOLUTE not in out

    # the demo's console
    console = metrics_table(analysis_metrics(DOC))
    assert_aligned(console, expected_table(HEADERS))
    # a cycle shown from the Checkpoint's status alone (no analysis documents) reads the same
    assert metrics_table(status_rows) == console

    # the report: the analysis rows (cycle 1) and the status' rows (cycle 2)
    cycle = {"cycle": 1, "checkpoint": "composer-1", "parent": "composer-0", "phase": "Canary",
             "reason": DOC.message, "metrics": analysis_metrics(DOC),
             "looks": [{"canary_samples": 4441, "metrics": analysis_metrics(DOC)}]}  # fmt: skip
    second = {**cycle, "cycle": 2, "metrics": status_rows, "looks": []}
    page = write_report(tmp_path, {"scenario": "default", "cycles": [cycle, second]}).read_text()
    for name, (old, new, change, span, verdict) in SHOWN.items():
        rows = re.findall(rf'<tr data-metric="{name}">(.*?)</tr>', page, re.S)
        shown = [[html.unescape(td) for td in re.findall(r"<td[^>]*>(.*?)</td>", r)] for r in rows]
        # cycle 1's table, then cycle 2's (the status' rows have no roles)
        assert shown == [[name, role, old, new, change, span, verdict] for role in (ROLE[name], "")]
        # the forest plots' labels: both cycles' final look
        label = f"{change} {verdict}" if span == "n/a" else f"{change} {span} {verdict}"
        assert page.count(f">{html.escape(label, quote=False)}</text>") == 2
    visible = re.sub(r"<style>.*?</style>|<[^>]*>", " ", page, flags=re.DOTALL)
    for text in (out, "\n".join(console), visible):
        assert not re.search(r"\de[+-]?\d", text), "no exponent notation"
        for _, _, change, span, _ in SHOWN.values():
            assert change in text and span in text


ROLE = {r["name"]: r["kind"] for r in ROWS}


def test_the_report_marks_clipped_intervals_and_shares_one_axis(tmp_path: Path) -> None:
    calm = copy.deepcopy(ROWS[:3])
    cycles = [
        {"cycle": 1, "checkpoint": "c-1", "parent": "c-0", "phase": "RolledBack",
         "metrics": analysis_metrics(DOC), "looks": []},
        {"cycle": 2, "checkpoint": "c-2", "parent": "c-1", "phase": "Promoted",
         "metrics": calm, "looks": []},
    ]  # fmt: skip
    page = write_report(tmp_path, {"cycles": cycles}).read_text()
    plots = re.findall(r'aria-label="cycle \d, final look: relative change.*?</svg>', page, re.S)
    assert len(plots) == 2
    # the rare event's +2215.5% runs beyond the axis: an arrow at the edge says where to
    assert ">+2215.5%</text>" in plots[0]
    assert "arrow: the interval runs beyond the axis" in plots[0]
    assert ">+2215.5%</text>" not in plots[1] and "arrow:" not in plots[1]
    # one scale for both cycles, from all their data: the largest estimate (+194.1%) fits
    for plot in plots:
        ticks = re.findall(r">([-+]?\d+%)</text>", plot)
        assert ticks[0] == "-100%" and ticks[-1] == "+200%", ticks
    # the guardrail's band (rise <= 10%) is drawn where the row has one
    assert plots[0].count("fill: #2ca02c; fill-opacity: 0.12") == 2
    assert "shaded: the guardrail's band" in plots[0]
    assert "fill-opacity: 0.12" not in plots[1] and "shaded" not in plots[1]


def test_an_old_status_row_shows_its_absolute_numbers_labelled() -> None:
    old = {"name": "latency_ms", "baseline": 1200.0, "canary": 1180.0, "difference": -20.0,
           "ciLow": -45.5, "ciHigh": 4.25}  # fmt: skip
    c = cells(old)
    assert c.absolute
    assert c.row() == ["latency_ms", "1200.0", "1180.0", "-20.0 (abs)", "[-45.5, +4.2] (abs)", "-"]
    lines = ab_table([old, ROWS[0]], indent="  ")
    assert lines[-1].startswith("  (abs): canary minus baseline")
    assert "+49.0%" in lines[2] and ABSOLUTE not in lines[2]


@pytest.mark.parametrize(
    ("value", "name", "shown"),
    [
        (1330.5, "latency_ms", "1330.5"),
        (12_345_678.9, "latency_ms", "12345678.9"),
        (250.0, "mean_completion_tokens", "250.0"),
        (0.456, "edit_rate", "0.456"),
        (0.00042, "invalid_tool_call_rate", "0.00042"),
        (0.001235, "invalid_tool_call_rate", "0.0012"),
        (-0.0000001, "edit_rate", "-0.0000001"),
        (0.005, "edit_rate", "0.005"),
        (-0.0001, "latency_ms", "0.0"),
        (float("nan"), "edit_rate", "n/a"),
        (None, "edit_rate", "n/a"),
    ],
)
def test_numbers_never_use_an_exponent(value: float | None, name: str, shown: str) -> None:
    assert number(value, name) == shown


def test_percentages_have_one_decimal() -> None:
    assert [percent(v) for v in (0.023, -0.973, 22.155, -0.00001, 1e6, None)] == [
        "+2.3%", "-97.3%", "+2215.5%", "+0.0%", "+100000000.0%", "n/a",
    ]  # fmt: skip


def test_columns_are_as_wide_as_their_widest_cell() -> None:
    lines = render_table(["a", "bb"], [["long value", "1"], ["x", "12345"]], align="<>")
    assert lines == ["a              bb", "long value      1", "x           12345"]
    with pytest.raises(ValueError, match="2 columns"):
        render_table(["a", "b"], [["only one"]])
