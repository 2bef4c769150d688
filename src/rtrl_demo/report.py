# ruff: noqa: E501  (HTML templates read better unwrapped)
"""``demo-report/report.html``: one self-contained page (no network, no script), its plots
matplotlib SVG inline (:mod:`~rtrl_demo.report_plots`, :mod:`~rtrl_demo.report_ci`,
:mod:`~rtrl_demo.report_flow`), a function of the run's summary (``summary.json``) alone.

Every phase and decision is worded and coloured as in the console and ``kubectl rtrl
status`` (:mod:`rtrl.phasestyle`): a checkpoint promoted and later replaced reads
"Promoted, later Superseded", not Superseded alone. Every table cell is
:func:`rtrl.abtable.cells`'s.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

from rtrl.abtable import ABSOLUTE_NOTE, cells, field, number
from rtrl.phasestyle import outcome, outcome_text, style

from . import report_ci, report_flow, report_plots
from .console import key_numbers

# The A/B arms plotted per cycle: metric, title, unit.
ARMS = (
    ("edit_persistence", "edit persistence (goal)", "share"),
    ("dissatisfied_followup_rate", "dissatisfied follow-up rate (goal)", "share"),
    ("latency_ms", "latency (goal)", "ms"),
    ("clarification_rate", "clarifying-question rate (guardrail)", "share"),
    ("invalid_tool_call_rate", "invalid tool-call rate (guardrail)", "share"),
)


def badge(phase: str | None, decision: str | None = None) -> str:
    """The outcome as every view words it, each phase on its own colour."""
    spans = [
        f'<span class="phase" data-phase="{html.escape(p)}" style="background:{style(p).hex}">{html.escape(p)}</span>'
        for p in outcome(phase, decision)
    ]
    text = html.escape(outcome_text(phase, decision))
    return f'<span class="outcome" data-outcome="{text}">{", later ".join(spans)}</span>'


def table(metrics: list[dict[str, Any]]) -> str:
    rows = []
    for m in metrics:
        c = cells(m)
        verdict = html.escape(c.verdict)
        colour = (
            report_ci.verdict_colour(c.verdict) if c.verdict in report_ci.VERDICTS else "inherit"
        )
        rows.append(
            f'<tr data-metric="{html.escape(c.metric)}"><td>{html.escape(c.metric)}</td><td>{html.escape(str(m.get("kind") or ""))}</td>'
            + "".join(
                f'<td class="num">{html.escape(v)}</td>'
                for v in (c.old, c.new, c.change, c.interval)
            )
            + f'<td class="verdict" style="color:{colour}">{verdict}</td></tr>'
        )
    head = "".join(
        f"<th>{h}</th>"
        for h in ("metric", "role", "old", "new", "change", "always-valid CI", "verdict")
    )
    note = (
        f'<p class="note">{html.escape(ABSOLUTE_NOTE)}</p>'
        if any(cells(m).absolute for m in metrics)
        else ""
    )
    return f'<table class="ab"><tr>{head}</tr>{"".join(rows)}</table>{note}'


def note(text: str) -> str:
    return f'<p class="empty">{html.escape(text)}</p>'


def overview(cycles: list[dict[str, Any]]) -> str:
    rows = []
    for c in cycles:
        numbers = "<br>".join(html.escape(n) for n in key_numbers(c.get("metrics") or []))
        rows.append(
            f'<tr data-checkpoint="{html.escape(str(c.get("checkpoint")))}"><td>{c.get("cycle")}</td>'
            f"<td>{html.escape(str(c.get('checkpoint')))}</td><td>{html.escape(str(c.get('parent')))}</td>"
            f"<td>{badge(c.get('phase'), c.get('decision'))}</td><td>{numbers}</td>"
            f'<td class="reason">{html.escape(str(c.get("reason") or ""))}</td></tr>'
        )
    head = "".join(
        f"<th>{h}</th>"
        for h in ("cycle", "checkpoint", "trained from", "decided", "key A/B numbers", "why")
    )
    return f'<table class="overview"><tr>{head}</tr>{"".join(rows)}</table>'


def metric_names(cycles: list[dict[str, Any]]) -> list[str]:
    """Every metric of any look, goals first, in the order the analysis lists them."""
    seen: dict[str, str] = {}
    for c in cycles:
        for look in c.get("looks") or []:
            for m in look.get("metrics") or []:
                seen.setdefault(str(m.get("name")), str(m.get("kind") or ""))
    return sorted(seen, key=lambda n: seen[n] != "goal")


def training_table(cycles: list[dict[str, Any]]) -> str:
    keys = (
        "steps",
        "tokens",
        "loss",
        "kl",
        "clip_fraction",
        "grad_norm",
        "tokens_per_second",
        "wall_seconds",
    )
    rows = []
    for c in cycles:
        t = c.get("training") or {}
        vals = "".join(f'<td class="num">{_training_cell(field(t, k), k)}</td>' for k in keys)
        rows.append(f"<tr><td>{html.escape(str(c.get('checkpoint')))}</td>{vals}</tr>")
    head = "".join(f"<th>{h}</th>" for h in ("checkpoint", *keys))
    return f'<table class="training"><tr>{head}</tr>{"".join(rows)}</table>'


def _training_cell(value: Any, key: str) -> str:
    """Counts as integers, seconds with one decimal, the rest as the A/B table would."""
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if key == "wall_seconds" and isinstance(value, float):
        return f"{value:.1f}"
    return number(value, key)


def events_table(items: list[dict[str, Any]]) -> str:
    rows = "".join(
        f"<tr{' class=warning' if e.get('warning') else ''}><td>{html.escape(str(e.get('at')))}</td><td>{html.escape(str(e.get('object')))}</td>"
        f"<td>{html.escape(str(e.get('reason')))}</td><td>{html.escape(str(e.get('message')))}</td></tr>"
        for e in items
    )
    return f"<details><summary>all {len(items)} Events</summary><table><tr><th>at</th><th>object</th><th>reason</th><th>message</th></tr>{rows}</table></details>"


def section(title: str, body: str, ident: str) -> str:
    return f'<section id="{ident}"><h2>{html.escape(title)}</h2>{body}</section>'


CSS = """body{font-family:sans-serif;max-width:1180px;margin:2em auto;color:#222}
svg.plot{display:block;margin:6px 0;max-width:100%;height:auto}
.grid{display:flex;flex-wrap:wrap;gap:4px}.grid svg.plot{width:380px}.grid.wide svg.plot{width:580px}
table{border-collapse:collapse;margin:6px 0}td,th{border:1px solid #ccc;padding:2px 8px;vertical-align:top}
td.num{text-align:right;font-variant-numeric:tabular-nums}td.reason{font-size:0.85em;max-width:420px}
.phase{color:white;border-radius:3px;padding:0 5px;font-weight:bold}
.empty{color:#8a6d00;background:#fff8e0;padding:4px 8px}tr.warning td{color:#8c1c13}"""


def ab_section(cycles: list[dict[str, Any]], h2h: dict[str, Any]) -> str:
    """Each cycle's final look, then the head-to-head: its table and forest plot, every
    forest plot on one axis."""
    # One axis for every cycle's final look and the head-to-head.
    final = [report_ci.row(m) for c in cycles for m in c.get("metrics") or []]
    span = report_ci.axis(final + [report_ci.row(m) for m in h2h.get("metrics") or []])
    ab = []
    for c in cycles:
        rows = [report_ci.row(m) for m in c.get("metrics") or []]
        looks = c.get("looks") or []
        samples = (
            f"{looks[-1].get('baseline_samples')}/{looks[-1].get('canary_samples')} matured interactions"
            if looks
            else ""
        )
        ab.append(
            f'<h3 id="cycle-{c.get("cycle")}">cycle {c.get("cycle")}: {html.escape(str(c.get("checkpoint")))} (new) vs {html.escape(str(c.get("parent")))} (old): {badge(c.get("phase"), c.get("decision"))}</h3>'
            f'<p>{len(looks)} look(s), {samples}. <span class="reason">{html.escape(str(c.get("reason") or ""))}</span></p>'
            + table(c.get("metrics") or [])
            + (
                report_ci.forest(f"cycle {c.get('cycle')}, final look: relative change", rows, span)
                if rows
                else ""
            )
        )
    if h2h.get("metrics"):
        ab.append(
            f"<h3>Head-to-head: {html.escape(str(h2h.get('canary')))} (now serving) vs {html.escape(str(h2h.get('baseline')))} (base)</h3>"
            f"<p>Both served half the users for two simulated hours after the last cycle; {h2h.get('baseline_samples')}/{h2h.get('canary_samples')} interactions, the canary analysis's always-valid intervals.</p>"
            + table(h2h["metrics"])
            + report_ci.forest(
                "head-to-head: relative change vs the base model",
                [report_ci.row(m) for m in h2h["metrics"]],
                span,
            )
        )
    elif h2h.get("error"):
        ab.append(note(f"head-to-head: {h2h['error']}"))
    return "".join(ab)


def write_report(out: Path, summary: dict[str, Any]) -> Path:
    cycles = summary.get("cycles") or []
    h2h = summary.get("head_to_head") or {}
    parts = []
    parts.append(
        section(
            "Cycles",
            overview(cycles) + (report_flow.lineage(cycles, summary.get("serving")) or ""),
            "cycles",
        )
    )
    if summary.get("organisations"):
        from . import report_orgs

        parts.append(
            section(
                "Organisations: each adapter against the base",
                report_orgs.section(summary["organisations"], summary.get("routes") or [], badge),
                "organisations",
            )
        )
    weights = report_plots.weights(summary.get("canary_weights") or [], cycles)
    parts.append(
        section("Canary weight", weights or note("no serving ticks were recorded"), "weights")
    )
    sequences = [report_ci.sequence(name, cycles) for name in metric_names(cycles)]
    parts.append(
        section(
            "Confidence sequences: every metric at every look",
            "<p>Each plot: the relative change of the new checkpoint vs the old (dot) and its 95% "
            "always-valid interval (bar) at every look of every cycle, in the colour of what was "
            "decided; dashed: no change; shaded: the guardrail's band (the change it tolerates).</p>"
            + f'<div class="grid wide">{"".join(s for s in sequences if s)}</div>'
            if any(sequences)
            else note("no canary analysis ran"),
            "sequences",
        )
    )
    parts.append(section("Canary A/B: each cycle's final look", ab_section(cycles, h2h), "ab"))
    arms = "".join(report_plots.arms(cycles, n, t, u) for n, t, u in ARMS) if cycles else ""
    parts.append(section("Both arms of each cycle", f'<div class="grid">{arms}</div>', "arms"))
    order = (
        [str(cycles[0].get("parent"))] + [str(c.get("checkpoint")) for c in cycles]
        if cycles
        else []
    )
    mix = report_plots.answer_mix(summary.get("answer_mix") or {}, order)
    parts.append(
        section("Answer mix", mix or note("no interactions were found to count"), "answers")
    )
    curves = report_plots.curves(cycles)
    missing = [str(c.get("checkpoint")) for c in cycles if not c.get("training_curves")]
    training = (curves or "") + (
        note(
            f"no training events for {', '.join(missing)}: the train step wrote no TensorBoard "
            "events under <checkpoint uri>/tensorboard/ (the table below has its train.json summary)"
        )
        if missing
        else ""
    )
    parts.append(section("Training", training + training_table(cycles), "training"))
    gates = report_ci.gates(cycles, summary.get("gates") or [])
    parts.append(section("Eval gates", gates or note("no eval gate results"), "gates"))
    parts.append(
        section("Staged data", report_plots.staged(cycles) or note("no stage monitors"), "staged")
    )
    items = summary.get("events") or []
    timeline = report_flow.events(items)
    parts.append(section("Events", (timeline or note("no Events")) + events_table(items), "events"))
    serving = str(summary.get("serving"))
    doc = f"""<!doctype html><html><head><meta charset="utf-8"><title>rtrl demo report</title>
<style>{CSS}</style></head>
<body><h1>rtrl demo: {html.escape(str(summary.get("scenario")))}</h1>
<p>{html.escape(str(summary.get("scenario_description")))}. {summary.get("users")} simulated users,
{len(cycles)} cycle(s), {summary.get("simulated_hours")} simulated hours, {summary.get("wall_seconds")} s wall.
Serving now: <b>{html.escape(serving)}</b>.</p>
{"".join(parts)}
</body></html>"""
    path = out / "report.html"
    path.write_text(doc, encoding="utf-8")
    return path
