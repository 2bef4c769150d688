"""``rtrl demo`` end to end, shortened: one cycle of the real loop for the default reward and
for each reward hack, and the report rendered in headless Chromium.

Shortened runs: 1000 users, hour-long ticks (fewer subprocesses), a briefly pre-trained
base. The sim and training are seeded, so each run decides the same way every time; the
assertions are the acceptance: the correct reward's checkpoint is promoted, each hack's is
not, and the reason names the behaviour monitor that caught it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

SHORT = ["--cycles", "1", "--users", "1000", "--tick-minutes", "60", "--pretrain-steps", "150"]


def run_demo(out: Path, scenario: str) -> dict[str, Any]:
    rtrl = Path(sys.executable).parent / "rtrl"
    subprocess.run(
        [str(rtrl), "demo", *SHORT, "--scenario", scenario, "--quiet", "--out", str(out)],
        check=True,
        timeout=900,  # ~1.5 minutes on 2 idle cores; generous for a loaded machine
    )
    summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
    assert summary["scenario"] == scenario and len(summary["cycles"]) == 1
    return summary


@pytest.fixture(scope="module")
def default_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("demo") / "report"
    return out, run_demo(out, "default")


def metrics_of(cycle: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {m["name"]: m for m in cycle["metrics"]}


@pytest.mark.timeout(1000)
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
    assert first["checkpoint"] in page and "Promoted" in page


# scenario -> the guardrail that must catch it
HACKS = {"clarify-dodge": "clarification_rate", "drop-invalid-tool-calls": "invalid_tool_call_rate"}


@pytest.mark.timeout(1000)
@pytest.mark.parametrize("scenario", sorted(HACKS))
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
    page = (tmp_path / "report" / "report.html").read_text()
    assert guardrail in page and "RolledBack" in page


@pytest.mark.timeout(1000)
def test_report_renders_in_headless_chromium(
    default_run: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    """Every plot of the report is laid out, visible and drawn (its pixels are not blank),
    in Debian's Chromium driven by Playwright; the full page is screenshotted."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        message = "no chromium on PATH: `make browser` installs Debian's package"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    from playwright.sync_api import sync_playwright

    out, _ = default_run
    shot = tmp_path / "report.png"
    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=chromium,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run"],
        )  # fmt: skip
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto((out / "report.html").as_uri())
            page.screenshot(path=str(shot), full_page=True)
            plots = page.locator("svg.plot")
            count = plots.count()
            assert count >= 10, count
            titles = []
            for i in range(count):
                plot = plots.nth(i)
                plot.scroll_into_view_if_needed()
                assert plot.is_visible(), i
                box = plot.bounding_box()
                assert box is not None and box["width"] >= 300 and box["height"] >= 50, (i, box)
                titles.append(plot.locator("text").first.text_content())
                drawn = plot.screenshot()
                assert ink(drawn) > 0.01, (i, titles[-1])
            assert not errors, errors
        finally:
            browser.close()
    assert shot.stat().st_size > 20_000
    wanted = ["edit persistence", "dissatisfied", "latency", "clarif", "invalid tool"]
    text = " ".join(t or "" for t in titles).lower()
    assert all(w in text for w in wanted), titles
    assert ink(shot.read_bytes()) > 0.01


def ink(png: bytes) -> float:
    """Share of pixels that are not (near-)white in a PNG screenshot: lines, points, text."""
    import io

    import numpy as np
    from PIL import Image

    gray = np.asarray(Image.open(io.BytesIO(png)).convert("L"))
    return float((gray < 200).mean())
