"""The report's plots as inline SVG: matplotlib figures (Agg, no pyplot state) saved as SVG
with text kept as text, their ids made unique per plot so that many can share one HTML page,
and the axis formatters every plot uses (plain numbers, never ``1.33e+03``; percentages).
"""

from __future__ import annotations

import io
import itertools
import re
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any

import matplotlib

matplotlib.use("Agg")

from matplotlib.figure import Figure
from matplotlib.ticker import Formatter, FuncFormatter, ScalarFormatter

from rtrl.abtable import number
from rtrl.phasestyle import style

STYLE: Any = {
    "svg.fonttype": "none",  # text stays <text>: smaller, selectable, searchable
    "font.family": "sans-serif",
    "font.size": 9,
    "axes.titlesize": 10,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "axes.axisbelow": True,
    "grid.color": "#e6e6e6",
    "legend.fontsize": 8,
    "legend.frameon": False,
}
_ids = itertools.count(1)
_ID = re.compile(r'id="([^"]+)"')
_METADATA = re.compile(r"\s*<metadata>.*?</metadata>", re.S)


@contextmanager
def figure(width: float, height: float, **subplots: Any) -> Iterator[tuple[Figure, Any]]:
    """A figure of ``width`` x ``height`` inches and its axes (``subplots`` as for
    ``Figure.subplots``), in the report's style, laid out so that no labels overlap."""
    with matplotlib.rc_context(STYLE):
        fig = Figure(figsize=(width, height), layout="constrained")
        axes = fig.subplots(**subplots)
        yield fig, axes


def svg(fig: Figure, title: str) -> str:
    """The figure as an ``<svg class="plot">`` element, its ids unique on the page and its
    title as the first text (a screen reader's and a test's handle)."""
    with matplotlib.rc_context(STYLE):
        buf = io.StringIO()
        fig.savefig(buf, format="svg")
    text = buf.getvalue()
    text = _METADATA.sub("", text[text.index("<svg") :])  # a date and a licence, no plot
    prefix = f"p{next(_ids)}-"
    for old in sorted(set(_ID.findall(text)), key=len, reverse=True):
        text = text.replace(f'id="{old}"', f'id="{prefix}{old}"')
        text = text.replace(f"#{old})", f"#{prefix}{old})").replace(
            f'"#{old}"', f'"#{prefix}{old}"'
        )
    safe = title.replace("&", "&amp;").replace("<", "&lt;")
    return text.replace("<svg ", f'<svg class="plot" role="img" aria-label="{safe}" ', 1).replace(
        ">", f"><title>{safe}</title>", 1
    )


def plain(axis: Any, metric: str = "") -> None:
    """Tick labels in fixed notation as the A/B table writes ``metric`` (no exponent, no
    offset)."""
    axis.set_major_formatter(FuncFormatter(lambda v, _: number(v, metric)))


def plain_scalar(axis: Any) -> None:
    fmt = ScalarFormatter(useOffset=False)
    fmt.set_scientific(False)
    axis.set_major_formatter(fmt)


class Percent(Formatter):
    """Tick labels of a share or relative change: ``+20%``, ``0%``, every tick of an axis
    with as many decimals as the finest of them needs (``-2.5%`` and ``-5.0%``)."""

    def __init__(self, signed: bool) -> None:
        self.signed = signed
        self.places = 0

    def format_ticks(self, values: Any) -> list[str]:
        self.places = next(
            (
                p
                for p in range(4)
                if all(abs(100 * v * 10**p - round(100 * v * 10**p)) < 1e-6 for v in values)
            ),
            4,
        )
        return [self(v) for v in values]

    def __call__(self, x: float, pos: Any = None) -> str:
        if abs(x) < 1e-12:
            return "0%"
        return f"{100 * x:{'+' if self.signed else ''}.{self.places}f}%"


def percent_axis(axis: Any, signed: bool = True) -> None:
    axis.set_major_formatter(Percent(signed))


def colour(phase: str | None) -> str:
    return style(phase).hex


def when(text: Any) -> datetime | None:
    if not isinstance(text, str) or not text:
        return None
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def hours_axis(ax: Any) -> None:
    """A time axis of simulated clock times, ``HH:MM``."""
    from matplotlib.dates import AutoDateLocator, DateFormatter

    ax.xaxis.set_major_locator(AutoDateLocator(minticks=3, maxticks=8))  # type: ignore[no-untyped-call]
    ax.xaxis.set_major_formatter(DateFormatter("%H:%M"))  # type: ignore[no-untyped-call]
    ax.set_xlabel("simulated time (UTC)")
