"""The operator's Prometheus metrics follow the plans: observe_plan on a few transitions,
and the JSON log formatter's fields."""

from __future__ import annotations

import json
import logging
import re
from datetime import timedelta

from prometheus_client import REGISTRY, generate_latest

from rtrl.core.api.rlcycle import NotificationEvent, RLCyclePhase
from rtrl.core.results.evaluation import EvalFailure
from rtrl.logs import JsonFormatter
from rtrl.metrics import SERIES, observe_plan, reconcile_failed, set_object_source
from rtrl.planning import plan
from rtrl.planning.actions import Create, Emit, PatchStatus
from tests.conftest import REPO
from tests.rtrl.planning.test_plan import T0, World, analysis, run_cycle, to_canary

NS = "metrics-test"
# The operator's own series (docs/monitoring.md lists them too).
OPERATOR_SERIES = {
    "rtrl_cycles_total",
    "rtrl_phase_duration_seconds",
    "rtrl_decisions_total",
    "rtrl_events_total",
    "rtrl_job_failures_total",
    "rtrl_reconcile_errors_total",
    "rtrl_last_promotion_age_seconds",
}


def value(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, {"namespace": NS, **labels}) or 0.0


def test_a_cycle_from_staging_to_promotion() -> None:
    rlc = "m-promote"
    observe_plan(rlc, NS, {"phase": "Idle"}, {"phase": "Staging", "canaryWeight": 0}, [
        Create({"kind": "Job", "metadata": {"name": f"{rlc}-1-stage-0"}}),
        Emit("RLCycle", rlc, "CycleStarted", "cycle 1"),
    ], now=1000.0)  # fmt: skip
    assert value("rtrl_decisions_total", action="create", kind="Job") >= 1
    assert value("rtrl_events_total", reason="CycleStarted", type="Normal") >= 1
    observe_plan(rlc, NS, {"phase": "Staging"}, {"phase": "Training"}, [], now=1100.0)
    assert value("rtrl_phase_duration_seconds_sum", rlcycle=rlc, phase="Staging") == 100.0
    observe_plan(rlc, NS, {"phase": "Training"}, {"phase": "Canary", "canaryWeight": 25}, [],
                 now=1200.0)  # fmt: skip
    assert value("rtrl_phase_duration_seconds_count", rlcycle=rlc, phase="Training") == 1.0
    observe_plan(rlc, NS, {"phase": "Canary", "canaryWeight": 25},
                 {"phase": "Idle", "canaryWeight": 0, "lastPromoted": f"{rlc}-1"}, [
        PatchStatus("rtrl.io/v1alpha1", "Checkpoint", f"{rlc}-1", {"phase": "Promoted"}),
        Emit("RLCycle", rlc, "Promoted", f"{rlc}-1 now serves"),
    ], now=1300.0)  # fmt: skip
    assert value("rtrl_cycles_total", rlcycle=rlc, result="promoted") == 1.0
    age = value("rtrl_last_promotion_age_seconds", rlcycle=rlc)
    assert age > 0  # since t=1300 (epoch seconds): far in the past


def test_failures_and_rejections() -> None:
    rlc = "m-fail"
    observe_plan(rlc, NS, {"phase": "Training"}, {"phase": "Training"}, [
        Emit("Checkpoint", f"{rlc}-3", "TrainRetrying", "failed: OOMKilled", warning=True),
    ])  # fmt: skip
    observe_plan(rlc, NS, {"phase": "Training"}, {"phase": "Idle"}, [
        Emit("Checkpoint", f"{rlc}-3", "TrainFailed", "failed", warning=True),
        Emit("RLCycle", rlc, "CycleFailed", "failed", warning=True),
    ])  # fmt: skip
    assert value("rtrl_job_failures_total", rlcycle=rlc, step="train") == 2.0
    assert value("rtrl_cycles_total", rlcycle=rlc, result="failed") == 1.0
    # The phase was already Training when first seen: its start is unknown, nothing observed.
    assert value("rtrl_phase_duration_seconds_count", rlcycle=rlc, phase="Training") == 0.0
    # A rejection, as the planner emits it: the eval's reason, the EvalRejected notification.
    rejected = (NotificationEvent.EVAL_REJECTED,)
    observe_plan(rlc, NS, {"phase": "Evaluating"}, {"phase": "Idle"}, [
        Emit("Checkpoint", f"{rlc}-4", EvalFailure.GATES_FAILED, "regressed", warning=True,
             notify=rejected),
        Emit("RLCycle", rlc, "CycleCompleted", "rejected", warning=True),
    ])  # fmt: skip
    assert value("rtrl_cycles_total", rlcycle=rlc, result="rejected") == 1.0
    # Every reason a rejection can have counts (SandboxUnsafe: the code suites not scored).
    observe_plan(rlc, NS, {"phase": "Evaluating"}, {"phase": "Idle"}, [
        Emit("Checkpoint", f"{rlc}-5", EvalFailure.SANDBOX_UNSAFE, "no sandbox", warning=True,
             notify=rejected),
    ])  # fmt: skip
    assert value("rtrl_cycles_total", rlcycle=rlc, result="rejected") == 2.0


