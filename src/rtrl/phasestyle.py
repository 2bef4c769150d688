"""One colour per phase and per decision, for every view: ``kubectl rtrl status``, the demo's
console and its HTML report read their colours here, so a Promoted checkpoint is the same
green everywhere and never shares a colour with RolledBack, Rejected or Failed.

Each style has a hex colour (HTML, plots) and an ANSI SGR code (terminals). Phases of the
same kind share a style: every phase still in progress is blue, every outcome its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from rtrl.core.api.checkpoint import CheckpointPhase, Decision
from rtrl.core.api.rlcycle import RLCyclePhase


@dataclass(frozen=True)
class Style:
    hex: str
    ansi: str  # the SGR parameters, e.g. "32" or "1;31"


IN_PROGRESS = Style("#1f77b4", "34")
CANARY = Style("#ff7f0e", "33")
PROMOTED = Style("#2ca02c", "32")
ROLLED_BACK = Style("#d62728", "31")
REJECTED = Style("#9467bd", "35")
FAILED = Style("#8c1c13", "1;31")
SUPERSEDED = Style("#7f7f7f", "2")
NEUTRAL = Style("#555555", "0")

# Checkpoint phases (rtrl.core.api.checkpoint.CheckpointPhase), RLCycle phases
# (rtrl.core.api.rlcycle.RLCyclePhase) and canary decisions, by their wire value.
STYLES: dict[str, Style] = {
    CheckpointPhase.PENDING: IN_PROGRESS,
    CheckpointPhase.STAGING: IN_PROGRESS,
    CheckpointPhase.TRAINING: IN_PROGRESS,
    CheckpointPhase.EVALUATING: IN_PROGRESS,
    CheckpointPhase.EVALUATED: IN_PROGRESS,
    CheckpointPhase.CANARY: CANARY,
    RLCyclePhase.AWAITING_APPROVAL: CANARY,
    RLCyclePhase.PROMOTING: PROMOTED,
    CheckpointPhase.PROMOTED: PROMOTED,
    RLCyclePhase.ROLLING_BACK: ROLLED_BACK,
    CheckpointPhase.ROLLED_BACK: ROLLED_BACK,
    CheckpointPhase.REJECTED: REJECTED,
    CheckpointPhase.FAILED: FAILED,
    RLCyclePhase.INVALID: FAILED,
    CheckpointPhase.SUPERSEDED: SUPERSEDED,
    RLCyclePhase.IDLE: NEUTRAL,
    RLCyclePhase.SUSPENDED: SUPERSEDED,
    RLCyclePhase.PINNED: NEUTRAL,
    Decision.PROMOTE: PROMOTED,
    Decision.ROLLBACK: ROLLED_BACK,
    Decision.CONTINUE: CANARY,
}


def style(value: str | None) -> Style:
    """The style of a phase or decision; neutral for anything unknown (or None)."""
    return STYLES.get(value or "", NEUTRAL)


def ansi(text: str, value: str | None) -> str:
    """``text`` coloured for a terminal as ``value`` (a phase or decision) is everywhere."""
    code = style(value).ansi
    return text if code == "0" else f"\x1b[{code}m{text}\x1b[0m"


# What a canary decision made of a checkpoint, as a phase.
DECIDED: dict[str, str] = {
    Decision.PROMOTE: CheckpointPhase.PROMOTED,
    Decision.ROLLBACK: CheckpointPhase.ROLLED_BACK,
}


def outcome(phase: str | None, decision: str | None = None) -> tuple[str, ...]:
    """What was decided, then what became of it, as phases: a checkpoint promoted and later
    replaced by another promotion is ``("Promoted", "Superseded")`` (its phase alone,
    Superseded, would hide that it was promoted); any other is its phase alone."""
    if phase == CheckpointPhase.SUPERSEDED:
        return (
            DECIDED.get(decision or "", CheckpointPhase.PROMOTED),
            CheckpointPhase.SUPERSEDED,
        )
    return (phase or CheckpointPhase.PENDING,)


def outcome_text(phase: str | None, decision: str | None = None) -> str:
    """``Promoted, later Superseded``; ``RolledBack``; ``Canary``..."""
    return ", later ".join(outcome(phase, decision))


def outcome_ansi(phase: str | None, decision: str | None = None) -> str:
    """:func:`outcome_text` for a terminal, each phase in its own colour."""
    return ", later ".join(ansi(p, p) for p in outcome(phase, decision))
