# ruff: noqa: E501  (HTML templates read better unwrapped)
"""The report's section for scenario two-orgs: per organisation, each cycle of its adapter
RLCycle (the canary's edit persistence on the organisation's users, its adapter against its
parent), the organisation's metric under the base and under its adapter (every interaction
each served it, from the sealed shards), and the routes the sidecar followed."""

from __future__ import annotations

import html
from collections.abc import Callable
from typing import Any

from rtrl.abtable import cells

# the report's outcome badge (rtrl_demo.report.badge): phase, decision -> HTML
Badge = Callable[[str | None, str | None], str]


def _num(value: Any, digits: int = 3) -> str:
    return "n/a" if value is None else f"{float(value):.{digits}f}"


def _ref(ref: dict[str, Any] | None) -> str:
    return html.escape(str((ref or {}).get("name") or "base"))


def section(orgs: dict[str, Any], routes: list[dict[str, Any]], badge: Badge) -> str:
    """The organisations' tables, then the route changes."""
    parts = [
        "<p>One base (demo-0) serves both organisations; each organisation's adapter RLCycle "
        "trains a LoRA adapter on its own users' interactions and canaries, promotes or rolls "
        "it back as its key of the routing ConfigMap. <em>Convention</em>: the share of the "
        "organisation's hidden-preference answers (edits and tool calls) in its own styles; the "
        "base, trained on nobody's, follows either half the time.</p>"
    ]
    for org, o in orgs.items():
        verdict = "improved" if o.get("improved") else "not improved"
        base, adapter = o.get("base") or {}, o.get("adapter") or {}
        rows = []
        for c in o.get("cycles") or []:
            goal = {
                "name": "edit_persistence",
                "baseline": c.get("parent_value"),
                "canary": c.get("adapter_value"),
                "relative_difference": c.get("relative_difference"),
                "relative_ci_low": c.get("relative_ci_low"),
                "relative_ci_high": c.get("relative_ci_high"),
                "verdict": c.get("verdict") or "",
            }
            cell = cells(goal)
            rows.append(
                f'<tr data-checkpoint="{html.escape(str(c.get("checkpoint")))}"><td>{c.get("cycle")}</td>'
                f"<td>{html.escape(str(c.get('checkpoint')))}</td><td>{html.escape(str(c.get('parent')))}</td>"
                f"<td>{badge(c.get('phase'), c.get('decision'))}</td>"
                + "".join(
                    f'<td class="num">{html.escape(v)}</td>'
                    for v in (cell.old, cell.new, cell.change, cell.interval, cell.verdict)
                )
                + "".join(
                    f'<td class="num">{_num(c.get(k), 3 if "persistence" in k else 2)}</td>'
                    for k in (
                        "base_persistence",
                        "adapter_persistence",
                        "base_convention",
                        "adapter_convention",
                    )
                )
                + "</tr>"
            )
        head = "".join(
            f"<th>{h}</th>"
            for h in (
                "cycle", "adapter", "trained from", "decided",
                "canary: parent", "canary: adapter", "change", "always-valid CI", "verdict",
                "base (all)", "adapter (all)", "convention: base", "convention: adapter",
            )
        )  # fmt: skip
        parts.append(
            f'<h3 data-org="{html.escape(org)}">{html.escape(org)} ({html.escape(str(o.get("rlcycle")))}): '
            f"served by {html.escape(str(o.get('serving')))}, {verdict}</h3>"
            f"<p>Edit persistence on {html.escape(org)}'s users: the base {_num(base.get('edit_persistence'))} "
            f"({base.get('n') or 0} interactions), its adapter {_num(adapter.get('edit_persistence'))} "
            f"({adapter.get('n') or 0}); in its convention {_num(base.get('convention'), 2)} → "
            f"{_num(adapter.get('convention'), 2)}. Requests of {html.escape(org)} served by another "
            f"organisation's adapter: {sum((o.get('served_by_other_orgs_adapters') or {}).values())}.</p>"
            f'<table class="overview"><tr>{head}</tr>{"".join(rows)}</table>'
        )
    changes, last = [], None
    for r in routes:
        shown = {
            org: (
                _ref(route.get("stable")),
                _ref(route.get("canary")) if route.get("canary") else "",
                route.get("weight") or 0,
            )
            for org, route in sorted((r.get("orgs") or {}).items())
        }
        if shown != last:
            for org, (stable, canary, weight) in shown.items():
                changes.append(
                    f"<tr><td>{html.escape(str(r.get('at')))}</td><td>{html.escape(org)}</td><td>{stable}</td>"
                    f'<td>{canary}</td><td class="num">{weight}</td><td class="num">{r.get("generation")}</td></tr>'
                )
            last = shown
    head = "".join(
        f"<th>{h}</th>"
        for h in (
            "from",
            "organisation",
            "stable",
            "canary",
            "canary weight %",
            "pod template generation",
        )
    )
    parts.append(
        "<p>The routing table the sidecar followed, at each change (the base's pod template "
        "never changed):</p>"
        f'<table class="routes"><tr>{head}</tr>{"".join(changes)}</table>'
    )
    return "".join(parts)