def test_json_logs_carry_the_rlcycle_and_checkpoint() -> None:
    formatter = JsonFormatter()
    record = logging.LogRecord(
        "rtrl.kube", logging.INFO, __file__, 1, "created %s %s", ("Checkpoint", "composer-42"),
        None,
    )  # fmt: skip
    record.rlcycle = "composer"
    record.namespace = "ml-serving"
    entry = json.loads(formatter.format(record))
    assert entry["message"] == "created Checkpoint composer-42"
    assert entry["checkpoint"] == "composer-42"
    assert entry["rlcycle"] == "composer"
    assert entry["namespace"] == "ml-serving"
    assert entry["level"] == "info" and entry["logger"] == "rtrl.kube"
    kopf_record = logging.LogRecord("kopf.objects", logging.INFO, __file__, 1, "done", (), None)
    kopf_record.k8s_ref = {"kind": "RLCycle", "name": "composer", "namespace": "ml-serving"}
    entry = json.loads(formatter.format(kopf_record))
    assert entry["rlcycle"] == "composer" and "checkpoint" not in entry


RLCYCLE = {
    "metadata": {"namespace": NS, "name": "c"},
    "status": {"phase": "Canary", "cycle": 3, "canaryWeight": 10,
               "cycleStartedAt": "2026-11-29T00:00:00Z", "conditions": []},
}  # fmt: skip
CHECKPOINT = {
    "metadata": {"namespace": NS, "name": "c-3"},
    "spec": {"rlCycle": "c", "cycle": 3, "uri": "s3://b/c-3/"},
    "status": {
        "phase": "Canary",
        "startedAt": "2026-11-29T00:00:00Z",
        "data": {"interactions": 2000, "tokens": 90000, "onPolicyFraction": 0.95,
                 "quarantined": {"truncated": 3}, "filesBad": 0,
                 "reward": {"mean": 0.31, "std": 0.42, "min": -1.0, "max": 1.0},
                 "monitors": {"edit_rate": 0.6, "latency_p95_ms": 850.0},
                 "refused": {"raw_logprobs_tempered": 40},
                 "fidelity": {"partitionsChecked": 4, "partitionsQuarantined": 1,
                              "rows": 128, "tokens": 12741, "meanAbsDelta": 0.0041,
                              "maxAbsDelta": 0.031, "isWeightP01": 0.988,
                              "isWeightP99": 1.011}},
        "training": {"steps": 4, "tokens": 90000, "loss": 0.12, "kl": 0.003,
                     "clipFraction": 0.02},
        "eval": {"verdict": "Passed", "gates": [
            {"metric": "he.pass", "candidate": 0.5, "parent": 0.4, "ciLow": -0.01,
             "ciHigh": 0.2, "passed": True}]},
        "rollout": [
            {"weight": 5, "startedAt": "2026-11-29T01:00:00Z", "decision": "continue"},
            {"weight": 10, "startedAt": "2026-11-29T02:00:00Z", "baselineSamples": 40,
             "canarySamples": 7, "metrics": [
                {"name": "edit_persistence", "baseline": 0.6, "canary": 0.7, "difference": 0.1,
                 "ciLow": -0.2, "ciHigh": 0.3, "relativeDifference": 0.1667,
                 "relativeCiLow": -0.3, "relativeCiHigh": 0.5, "verdict": "inconclusive"},
                {"name": "latency_p95", "baseline": 800.0, "canary": 900.0,
                 "difference": 100.0, "ciLow": 50.0, "ciHigh": 150.0, "verdict": "tripped"}]}],
    },
}  # fmt: skip


def sample(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, {"namespace": NS, **labels})


