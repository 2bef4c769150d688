"""Phases, decisions, condition types and reasons are spelled once, in their enums: a literal
"Canary" or "RolledBack" anywhere else in the code is a second spelling that can drift from the
first (a typo in one is a state nothing matches). This reads every module under src/ and fails
on a string constant equal to a member of one of the vocabularies, outside the enum that
defines it."""

from __future__ import annotations

import ast
from enum import StrEnum
from pathlib import Path

import pytest

from rtrl.core.api.checkpoint import CheckpointPhase, Decision, Verdict
from rtrl.core.api.reasons import ConditionType, JobCondition, PodPhase, Reason
from rtrl.core.api.rlcycle import NotificationEvent, RLCyclePhase
from rtrl.core.results.analysis import CauseKind
from rtrl.core.results.evaluation import EvalFailure

SRC = Path(__file__).resolve().parents[4] / "src"
VOCABULARIES: tuple[type[StrEnum], ...] = (
    CheckpointPhase,
    RLCyclePhase,
    Decision,
    Verdict,
    ConditionType,
    Reason,
    NotificationEvent,
    CauseKind,
    EvalFailure,
    JobCondition,
    PodPhase,
)
WORDS = {m.value: type(m).__name__ for v in VOCABULARIES for m in v}

# (module relative to src/, word): the same letters meaning something else, and why.
ALLOWED: dict[tuple[str, str], str] = {
    # outside rtrl/planning
    ("rtrl/core/api/__init__.py", "Serving"): "a printer column's heading",
    ("rtrl/core/api/__init__.py", "Canary"): "a printer column's heading (the canary weight)",
    ("rtrl/kube/informer.py", "continue"): "a list's continue token (Kubernetes' pages)",
    ("rtrl/kubectl_plugin/commands.py", "promote"): "the kubectl rtrl verb",
    ("rtrl/kubectl_plugin/commands.py", "rollback"): "the kubectl rtrl verb",
    ("rtrl/kubectl_plugin/parser.py", "rollback"): "the kubectl rtrl verb",
    ("rtrl/kubectl_plugin/render.py", "Training"): "a heading: status.training's numbers",
    ("rtrl/kubectl_plugin/render.py", "Serving"): "a heading: status.serving",
    ("rtrl/kubectl_plugin/render.py", "Suspended"): "a heading: spec.suspend",
    ("rtrl/kubectl_plugin/render.py", "Pinned"): "a heading: spec.pin",
    ("rtrl/kubectl_plugin/render.py", "promote"): "the verb in the annotation rtrl.io/promote",
    ("rtrl/kubectl_plugin/render.py", "rollback"): "the verb in the annotation rtrl.io/rollback",
    ("rtrl/kubectl_plugin/view.py", "Suspended"): "a Job's state: its spec.suspend",
    ("rtrl/kubectl_plugin/view.py", "Ready"): "a Deployment's state: its replicas ready",
    ("rtrl/kubectl_plugin/view.py", "Progressing"): "a Deployment's state: rolling out",
    ("rtrl_demo/report.py", "Training"): "a section's title",
    ("rtrl_demo/scenario.py", "inconclusive"): "the field spec.rollout.analysis.inconclusive",
    ("rtrl_localkube/emulator_state.py", "Invalid"): "a Kubernetes Status reason (HTTP 422)",
    ("rtrl_localkube/node.py", "Ready"): "a Node's condition type",
    ("rtrl_localkube/podlife.py", "Ready"): "a Pod's condition type",
    ("rtrl_trainer/analyze/rule.py", "inconclusive"): "a metric's verdict, not the cause",
    ("rtrl_trainer/analyze/rule.py", "guardrail"): "a metric's kind (goal or guardrail)",
}


def _enum_values(tree: ast.AST) -> set[int]:
    """ids of the constants that are the members' values of a StrEnum class body."""
    ids: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and any(
            isinstance(b, ast.Name) and b.id == "StrEnum" for b in node.bases
        ):
            for stmt in node.body:
                if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Constant):
                    ids.add(id(stmt.value))
    return ids


def _docstrings(tree: ast.AST) -> set[int]:
    ids: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            ids.add(id(node.value))
    return ids


def literals(path: Path) -> list[tuple[int, str]]:
    """(line, word) of each vocabulary word spelled as a literal in the module."""
    tree = ast.parse(path.read_text(), filename=str(path))
    skip = _enum_values(tree) | _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and node.value in WORDS
            and id(node) not in skip
        ):
            found.append((node.lineno, node.value))
    return sorted(found)


def test_no_phase_decision_or_reason_is_spelled_outside_its_enum() -> None:
    found = []
    for path in sorted(SRC.rglob("*.py")):
        module = path.relative_to(SRC).as_posix()
        for line, word in literals(path):
            if (module, word) not in ALLOWED:
                found.append(f"{module}:{line}: {word!r} ({WORDS[word]})")
    assert not found, f"{len(found)} spelled outside their enum:\n" + "\n".join(found)


def test_the_scan_finds_a_literal_and_skips_the_enum(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text(
        '"""Canary"""\n'
        "from enum import StrEnum\n"
        "class Phase(StrEnum):\n"
        '    CANARY = "Canary"\n'
        "def f(ck):\n"
        '    return ck["phase"] == "Canary" or ck["reason"] in ("RolledBack", "x")\n'
    )
    assert literals(module) == [(6, "Canary"), (6, "RolledBack")]


@pytest.mark.parametrize(
    ("subject", "what", "reason"),
    [
        ("stage", "Started", Reason.STAGE_STARTED),
        ("train", "Retrying", Reason.TRAIN_RETRYING),
        ("eval", "Failed", Reason.EVAL_FAILED),
        ("analysis", "Promote", Reason.ANALYSIS_PROMOTE),
    ],
)
def test_a_reason_made_of_a_steps_name_is_a_member(subject: str, what: str, reason: Reason) -> None:
    assert Reason.of(subject, what) is reason


def test_a_reason_that_is_not_a_member_is_refused() -> None:
    with pytest.raises(ValueError, match="Seal"):
        Reason.of("seal", "Started")
