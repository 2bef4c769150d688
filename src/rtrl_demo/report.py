# ruff: noqa: E501  (HTML and SVG templates read better unwrapped)
"""``demo-report/report.html``: one self-contained page, plots drawn as inline SVG."""

from __future__ import annotations

import html
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rtrl.abtable import ABSOLUTE_NOTE, NA, Cells, band, cells, field, finite, number, percent

W, H, PAD = 360, 180, 36


COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd")


def _line_svg(
    title: str, labels: list[str], series: dict[str, list[float | None]], metric: str = ""
) -> str:
    """One plot, one polyline per series (a legend when there are several); points are
    labelled as the A/B table writes ``metric``'s values."""
    values = [v for vs in series.values() for v in vs if v is not None]
    parts = [f'<svg class="plot" width="{W}" height="{H}" viewBox="0 0 {W} {H}" role="img">']
    parts.append(f'<text x="{PAD}" y="14" font-size="12">{html.escape(title)}</text>')
    if values:
        lo, hi = min(values), max(values)
        span = (hi - lo) or 1.0
        n = max(1, len(labels) - 1)

        def xy(i: int, v: float) -> tuple[float, float]:
            return PAD + (W - 2 * PAD) * i / n, H - PAD - (H - 2 * PAD - 10) * (v - lo) / span

        for k, (name, vs) in enumerate(series.items()):
            color = COLORS[k % len(COLORS)]
            points = [(i, v) for i, v in enumerate(vs) if v is not None]
            coords = " ".join(f"{x:.1f},{y:.1f}" for x, y in (xy(i, v) for i, v in points))
            parts.append(
                f'<polyline fill="none" stroke="{color}" stroke-width="2" points="{coords}"/>'
            )
            for i, v in points:
                x, y = xy(i, v)
                parts.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{color}"/>')
                parts.append(
                    f'<text x="{x:.1f}" y="{y - 6:.1f}" font-size="10" text-anchor="middle">{number(v, metric)}</text>'
                )
            if len(series) > 1:
                parts.append(
                    f'<text x="{W - PAD}" y="{14 + 12 * k}" font-size="10" text-anchor="end" fill="{color}">{html.escape(name)}</text>'
                )
    for i, label in enumerate(labels):
        x = PAD + (W - 2 * PAD) * i / max(1, len(labels) - 1)
        parts.append(
            f'<text x="{x:.1f}" y="{H - 10}" font-size="10" text-anchor="middle">{html.escape(label)}</text>'
        )
    parts.append(f'<line x1="{PAD}" y1="{H - PAD}" x2="{W - PAD}" y2="{H - PAD}" stroke="#999"/>')
    parts.append("</svg>")
    return "".join(parts)


@dataclass(frozen=True)
class _Forest:
    """One row of a forest plot: a metric's relative change and interval (None: n/a or an
    old status row's absolute numbers, shown as text only), its cells, its band."""

    label: str
    cells: Cells
    rel: float | None
    lo: float | None
    hi: float | None
    band: tuple[float | None, float | None] | None

    @property
    def text(self) -> str:
        if self.cells.absolute:
            return "absolute difference only (see the table)"
        c = self.cells
        if c.change == c.interval == NA:
            return f"{NA} {c.verdict}"
        return f"{c.change} {c.interval} {c.verdict}"


def _forest_row(m: dict[str, Any], label: str | None = None) -> _Forest:
    shown = cells(m)
    keys = () if shown.absolute else ("relative_difference", "relative_ci_low", "relative_ci_high")
    rel, lo, hi = [finite(field(m, k)) for k in keys] or [None, None, None]
    if lo is None or hi is None:
        lo = hi = None
    return _Forest(label or shown.metric, shown, rel, lo, hi, band(m))


def _nice(v: float) -> float:
    """The smallest of 1, 2, 2.5, 5 times a power of ten that is at least ``v``."""
    e = 10.0 ** math.floor(math.log10(v))
    return next(f * e for f in (1, 2, 2.5, 5, 10) if f * e >= v * (1 - 1e-9))


# An interval bound more than this many times the larger of the largest estimate (or band
# edge) and the median bound is drawn to the axis' edge with an arrow and its value, so that
# one huge interval (a rare event's rate) does not flatten every other.
OUTLIER = 3.0


def _axis(rows: list[_Forest]) -> tuple[float, float]:
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


def _tick(v: float) -> str:
    return "0%" if v == 0 else f"{100 * v:+g}%"


VERDICT_COLORS = {"better": "#2ca02c", "worse": "#d62728", "tripped": "#d62728", "beyond": "#e08000"}  # fmt: skip


