"""The operator's Prometheus metrics follow the plans: observe_plan on a few transitions,
and the JSON log formatter's fields."""

from __future__ import annotations

import json
import logging

from prometheus_client import REGISTRY

from rtrl.logs import JsonFormatter
from rtrl.metrics import observe_plan
from rtrl.planning.actions import Create, Emit, PatchStatus

NS = "metrics-test"


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
    assert value("rtrl_canary_weight_percent", rlcycle=rlc) == 25.0
    assert value("rtrl_phase_duration_seconds_count", rlcycle=rlc, phase="Training") == 1.0
    observe_plan(rlc, NS, {"phase": "Canary", "canaryWeight": 25},
                 {"phase": "Idle", "canaryWeight": 0, "lastPromoted": f"{rlc}-1"}, [
        PatchStatus("rtrl.io/v1alpha1", "Checkpoint", f"{rlc}-1", {"phase": "Promoted"}),
        Emit("RLCycle", rlc, "Promoted", f"{rlc}-1 now serves"),
    ], now=1300.0)  # fmt: skip
    assert value("rtrl_cycles_total", rlcycle=rlc, result="promoted") == 1.0
    assert value("rtrl_canary_weight_percent", rlcycle=rlc) == 0.0
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
    observe_plan(rlc, NS, {"phase": "Evaluating"}, {"phase": "Idle"}, [
        Emit("Checkpoint", f"{rlc}-4", "EvalGatesFailed", "regressed", warning=True),
        Emit("RLCycle", rlc, "CycleCompleted", "rejected", warning=True),
    ])  # fmt: skip
    assert value("rtrl_cycles_total", rlcycle=rlc, result="rejected") == 1.0


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


def test_checkpoint_series_come_from_the_source_and_vanish_with_it() -> None:
    from rtrl.metrics import set_checkpoint_source

    ck = {
        "metadata": {"namespace": NS, "name": "c-1"},
        "spec": {"rlCycle": "c"},
        "status": {
            "eval": {"gates": [{"metric": "he.pass", "candidate": 0.5, "parent": 0.4,
                                "ciLow": -0.01, "ciHigh": 0.2, "passed": True}]},
            "rollout": [{"weight": 10, "baselineSamples": 40, "canarySamples": 7, "metrics": [
                {"name": "edit_persistence", "baseline": 0.6, "canary": 0.7,
                 "difference": 0.1, "ciLow": -0.2, "ciHigh": 0.3}]}],
        },
    }  # fmt: skip
    held = [ck]
    set_checkpoint_source(lambda: held)
    ident = {"rlcycle": "c", "checkpoint": "c-1"}
    assert value("rtrl_eval_gate_value", **ident, metric="he.pass", arm="candidate") == 0.5
    assert value("rtrl_eval_gate_passed", **ident, metric="he.pass") == 1.0
    assert value("rtrl_ab_estimate", **ident, metric="edit_persistence", arm="canary") == 0.7
    assert value("rtrl_ab_difference_interval", **ident, metric="edit_persistence",
                 bound="high") == 0.3  # fmt: skip
    assert value("rtrl_ab_samples", **ident, arm="canary") == 7.0
    held.clear()
    assert REGISTRY.get_sample_value("rtrl_ab_samples", {"namespace": NS, **ident,
                                     "arm": "canary"}) is None  # fmt: skip
