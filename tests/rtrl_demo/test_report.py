"""The demo report from a three-cycle summary (tests/rtrl_demo/reportdata.py, no demo run):
every plot rendered in headless Chromium, and the report, the console and ``kubectl rtrl
status`` wording and colouring each checkpoint's outcome alike (tests/rtrl/test_abtable.py
holds their cells to one another)."""

from __future__ import annotations

import html
import re
from pathlib import Path
from typing import Any

import pytest

from rtrl.phasestyle import outcome_ansi, outcome_text, style
from rtrl_demo import console, report
from rtrl_demo.traces import TRAIN_TAGS

from . import reportdata
from .browser import check_plots, render

# A title (substring) of every kind of plot the report must draw.
PLOTS = [
    "lineage",
    "canary weight over time",
    *(
        f"{m} (goal): estimate and always-valid interval"
        for m in ("edit_persistence", "latency_ms")
    ),
    "clarification_rate (guardrail): estimate and always-valid interval at each look; shaded",
    "cycle 1, final look",
    "cycle 3, final look",
    "head-to-head",
    "edit persistence (goal)",
    "invalid tool-call rate (guardrail)",
    "answer mix per checkpoint",
    "learning curves",
    "eval gates",
    "staged data",
    "Events timeline",
]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], str]:
    root = tmp_path_factory.mktemp("report")
    summary = reportdata.summary(root)
    path = report.write_report(root, summary)
    return root, summary, path.read_text()


def test_report_renders_every_plot_in_headless_chromium(
    built: tuple[Path, dict[str, Any], str], tmp_path: Path
) -> None:
    root, _, _ = built
    shot = tmp_path / "report.png"
    plots = check_plots(render(root / "report.html", shot), PLOTS)
    # one confidence sequence per metric, goals and guardrails
    sequences = [t for t in plots if "at each look" in t]
    assert len(sequences) == 6, sequences
    assert shot.stat().st_size > 50_000


def test_report_is_one_file_with_plain_numbers(built: tuple[Path, dict[str, Any], str]) -> None:
    _, _, page = built
    assert "<script" not in page and not re.search(r'(src|href)="(https?:|//)', page)
    assert not re.search(r">[-+]?\d+(\.\d+)?e[-+]\d+<", page), "a label in exponent notation"
    assert "1327.4" in page  # latency as the table writes it
    assert "no training events" in page  # demo-3's train step wrote none
    # the learning curves are demo-1's and demo-2's, read back from their event files
    for tag in TRAIN_TAGS:
        assert f">{tag.removeprefix('train/')}<" in page, tag


def test_without_any_training_events_the_report_says_so(tmp_path: Path) -> None:
    summary = reportdata.summary(tmp_path, with_events=False)
    page = report.write_report(tmp_path, summary).read_text()
    assert "learning curves" not in page
    assert page.count("no training events for demo-1, demo-2, demo-3") == 1


def test_forest_plots_share_one_axis(built: tuple[Path, dict[str, Any], str]) -> None:
    _, _, page = built
    forests = re.findall(
        r'aria-label="(?:cycle \d, final look|head-to-head)[^"]*".*?</svg>', page, re.S
    )
    assert len(forests) == 4
    ticks = [re.findall(r">([-+]?\d+%)<", f) for f in forests]
    assert all(t == ticks[0] for t in ticks) and ticks[0], ticks


CASES = [
    ("Superseded", "promote"),
    ("Promoted", "promote"),
    ("RolledBack", "rollback"),
    ("Rejected", None),
    ("Canary", "continue"),
]


@pytest.mark.parametrize(("phase", "decision"), CASES)
def test_console_and_report_word_and_colour_an_outcome_alike(
    phase: str, decision: str | None
) -> None:
    words = outcome_text(phase, decision)
    assert console.shown(phase, decision, color=False) == words
    assert console.shown(phase, decision, color=True) == outcome_ansi(phase, decision)
    badge = report.badge(phase, decision)
    assert f'data-outcome="{html.escape(words)}"' in badge
    for p in words.split(", later "):
        assert f'data-phase="{p}" style="background:{style(p).hex}"' in badge
        assert (
            f"\x1b[{style(p).ansi}m{p}\x1b[0m" in outcome_ansi(phase, decision)
            or style(p).ansi == "0"
        )


def test_promoted_then_superseded_reads_so_everywhere(
    built: tuple[Path, dict[str, Any], str],
) -> None:
    """Cycle 1 was promoted, then cycle 2's promotion superseded it: the console's summary
    and the report both say so, and its decision is Promoted's colour, not RolledBack's."""
    _, summary, page = built
    assert outcome_text("Superseded", "promote") == "Promoted, later Superseded"
    assert style("Promoted").hex != style("RolledBack").hex
    row = re.search(r'<tr data-checkpoint="demo-1">.*?</tr>', page, re.S)
    assert row and 'data-outcome="Promoted, later Superseded"' in row.group(0)
    text = console.final_summary(summary, "report.html")
    assert "demo-1 vs demo-0  Promoted, later Superseded" in text
    assert "demo-3 vs demo-2  RolledBack" in text
    assert "clarification_rate +97.5% [+50.0%, +320.0%] tripped" in text
    assert "report: report.html" in text


def test_serving_ticks_print_a_line_only_with_verbose_or_when_they_fail(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for verbose, ok, printed in ((False, True, False), (True, True, True), (False, False, True)):
        progress = console.Progress(quiet=True, verbose=verbose)
        progress.done("06:00 serve demo-0", "serve", 1.5, ok)
        progress.done("08:00 stage demo-1-stage-0", "stage", 3.1, True)
        lines = capsys.readouterr().err.splitlines()
        assert any("serve demo-0" in x for x in lines) == printed, (verbose, ok, lines)
        assert any("stage demo-1-stage-0" in x for x in lines)


def test_a_report_of_a_failed_cycle_lays_out_every_plot(tmp_path: Path) -> None:
    """The report of a demo that lost its training (one checkpoint, nothing canaried): its
    plots still render without overlapping labels (the answer mix's title once overlapped
    its first panel's "all tasks" when only one checkpoint had answers)."""
    summary = reportdata.failed_summary(tmp_path)
    path = report.write_report(tmp_path, summary)
    facts = render(path, tmp_path / "failed.png")
    plots = check_plots(facts, ["answer mix per checkpoint", "lineage"])
    assert plots
