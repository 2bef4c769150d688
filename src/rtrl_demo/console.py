"""What the demo prints while it runs: a progress line per step, and the blog's table for
each finished cycle and for the final head-to-head."""

from __future__ import annotations

import sys
from typing import Any

from rtrl.abtable import ab_table

from .scenario import HEAD_TO_HEAD
from .summary import analysis_docs, analysis_metrics


class Progress:
    """A one-line text bar on stderr per long step, scaled by how long that step took
    last time (the subprocess does not report its own progress)."""

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet or not sys.stderr.isatty()
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
        if self.quiet:
            print(f"  {label:<34} {mark} in {seconds:.1f}s", file=sys.stderr)
        else:
            sys.stderr.write(f"\r  {label:<34} [{'#' * 30}] {seconds:5.1f}s {mark}\n")


def metrics_table(metrics: list[dict[str, Any]]) -> list[str]:
    """The blog's table: each metric in both arms, the relative change of the new checkpoint
    vs the old with its always-valid interval, and the verdict (the cells of
    :mod:`rtrl.abtable`, as ``kubectl rtrl status`` and the report show them)."""
    return ab_table(metrics, indent="  ")


def cycle_table(ck: dict[str, Any]) -> str:
    status = ck.get("status") or {}
    records = status.get("rollout") or []
    last = records[-1] if records else {}
    looks = analysis_docs(ck)
    doc = looks[-1] if looks else {}
    lines = [
        "",
        f"cycle {ck['spec'].get('cycle')}: {ck['metadata']['name']} (new) vs "
        f"{ck['spec'].get('parent')} (old), {len(looks)} look(s), "
        f"{doc.get('baseline_samples', '?')}/{doc.get('canary_samples', '?')} matured "
        f"interactions  ->  {status.get('phase')}",
    ]
    lines += metrics_table(analysis_metrics(doc) if doc else last.get("metrics") or [])
    reason = doc.get("message") or last.get("reason") or status.get("message") or ""
    lines.append(f"  decision: {last.get('decision') or status.get('phase')}: {reason}")
    return "\n".join(lines)


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
