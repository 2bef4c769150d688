"""The demo report in headless Chromium (Debian's /usr/bin/chromium, driven by Playwright):
every plot laid out, drawn (axes, paths, pixels that are not blank) and free of labels
drawn over each other; the full page screenshotted."""

from __future__ import annotations

import io
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]  # fmt: skip

# Per plot: its title, size, how many axes and paths its SVG has, the pairs of its text
# labels whose boxes overlap by more than a third of the smaller one, and the labels that
# run out of the plot (cut off).
PLOTS_JS = """() => [...document.querySelectorAll('svg.plot')].map(svg => {
  const texts = [...svg.querySelectorAll('text')].filter(t => t.textContent.trim())
    .map(t => ({t: t.textContent.trim(), r: t.getBoundingClientRect()}));
  const overlaps = [];
  for (let i = 0; i < texts.length; i++) for (let j = i + 1; j < texts.length; j++) {
    const a = texts[i].r, b = texts[j].r;
    const w = Math.min(a.right, b.right) - Math.max(a.left, b.left);
    const h = Math.min(a.bottom, b.bottom) - Math.max(a.top, b.top);
    const small = Math.min(a.width * a.height, b.width * b.height);
    if (w > 0 && h > 0 && small > 0 && w * h > small / 3) overlaps.push([texts[i].t, texts[j].t]);
  }
  const box = svg.getBoundingClientRect();
  const cut = texts.filter(({r}) => r.left < box.left - 1 || r.right > box.right + 1
                                    || r.top < box.top - 1 || r.bottom > box.bottom + 1)
    .map(({t}) => t);
  return {title: svg.getAttribute('aria-label'), width: box.width, height: box.height,
          axes: svg.querySelectorAll('g[id*="axes_"]').length,
          paths: svg.querySelectorAll('path').length, overlaps, cut};
})"""


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        message = "no chromium on PATH: `make browser` installs Debian's package"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return found


def render(report: Path, shot: Path) -> list[dict[str, Any]]:
    """Open ``report``, screenshot the full page to ``shot`` and each plot next to it
    (``<shot>-NN.png``); every plot's facts (PLOTS_JS) with its ``ink`` (the share of its
    pixels that are not near-white) and ``spread`` (their standard deviation)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium(), args=ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(report.as_uri())
            page.screenshot(path=str(shot), full_page=True)
            facts: list[dict[str, Any]] = page.evaluate(PLOTS_JS)
            plots = page.locator("svg.plot")
            assert plots.count() == len(facts)
            for i, fact in enumerate(facts):
                plot = plots.nth(i)
                plot.scroll_into_view_if_needed()
                fact["visible"] = plot.is_visible()
                png = plot.screenshot()
                shot.with_name(f"{shot.stem}-{i:02d}.png").write_bytes(png)
                fact["ink"], fact["spread"] = ink(png)
            assert not errors, errors
        finally:
            browser.close()
    return facts


def ink(png: bytes) -> tuple[float, float]:
    """The share of pixels that are not (near-)white, and the pixels' standard deviation."""
    import numpy as np
    from PIL import Image

    gray = np.asarray(Image.open(io.BytesIO(png)).convert("L"))
    return float((gray < 200).mean()), float(gray.std())


def check_plots(facts: list[dict[str, Any]], wanted: list[str]) -> dict[str, dict[str, Any]]:
    """Each plot visible, of a readable size, with axes, drawn paths and pixels, and no
    overlapping or cut-off labels; every title in ``wanted`` (a substring) present. By
    title."""
    by_title = {str(f["title"]): f for f in facts}
    for f in facts:
        assert f["visible"], f
        assert f["width"] >= 300 and f["height"] >= 100, f
        assert f["axes"] >= 1 and f["paths"] >= 5, f
        assert f["ink"] > 0.01 and f["spread"] > 10, f
        assert not f["overlaps"], (f["title"], f["overlaps"])
        assert not f["cut"], (f["title"], f["cut"])
    for w in wanted:
        assert any(w in t for t in by_title), (w, sorted(by_title))
    return by_title
