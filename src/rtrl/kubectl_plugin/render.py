"""What ``kubectl rtrl status`` and ``history`` print: pure functions of the objects as the
API returns them (plain camelCase dicts) and the clock, so the text is tested without a
cluster and reads the same whatever the terminal.

The layout follows ``kubectl describe``: a header block of ``Key: value`` lines, then
aligned tables with upper-case headers; ``-`` marks what is not known yet.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime
from typing import Any

from rtrl.abtable import KUBECTL_HEADERS, ab_table
from rtrl.abtable import number as metric_number
from rtrl.core.api.checkpoint import CheckpointPhase, Decision
from rtrl.core.api.names import GROUP
from rtrl.core.api.reasons import ConditionType, Reason
from rtrl.core.api.rlcycle import RLCyclePhase
from rtrl.phasestyle import outcome
from rtrl.planning.gates import reason_text
from rtrl.planning.timeutil import parse_time

from .running import progress_line, weight_text

# A condition's healthy state: these are listed as one line; anything else stands out.
HEALTHY: dict[str, str] = {
    ConditionType.READY: "True",
    ConditionType.DEGRADED: "False",
    ConditionType.INSUFFICIENT_DATA: "False",
    ConditionType.INVALID_SPEC: "False",
}
REASON_WIDTH = 60
# How a phase or decision is coloured: ``(text, value) -> text``; :func:`plain` leaves it be,
# a terminal's is ``rtrl.phasestyle.ansi`` (the commands choose).
Paint = Callable[[str, str | None], str]


def plain(text: str, value: str | None = None) -> str:
    return text


# --- small helpers ------------------------------------------------------------------------
def duration(seconds: float) -> str:
    """A span the way kubectl prints ages: 45s, 12m, 3h12m, 21d, 2y."""
    seconds = max(0, int(seconds))
    minutes, hours, days = seconds // 60, seconds // 3600, seconds // 86400
    if seconds < 120:
        return f"{seconds}s"
    if minutes < 60:
        return f"{minutes}m"
    if hours < 8:
        rest = minutes % 60
        return f"{hours}h{rest}m" if rest else f"{hours}h"
    if hours < 48:
        return f"{hours}h"
    if days < 8:
        rest = hours % 24
        return f"{days}d{rest}h" if rest else f"{days}d"
    if days < 365 * 2:
        return f"{days}d"
    return f"{days // 365}y"


def age(obj: dict[str, Any], now: datetime) -> str:
    created = parse_time(meta(obj).get("creationTimestamp"))
    return duration((now - created).total_seconds()) if created else "-"


def when(text: object, now: datetime) -> str:
    """An API time with how far it is from now: ``2025-05-01T10:00:00Z (3h ago)``."""
    moment = parse_time(text)
    if moment is None:
        return "-"
    delta = (moment - now).total_seconds()
    relative = f"in {duration(delta)}" if delta > 0 else f"{duration(-delta)} ago"
    return f"{moment.astimezone(UTC).strftime('%Y-%m-%dT%H:%M:%SZ')} ({relative})"


def stamp(text: object) -> str:
    moment = parse_time(text)
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ") if moment else "-"


def meta(obj: dict[str, Any]) -> dict[str, Any]:
    return dict(obj.get("metadata") or {})


def status(obj: dict[str, Any] | None) -> dict[str, Any]:
    return dict((obj or {}).get("status") or {})


def spec(obj: dict[str, Any] | None) -> dict[str, Any]:
    return dict((obj or {}).get("spec") or {})


def text(value: object) -> str:
    return "-" if value is None or value == "" else str(value)


def one_line(value: object, width: int | None = None) -> str:
    out = " ".join(str(value or "").split()) or "-"
    if width is not None and len(out) > width:
        out = out[: width - 3].rstrip() + "..."
    return out


def number(value: object) -> str:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return "-"
    return str(value) if isinstance(value, int) else f"{value:.4g}"


def table(
    headers: Sequence[str],
    rows: Iterable[Sequence[str]],
    indent: str = "",
    *,
    paint: Paint = plain,
    styled: Sequence[int] = (),
) -> list[str]:
    """Columns padded to their widest cell, two spaces apart (as ``kubectl get``). The cells
    of the ``styled`` columns are painted as their value after padding, so colour codes
    never shift a column."""
    cells = [list(headers), *[list(r) for r in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    out = []
    for n, row in enumerate(cells):
        padded = [c.ljust(w) for c, w in zip(row, widths, strict=True)]
        padded[-1] = row[-1]  # no trailing blanks (a painted one would survive rstrip)
        for i in styled if n else ():
            padded[i] = paint(padded[i], row[i])
        out.append((indent + "  ".join(padded)).rstrip())
    return out


def fields(pairs: Sequence[tuple[str, str]], indent: str = "") -> list[str]:
    width = max(len(k) for k, _ in pairs) + 1
    return [f"{indent}{(k + ':').ljust(width)}  {v}" for k, v in pairs]


# --- pieces ------------------------------------------------------------------------------
def condition_line(c: dict[str, Any]) -> str:
    head = f"{c.get('type')}={c.get('status')} {c.get('reason') or ''}".rstrip()
    message = one_line(c.get("message"))
    return head if message == "-" else f"{head}: {message}"


def eval_summary(ck: dict[str, Any]) -> str:
    ev = status(ck).get("eval") or {}
    if not ev:
        return "-"
    gates = ev.get("gates") or []
    if not gates:
        return str(ev.get("verdict") or "-")
    failed = [str(g.get("metric")) for g in gates if not g.get("passed")]
    passed = len(gates) - len(failed)
    out = f"{ev.get('verdict')} ({passed}/{len(gates)} gates passed"
    return out + (f"; failed: {', '.join(failed)})" if failed else ")")


def gate_lines(ck: dict[str, Any], paint: Paint = plain) -> list[str]:
    """The eval gates: each metric's candidate and parent value, their difference with its
    bootstrap interval, and whether the gate passed."""
    gates = (status(ck).get("eval") or {}).get("gates") or []
    if not gates:
        return []
    rows = []
    for g in gates:
        name = str(g.get("metric"))
        candidate, parent = g.get("candidate"), g.get("parent")
        change = (
            candidate - parent
            if isinstance(candidate, int | float) and isinstance(parent, int | float)
            else None
        )
        low = metric_number(g.get("ciLow"), name, signed=True)
        high = metric_number(g.get("ciHigh"), name, signed=True)
        rows.append(
            [
                name,
                metric_number(candidate, name),
                metric_number(parent, name),
                metric_number(change, name, signed=True),
                f"[{low}, {high}]",
                "yes" if g.get("passed") else "no",
            ]
        )
    headers = ["METRIC", "CANDIDATE", "PARENT", "DIFFERENCE", "CI (difference)", "PASSED"]

    def failed_red(cell: str, value: str | None) -> str:
        return paint(cell, CheckpointPhase.FAILED if value == "no" else None)

    return ["  Eval gates:", *table(headers, rows, "    ", paint=failed_red, styled=[5])]


def last_decision(ck: dict[str, Any]) -> tuple[str, str]:
    st = status(ck)
    manual = st.get("reason") == Reason.MANUAL_ROLLBACK
    if st.get("phase") == CheckpointPhase.ROLLED_BACK and manual:
        # promoted by its canary, then rolled back by hand: the last decision is the person's
        return Decision.ROLLBACK.value, one_line(st.get("message"))
    records = st.get("rollout") or []
    decided = [r for r in records if r.get("decision")]
    if not decided:
        return "-", "-"
    last = decided[-1]
    return str(last["decision"]), one_line(reason_text(last))


def step_number(record: dict[str, Any], position: int) -> str:
    """The step of spec.rollout.steps a record ran, from 1 (steps edited mid-canary restart
    at 1); a record of an older rtrl has only its position."""
    step = record.get("step")
    return str(int(step) + 1) if step is not None else str(position)


def rollout_lines(ck: dict[str, Any], now: datetime, paint: Paint = plain) -> list[str]:
    records = status(ck).get("rollout") or []
    if not records:
        return ["  Rollout:    not started"]
    rows = []
    for i, r in enumerate(records, 1):
        ended = stamp(r.get("endedAt")) if r.get("endedAt") else "running"
        rows.append(
            [
                step_number(r, i),
                weight_text(r),
                stamp(r.get("startedAt")),
                ended,
                text(r.get("analyses", 0)),
                text(r.get("decision")),
                text(r.get("baselineSamples")),
                text(r.get("canarySamples")),
            ]
        )
    headers = ["STEP", "WEIGHT", "STARTED", "ENDED", "ANALYSES", "DECISION", "BASELINE N"]
    out = ["  Rollout:", *table([*headers, "CANARY N"], rows, "    ", paint=paint, styled=[5])]
    for i, r in enumerate(records, 1):
        if not r.get("reason") and not r.get("metrics"):
            continue
        out.append("")
        decision = text(r.get("decision"))
        out.append(f"    Step {step_number(r, i)} at {weight_text(r)}: {paint(decision, decision)}")
        if r.get("reason"):
            out.append(f"      Reason: {one_line(reason_text(r))}")
        metrics = r.get("metrics") or []
        if metrics:
            out += ab_table(metrics, KUBECTL_HEADERS, indent="      ")
    return out


def checkpoint_lines(
    ck: dict[str, Any], role: str, now: datetime, paint: Paint = plain
) -> list[str]:
    st = status(ck)
    # as the report and the demo's console word it: "Promoted, later Superseded"
    decision = last_decision(ck)[0]
    raw = str(st.get("phase") or CheckpointPhase.PENDING)
    decided = outcome(raw, decision) if decision != "-" else (raw,)
    phase = ", later ".join(paint(p, p) for p in decided)
    if st.get("reason") or st.get("message"):
        detail = one_line(f"{st.get('reason') or ''}: {st.get('message') or ''}".strip(": "))
        phase = f"{phase} ({detail})"
    pairs = [
        ("Phase", phase),
        ("Cycle", text(spec(ck).get("cycle"))),
        ("Parent", text(spec(ck).get("parent"))),
        ("URI", text(spec(ck).get("uri"))),
        ("Started", when(st.get("startedAt"), now)),
    ]
    if st.get("completedAt"):
        pairs.append(("Completed", when(st.get("completedAt"), now)))
    data = st.get("data") or {}
    if data:
        on_policy = data.get("onPolicyFraction")
        share = f", {on_policy:.1%} on-policy" if isinstance(on_policy, int | float) else ""
        pairs.append(
            ("Data", f"{data.get('interactions', 0)} interactions, {data.get('tokens', 0)} tokens"
             f"{share}")
        )  # fmt: skip
    reported = progress_line(st, now)
    if reported:
        pairs.append(("Progress", reported))
    training = st.get("training") or {}
    if training:
        extra = "".join(
            f", {key} {number(training[key])}" for key in ("loss", "kl") if key in training
        )
        pairs.append(("Training", f"{training.get('steps', 0)} steps{extra}"))
    pairs.append(("Eval", eval_summary(ck)))
    return [
        f"{role} {meta(ck).get('name')}:",
        *fields(pairs, indent="  "),
        *gate_lines(ck, paint),
        *rollout_lines(ck, now, paint),
    ]


# --- the views ---------------------------------------------------------------------------
def rlcycle_lines(rlc: dict[str, Any], now: datetime, paint: Paint = plain) -> list[str]:
    """The RLCycle's block: phase, cycle, what serves, the canary, requests, conditions."""
    st, sp, md = status(rlc), spec(rlc), meta(rlc)
    raw = str(st.get("phase") or RLCyclePhase.PENDING)
    phase = paint(raw, raw)
    if st.get("message"):
        phase = f"{phase} ({one_line(st.get('message'))})"
    stale = (
        st.get("observedGeneration") is not None
        and md.get("generation") is not None
        and int(st["observedGeneration"]) < int(md["generation"])
    )
    if stale:
        phase += "  [the operator has not yet seen the latest spec]"
    weight = int(st.get("canaryWeight") or 0)
    pairs = [
        ("Phase", phase),
        ("Cycle", text(st.get("cycle"))),
        ("Serving", text(st.get("serving"))),
        ("Candidate", text(st.get("candidate"))),
        ("Canary weight", f"{weight}%"),
        ("Last promoted", text(st.get("lastPromoted"))),
        ("Next run", when(st.get("nextRun"), now) if st.get("nextRun") else "-"),
    ]
    if sp.get("suspend"):
        pairs.append(("Suspended", "yes (spec.suspend: true): no new cycle starts"))
    if sp.get("pin"):
        pairs.append(("Pinned", f"{sp['pin']} (spec.pin): no cycles start"))
    annotations = md.get("annotations") or {}
    for verb, key in (("trigger", "lastTrigger"), ("rollback", "lastRollback"),
                      ("promote", "lastPromote")):  # fmt: skip
        requested = annotations.get(f"{GROUP}/{verb}")
        if requested and requested != st.get(key):
            pairs.append((f"Pending {verb}", f"{GROUP}/{verb}={requested} (not yet handled)"))
    lines = [f"RLCycle {md.get('namespace', '')}/{md.get('name')}:".replace(" /", " ")]
    lines += fields(pairs, indent="  ")
    conditions = list(st.get("conditions") or [])
    notable = [c for c in conditions if HEALTHY.get(str(c.get("type"))) not in (None, c["status"])]
    usual = [c for c in conditions if c not in notable]
    lines.append("  Conditions:")
    if not conditions:
        lines.append("    none reported yet (is the operator running?)")
    for c in notable:
        lines.append(f"    ! {condition_line(c)}")
    for c in usual:
        lines.append(f"    {condition_line(c)}")
    return lines