def _ci_svg(title: str, rows: list[_Forest], axis: tuple[float, float]) -> str:
    """Relative change with its always-valid interval, one row per metric, on ``axis``
    (shared by the plots it is compared with). Guardrail bands are shaded; an interval that
    runs beyond the axis ends in an arrow labelled with its bound."""
    left_v, right_v = axis
    left, right, label_x, width = 200, 540, 552, 820
    top = 26
    rows_end = top + 22 * len(rows)

    def x(v: float) -> float:
        v = max(left_v, min(right_v, v))
        return left + (right - left) * (v - left_v) / (right_v - left_v)

    clipped = False
    body: list[str] = []
    for k, r in enumerate(rows):
        y = top + 12 + 22 * k
        color = VERDICT_COLORS.get(r.cells.verdict, "#555")
        if r.band is not None:
            drop, rise = r.band
            a = -drop if drop is not None else left_v
            b = rise if rise is not None else right_v
            body.append(
                f'<rect x="{x(a):.1f}" y="{y - 8}" width="{x(b) - x(a):.1f}" height="16" fill="#2ca02c" fill-opacity="0.12"/>'
            )
            for edge in (-drop if drop is not None else None, rise):
                if edge is not None:
                    body.append(
                        f'<line x1="{x(edge):.1f}" y1="{y - 9}" x2="{x(edge):.1f}" y2="{y + 9}" stroke="#2ca02c" stroke-dasharray="2"/>'
                    )
        body.append(f'<text x="4" y="{y + 4}" font-size="11">{html.escape(r.label)}</text>')
        body.append(
            f'<text x="{label_x}" y="{y + 4}" font-size="11" fill="{color}">{html.escape(r.text)}</text>'
        )
        if r.lo is not None and r.hi is not None:
            body.append(
                f'<line x1="{x(r.lo):.1f}" y1="{y}" x2="{x(r.hi):.1f}" y2="{y}" stroke="{color}" stroke-width="3"/>'
            )
            if r.lo < left_v:
                clipped = True
                body.append(
                    f'<polygon points="{left - 7},{y} {left},{y - 5} {left},{y + 5}" fill="{color}"/>'
                )
                body.append(
                    f'<text x="{left + 2}" y="{y - 5}" font-size="9" fill="{color}">&#8592; {html.escape(percent(r.lo))}</text>'
                )
            if r.hi > right_v:
                clipped = True
                body.append(
                    f'<polygon points="{right + 7},{y} {right},{y - 5} {right},{y + 5}" fill="{color}"/>'
                )
                body.append(
                    f'<text x="{right - 2}" y="{y - 5}" font-size="9" text-anchor="end" fill="{color}">{html.escape(percent(r.hi))} &#8594;</text>'
                )
        if r.rel is not None:
            body.append(f'<circle cx="{x(r.rel):.1f}" cy="{y}" r="4" fill="{color}"/>')
    notes = [f"axis {_tick(left_v)} to {_tick(right_v)}, the same in every plot of its kind"]
    if any(r.band is not None for r in rows):
        notes.append("shaded: the guardrail's band (the change it tolerates)")
    if clipped:
        notes.append("arrow: the interval runs beyond the axis, to the bound written at its end")
    h = rows_end + 18 + 13 * len(notes)
    parts = [
        f'<svg class="plot" width="{width}" height="{h}" viewBox="0 0 {width} {h}" role="img">',
        f'<text x="4" y="14" font-size="12">{html.escape(title)}</text>',
    ]
    ticks = sorted({left_v, left_v / 2, 0.0, right_v / 2, right_v})
    for v in ticks:
        style = 'stroke="#999" stroke-dasharray="3"' if v == 0 else 'stroke="#e4e4e4"'
        parts.append(
            f'<line x1="{x(v):.1f}" y1="{top - 4}" x2="{x(v):.1f}" y2="{rows_end}" {style}/>'
        )
        parts.append(
            f'<text x="{x(v):.1f}" y="{rows_end + 12}" font-size="9" text-anchor="middle">{_tick(v)}</text>'
        )
    parts += body
    for i, note in enumerate(notes):
        parts.append(
            f'<text x="4" y="{rows_end + 26 + 13 * i}" font-size="10" fill="#555">{html.escape(note)}</text>'
        )
    parts.append("</svg>")
    return "".join(parts)


def _metric(c: dict[str, Any], name: str, arm: str) -> float | None:
    for m in c.get("metrics") or []:
        if m.get("name") == name and m.get(arm) is not None:
            return float(m[arm])
    return None


def _table(metrics: list[dict[str, Any]]) -> str:
    rows = []
    for m in metrics:
        c = cells(m)
        verdict = html.escape(c.verdict)
        rows.append(
            f"<tr><td>{html.escape(c.metric)}</td><td>{html.escape(str(m.get('kind') or ''))}</td>"
            f"<td>{html.escape(c.old)}</td><td>{html.escape(c.new)}</td>"
            f"<td>{html.escape(c.change)}</td><td>{html.escape(c.interval)}</td>"
            f'<td class="v-{verdict}">{verdict}</td></tr>'
        )
    head = "".join(f"<th>{h}</th>" for h in ("metric", "role", "old", "new", "change", "always-valid CI", "verdict"))  # fmt: skip
    note = f'<p class="note">{html.escape(ABSOLUTE_NOTE)}</p>' if any(cells(m).absolute for m in metrics) else ""  # fmt: skip
    return f"<table><tr>{head}</tr>{''.join(rows)}</table>{note}"


def _ci_rows(metrics: list[dict[str, Any]]) -> list[_Forest]:
    return [_forest_row(m) for m in metrics]


