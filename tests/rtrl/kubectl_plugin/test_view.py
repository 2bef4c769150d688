"""What ``kubectl rtrl status`` (one-off and ``--watch``) and ``list`` print, from objects
written by hand: the tree of the cycle's objects, the eval gates, the Events, the list's
columns, colours that never shift a column, and when ``wait`` counts a phase as reached
(rtrl.kubectl_plugin.view, .render, .live: pure functions of the objects and the clock)."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from rtrl.kubectl_plugin import live
from rtrl.kubectl_plugin.render import checkpoint_lines, plain, render_history, table
from rtrl.kubectl_plugin.view import Snapshot, event_lines, frame, list_lines, tree_lines
from rtrl.phasestyle import ansi

NOW = datetime(2026, 5, 1, 12, 0, tzinfo=UTC)
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def at(**delta: float) -> str:
    return (NOW - timedelta(**delta)).strftime("%Y-%m-%dT%H:%M:%SZ")


def obj(kind: str, name: str, created: str, status: dict[str, Any] | None = None,
        **extra: Any) -> dict[str, Any]:  # fmt: skip
    md = {"name": name, "namespace": "ml", "uid": f"uid-{name}", "resourceVersion": "1",
          "creationTimestamp": created, **extra.pop("metadata", {})}  # fmt: skip
    return {"kind": kind, "metadata": md, "status": status or {}, **extra}


RLC = obj("RLCycle", "composer", at(days=3),
          {"phase": "Canary", "cycle": 2, "serving": "composer-1", "candidate": "composer-2",
           "canaryWeight": 25, "nextRun": at(hours=-3)})  # fmt: skip
GATES = [
    {"metric": "replay.kl", "candidate": 0.01, "parent": 0.0, "ciLow": 0.005, "ciHigh": 0.015,
     "passed": True},
    {"metric": "tasks.pass_at_1", "candidate": 0.41, "parent": 0.5, "ciLow": -0.14,
     "ciHigh": -0.04, "passed": False},
]  # fmt: skip
RELATIVE = {"name": "edit_persistence", "baseline": 0.6, "canary": 0.62, "difference": 0.02,
            "relativeDifference": 0.0333, "relativeCiLow": -0.008, "relativeCiHigh": 0.075,
            "verdict": "inconclusive"}  # fmt: skip
CANDIDATE = obj("Checkpoint", "composer-2", at(hours=4),
                {"phase": "Canary", "eval": {"verdict": "Failed", "gates": GATES},
                 "rollout": [{"weight": 25, "startedAt": at(hours=1), "analyses": 1,
                              "decision": "continue", "metrics": [RELATIVE]}]},
                spec={"cycle": 2, "parent": "composer-1", "rlCycle": "composer"})  # fmt: skip
SERVING = obj("Checkpoint", "composer-1", at(days=1), {"phase": "Promoted"})


def job(step: str, minutes: int, status: dict[str, Any]) -> dict[str, Any]:
    labels = {"rtrl.io/step": step, "rtrl.io/attempt": "1"}
    return obj("Job", f"composer-2-{step}-1", at(minutes=minutes), status,
               metadata={"labels": labels})  # fmt: skip


JOBS = [
    job("train", 200, {"conditions": [{"type": "Complete", "status": "True"}]}),
    job("stage", 230, {"conditions": [{"type": "Complete", "status": "True"}]}),
    job("analyze-1", 2, {"active": 1}),
    job("eval", 150, {"conditions": [{"type": "Failed", "status": "True"}]}),
]
CANARY = obj("Deployment", "composer-vllm-canary", at(hours=1), {"readyReplicas": 1},
             spec={"replicas": 1})  # fmt: skip


def event(name: str, reason: str, minutes: float, kind: str = "Checkpoint", **more: Any) -> Any:
    return {"metadata": {"name": f"{name}.{reason}", "resourceVersion": "1"},
            "involvedObject": {"kind": kind, "name": name}, "reason": reason,
            "type": "Normal", "message": f"{reason} of {name}",
            "lastTimestamp": at(minutes=minutes), **more}  # fmt: skip


def snapshot(**changes: Any) -> Snapshot:
    base: dict[str, Any] = dict(rlcycle=RLC, checkpoint=CANDIDATE, serving=SERVING, jobs=JOBS,
                                canaries=[CANARY], events=[])  # fmt: skip
    return Snapshot(**(base | changes))


def test_the_tree_nests_the_cycle_s_objects_under_the_rlcycle() -> None:
    lines = tree_lines(snapshot(), NOW)
    assert [line.split()[:3] for line in lines] == [
        ["NAME", "KIND", "STATUS"],
        ["composer", "RLCycle", "Canary"],
        ["├──", "composer-1", "Checkpoint"],
        ["└──", "composer-2", "Checkpoint"],
        ["├──", "composer-2-stage-1", "Job"],  # oldest first
        ["├──", "composer-2-train-1", "Job"],
        ["├──", "composer-2-eval-1", "Job"],
        ["├──", "composer-2-analyze-1-1", "Job"],
        ["└──", "composer-vllm-canary", "Deployment"],
    ]
    assert lines[1].split()[3:] == ["3d", "cycle", "2,", "serving", "composer-1"]
    assert lines[2].split()[3:] == ["Promoted", "24h", "serving"]
    assert lines[3].split()[3:] == ["Canary", "4h", "candidate"]
    assert lines[4].startswith("    ├── composer-2-stage-1 ")  # under the last checkpoint
    states = {line.split()[1]: line.split()[3:] for line in lines[4:8]}
    assert states["composer-2-stage-1"] == ["Succeeded", "3h50m", "stage,", "attempt", "1"]
    assert states["composer-2-eval-1"][0] == "Failed"
    assert states["composer-2-analyze-1-1"][:2] == ["Running", "2m"]
    assert lines[8].split()[3:] == ["Ready", "1h", "canary", "25%,", "1/1", "ready"]
    # one column each: every STATUS cell starts at the header's offset
    offset = lines[0].index("STATUS")
    assert all(line[offset - 2 : offset] == "  " and line[offset] != " " for line in lines[1:])


def test_a_last_cycle_that_serves_and_what_could_not_be_read() -> None:
    promoted = {**CANDIDATE, "status": {"phase": "Promoted"}}
    rlc = {**RLC, "status": {"phase": "Idle", "cycle": 2, "serving": "composer-2"}}
    snap = snapshot(rlcycle=rlc, checkpoint=promoted, serving=promoted, role="Last cycle",
                    jobs=[], canaries=[], unreadable=["events: forbidden: GET ..."])  # fmt: skip
    lines = tree_lines(snap, NOW)
    assert len(lines) == 4
    assert lines[2].split() == ["└──", "composer-2", "Checkpoint", "Promoted", "4h", "last",
                                "cycle,", "serving"]  # fmt: skip
    assert lines[3] == "(events: forbidden: GET ...)"


def test_the_gates_table_and_the_relative_ab_row_in_the_frame() -> None:
    out = frame(snapshot(), NOW)
    gates = out.split("  Eval gates:\n")[1].splitlines()
    assert gates[0].split() == ["METRIC", "CANDIDATE", "PARENT", "DIFFERENCE", "CI",
                                "(difference)", "PASSED"]  # fmt: skip
    assert gates[1].split() == ["replay.kl", "0.010", "0.000", "+0.010", "[+0.005,", "+0.015]",
                                "yes"]  # fmt: skip
    assert gates[2].split() == ["tasks.pass_at_1", "0.410", "0.500", "-0.090", "[-0.140,",
                                "-0.040]", "no"]  # fmt: skip
    # The A/B row: relative change and always-valid interval, as the console and report
    row = next(line.split() for line in out.splitlines() if "edit_persistence" in line)
    assert row == ["edit_persistence", "0.600", "0.620", "+3.3%", "[-0.8%,", "+7.5%]",
                   "inconclusive"]  # fmt: skip
    assert "(abs)" not in out
    assert out.index("RLCycle ml/composer:") < out.index("NAME ") < out.index("Candidate ")
    assert out.rstrip().endswith("Events: none")


def test_events_oldest_first_the_last_few_with_counts() -> None:
    events = [event("composer-2", f"Reason{i}", minutes=20 - i) for i in range(10)]
    events.append(event("composer", "CycleStarted", 30, kind="RLCycle", count=3))
    events.append(event("composer-2", "CanaryAborted", 0.5, type="Warning",
                        message="canary " + "x" * 200))  # fmt: skip
    lines = event_lines(events, NOW)
    assert lines[0] == "Events (last 8):"
    assert lines[1].split() == ["AGE", "TYPE", "REASON", "OBJECT", "MESSAGE"]
    assert [line.split()[2] for line in lines[2:]] == [f"Reason{i}" for i in range(3, 10)] + [
        "CanaryAborted"
    ]
    assert lines[-1].split()[:4] == ["30s", "Warning", "CanaryAborted", "Checkpoint/composer-2"]
    assert lines[-1].endswith("...") and len(lines[-1].split("canary ")[1]) == 100 - 7
    shown = event_lines(events[-2:-1], NOW)
    assert shown[2].split()[:4] == ["30m", "(x3)", "Normal", "CycleStarted"]


def test_list_one_row_per_rlcycle() -> None:
    idle = obj("RLCycle", "planner", at(hours=2), {"phase": "Idle", "cycle": 7,
               "serving": "planner-7", "nextRun": at(minutes=5)},
               metadata={"namespace": "agents"})  # fmt: skip
    lines = list_lines([RLC, idle], NOW, all_namespaces=True)
    assert [line.split() for line in lines] == [
        ["NAMESPACE", "NAME", "PHASE", "SERVING", "CANDIDATE", "CANARY", "CYCLE", "NEXT", "RUN",
         "AGE"],
        ["agents", "planner", "Idle", "planner-7", "-", "0%", "7", "5m", "ago", "2h"],
        ["ml", "composer", "Canary", "composer-1", "composer-2", "25%", "2", "in", "3h", "3d"],
    ]  # fmt: skip
    one = list_lines([RLC], NOW, all_namespaces=False)
    assert one[0].split()[0] == "NAME" and one[1].split()[:2] == ["composer", "Canary"]


def test_colours_paint_phases_without_shifting_columns() -> None:
    painted = tree_lines(snapshot(), NOW, ansi)
    assert "\x1b[33mCanary" in painted[1] and "\x1b[32mPromoted" in painted[2]
    assert [ANSI.sub("", line) for line in painted] == tree_lines(snapshot(), NOW, plain)
    out = frame(snapshot(), NOW, ansi)
    assert "Phase:          \x1b[33mCanary\x1b[0m" in out
    assert "\x1b[1;31mno\x1b[0m" in out  # the failed gate
    lines = table(["A", "B"], [["Failed", "x"], ["Promoted", "y"]], paint=ansi, styled=[0])
    assert [ANSI.sub("", line) for line in lines] == ["A         B", "Failed    x", "Promoted  y"]


def test_the_painter_follows_the_terminal_and_no_color(monkeypatch: pytest.MonkeyPatch) -> None:
    class Tty:
        def __init__(self, tty: bool) -> None:
            self.tty = tty

        def isatty(self) -> bool:
            return self.tty

    monkeypatch.delenv("NO_COLOR", raising=False)
    assert live.painter(Tty(True)) is ansi  # type: ignore[arg-type]
    assert live.painter(Tty(False)) is plain  # type: ignore[arg-type]
    monkeypatch.setenv("NO_COLOR", "1")
    assert live.painter(Tty(True)) is plain  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("target", "phase", "seen", "rlc_phase", "verdict"),
    [
        ("Promoted", "Canary", set(), "Canary", None),
        ("Promoted", "Promoted", set(), "Idle", True),
        ("Promoted", "RolledBack", {"Canary"}, "Idle", False),
        ("Promoted", "Rejected", set(), "Idle", False),
        ("RolledBack", "RolledBack", set(), "Idle", True),
        # a phase no look caught, passed on the way
        ("Training", "Evaluating", set(), "Evaluating", True),
        ("Canary", "Promoted", set(), "Idle", True),
        ("Canary", "Rejected", {"Evaluating"}, "Idle", False),
        ("Evaluated", "Rejected", set(), "Idle", True),
        ("Training", "Failed", {"Training"}, "Idle", True),
        ("Canary", "Failed", {"Training"}, "Idle", False),
        ("Promoting", "Canary", set(), "Promoting", True),
        ("Promoting", "Promoted", set(), "Idle", True),
        ("Promoting", "RolledBack", set(), "Idle", False),
    ],
)
def test_when_wait_counts_a_phase_as_reached(
    target: str, phase: str, seen: set[str], rlc_phase: str, verdict: bool | None
) -> None:
    assert live.reached(target, phase, seen, rlc_phase) is verdict


def test_a_superseded_checkpoint_reads_as_the_report_words_it() -> None:
    """Promoted by its canary, replaced by a later promotion: "Promoted, later Superseded",
    each word in its own colour, as the demo's report and console say (rtrl.phasestyle)."""
    promoted = [{"weight": 50, "startedAt": at(hours=9), "analyses": 3, "decision": "promote"}]
    old = obj("Checkpoint", "composer-1", at(days=1), {"phase": "Superseded", "rollout": promoted},
              spec={"cycle": 1, "parent": "composer-0", "rlCycle": "composer"})  # fmt: skip
    base = obj("Checkpoint", "composer-0", at(days=2), {"phase": "Superseded"})
    lines = checkpoint_lines(old, "last", NOW)
    assert any("Promoted, later Superseded" in line for line in lines), lines
    coloured = "\n".join(checkpoint_lines(old, "last", NOW, ansi))
    assert f"{ansi('Promoted', 'Promoted')}, later {ansi('Superseded', 'Superseded')}" in coloured
    # registered by hand, never decided by a canary: its phase alone
    assert not any("Promoted" in line for line in checkpoint_lines(base, "last", NOW))