def render_status(
    rlc: dict[str, Any], checkpoint: dict[str, Any] | None, role: str, now: datetime
) -> str:
    """The RLCycle, then its candidate (or last) Checkpoint (``kubectl rtrl status`` adds
    the tree of its objects and the Events: :mod:`.view`)."""
    lines = rlcycle_lines(rlc, now)
    if checkpoint is not None:
        lines += ["", *checkpoint_lines(checkpoint, role, now)]
    return "\n".join(lines) + "\n"


def newest_first(checkpoints: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    def key(ck: dict[str, Any]) -> tuple[int, str, str]:
        cycle = spec(ck).get("cycle")
        return (
            int(cycle) if isinstance(cycle, int) else -1,
            str(meta(ck).get("creationTimestamp") or ""),
            str(meta(ck).get("name") or ""),
        )

    return sorted(checkpoints, key=key, reverse=True)


def render_history(
    checkpoints: Sequence[dict[str, Any]], serving: str | None, now: datetime
) -> str:
    """``kubectl rtrl history``: one row per Checkpoint, newest first; ``*`` marks the
    serving one."""
    rows = []
    for ck in newest_first(checkpoints):
        name = str(meta(ck).get("name"))
        decision, reason = last_decision(ck)
        rows.append(
            [
                f"{'*' if name == serving else ' '} {name}",
                text(spec(ck).get("cycle")),
                text(status(ck).get("phase")),
                text(spec(ck).get("parent")),
                text((status(ck).get("eval") or {}).get("verdict")),
                decision,
                one_line(reason, REASON_WIDTH),
                age(ck, now),
            ]
        )
    headers = ["  NAME", "CYCLE", "PHASE", "PARENT", "EVAL", "DECISION", "REASON", "AGE"]
    lines = table(headers, rows)
    if serving:
        lines.append(f"(* serving: {serving})")
    return "\n".join(lines) + "\n"