def _look_rows(c: dict[str, Any]) -> list[_Forest]:
    """Edit persistence at each look of one cycle."""
    rows = []
    for k, look in enumerate(c.get("looks") or []):
        for m in look.get("metrics") or []:
            if m.get("name") == "edit_persistence":
                rows.append(_forest_row(m, f"look {k + 1} (n={look.get('canary_samples')})"))
    return rows


def write_report(out: Path, summary: dict[str, Any]) -> Path:
    cycles = summary.get("cycles") or []
    labels = [f"cycle {c.get('cycle') or i + 1}" for i, c in enumerate(cycles)]
    plots = []
    # The A/B test of each cycle: the old (serving) and new (canary) arm, final look.
    for name, title in (
        ("edit_persistence", "edit persistence (goal)"),
        ("dissatisfied_followup_rate", "dissatisfied follow-up rate (goal)"),
        ("latency_ms", "latency, ms (goal)"),
        ("clarification_rate", "clarifying-question rate (guardrail)"),
        ("invalid_tool_call_rate", "invalid tool-call rate (guardrail)"),
    ):
        series = {
            arm: [_metric(c, name, key) for c in cycles]
            for arm, key in (("old", "baseline"), ("new", "canary"))
        }
        plots.append(_line_svg(f"{title}: A/B arms", labels, series, name))
    # What the stage step measured on the serving checkpoint's data at each cycle's start.
    staged = [(c.get("monitors") or {}) for c in cycles]
    plots.append(
        _line_svg(
            "mean reward of the staged data",
            labels,
            {"reward": [((s.get("reward") or {}).get("mean")) for s in staged]},
            "reward",
        )
    )
    for name in (
        "edit_rate",
        "clarification_rate",
        "invalid_tool_call_rate",
        "mean_completion_tokens",
    ):
        values = [(s.get("monitors") or {}).get(name) for s in staged]
        plots.append(_line_svg(f"{name} (stage monitor)", labels, {name: values}, name))
    kls = [(c.get("training") or {}).get("kl") for c in cycles]
    plots.append(_line_svg("KL to parent (training, last step)", labels, {"kl": kls}, "kl"))
    h2h = summary.get("head_to_head") or {}
    # One scale for every cycle's final look and the head-to-head, one for the looks.
    final_rows = [r for c in cycles for r in _ci_rows(c.get("metrics") or [])]
    final_axis = _axis(final_rows + _ci_rows(h2h.get("metrics") or []))
    look_axis = _axis([r for c in cycles for r in _look_rows(c)])
    sections = []
    for c in cycles:
        per_look = _look_rows(c)
        parts = [
            f"<section><h3>cycle {c.get('cycle')}: {html.escape(c['checkpoint'])} (new) vs {html.escape(str(c.get('parent')))} (old):"
            f' <span class="decision">{html.escape(str(c.get("phase")))}</span></h3>',
            f'<p class="reason">{html.escape(str(c.get("reason") or ""))}</p>',
            _table(c.get("metrics") or []),
        ]
        rows = _ci_rows(c.get("metrics") or [])
        if rows:
            parts.append(_ci_svg("final look: relative change, always-valid CI", rows, final_axis))
        if per_look:
            parts.append(_ci_svg("edit persistence at each look", per_look, look_axis))
        parts.append("</section>")
        sections.append("".join(parts))
    h2h_html = ""
    if h2h.get("metrics"):
        h2h_html = (
            f"<h2>Head-to-head: {html.escape(str(h2h.get('canary')))} (now serving) vs {html.escape(str(h2h.get('baseline')))} (base)</h2>"
            f"<p>Both served half the users for two simulated hours after the last cycle; {h2h.get('baseline_samples')}/{h2h.get('canary_samples')} interactions, the canary analysis's always-valid intervals.</p>"
            + _table(h2h["metrics"])
            + _ci_svg("relative change vs the base model", _ci_rows(h2h["metrics"]), final_axis)
        )
    doc = f"""<!doctype html><html><head><meta charset="utf-8"><title>rtrl demo report</title>
<style>body{{font-family:sans-serif;max-width:1100px;margin:2em auto}}svg.plot{{border:1px solid #ddd;margin:4px}}
table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;padding:2px 8px}}.decision{{color:#06c}}
.v-better{{color:#2ca02c}}.v-worse,.v-tripped{{color:#d62728;font-weight:bold}}.v-beyond{{color:#e08000;font-weight:bold}}</style></head>
<body><h1>rtrl demo: {html.escape(str(summary.get("scenario")))}</h1>
<p>{html.escape(str(summary.get("scenario_description")))}. {summary.get("users")} simulated users,
{len(cycles)} cycle(s), {summary.get("simulated_hours")} simulated hours, {summary.get("wall_seconds")} s wall.
Final serving checkpoint: <b>{html.escape(str(summary.get("serving")))}</b>.</p>
<h2>Per cycle</h2><div id="plots">{"".join(plots)}</div>
{h2h_html}
<h2>Canary A/B</h2>{"".join(sections)}
</body></html>"""
    path = out / "report.html"
    path.write_text(doc, encoding="utf-8")
    return path
