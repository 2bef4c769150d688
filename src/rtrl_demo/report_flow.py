"""The report's plots of what happened in order: the checkpoints' lineage (a tree, each in
the colour of its phase) and the Events the planner emitted, on one timeline."""

from __future__ import annotations

from collections import defaultdict
from datetime import timedelta
from typing import Any

from rtrl.core.api.checkpoint import CheckpointPhase
from rtrl.core.api.reasons import Reason
from rtrl.phasestyle import outcome, outcome_text

from .report_svg import colour, figure, hours_axis, svg, when


def lineage(cycles: list[dict[str, Any]], serving: str | None) -> str | None:
    """Each checkpoint under its parent, left to right by cycle: the promoted line on top,
    a checkpoint that was not promoted one row below its parent's line; each box in the
    colour of what was decided (its edge in what became of it, Superseded's grey)."""
    if not cycles:
        return None
    nodes: dict[str, tuple[float, float]] = {}
    base = str(cycles[0].get("parent") or "base")
    nodes[base] = (0.0, 0.0)
    promoted = {
        c.get("checkpoint")
        for c in cycles
        if outcome(c.get("phase"), c.get("decision"))[0] == CheckpointPhase.PROMOTED
    }
    with figure(8.6, 2.3) as (fig, ax):
        for i, c in enumerate(cycles, start=1):
            name = str(c.get("checkpoint"))
            parent = str(c.get("parent"))
            py = nodes.get(parent, (0.0, 0.0))[1]
            y = py if name in promoted else py - 1.0
            nodes[name] = (float(i), y)
            if parent in nodes:
                ax.annotate(
                    "",
                    (i - 0.32, y),
                    xytext=(nodes[parent][0] + 0.32, py),
                    arrowprops={"arrowstyle": "->", "color": "#777", "lw": 1},
                )
        ax.text(
            0,
            0,
            f"{base}\nbase",
            ha="center",
            va="center",
            fontsize=8,
            bbox={"boxstyle": "round", "fc": "#ffffff", "ec": "#555"},
        )
        for c in cycles:
            name = str(c.get("checkpoint"))
            phases = outcome(c.get("phase"), c.get("decision"))
            text = f"{name}\n{outcome_text(c.get('phase'), c.get('decision'))}"
            if name == serving:
                text += "\n(serving now)"
            ax.text(
                nodes[name][0],
                nodes[name][1],
                text,
                ha="center",
                va="center",
                fontsize=7.5,
                color="white",
                bbox={
                    "boxstyle": "round",
                    "fc": colour(phases[0]),
                    "ec": colour(phases[-1]),
                    "lw": 2.5,
                },
            )
        lowest = min(y for _, y in nodes.values())
        ax.set_xlim(-0.6, len(cycles) + 0.6)
        ax.set_ylim(lowest - 0.7, 0.7)
        ax.set_xticks(
            range(len(cycles) + 1), ["base", *[f"cycle {c.get('cycle')}" for c in cycles]]
        )
        ax.set_yticks([])
        ax.grid(False)
        ax.spines["left"].set_visible(False)
        title = "lineage: each checkpoint under the one it was trained from"
        ax.set_title(title, loc="left")
        return svg(fig, title)


# An Event's reason in the colour of the phase or decision it reports.
REASON_PHASES: dict[str, CheckpointPhase] = {
    Reason.CANARY_STARTED: CheckpointPhase.CANARY,
    Reason.CANARY_STEP: CheckpointPhase.CANARY,
    Reason.ANALYSIS_CONTINUE: CheckpointPhase.CANARY,
    Reason.ANALYSIS_PROMOTE: CheckpointPhase.PROMOTED,
    Reason.PROMOTED: CheckpointPhase.PROMOTED,
    Reason.ANALYSIS_ROLLBACK: CheckpointPhase.ROLLED_BACK,
    Reason.ROLLED_BACK: CheckpointPhase.ROLLED_BACK,
    Reason.EVAL_FAILED: CheckpointPhase.REJECTED,
    Reason.CYCLE_FAILED: CheckpointPhase.FAILED,
    Reason.ROLLBACK_IMPOSSIBLE: CheckpointPhase.FAILED,
}
MARKERS = "osD^v<>ph*X"


def events(items: list[dict[str, Any]]) -> str | None:
    """Every Event the run emitted: one row per object, a marker per Event at its time, the
    marker's colour the phase its reason reports (blue: a step of a cycle in progress) and
    its shape the reason (legend); a warning has a black edge."""
    rows = [(t, e) for e in items if (t := when(e.get("at"))) is not None]
    if not rows:
        return None
    objects = sorted(
        {str(e.get("object")) for _, e in rows}, key=lambda o: (not o.startswith("RLCycle"), o)
    )
    reasons = sorted({str(e.get("reason")) for _, e in rows})
    # Events of one object at one moment (a step's Started and its result, when the step
    # took no simulated time) stack down its row in the order they were emitted.
    same: dict[tuple[str, Any], list[int]] = defaultdict(list)
    for i, (t, e) in enumerate(rows):
        same[(str(e.get("object")), t)].append(i)
    most = max(len(v) for v in same.values())
    offset = {
        i: (k - (len(v) - 1) / 2) * 0.8 / most for v in same.values() for k, i in enumerate(v)
    }
    row_inches = max(0.3, 0.11 * most)
    with figure(8.6, 1.2 + row_inches * len(objects) + 0.12 * len(reasons)) as (fig, ax):
        for k, reason in enumerate(reasons):
            pts = [(i, t, e) for i, (t, e) in enumerate(rows) if e.get("reason") == reason]
            ax.scatter(
                [t for _, t, _ in pts],
                [objects.index(str(e.get("object"))) + offset[i] for i, _, e in pts],
                marker=MARKERS[k % len(MARKERS)],
                color=colour(REASON_PHASES.get(reason, CheckpointPhase.TRAINING)),
                edgecolors=["black" if e.get("warning") else "none" for _, _, e in pts],
                s=36,
                label=reason,
                zorder=3,
            )
        ax.set_yticks(range(len(objects)), objects)
        ax.set_ylim(len(objects) - 0.5, -0.5)
        times = [t for t, _ in rows]
        pad = max((max(times) - min(times)) * 0.03, timedelta(minutes=10))
        ax.set_xlim(min(times) - pad, max(times) + pad)
        hours_axis(ax)
        fig.legend(loc="outside lower center", ncols=6, fontsize=7)
        title = "Events timeline (the planner's Events, by object)"
        ax.set_title(title, loc="left")
        return svg(fig, title)
