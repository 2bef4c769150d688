"""The verbs that follow an RLCycle as it changes: ``status --watch`` redraws the view of
:mod:`.view` until Ctrl-C, ``wait`` returns when the cycle reaches a phase (or ends in
another outcome, or the time is up), and ``list`` is their one-line-per-RLCycle overview.

Both loops poll: each look is a few GETs (the RLCycle, its Checkpoints, the Jobs and
canary of the one shown, its Events), which a restarted API server, an expired watch
(410 Gone) or a proxy that cuts long requests do not disturb, at a cost a person watching
does not notice. An error on one look is shown and the next look tried; only a missing
RLCycle ends the watch.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import sys
import time
import unicodedata
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any, TextIO

from ..core.api.checkpoint import CheckpointPhase
from ..core.api.names import CYCLE_PHASES, RUNNING_PHASES
from ..core.api.rlcycle import RLCyclePhase
from ..kube.client import KubeError
from ..phasestyle import ansi
from . import view
from .render import Paint, duration, meta, plain, spec, status
from .session import PluginError, Session, describe, is_transport_error

WATCH_SECONDS = 1.0
WAIT_SECONDS = 0.5
HOME, CLEAR_LINE, CLEAR_BELOW = "\x1b[H", "\x1b[K", "\x1b[J"
# Exit codes of `wait` (kubectl wait exits 1 on a timeout; 2 is every verb's usage error).
REACHED, TIMED_OUT, OTHER_OUTCOME = 0, 1, 3

CHECKPOINT_PHASES = {str(p) for p in CheckpointPhase}
RLCYCLE_PHASES = {str(p) for p in RLCyclePhase}
OUTCOMES = {
    CheckpointPhase.PROMOTED,
    CheckpointPhase.ROLLED_BACK,
    CheckpointPhase.REJECTED,
    CheckpointPhase.FAILED,
    CheckpointPhase.SUPERSEDED,
}
# A cycle's way through: a phase before the one seen was passed even if no look caught it.
PIPELINE = CYCLE_PHASES
PASSED: dict[str, CheckpointPhase] = {
    CheckpointPhase.PROMOTED: CheckpointPhase.CANARY,
    CheckpointPhase.ROLLED_BACK: CheckpointPhase.CANARY,
    CheckpointPhase.REJECTED: CheckpointPhase.EVALUATED,
}
# RLCycle phases that belong to the cycle's outcome: (the Checkpoint phase they lead to)
LEADS_TO: dict[str, CheckpointPhase] = {
    RLCyclePhase.PROMOTING: CheckpointPhase.PROMOTED,
    RLCyclePhase.ROLLING_BACK: CheckpointPhase.ROLLED_BACK,
}


def painter(stream: TextIO) -> Paint:
    """Colours on a terminal, unless NO_COLOR is set (no-color.org)."""
    return ansi if stream.isatty() and not os.environ.get("NO_COLOR") else plain


class StopFlag:
    """Set by Ctrl-C. A plain attribute rather than a ``threading.Event``: a signal handler
    runs in the main thread between two bytecodes, possibly while that thread holds the
    Event's lock inside ``wait()``, and ``Event.set()`` would then wait for that lock for
    ever."""

    def __init__(self) -> None:
        self.requested = False

    def is_set(self) -> bool:
        return self.requested

    def wait(self, seconds: float) -> None:
        """Sleep ``seconds``, or less: the flag is looked at every tenth of a second."""
        deadline = time.monotonic() + seconds
        while not self.requested and (left := deadline - time.monotonic()) > 0:
            time.sleep(min(0.1, left))


@contextmanager
def interruptible() -> Iterator[StopFlag]:
    """Ctrl-C sets the flag instead of raising KeyboardInterrupt wherever the loop is (in
    the middle of a TLS read, it left the process hanging at exit): the loop ends at its
    next pause, the request under way finished."""
    stop = StopFlag()

    def request(*_: object) -> None:
        stop.requested = True

    previous = signal.signal(signal.SIGINT, request)
    try:
        yield stop
    finally:
        signal.signal(signal.SIGINT, previous)


# --- one look ------------------------------------------------------------------------------
def snapshot(session: Session, name: str) -> view.Snapshot:
    """The RLCycle, the Checkpoint of its running cycle (else of its last one), the serving
    one, that Checkpoint's Jobs and canary, and the Events of both. What the user may not
    read (RBAC) is named in ``unreadable`` rather than failing the view."""
    rlc = session.rlcycle(name)
    st = status(rlc)
    checkpoints = session.checkpoints_of(name)
    by_name = {str(meta(c).get("name")): c for c in checkpoints}
    snap = view.Snapshot(rlc)
    candidate = by_name.get(str(st.get("candidate"))) if st.get("candidate") else None
    if candidate is not None and status(candidate).get("phase") in RUNNING_PHASES:
        snap.checkpoint = candidate
    else:
        owned = [c for c in checkpoints if spec(c).get("rlCycle")]
        snap.checkpoint, snap.role = candidate or (owned[0] if owned else None), "Last cycle"
    serving = st.get("serving")
    snap.serving = by_name.get(str(serving)) if serving else None
    if serving and snap.serving is None:
        snap.serving = session.checkpoint(str(serving))
    shown = view.name_of(snap.checkpoint) if snap.checkpoint is not None else None
    if shown is not None:
        try:
            snap.jobs, snap.canaries = session.children(shown)
        except KubeError as exc:
            snap.unreadable.append(f"jobs and canary: {describe(exc, session.server)}")
    try:
        snap.events = session.events_of("RLCycle", name, uid_of(rlc))
        if shown is not None and snap.checkpoint is not None:
            snap.events += session.events_of("Checkpoint", shown, uid_of(snap.checkpoint))
    except KubeError as exc:
        snap.unreadable.append(f"events: {describe(exc, session.server)}")
    return snap


def uid_of(obj: dict[str, Any]) -> str | None:
    return (obj.get("metadata") or {}).get("uid")


# --- status --watch ------------------------------------------------------------------------
def watch(session: Session, name: str, out: TextIO = sys.stdout) -> int:
    """Redraw in place on a terminal (cursor home, each line cleared to its end, the rest of
    the screen below cleared), else append a frame each time something shown changed.
    Ctrl-C ends it with 0."""
    tty = out.isatty()
    paint = painter(out)
    title = f"kubectl rtrl status {name} -n {session.namespace} --watch (Ctrl-C to stop)"
    shown: tuple[str, ...] | None = None
    body, problem = "", ""
    try:
        if tty:
            out.write(HOME + "\x1b[2J")
        with interruptible() as stop:
            while not stop.is_set():
                now = datetime.now(UTC)
                try:
                    snap = snapshot(session, name)
                    body, problem = view.frame(snap, now, paint), ""
                    versions: tuple[str, ...] | None = snap.versions()
                except PluginError:
                    raise
                except Exception as exc:  # a look that failed: say so, keep the last frame
                    if not (isinstance(exc, KubeError) or is_transport_error(exc)):
                        raise
                    problem = f"error: {describe(exc, session.server)} (retrying)"
                    versions = shown
                stamp = now.strftime("%Y-%m-%dT%H:%M:%SZ")
                text = f"{title}  {stamp}\n\n{body}" + (f"\n{problem}\n" if problem else "")
                if tty:
                    size = shutil.get_terminal_size()
                    lines = fit(text, size.lines, size.columns)
                    out.write(
                        HOME + "".join(f"{line}{CLEAR_LINE}\n" for line in lines) + CLEAR_BELOW
                    )
                elif versions != shown or problem:
                    out.write(("\n" if shown is not None else "") + text)
                shown = versions
                out.flush()
                stop.wait(WATCH_SECONDS)
        if tty:
            out.write("\n")
        return 0
    except BrokenPipeError:  # `| head`: the reader has what it wanted
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (Python flushes it at exit)
        return 0


def fit(text: str, height: int, width: int) -> list[str]:
    """The rows of the frame that fit a terminal ``height`` rows high (one left for the
    cursor) and ``width`` columns wide, the last one saying how many did not. A line wider
    than the terminal is cut into rows here, as the terminal would wrap it: counted as one
    line, it scrolled the screen and the header was lost at every redraw."""
    lines = [row for line in text.rstrip("\n").split("\n") for row in rows(line, width)]
    room = max(2, height - 1)
    if len(lines) <= room:
        return lines
    hidden = len(lines) - room + 1
    return [
        *lines[: room - 1],
        *rows(f"... {hidden} more rows: a larger terminal shows them", width)[:1],
    ]


ESCAPE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def rows(line: str, width: int) -> list[str]:
    """``line`` cut into rows of at most ``width - 1`` columns (the last column stays
    empty: a row that fills it leaves the cursor there, and clearing to the line's end
    would erase its last character). Escape codes take no column, a wide character two."""
    room = max(1, width - 1)
    out: list[str] = []
    row, used, at = "", 0, 0
    for match in [*ESCAPE.finditer(line), None]:
        end = match.start() if match is not None else len(line)
        for char in line[at:end]:
            cells = 2 if unicodedata.east_asian_width(char) in ("W", "F") else 1
            if used + cells > room and used:
                out.append(row)
                row, used = "", 0
            row, used = row + char, used + cells
        if match is not None:
            row, at = row + match.group(), match.end()
    return [*out, row]


# --- wait ----------------------------------------------------------------------------------
def phase_name(value: str) -> str:
    """``--for``: a Checkpoint or RLCycle phase, any case."""
    for phase in sorted(CHECKPOINT_PHASES | RLCYCLE_PHASES):
        if phase.lower() == value.lower():
            return phase
    known = ", ".join(sorted(CHECKPOINT_PHASES | RLCYCLE_PHASES))
    raise argparse.ArgumentTypeError(f"unknown phase {value!r} (one of: {known})")


def reached(target: str, phase: str, seen: set[str], rlc_phase: str) -> bool | None:
    """Whether the cycle's Checkpoint (at ``phase``, earlier looks ``seen``) has reached
    ``target``: True, False once it ended elsewhere, None while it still may."""
    if target in LEADS_TO:
        if target == rlc_phase or target in seen or phase == LEADS_TO[target]:
            return True
    elif target == phase or target in seen:
        return True
    elif target in PIPELINE:
        passed = phase if phase in PIPELINE else PASSED.get(phase)
        if passed is not None and PIPELINE.index(passed) >= PIPELINE.index(target):
            return True
    return False if phase in OUTCOMES else None


def cycle_checkpoint(session: Session, name: str, known: set[str]) -> dict[str, Any] | None:
    """The RLCycle's running cycle's Checkpoint, or the first one not in ``known`` (uids)."""
    rlc = session.rlcycle(name)
    candidate = status(rlc).get("candidate")
    owned = [c for c in session.checkpoints_of(name) if spec(c).get("rlCycle") == name]
    for ck in owned:
        if view.name_of(ck) == candidate and status(ck).get("phase") in RUNNING_PHASES:
            return ck
    new = [c for c in owned if str(meta(c).get("uid")) not in known]
    return new[-1] if new else None  # newest first: the oldest new one


def cmd_wait(args: argparse.Namespace) -> int:
    session: Session = args.session
    name, target = args.name, args.for_phase
    deadline = time.monotonic() + args.timeout
    on_cycle = target in CHECKPOINT_PHASES or target in LEADS_TO
    known = {str(meta(c).get("uid")) for c in session.checkpoints_of(name)}
    ck = cycle_checkpoint(session, name, known) if on_cycle else None
    if ck is not None:
        known.discard(str(meta(ck).get("uid")))
    seen: set[str] = set()
    where = f"rlcycle.rtrl.io/{name}"
    try:
        while True:
            rlc_phase = str(status(session.rlcycle(name)).get("phase") or RLCyclePhase.PENDING)
            if not on_cycle:
                if rlc_phase == target:
                    print(f"{where}: phase {target} reached", file=sys.stderr)
                    return REACHED
                now_is = f"{where} is {rlc_phase}"
            else:
                if ck is None:
                    ck = cycle_checkpoint(session, name, known)
                elif (ck := session.checkpoint(view.name_of(ck))) is None:
                    raise PluginError(f"{where}: its cycle's Checkpoint was deleted")
                if ck is None:
                    now_is = f"no new cycle of {where} started"
                else:
                    phase = str(status(ck).get("phase") or CheckpointPhase.PENDING)
                    verdict = reached(target, phase, seen, rlc_phase)
                    seen |= {phase, rlc_phase}
                    ck_name = view.name_of(ck)
                    if verdict:
                        print(f"{where}: {ck_name} reached {target} (is {phase})", file=sys.stderr)
                        return REACHED
                    if verdict is False:
                        why = status(ck).get("message") or status(ck).get("reason")
                        detail = f": {why}" if why else ""
                        print(f"error: {where}: {ck_name} ended {phase}, not {target}{detail}",
                              file=sys.stderr)  # fmt: skip
                        return OTHER_OUTCOME
                    now_is = f"{ck_name} is {phase}"
            left = deadline - time.monotonic()
            if left <= 0:
                print(f"error: timed out after {duration(args.timeout)} waiting for {target} "
                      f"({now_is})", file=sys.stderr)  # fmt: skip
                return TIMED_OUT
            time.sleep(min(WAIT_SECONDS, left))
    except KeyboardInterrupt:
        return 130


# --- list ----------------------------------------------------------------------------------
def cmd_list(args: argparse.Namespace) -> int:
    session: Session = args.session
    items = session.rlcycles(args.all_namespaces)
    if not items:
        where = "" if args.all_namespaces else f" in {session.namespace} namespace"
        print(f"No RLCycles found{where}.", file=sys.stderr)
        return 0
    now = datetime.now(UTC)
    print("\n".join(view.list_lines(items, now, args.all_namespaces, painter(sys.stdout))))
    return 0
