"""The report's interval plots: each cycle's final look as a forest plot (one axis shared by
every cycle and the head-to-head, guardrail bands drawn), each metric's confidence sequence
over the looks (how a guardrail walked toward tripping), and the eval gates."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

from rtrl.abtable import NA, Cells, band, cells, field, finite, number, percent
from rtrl.core.api.checkpoint import CheckpointPhase
from rtrl.phasestyle import outcome, outcome_text

from .report_svg import colour, figure, hours_axis, percent_axis, svg, when

BAND = "#2ca02c"  # a guardrail's tolerated change, shaded
VERDICTS = {
    "better": CheckpointPhase.PROMOTED,
    "worse": CheckpointPhase.ROLLED_BACK,
    "tripped": CheckpointPhase.ROLLED_BACK,
    "beyond": CheckpointPhase.CANARY,
}


def verdict_colour(verdict: str) -> str:
    """A verdict in the colour of the decision it pushes toward (better: promote...)."""
    return colour(VERDICTS.get(verdict))


@dataclass(frozen=True)
class Row:
    """A metric's relative change and interval (None: n/a, or an old status row's absolute
    numbers, shown as text only), its cells and its guardrail band."""

    label: str
    cells: Cells
    rel: float | None
    lo: float | None
    hi: float | None
    band: tuple[float | None, float | None] | None

    @property
    def text(self) -> str:
        c = self.cells
        if c.absolute:
            return "absolute difference only (see the table)"
        if c.change == c.interval == NA:
            return f"{NA} {c.verdict}"
        return f"{c.change} {c.interval} {c.verdict}"


def row(m: dict[str, Any], label: str | None = None) -> Row:
    shown = cells(m)
    keys = () if shown.absolute else ("relative_difference", "relative_ci_low", "relative_ci_high")
    rel, lo, hi = [finite(field(m, k)) for k in keys] or [None, None, None]
    if lo is None or hi is None:
        lo = hi = None
    return Row(label or shown.metric, shown, rel, lo, hi, band(m))


def _nice(v: float) -> float:
    """The smallest of 1, 2, 2.5, 5 times a power of ten that is at least ``v``."""
    e = 10.0 ** math.floor(math.log10(v))
    return next(f * e for f in (1, 2, 2.5, 5, 10) if f * e >= v * (1 - 1e-9))


# An interval bound more than this many times the larger of the largest estimate (or band
# edge) and the median bound is drawn to the axis' edge with an arrow and its value, so that
# one huge interval (a rare event's rate) does not flatten every other.
OUTLIER = 3.0


def axis(rows: list[Row]) -> tuple[float, float]:
    """One axis for a set of forest plots, from all their rows: it holds every estimate,
    every band edge and every interval bound but the outliers. A relative change is above
    -100%, so the axis does not reach further left."""
    core = [0.05]
    bounds = []
    for r in rows:
        if r.rel is not None:
            core.append(abs(r.rel))
        core += [abs(v) for v in r.band or () if v is not None]
        bounds += [abs(v) for v in (r.lo, r.hi) if v is not None]
    ref = max(*core, statistics.median(bounds) if bounds else 0.0)
    span = _nice(max(core + [b for b in bounds if b <= OUTLIER * ref]))
    return -min(span, 1.0), span


def _band(ax: Any, b: tuple[float | None, float | None], lo: float, hi: float, y: Any) -> None:
    drop, rise = b
    a = -drop if drop is not None else lo
    z = rise if rise is not None else hi
    if y is None:
        ax.axhspan(a, z, color=BAND, alpha=0.12, lw=0)
    else:
        ax.fill_betweenx([y - 0.38, y + 0.38], a, z, color=BAND, alpha=0.12, lw=0)
    for edge in (-drop if drop is not None else None, rise):
        if edge is not None:
            if y is None:
                ax.axhline(edge, color=BAND, ls="--", lw=0.8)
            else:
                ax.vlines(edge, y - 0.4, y + 0.4, color=BAND, ls="--", lw=0.8)


def forest(title: str, rows: list[Row], span: tuple[float, float]) -> str:
    """Relative change with its always-valid interval, one row per metric, on ``span``
    (shared by the plots it is compared with). An interval beyond the axis ends in an arrow
    labelled with its bound."""
    left, right = span
    clipped = False
    with figure(8.6, 0.8 + 0.32 * len(rows)) as (fig, ax):
        ax.set_xlim(left, right)
        ax.set_ylim(len(rows) - 0.5, -0.5)
        ax.axvline(0, color="#555", ls="--", lw=0.8)
        for y, r in enumerate(rows):
            c = verdict_colour(r.cells.verdict)
            if r.band is not None:
                _band(ax, r.band, left, right, y)
            if r.lo is not None and r.hi is not None:
                ax.hlines(y, max(r.lo, left), min(r.hi, right), color=c, lw=3)
                for bound, edge, ha, mark in (
                    (r.lo, left, "left", "<"),
                    (r.hi, right, "right", ">"),
                ):
                    if (bound < edge) if ha == "left" else (bound > edge):
                        clipped = True
                        ax.plot([edge], [y], marker=mark, color=c, ms=7, clip_on=False)
                        ax.annotate(
                            percent(bound),
                            (edge, y),
                            xytext=(0, 5),
                            ha=ha,
                            textcoords="offset points",
                            fontsize=7,
                            color=c,
                        )
            if r.rel is not None:
                ax.plot([max(left, min(right, r.rel))], [y], "o", color=c, ms=5)
            ax.text(
                1.02,
                y,
                r.text,
                transform=ax.get_yaxis_transform(),
                va="center",
                fontsize=8,
                color=c,
            )
        ax.set_yticks(range(len(rows)), [r.label for r in rows])
        ax.grid(axis="y", visible=False)
        percent_axis(ax.xaxis)
        label = "relative change, new vs old (95% always-valid interval)"
        if any(r.band is not None for r in rows):
            label += "; shaded: the guardrail's band"
        if clipped:
            label += "\narrow: the interval runs beyond the axis, to the bound written at its end"
        ax.set_xlabel(label)
        ax.set_title(title, loc="left")
        return svg(fig, title)


def sequence(name: str, cycles: list[dict[str, Any]]) -> str | None:
    """One metric's confidence sequence: its relative change and always-valid interval at
    every look of every cycle, over simulated time, with the 0 line and the guardrail's band
    (a guardrail's walk toward tripping, an effect's toward significance). None when no look
    has the metric."""
    kind, drawn = "", False
    bands: list[tuple[float | None, float | None]] = []
    with figure(6.4, 2.9) as (fig, ax):
        times = []
        for c in cycles:
            pts = []
            for look in c.get("looks") or []:
                at = when(look.get("now"))
                for m in look.get("metrics") or []:
                    if m.get("name") == name:
                        kind = kind or str(m.get("kind") or "")
                        if (b := band(m)) is not None:
                            bands.append(b)
                        r = row(m)
                        if at is not None and r.rel is not None and r.lo is not None:
                            pts.append((at, r))
            if not pts:
                continue
            drawn = True
            decided = outcome(c.get("phase"), c.get("decision"))[0]
            col = colour(decided)
            xs = [p[0] for p in pts]
            times += xs
            los = [p[1].lo for p in pts]
            his = [p[1].hi for p in pts]
            rels = [p[1].rel for p in pts]
            words = outcome_text(c.get("phase"), c.get("decision"))
            label = f"cycle {c.get('cycle')} {c.get('checkpoint')}: {words}"
            if len(pts) > 1:
                ax.fill_between(xs, los, his, color=col, alpha=0.15, lw=0)
            ax.vlines(xs, los, his, color=col, lw=2)
            ax.plot(xs, rels, "-o", color=col, ms=4, label=label)
        if not drawn:
            return None
        ax.axhline(0, color="#555", ls="--", lw=0.8)
        if bands:  # shaded to the edges of what the data (and the band's edges) need
            edges = [-v if i == 0 else v for i, v in enumerate(bands[0]) if v is not None]
            lo_y, hi_y = ax.get_ylim()
            lo_y, hi_y = min([lo_y, *edges]), max([hi_y, *edges])
            ax.set_ylim(lo_y, hi_y)
            _band(ax, bands[0], lo_y, hi_y, None)
        lo_t, hi_t = min(times), max(times)
        from datetime import timedelta

        pad = max((hi_t - lo_t) * 0.05, timedelta(minutes=30))
        ax.set_xlim(lo_t - pad, hi_t + pad)
        hours_axis(ax)
        percent_axis(ax.yaxis)
        ax.set_ylabel("relative change")
        what = f"{name} ({kind})" if kind else name
        title = f"{what}: estimate and always-valid interval at each look"
        if bands:
            title += "; shaded: the guardrail's band"
        ax.set_title(what, loc="left")
        fig.legend(loc="outside lower center", ncols=3, fontsize=7)
        return svg(fig, title)


def gates(cycles: list[dict[str, Any]], spec: list[dict[str, Any]]) -> str | None:
    """Each cycle's eval gates: candidate minus parent with its bootstrap interval, coloured
    passed (as Promoted) or failed (as Rejected). None when no cycle has gate results."""
    limits = {str(g.get("metric")): g.get("maxRegression") for g in spec}
    rows = [
        (c, g)
        for c in cycles
        for g in ((c.get("eval") or {}).get("gates") or [])
        if finite(g.get("candidate")) is not None and finite(g.get("parent")) is not None
    ]
    if not rows:
        return None
    with figure(8.6, 0.9 + 0.32 * len(rows)) as (fig, ax):
        ax.set_ylim(len(rows) - 0.5, -0.5)
        ax.axvline(0, color="#555", ls="--", lw=0.8)
        for y, (_, g) in enumerate(rows):
            metric = str(g.get("metric"))
            col = colour(CheckpointPhase.PROMOTED if g.get("passed") else CheckpointPhase.REJECTED)
            diff = float(g["candidate"]) - float(g["parent"])
            lo, hi = (
                finite(g.get("ciLow", g.get("ci_low"))),
                finite(g.get("ciHigh", g.get("ci_high"))),
            )
            if lo is not None and hi is not None:
                ax.hlines(y, lo, hi, color=col, lw=3)
            ax.plot([diff], [y], "o", color=col, ms=5)
            limit = limits.get(metric)
            text = (
                f"{number(g['candidate'], metric)} vs {number(g['parent'], metric)}: "
                f"{'passed' if g.get('passed') else 'failed'}"
                + (f" (max regression {lim:g})" if (lim := finite(limit)) is not None else "")
            )
            ax.text(
                1.02,
                y,
                text,
                transform=ax.get_yaxis_transform(),
                va="center",
                fontsize=8,
                color=col,
            )
        ax.set_yticks(
            range(len(rows)), [f"{c.get('checkpoint')} {g.get('metric')}" for c, g in rows]
        )
        ax.grid(axis="y", visible=False)
        from .report_svg import plain

        plain(ax.xaxis, "difference")
        ax.set_xlabel("candidate minus parent (the metric's units), bootstrap interval")
        title = "eval gates: candidate vs parent"
        ax.set_title(title, loc="left")
        return svg(fig, title)