def test_history_of_a_promoted_checkpoint_rolled_back_by_hand_says_rollback() -> None:
    """Promoted by its canary, later rolled back with `kubectl rtrl rollback`: history said
    DECISION promote with the promotion's reason, and the rollback appeared nowhere."""
    now = datetime(2026, 11, 29, 12, tzinfo=UTC)
    promoted_then_back = {
        "metadata": {"name": "composer-1", "creationTimestamp": "2026-11-29T01:00:00Z"},
        "spec": {"cycle": 1, "parent": "composer-0"},
        "status": {"phase": "RolledBack", "reason": "ManualRollback",
                   "message": "rtrl.io/rollback=back-1: serving composer-0 again",
                   "rollout": [{"weight": 5, "decision": "promote",
                                "reason": "edit_persistence better"}]},
    }  # fmt: skip
    base = {"metadata": {"name": "composer-0", "creationTimestamp": "2026-11-29T00:00:00Z"},
            "spec": {}, "status": {"phase": "Promoted", "reason": "ServingAgain"}}  # fmt: skip
    out = render_history([promoted_then_back, base], "composer-0", now)
    row = next(line for line in out.splitlines() if "composer-1" in line)
    assert "rollback" in row and "rtrl.io/rollback=back-1" in row, out
    assert "edit_persistence better" not in row


def test_watch_rows_are_cut_as_the_terminal_wraps_them_and_fit_its_height() -> None:
    """``status --watch`` counts a line wider than the terminal as the rows the terminal
    wraps it into (tests/e2e/test_kubectl_live.py sees the header kept in a real one)."""
    assert live.rows("abcdefghij", 5) == ["abcd", "efgh", "ij"]  # the last column stays free
    assert live.rows("", 5) == [""]
    painted = ansi("Promoted", "Promoted") + " now"
    cut = live.rows(painted, 6)
    assert [ANSI.sub("", r) for r in cut] == ["Promo", "ted n", "ow"]
    assert "".join(cut) == painted  # the colour codes kept, taking no column
    assert live.rows("模型模型", 6) == ["模型", "模型"]  # a wide character takes two
    frame = "title " * 20 + "\n\n" + "\n".join(f"line {i}" for i in range(30))
    shown = live.fit(frame, 12, 60)
    assert len(shown) == 11 and all(len(r) <= 59 for r in shown)
    assert shown[:4] == [("title " * 20)[:59], ("title " * 20)[59:118], "e ", ""]
    assert shown[4:10] == [f"line {i}" for i in range(6)]
    assert shown[-1] == "... 24 more rows: a larger terminal shows them"
