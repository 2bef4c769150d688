"""The crash suite's invariants catch what they name: each rule is shown a history that
breaks it (and the clean history next to it), so a check that cannot fail fails here."""

from __future__ import annotations

from itertools import count
from typing import Any

from rtrl_localkube.invariants import Ledger, status_problems

_rv = count(1)
URI = "file:///store/composer-1/model/"
BASE = "file:///store/base/"


def obj(kind: str, name: str, uid: str | None = None, **body: Any) -> dict[str, Any]:
    meta = {"name": name, "uid": uid or f"uid-{name}", "resourceVersion": str(next(_rv))}
    meta.update(body.pop("metadata", {}))
    return {"kind": kind, "metadata": meta, **body}


def rlcycle(**status: Any) -> dict[str, Any]:
    spec = {
        "historyLimit": 2,
        "target": {"deployment": "vllm", "container": "vllm", "checkpointEnv": "MODEL_URI"},
    }
    return obj("RLCycle", "composer", spec=spec, status=status)


def checkpoint(name: str, cycle: int, phase: str | None, uid: str | None = None,
               **status: Any) -> dict[str, Any]:  # fmt: skip
    spec = {"rlCycle": "composer", "cycle": cycle, "uri": URI.replace("composer-1", name)}
    return obj("Checkpoint", name, uid, spec=spec, status={"phase": phase, **status})


def job(name: str, step: str, ck_uid: str = "uid-composer-1", uid: str | None = None,
        done: bool = False) -> dict[str, Any]:  # fmt: skip
    labels = {"rtrl.io/rlcycle": "composer", "rtrl.io/step": step, "rtrl.io/checkpoint-uid": ck_uid}
    conditions = [{"type": "Complete", "status": "True"}] if done else []
    return obj("Job", name, uid, metadata={"labels": labels}, status={"conditions": conditions})


def deployment(name: str, uri: str, replicas: int = 1, arm: str | None = None) -> dict[str, Any]:
    labels = {"rtrl.io/arm": arm} if arm else {}
    container = {"name": "vllm", "env": [{"name": "MODEL_URI", "value": uri}]}
    template = {"metadata": {"labels": labels}, "spec": {"containers": [container]}}
    return obj("Deployment", name, spec={"replicas": replicas, "template": template})


def ledger_with(*events: tuple[str, dict[str, Any]]) -> Ledger:
    ledger = Ledger()
    ledger.feed("RLCycle", "ADDED", rlcycle())
    for event_type, o in events:
        ledger.feed(o["kind"], event_type, o)
    return ledger


def kinds(ledger: Ledger) -> list[str]:
    return [v.invariant for v in ledger.violations()]


def test_a_clean_cycle_breaks_nothing() -> None:
    ck = checkpoint("composer-1", 1, None)
    ledger = ledger_with(
        ("ADDED", deployment("vllm", BASE)),
        ("ADDED", ck),
        ("ADDED", job("composer-1-stage-0", "stage")),
        ("MODIFIED", job("composer-1-stage-0", "stage", done=True)),
        ("ADDED", job("composer-1-train-0", "train")),
        ("MODIFIED", checkpoint("composer-1", 1, "Evaluated", eval={"verdict": "Passed"})),
        ("ADDED", deployment("vllm-canary", URI, arm="canary")),
        ("MODIFIED", deployment("vllm", URI)),
        ("MODIFIED", checkpoint("composer-1", 1, "Promoted", eval={"verdict": "Passed"})),
        ("ADDED", checkpoint("composer-2", 2, None)),
    )
    assert ledger.violations() == []
    assert ledger.created("Job") == ["composer-1-stage-0", "composer-1-train-0"]


def test_a_job_recreated_or_doubled_is_a_duplicate() -> None:
    recreated = ledger_with(
        ("ADDED", job("composer-1-stage-0", "stage", uid="a")),
        ("DELETED", job("composer-1-stage-0", "stage", uid="a")),
        ("ADDED", job("composer-1-stage-0", "stage", uid="b")),
    )
    assert kinds(recreated) == ["duplicate-job"]
    doubled = ledger_with(
        ("ADDED", job("composer-1-stage-0", "stage")), ("ADDED", job("composer-1-stage-1", "stage"))
    )
    assert kinds(doubled) == ["duplicate-job"]
    retried = ledger_with(
        ("ADDED", job("composer-1-stage-0", "stage")),
        ("MODIFIED", job("composer-1-stage-0", "stage", done=True)),
        ("ADDED", job("composer-1-stage-1", "stage")),
    )
    assert kinds(retried) == []


