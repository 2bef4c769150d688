# ruff: noqa: E501  (HTML and SVG templates read better unwrapped)
"""``demo-report/report.html``: one self-contained page, plots drawn as inline SVG."""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

W, H, PAD = 360, 180, 36


COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd")


def _line_svg(title: str, labels: list[str], series: dict[str, list[float | None]]) -> str:
    """One plot, one polyline per series (a legend when there are several)."""
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
                    f'<text x="{x:.1f}" y="{y - 6:.1f}" font-size="10" text-anchor="middle">{v:.3g}</text>'
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


def _ci_svg(title: str, rows: list[tuple[str, float, float, float, str]]) -> str:
    """Relative change with its always-valid interval, one row per metric."""
    h = 30 + 24 * len(rows)
    # at most +-200%: one huge interval (a rare event's rate) must not flatten the others;
    # longer ones are cut at the edge
    span = min(2.0, max([0.05, *(max(abs(lo), abs(hi)) for _, _, lo, hi, _ in rows)]))
    left, right = 190, W + 120 - 20
    parts = [
        f'<svg class="plot" width="{W + 120}" height="{h}" role="img">',
        f'<text x="4" y="14" font-size="12">{html.escape(title)}</text>',
    ]
    mid = (left + right) / 2

    def x(v: float) -> float:
        return mid + (right - left) / 2 * max(-1.0, min(1.0, v / span))

    parts.append(
        f'<line x1="{mid}" y1="20" x2="{mid}" y2="{h}" stroke="#999" stroke-dasharray="3"/>'
    )
    parts.append(
        f'<text x="{right}" y="14" font-size="10" text-anchor="end">scale: &#177;{span:.0%}</text>'
    )
    for k, (name, rel, lo, hi, verdict) in enumerate(rows):
        y = 34 + 24 * k
        color = {
            "better": "#2ca02c",
            "worse": "#d62728",
            "tripped": "#d62728",
            "beyond": "#e08000",
        }.get(verdict, "#555")
        parts.append(f'<text x="4" y="{y + 4}" font-size="11">{html.escape(name)}</text>')
        parts.append(
            f'<line x1="{x(lo):.1f}" y1="{y}" x2="{x(hi):.1f}" y2="{y}" stroke="{color}" stroke-width="3"/>'
        )
        parts.append(f'<circle cx="{x(rel):.1f}" cy="{y}" r="4" fill="{color}"/>')
    parts.append("</svg>")
    return "".join(parts)


def _rel(m: dict[str, Any]) -> tuple[float, float, float] | None:
    keys = [("relative_difference", "relative_ci_low", "relative_ci_high"),
            ("difference", "ciLow", "ciHigh")]  # fmt: skip
    for a, b, c in keys:
        if m.get(a) is not None and m.get(b) is not None and m.get(c) is not None:
            return float(m[a]), float(m[b]), float(m[c])
    return None


def _metric(c: dict[str, Any], name: str, arm: str) -> float | None:
    for m in c.get("metrics") or []:
        if m.get("name") == name and m.get(arm) is not None:
            return float(m[arm])
    return None


def _table(metrics: list[dict[str, Any]]) -> str:
    rows = []
    for m in metrics:
        rel = _rel(m)
        if rel is None:
            continue
        rows.append(
            f"<tr><td>{html.escape(str(m.get('name')))}</td><td>{html.escape(str(m.get('kind') or ''))}</td>"
            f"<td>{_fmt(m.get('baseline'))}</td><td>{_fmt(m.get('canary'))}</td>"
            f"<td>{rel[0]:+.1%}</td><td>[{rel[1]:+.1%}, {rel[2]:+.1%}]</td>"
            f'<td class="v-{html.escape(str(m.get("verdict") or ""))}">{html.escape(str(m.get("verdict") or ""))}</td></tr>'
        )
    head = "<tr><th>metric</th><th>role</th><th>old</th><th>new</th><th>change</th><th>always-valid CI</th><th>verdict</th></tr>"
    return f"<table>{head}{''.join(rows)}</table>"


def _fmt(x: Any) -> str:
    if x is None:
        return "n/a"
    return f"{float(x):.0f}" if abs(float(x)) >= 100 else f"{float(x):.3f}"


def _ci_rows(metrics: list[dict[str, Any]]) -> list[tuple[str, float, float, float, str]]:
    rows = []
    for m in metrics:
        rel = _rel(m)
        if rel is not None:
            rows.append((str(m.get("name")), *rel, str(m.get("verdict") or "")))
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
        plots.append(_line_svg(f"{title}: A/B arms", labels, series))
    # What the stage step measured on the serving checkpoint's data at each cycle's start.
    staged = [(c.get("monitors") or {}) for c in cycles]
    plots.append(
        _line_svg(
            "mean reward of the staged data",
            labels,
            {"reward": [((s.get("reward") or {}).get("mean")) for s in staged]},
        )
    )
    for name in (
        "edit_rate",
        "clarification_rate",
        "invalid_tool_call_rate",
        "mean_completion_tokens",
    ):
        values = [(s.get("monitors") or {}).get(name) for s in staged]
        plots.append(_line_svg(f"{name} (stage monitor)", labels, {name: values}))
    kls = [(c.get("training") or {}).get("kl") for c in cycles]
    plots.append(_line_svg("KL to parent (training, last step)", labels, {"kl": kls}))
    sections = []
    for c in cycles:
        looks = c.get("looks") or []
        per_look = []
        for k, look in enumerate(looks):
            for m in look.get("metrics") or []:
                rel = _rel(m)
                if m.get("name") == "edit_persistence" and rel is not None:
                    per_look.append(
                        (
                            f"look {k + 1} (n={look.get('canary_samples')})",
                            *rel,
                            str(m.get("verdict") or ""),
                        )
                    )
        parts = [
            f"<section><h3>cycle {c.get('cycle')}: {html.escape(c['checkpoint'])} (new) vs {html.escape(str(c.get('parent')))} (old):"
            f' <span class="decision">{html.escape(str(c.get("phase")))}</span></h3>',
            f'<p class="reason">{html.escape(str(c.get("reason") or ""))}</p>',
            _table(c.get("metrics") or []),
        ]
        rows = _ci_rows(c.get("metrics") or [])
        if rows:
            parts.append(_ci_svg("final look: relative change, always-valid CI", rows))
        if per_look:
            parts.append(_ci_svg("edit persistence at each look", per_look))
        parts.append("</section>")
        sections.append("".join(parts))
    h2h = summary.get("head_to_head") or {}
    h2h_html = ""
    if h2h.get("metrics"):
        h2h_html = (
            f"<h2>Head-to-head: {html.escape(str(h2h.get('canary')))} (now serving) vs {html.escape(str(h2h.get('baseline')))} (base)</h2>"
            f"<p>Both served half the users for two simulated hours after the last cycle; {h2h.get('baseline_samples')}/{h2h.get('canary_samples')} interactions, the canary analysis's always-valid intervals.</p>"
            + _table(h2h["metrics"])
            + _ci_svg("relative change vs the base model", _ci_rows(h2h["metrics"]))
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
    path.write_text(doc)
    return path
