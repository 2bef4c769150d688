"""The RLCycles' and Checkpoints' status as Prometheus series, built at each scrape.

A platform team graphs and alerts on what a cycle is doing: its phase, the A/B numbers of
its canary, what it trained on and how training and eval went. The operator's cache holds
every RLCycle and Checkpoint as the API server last showed them, so reading them at scrape
time (instead of setting gauges from the reconciles) makes every series say what the
object's status says now, costs nothing between scrapes, and drops a deleted object's series
at the next scrape.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..core.api.checkpoint import Verdict
from ..core.api.names import LABEL_RLCYCLE
from ..core.api.rlcycle import RLCyclePhase
from ..planning.timeutil import parse_time

# A deleted object leaves the cache and so its series vanish; cardinality is bounded by the
# RLCycles, each RLCycle's history limit (pruned Checkpoints are deleted) and the API's list
# bounds (at most 64 gates and 64 A/B metrics per Checkpoint, 32 monitors, 64 quarantine
# reasons). A number the status does not hold is not reported: never a made-up 0.
_objects: Callable[[str], Iterable[Mapping[str, Any]]] = lambda kind: ()  # noqa: E731


def set_object_source(source: Callable[[str], Iterable[Mapping[str, Any]]]) -> None:
    """Where the collector reads the RLCycles and Checkpoints (``source("RLCycle")``) of
    every namespace from at each scrape (the kube room's cache)."""
    global _objects  # noqa: PLW0603 (set once when the operator starts)
    _objects = source


RLCYCLE = ["namespace", "rlcycle"]
CHECKPOINT = ["namespace", "rlcycle", "checkpoint"]

# status field -> (series, help); one series per number, without extra labels.
RLCYCLE_NUMBERS = {
    "cycle": ("rtrl_rlcycle_cycle", "Number of the current (or last) cycle."),
    "canaryWeight": ("rtrl_canary_weight_percent", "Current canary traffic share."),
}
RLCYCLE_TIMES = {
    "cycleStartedAt": (
        "rtrl_rlcycle_cycle_started_timestamp_seconds",
        "When the current (or last) cycle began, in Unix seconds.",
    ),
    "nextRun": ("rtrl_rlcycle_next_run_timestamp_seconds", "When the next cycle is due."),
}
CHECKPOINT_TIMES = {
    "startedAt": (
        "rtrl_checkpoint_started_timestamp_seconds",
        "When the Checkpoint's cycle started, in Unix seconds.",
    ),
    "completedAt": (
        "rtrl_checkpoint_completed_timestamp_seconds",
        "When the Checkpoint reached a final phase, in Unix seconds.",
    ),
}
DATA_NUMBERS = {
    "interactions": ("rtrl_data_interactions", "Interactions the stage step selected."),
    "tokens": ("rtrl_data_tokens", "Completion tokens the stage step selected."),
    "onPolicyFraction": (
        "rtrl_data_on_policy_fraction",
        "Share of the staged interactions served by the parent itself.",
    ),
    "filesBad": ("rtrl_data_files_bad", "Shard files the stage step could not read."),
}
# status.data.fidelity (the stage's fidelity gate, overall) -> (series, help)
FIDELITY_NUMBERS = {
    "partitionsChecked": (
        "rtrl_data_fidelity_partitions_checked",
        "Partitions of the serving checkpoint whose sampled rows the fidelity gate recomputed.",
    ),
    "partitionsQuarantined": (
        "rtrl_data_fidelity_partitions_quarantined",
        "Partitions the fidelity gate quarantined (logged log-probs not the checkpoint's).",
    ),
    "tokens": ("rtrl_data_fidelity_tokens", "Completion tokens the fidelity gate compared."),
    "meanAbsDelta": (
        "rtrl_data_fidelity_mean_abs_delta",
        "Mean |recomputed - logged| log-prob per token (nats).",
    ),
    "maxAbsDelta": ("rtrl_data_fidelity_max_abs_delta", "Largest |recomputed - logged|."),
    "unsupportedFraction": (
        "rtrl_data_fidelity_unsupported_fraction",
        "Share of logged tokens outside the recomputed top-p/top-k.",
    ),
}
TRAINING_NUMBERS = {
    "steps": ("rtrl_training_steps", "Optimizer steps taken."),
    "tokens": ("rtrl_training_tokens", "Completion tokens trained on."),
    "loss": ("rtrl_training_loss", "Final policy loss."),
    "kl": ("rtrl_training_kl", "Mean k3 KL to the parent."),
    "clipFraction": ("rtrl_training_clip_fraction", "Share of clipped tokens."),
    "truncationFraction": (
        "rtrl_training_truncation_fraction",
        "Share of tokens whose importance ratio was truncated.",
    ),
    "meanAdvantage": ("rtrl_training_mean_advantage", "Mean advantage of the batch."),
    "gradNorm": ("rtrl_training_grad_norm", "Last gradient norm."),
    "tokensPerSecond": ("rtrl_training_tokens_per_second", "Training throughput."),
    "wallSeconds": ("rtrl_training_wall_seconds", "Wall time of the training step."),
}


# Series with more labels than their object's, and their help: the others are in the tables.
LABELLED: dict[str, tuple[str, list[str]]] = {
    "rtrl_rlcycle_phase": ("Phase of the RLCycle: 1 for the current one, 0 for the others.",
                           ["phase"]),
    "rtrl_checkpoint_phase": ("Phase of the Checkpoint: 1, for its current phase only.",
                              ["phase"]),
    "rtrl_data_quarantined": ("Rows the stage step skipped, by reason.", ["reason"]),
    "rtrl_data_refused": ("Valid rows not trained on: their logged log-probs are not their "
                          "sampling distribution's, by reason.", ["reason"]),
    "rtrl_data_fidelity_is_weight": ("Quantile of the fidelity gate's importance weights "
                                     "exp(recomputed - logged).", ["quantile"]),
    "rtrl_data_reward": ("Reward of the staged interactions (stat: mean, std, min, max).",
                         ["stat"]),
    "rtrl_data_monitor": ("Behaviour monitor of the staged set.", ["monitor"]),
    "rtrl_eval_gate_value": ("Eval gate value, by arm.", ["metric", "arm"]),
    "rtrl_eval_gate_difference_interval": (
        "Bootstrap interval of an eval gate's difference (bound: low/high).", ["metric", "bound"]),
    "rtrl_eval_gate_passed": ("1 when the eval gate passed.", ["metric"]),
    "rtrl_ab_decision": ("The step's decision (promote, rollback, continue): 1.", ["decision"]),
    "rtrl_ab_samples": ("Matured interactions of the step, by arm.", ["arm"]),
    "rtrl_ab_estimate": ("A/B estimate of a metric, by arm.", ["metric", "arm"]),
    "rtrl_ab_difference": ("Canary minus baseline.", ["metric"]),
    "rtrl_ab_difference_interval": (
        "Always-valid interval of the difference (bound: low/high).", ["metric", "bound"]),
    "rtrl_ab_relative_difference": ("Canary over baseline minus 1.", ["metric"]),
    "rtrl_ab_relative_difference_interval": (
        "Always-valid interval of the relative difference (bound: low/high).",
        ["metric", "bound"]),
    "rtrl_ab_verdict": ("The metric's verdict (better, worse, inconclusive; ok, beyond, "
                        "tripped; too-few-events): 1.", ["metric", "verdict"]),
}  # fmt: skip
CHECKPOINT_NUMBERS = {
    "rtrl_checkpoint_cycle": "Cycle number of the Checkpoint.",
    "rtrl_eval_passed": "1 when the eval verdict is Passed, 0 when Failed.",
    "rtrl_ab_weight_percent": "Canary weight of the step the A/B numbers are of.",
}


def _catalogue() -> dict[str, tuple[str, list[str]]]:
    """Every per-object series: its help and labels."""
    out = {name: (doc, RLCYCLE) for name, doc in (*RLCYCLE_NUMBERS.values(),
                                                   *RLCYCLE_TIMES.values())}  # fmt: skip
    plain = (*CHECKPOINT_TIMES.values(), *DATA_NUMBERS.values(), *FIDELITY_NUMBERS.values(),
             *TRAINING_NUMBERS.values(), *CHECKPOINT_NUMBERS.items())  # fmt: skip
    out |= {name: (doc, CHECKPOINT) for name, doc in plain}
    for name, (doc, extra) in LABELLED.items():
        out[name] = (doc, [*(RLCYCLE if name == "rtrl_rlcycle_phase" else CHECKPOINT), *extra])
    return out


SERIES = _catalogue()


class _Families:
    """The gauge families of one scrape: all of them, so that /metrics names every series
    (HELP and TYPE) even before an RLCycle has one."""

    def __init__(self) -> None:
        self.made = {
            name: GaugeMetricFamily(name, doc, labels=labels)
            for name, (doc, labels) in SERIES.items()
        }

    def add(self, name: str, values: list[str], v: float) -> None:
        self.made[name].add_metric(values, v)

    def numbers(
        self, table: Mapping[str, tuple[str, str]], src: Mapping[str, Any], ident: list[str]
    ) -> None:
        for field, (name, _) in table.items():
            if _is_number(src.get(field)):
                self.add(name, ident, float(src[field]))

    def times(
        self, table: Mapping[str, tuple[str, str]], src: Mapping[str, Any], ident: list[str]
    ) -> None:
        for field, (name, _) in table.items():
            at = parse_time(src.get(field))
            if at is not None:
                self.add(name, ident, at.timestamp())

    def state_set(self, name: str, states: Iterable[str], current: Any, ident: list[str]) -> None:
        """kube-state-metrics style: one series per possible state, 1 for the current one."""
        if current:
            for state in states:
                self.add(name, [*ident, state], 1.0 if state == current else 0.0)

    def interval(self, name: str, ident: list[str], low: Any, high: Any) -> None:
        """An interval's two bounds as ``bound="low"|"high"`` series (ident ends in metric)."""
        if _is_number(low) and _is_number(high):
            self.add(name, [*ident, "low"], float(low))
            self.add(name, [*ident, "high"], float(high))


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _rlcycle(out: _Families, rlc: Mapping[str, Any]) -> None:
    meta = rlc.get("metadata") or {}
    ident = [str(meta.get("namespace") or ""), str(meta.get("name") or "")]
    status = rlc.get("status") or {}
    out.state_set("rtrl_rlcycle_phase", [p.value for p in RLCyclePhase], status.get("phase"), ident)
    out.numbers(RLCYCLE_NUMBERS, status, ident)
    out.times(RLCYCLE_TIMES, status, ident)


def _checkpoint(
    out: _Families, ck: Mapping[str, Any], serves: Mapping[tuple[str, str], str]
) -> None:
    meta = ck.get("metadata") or {}
    spec = ck.get("spec") or {}
    namespace, name = str(meta.get("namespace") or ""), str(meta.get("name") or "")
    # A Checkpoint registered by hand (the base model) has no spec.rlCycle: its series are
    # the RLCycle's that serves it, else the one its rtrl.io/rlcycle label names, so that a
    # dashboard selecting one RLCycle shows its base too.
    rlcycle = (spec.get("rlCycle") or serves.get((namespace, name))
               or (meta.get("labels") or {}).get(LABEL_RLCYCLE) or "")  # fmt: skip
    ident = [namespace, str(rlcycle), name]
    status = ck.get("status") or {}
    if status.get("phase"):  # the current one only: historyLimit Checkpoints, most of them final
        out.add("rtrl_checkpoint_phase", [*ident, str(status["phase"])], 1.0)
    if _is_number(spec.get("cycle")):
        out.add("rtrl_checkpoint_cycle", ident, float(spec["cycle"]))
    out.times(CHECKPOINT_TIMES, status, ident)
    data = status.get("data") or {}
    out.numbers(DATA_NUMBERS, data, ident)
    for label, name in (("quarantined", "rtrl_data_quarantined"), ("reward", "rtrl_data_reward"),
                        ("monitors", "rtrl_data_monitor"),
                        ("refused", "rtrl_data_refused")):  # fmt: skip
        for key, v in sorted((data.get(label) or {}).items()):
            if _is_number(v):
                out.add(name, [*ident, str(key)], float(v))
    fidelity = data.get("fidelity") or {}
    out.numbers(FIDELITY_NUMBERS, fidelity, ident)
    for quantile in ("01", "50", "99"):
        weight = fidelity.get(f"isWeightP{quantile}")
        if isinstance(weight, int | float) and not isinstance(weight, bool):
            out.add("rtrl_data_fidelity_is_weight", [*ident, f"0.{quantile}"], float(weight))
    out.numbers(TRAINING_NUMBERS, status.get("training") or {}, ident)
    _eval(out, status.get("eval") or {}, ident)
    _ab(out, (status.get("rollout") or [{}])[-1], ident)


def _eval(out: _Families, summary: Mapping[str, Any], ident: list[str]) -> None:
    if summary.get("verdict"):
        out.add("rtrl_eval_passed", ident, 1.0 if summary["verdict"] == Verdict.PASSED else 0.0)
    # The CRD requires every number of a GateResult (and of a MetricComparison, below):
    # indexing them reports what the status says, and a malformed one fails the scrape
    # loudly rather than reading as a 0.
    for g in summary.get("gates") or []:
        m = [*ident, str(g["metric"])]
        for arm in ("candidate", "parent"):
            out.add("rtrl_eval_gate_value", [*m, arm], float(g[arm]))
        out.interval("rtrl_eval_gate_difference_interval", m, g["ciLow"], g["ciHigh"])
        out.add("rtrl_eval_gate_passed", m, 1.0 if g["passed"] else 0.0)


def _ab(out: _Families, step: Mapping[str, Any], ident: list[str]) -> None:
    """The latest canary step: its weight, decision, samples and A/B numbers."""
    if _is_number(step.get("weight")):
        out.add("rtrl_ab_weight_percent", ident, float(step["weight"]))
    if step.get("decision"):
        out.add("rtrl_ab_decision", [*ident, str(step["decision"])], 1.0)
    for arm in ("baseline", "canary"):
        if _is_number(step.get(f"{arm}Samples")):
            out.add("rtrl_ab_samples", [*ident, arm], float(step[f"{arm}Samples"]))
    for row in step.get("metrics") or []:
        m = [*ident, str(row["name"])]
        for arm in ("baseline", "canary"):
            out.add("rtrl_ab_estimate", [*m, arm], float(row[arm]))
        out.add("rtrl_ab_difference", m, float(row["difference"]))
        out.interval("rtrl_ab_difference_interval", m, row["ciLow"], row["ciHigh"])
        if _is_number(row.get("relativeDifference")):
            out.add("rtrl_ab_relative_difference", m, float(row["relativeDifference"]))
        out.interval("rtrl_ab_relative_difference_interval", m, row.get("relativeCiLow"),
                     row.get("relativeCiHigh"))  # fmt: skip
        if row.get("verdict"):
            out.add("rtrl_ab_verdict", [*m, str(row["verdict"])], 1.0)


class StatusCollector(Collector):
    """The RLCycles' and Checkpoints' status numbers, from the cache at each scrape."""

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        out = _Families()
        serves: dict[tuple[str, str], str] = {}
        for rlc in _objects("RLCycle"):
            _rlcycle(out, rlc)
            meta, serving = rlc.get("metadata") or {}, (rlc.get("status") or {}).get("serving")
            if serving:
                serves[(str(meta.get("namespace") or ""), str(serving))] = str(meta.get("name"))
        for ck in _objects("Checkpoint"):
            _checkpoint(out, ck, serves)
        return list(out.made.values())


__all__ = ["SERIES", "StatusCollector", "set_object_source"]