def test_a_checkpoint_recreated_doubled_or_overlapping_is_a_duplicate() -> None:
    again = ledger_with(
        ("ADDED", checkpoint("composer-1", 1, None, uid="a")),
        ("DELETED", checkpoint("composer-1", 1, None, uid="a")),
        ("ADDED", checkpoint("composer-1", 1, None, uid="b")),
    )
    assert kinds(again) == ["duplicate-checkpoint"]
    same_cycle = ledger_with(
        ("ADDED", checkpoint("composer-1", 1, "Failed")), ("ADDED", checkpoint("other", 1, None))
    )
    assert kinds(same_cycle) == ["duplicate-checkpoint"]
    overlap = ledger_with(
        ("ADDED", checkpoint("composer-1", 1, "Training")),
        ("ADDED", checkpoint("composer-2", 2, None)),
    )
    assert kinds(overlap) == ["duplicate-checkpoint"]


def test_a_checkpoint_deleted_unless_insufficient_pruned_or_its_rlcycle_went_is_lost() -> None:
    lost = ledger_with(
        ("ADDED", checkpoint("composer-1", 1, "Training", data={})),
        ("DELETED", checkpoint("composer-1", 1, "Training", data={})),
    )
    assert kinds(lost) == ["lost-checkpoint"]
    pruned_too_far = ledger_with(
        ("ADDED", checkpoint("composer-1", 1, "Promoted", data={})),
        ("ADDED", checkpoint("composer-2", 2, "Promoted", data={})),
        ("DELETED", checkpoint("composer-1", 1, "Promoted", data={})),
    )
    assert kinds(pruned_too_far) == ["lost-checkpoint"]  # 1 left, historyLimit 2
    insufficient = ledger_with(
        ("ADDED", checkpoint("composer-1", 1, "Staging")),
        ("DELETED", checkpoint("composer-1", 1, "Staging")),
    )
    assert kinds(insufficient) == []
    gone = ledger_with(
        ("ADDED", checkpoint("composer-1", 1, "Training", data={})),
        ("DELETED", checkpoint("composer-1", 1, "Training", data={})),
    )
    gone.feed("RLCycle", "DELETED", rlcycle())  # its RLCycle's deletion, seen later
    assert kinds(gone) == []
    # judged before that event arrives: a direct read of the RLCycle decides, and says
    # whether it still exists
    not_yet = ledger_with(
        ("ADDED", checkpoint("composer-1", 1, "Training", data={})),
        ("DELETED", checkpoint("composer-1", 1, "Training", data={})),
    )
    assert [v.invariant for v in not_yet.violations(lambda name: name == "composer")] == []
    assert [v.invariant for v in not_yet.violations(lambda name: False)] == ["lost-checkpoint"]


def test_serving_or_a_canary_before_eval_passed_is_caught() -> None:
    early = ledger_with(
        ("ADDED", checkpoint("composer-1", 1, "Evaluating")),
        ("ADDED", deployment("vllm-canary", URI, arm="canary")),
        ("MODIFIED", checkpoint("composer-1", 1, "Evaluated", eval={"verdict": "Passed"})),
    )
    assert kinds(early) == ["unevaluated-serving"]
    rejected = ledger_with(
        ("ADDED", checkpoint("composer-1", 1, "Rejected", eval={"verdict": "Failed"})),
        ("MODIFIED", deployment("vllm", URI)),
    )
    assert kinds(rejected) == ["unevaluated-serving"]


def test_the_status_is_checked_against_the_children() -> None:
    base = obj("Checkpoint", "composer-0", spec={"uri": BASE}, status={"phase": "Promoted"})
    ck = checkpoint("composer-1", 1, "Training", data={})
    target = deployment("vllm", BASE)
    ok = rlcycle(phase="Training", serving="composer-0", candidate="composer-1", cycle=1)
    train = job("composer-1-train-0", "train")
    assert status_problems(ok, [base, ck], [train], [target]) == []
    problems = [str(p) for p in status_problems(ok, [base, ck], [], [target])]
    assert problems == ["status: RLCycle composer: phase Training, but composer-1 has no train Job"]
    idle = rlcycle(phase="Idle", serving="composer-1", cycle=0, canaryWeight=25)
    canary = deployment("vllm-canary", URI, arm="canary")
    problems = [str(p) for p in status_problems(idle, [base, ck], [train], [target, canary])]
    assert len(problems) == 6, problems  # serving, a Job, a Checkpoint, canary, weight, cycle
