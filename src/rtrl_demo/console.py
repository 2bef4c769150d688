"""What the demo prints while it runs: a progress line per step (the users' serving ticks
only with ``--verbose``: they are most of the lines and none is a decision), the blog's
table for each finished cycle and for the final head-to-head, and a summary at the end.
Phases and decisions are coloured as everywhere (:mod:`rtrl.phasestyle`) on a terminal."""

from __future__ import annotations

import os
import sys
from typing import Any

from rtrl.abtable import ab_table, cells
from rtrl.phasestyle import ansi, outcome_ansi, outcome_text

from .scenario import HEAD_TO_HEAD
from .summary import analysis_docs, analysis_metrics


class Progress:
    """A one-line text bar on stderr per long step, scaled by how long that step took
    last time (the subprocess does not report its own progress)."""

    def __init__(self, quiet: bool, verbose: bool = False) -> None:
        self.quiet = quiet or not sys.stderr.isatty()
        self.verbose = verbose
        self.last: dict[str, float] = {}

    def tick(self, label: str, kind: str, elapsed: float) -> None:
        if self.quiet:
            return
        expected = self.last.get(kind, 20.0)
        frac = min(0.99, elapsed / max(expected, 0.1))
        bar = "#" * int(frac * 30)
        sys.stderr.write(f"\r  {label:<34} [{bar:<30}] {elapsed:5.1f}s")
        sys.stderr.flush()

    def done(self, label: str, kind: str, seconds: float, ok: bool) -> None:
        self.last[kind] = seconds
        mark = "done" if ok else "FAILED"
        if kind in ("serve", "seal") and ok and not self.verbose:
            if not self.quiet:  # the bar was shown while it ran; it leaves no line
                sys.stderr.write("\r\x1b[K")
            return
        if self.quiet:
            print(f"  {label:<34} {mark} in {seconds:.1f}s", file=sys.stderr)
        else:
            sys.stderr.write(f"\r  {label:<34} [{'#' * 30}] {seconds:5.1f}s {mark}\n")


def metrics_table(metrics: list[dict[str, Any]]) -> list[str]:
    """The blog's table: each metric in both arms, the relative change of the new checkpoint
    vs the old with its always-valid interval, and the verdict (the cells of
    :mod:`rtrl.abtable`, as ``kubectl rtrl status`` and the report show them)."""
    return ab_table(metrics, indent="  ")


def colour() -> bool:
    """Whether stderr takes ANSI colours: a terminal, and NO_COLOR unset."""
    return sys.stderr.isatty() and not os.environ.get("NO_COLOR")


def cycle_table(ck: dict[str, Any], color: bool = False) -> str:
    status = ck.get("status") or {}
    records = status.get("rollout") or []
    last = records[-1] if records else {}
    looks = analysis_docs(ck)
    doc = looks[-1] if looks else None
    samples = f"{doc.baseline_samples}/{doc.canary_samples}" if doc else "?/?"
    lines = [
        "",
        f"cycle {ck['spec'].get('cycle')}: {ck['metadata']['name']} (new) vs "
        f"{ck['spec'].get('parent')} (old), {len(looks)} look(s), {samples} matured "
        f"interactions  ->  {shown(status.get('phase'), last.get('decision'), color)}",
    ]
    lines += metrics_table(analysis_metrics(doc) if doc else last.get("metrics") or [])
    reason = (doc.message if doc else "") or last.get("reason") or status.get("message") or ""
    decision = str(last.get("decision") or status.get("phase"))
    head = f"decision: {decision}"
    lines.append(f"  {ansi(head, decision) if color else head}: {reason}")
    return "\n".join(lines)


def shown(phase: str | None, decision: str | None, color: bool) -> str:
    """A checkpoint's outcome as every view words and colours it."""
    return outcome_ansi(phase, decision) if color else outcome_text(phase, decision)


# The numbers the end summary gives per cycle: the primary goal, then any metric that moved
# a decision the other way (a goal worse, a guardrail beyond or tripped).
PRIMARY = "edit_persistence"
ALARMS = ("worse", "beyond", "tripped")


def key_numbers(metrics: list[dict[str, Any]]) -> list[str]:
    out = []
    for m in metrics:
        c = cells(m)
        if c.metric == PRIMARY or c.verdict in ALARMS:
            out.append(f"{c.metric} {c.change} {c.interval} {c.verdict}")
    return out


def final_summary(result: dict[str, Any], report: str, color: bool = False) -> str:
    """The run in a few lines: each cycle's checkpoint, what was decided and its key A/B
    numbers, the head-to-head, what serves now and where the report is."""
    cycles = result.get("cycles") or []
    lines = ["", f"rtrl demo: summary ({len(cycles)} cycle(s), {result.get('simulated_hours')} "
             f"simulated hours, {result.get('wall_seconds')} s)"]  # fmt: skip
    for c in cycles:
        lines.append(
            f"  cycle {c.get('cycle')}  {c.get('checkpoint')} vs {c.get('parent')}  "
            f"{shown(c.get('phase'), c.get('decision'), color)}"
        )
        lines += [f"      {n}" for n in key_numbers(c.get("metrics") or [])]
    h2h = result.get("head_to_head") or {}
    if h2h.get("metrics"):
        lines.append(f"  head-to-head  {h2h.get('canary')} vs {h2h.get('baseline')}")
        lines += [f"      {n}" for n in key_numbers(h2h["metrics"])]
    lines += organisation_lines(result.get("organisations") or {})
    lines.append(f"  serving now: {result.get('serving')}")
    lines.append(f"  report: {report}")
    return "\n".join(lines)


def _share(value: float | None, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def organisation_lines(orgs: dict[str, Any]) -> list[str]:
    """two-orgs: per organisation, its adapter against the base on its own users (every
    interaction each served it) and whether the adapter improved the org's own metric."""
    lines = []
    for org, o in orgs.items():
        base, adapter = o.get("base") or {}, o.get("adapter") or {}
        verdict = "improved" if o.get("improved") else "not improved"
        what = "one shared model" if o.get("shared") else "adapter"
        if o.get("serving") == "demo-0":
            lines.append(f"  {org}: no {what} promoted: served by the base demo-0 ({verdict})")
            continue
        lines.append(
            f"  {org}: {o.get('serving')} ({what}) vs demo-0 (base) on {org}'s users: "
            f"edit_persistence {_share(base.get('edit_persistence'))} -> "
            f"{_share(adapter.get('edit_persistence'))}, in {org}'s convention "
            f"{_share(base.get('convention'), 2)} -> {_share(adapter.get('convention'), 2)}: "
            f"{verdict}"
        )
    return lines


def head_to_head_table(h2h: dict[str, Any]) -> str:
    if h2h.get("error"):
        return f"\nhead-to-head {h2h['canary']} vs {h2h['baseline']}: {h2h['error']}"
    lines = [
        "",
        f"head-to-head: {h2h['canary']} (now serving) vs {h2h['baseline']} (the base model), "
        f"50/50 for {HEAD_TO_HEAD}, {h2h.get('baseline_samples')}/{h2h.get('canary_samples')} "
        "interactions",
    ]
    return "\n".join(lines + metrics_table(h2h.get("metrics") or []))