def test_status_series_are_what_the_status_says() -> None:
    held = {"RLCycle": [RLCYCLE], "Checkpoint": [CHECKPOINT]}
    set_object_source(lambda kind: held[kind])
    rlc = {"rlcycle": "c"}
    # the phase as a state set: every phase, 1 for the current one
    assert sample("rtrl_rlcycle_phase", **rlc, phase="Canary") == 1.0
    assert sample("rtrl_rlcycle_phase", **rlc, phase="Training") == 0.0
    assert sum(sample("rtrl_rlcycle_phase", **rlc, phase=p.value) or 0
               for p in RLCyclePhase) == 1.0  # fmt: skip
    assert all(sample("rtrl_rlcycle_phase", **rlc, phase=p.value) is not None
               for p in RLCyclePhase)  # fmt: skip
    assert sample("rtrl_rlcycle_cycle", **rlc) == 3.0
    assert sample("rtrl_canary_weight_percent", **rlc) == 10.0
    assert sample("rtrl_rlcycle_cycle_started_timestamp_seconds", **rlc) == 1795910400.0
    assert sample("rtrl_rlcycle_next_run_timestamp_seconds", **rlc) is None  # not in status

    ck = {"rlcycle": "c", "checkpoint": "c-3"}
    assert sample("rtrl_checkpoint_phase", **ck, phase="Canary") == 1.0
    assert sample("rtrl_checkpoint_phase", **ck, phase="RolledBack") is None  # current only
    assert sample("rtrl_checkpoint_cycle", **ck) == 3.0
    assert sample("rtrl_checkpoint_started_timestamp_seconds", **ck) == 1795910400.0
    assert sample("rtrl_checkpoint_completed_timestamp_seconds", **ck) is None
    assert sample("rtrl_data_interactions", **ck) == 2000.0
    assert sample("rtrl_data_on_policy_fraction", **ck) == 0.95
    assert sample("rtrl_data_quarantined", **ck, reason="truncated") == 3.0
    assert sample("rtrl_data_reward", **ck, stat="std") == 0.42
    assert sample("rtrl_data_monitor", **ck, monitor="latency_p95_ms") == 850.0
    assert sample("rtrl_data_monitor", **ck, monitor="clarification_rate") is None
    assert sample("rtrl_data_refused", **ck, reason="raw_logprobs_tempered") == 40.0
    assert sample("rtrl_data_fidelity_partitions_quarantined", **ck) == 1.0
    assert sample("rtrl_data_fidelity_mean_abs_delta", **ck) == 0.0041
    assert sample("rtrl_data_fidelity_is_weight", **ck, quantile="0.99") == 1.011
    assert sample("rtrl_data_fidelity_is_weight", **ck, quantile="0.50") is None  # not in status
    assert sample("rtrl_data_fidelity_unsupported_fraction", **ck) is None
    assert sample("rtrl_training_loss", **ck) == 0.12
    assert sample("rtrl_training_clip_fraction", **ck) == 0.02
    # not in status (the training step did not report it): no series, not a 0
    assert sample("rtrl_training_tokens_per_second", **ck) is None
    assert sample("rtrl_eval_passed", **ck) == 1.0
    assert sample("rtrl_eval_gate_value", **ck, metric="he.pass", arm="candidate") == 0.5
    assert sample("rtrl_eval_gate_passed", **ck, metric="he.pass") == 1.0
    # the A/B numbers of the latest step only
    assert sample("rtrl_ab_weight_percent", **ck) == 10.0
    assert sample("rtrl_ab_decision", **ck, decision="continue") is None
    assert sample("rtrl_ab_samples", **ck, arm="canary") == 7.0
    ep = {**ck, "metric": "edit_persistence"}
    assert sample("rtrl_ab_estimate", **ep, arm="canary") == 0.7
    assert sample("rtrl_ab_difference_interval", **ep, bound="high") == 0.3
    assert sample("rtrl_ab_relative_difference", **ep) == 0.1667
    assert sample("rtrl_ab_relative_difference_interval", **ep, bound="low") == -0.3
    assert sample("rtrl_ab_verdict", **ep, verdict="inconclusive") == 1.0
    lat = {**ck, "metric": "latency_p95"}
    assert sample("rtrl_ab_verdict", **lat, verdict="tripped") == 1.0
    assert sample("rtrl_ab_relative_difference", **lat) is None
    assert sample("rtrl_ab_relative_difference_interval", **lat, bound="low") is None

    # a Checkpoint without a status yet: only what its spec says; no phase, no zeros
    held["Checkpoint"] = [{**CHECKPOINT, "status": None}]
    assert sample("rtrl_checkpoint_cycle", **ck) == 3.0
    assert sample("rtrl_checkpoint_phase", **ck, phase="Canary") is None
    assert sample("rtrl_data_interactions", **ck) is None
    # deleted: its series vanish
    held["RLCycle"], held["Checkpoint"] = [], []
    assert sample("rtrl_rlcycle_phase", **rlc, phase="Canary") is None
    assert sample("rtrl_checkpoint_cycle", **ck) is None


def test_every_series_is_named_on_metrics_before_any_object_exists() -> None:
    """HELP and TYPE of each per-object series are served with no RLCycle at all: the chart's
    contract test reads the names a scrape exposes."""
    set_object_source(lambda kind: [])
    text = generate_latest(REGISTRY).decode()
    typed = set(re.findall(r"^# TYPE (\S+) ", text, flags=re.M))
    assert set(SERIES) <= typed, set(SERIES) - typed


def test_failed_rounds_are_counted_by_error() -> None:
    before = value("rtrl_reconcile_errors_total", rlcycle="e", error="kube")
    reconcile_failed(NS, "e", internal=False)
    reconcile_failed(NS, "e", internal=True)
    assert value("rtrl_reconcile_errors_total", rlcycle="e", error="kube") == before + 1
    assert value("rtrl_reconcile_errors_total", rlcycle="e", error="internal") >= 1


def test_the_user_guide_lists_every_series() -> None:
    guide = (REPO / "docs" / "monitoring.md").read_text()
    listed = set(re.findall(r"`(rtrl_\w+)", guide))
    assert set(SERIES) - listed == set()
    assert listed - set(SERIES) - OPERATOR_SERIES == set()  # none the operator does not serve


def test_a_promoted_cycle_rolled_back_by_hand_later_is_counted_once() -> None:
    """rtrl_cycles_total counts finished cycles: composer-1's cycle ended once, promoted; a
    later `kubectl rtrl rollback` of the serving checkpoint counted it again as rolled_back."""
    rlc = "m-composer"
    world = World()
    run_cycle(world)
    world.now = T0 + timedelta(hours=2)
    world.rlcycle["metadata"]["annotations"] = {"rtrl.io/rollback": "back-1"}
    decided = plan(world.observed(), world.now)
    assert "RolledBack" in [a.reason for a in decided.actions if isinstance(a, Emit)]
    observe_plan(rlc, NS, world.rlcycle["status"], decided.status, decided.actions)
    assert value("rtrl_events_total", reason="RolledBack", type="Warning") >= 1
    assert value("rtrl_cycles_total", rlcycle=rlc, result="rolled_back") == 0.0


def test_a_canary_rolled_back_ends_its_cycle_as_rolled_back() -> None:
    rlc = "m-canary-back"
    world = World()
    to_canary(world)
    world.now += timedelta(minutes=30)
    world.reconcile()
    world.finish("analyze-0", result=analysis("rollback"))
    counted = 0.0
    for _ in range(4):  # the decision recorded, then carried out
        decided = plan(world.observed(), world.now)
        observe_plan(rlc, NS, world.rlcycle["status"], decided.status, decided.actions)
        world.apply(decided.actions)
        world.rlcycle["status"] = decided.status
        counted = value("rtrl_cycles_total", rlcycle=rlc, result="rolled_back")
    assert world.checkpoint("composer-1")["status"]["phase"] == "RolledBack"
    assert counted == 1.0


def test_the_base_checkpoint_is_selected_with_the_rlcycle_that_serves_it() -> None:
    """A base Checkpoint registered by hand has no spec.rlCycle: its series had rlcycle="",
    so a dashboard selecting one RLCycle could not show what it serves."""
    serving = {**RLCYCLE, "status": {**RLCYCLE["status"], "serving": "c-0"}}
    base = {"metadata": {"namespace": NS, "name": "c-0"}, "spec": {"uri": "s3://b/c-0/"},
            "status": {"phase": "Promoted"}}  # fmt: skip
    labelled = {"metadata": {"namespace": NS, "name": "d-0", "labels": {"rtrl.io/rlcycle": "d"}},
                "spec": {"uri": "s3://b/d-0/"}, "status": {"phase": "Superseded"}}  # fmt: skip
    held = {"RLCycle": [serving], "Checkpoint": [base, labelled]}
    set_object_source(lambda kind: held[kind])
    try:
        assert sample("rtrl_checkpoint_phase", rlcycle="c", checkpoint="c-0", phase="Promoted")
        assert (
            sample("rtrl_checkpoint_phase", rlcycle="", checkpoint="c-0", phase="Promoted") is None
        )
        assert sample("rtrl_checkpoint_phase", rlcycle="d", checkpoint="d-0", phase="Superseded")
    finally:
        set_object_source(lambda kind: [])
