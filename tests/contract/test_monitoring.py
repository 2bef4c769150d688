"""The chart's Grafana dashboard and PrometheusRule, rendered by the real helm: every PromQL
expression in them parses, and every series it reads is one the operator serves on /metrics
(read from a real scrape of the operator's registry, not from a list kept by hand), so a
renamed or removed series breaks this test instead of a panel or an alert in production."""

from __future__ import annotations

import json
import re
import urllib.request
from typing import Any

import promql_parser
import pytest
from prometheus_client.parser import text_string_to_metric_families

from rtrl import metrics
from rtrl_localkube.processes import free_port
from tests.contract.test_chart import render

# Series Prometheus itself records for each scrape target, not the operator.
PROMETHEUS_SERIES = {"up"}
ALERTS = {
    "RLCycleStuck",
    "RLCycleCanaryStuck",
    "RLCycleAwaitingApproval",
    "RLCycleGuardrailTripped",
    "RLCycleRolledBack",
    "RLCycleEvalGateFailed",
    "RTRLOperatorDown",
    "RTRLOperatorErroring",
}
ON = ("--set", "metrics.dashboard.enabled=true", "--set", "metrics.prometheusRule.enabled=true")
# Grafana's own variables, as a query sends them; the dashboard's are replaced by a name.
GRAFANA_INTERVALS = re.compile(r"\$__(range|rate_interval|interval)\b")
GRAFANA_VARIABLE = re.compile(r"\$\{?(\w+)\}?")
LABEL_VALUES = re.compile(r"^label_values\((.*),\s*\w+\)$", re.S)

SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "info": ("_info",),
}


@pytest.fixture(scope="module")
def exported() -> set[str]:
    """The series names the operator's /metrics serves, from a scrape over HTTP: every
    family it declares (HELP/TYPE, also before any RLCycle exists) with the sample names
    its type gives it."""
    port = free_port()
    metrics.serve(port, addr="127.0.0.1")
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    names = set()
    for family in text_string_to_metric_families(text):
        names |= {family.name + s for s in SUFFIXES.get(family.type, ("",))}
        names |= {sample.name for sample in family.samples}
    assert "rtrl_rlcycle_phase" in names and "rtrl_cycles_total" in names, sorted(names)
    return names


def _queries(value: Any) -> list[str]:
    """Every PromQL query of a Grafana dashboard: panel targets (rows included) and the
    query variables' ``label_values(<selector>, label)`` selectors."""
    found = []
    for panel in value.get("panels") or []:
        found += [t["expr"] for t in panel.get("targets") or []]
        found += _queries(panel)
    for var in (value.get("templating") or {}).get("list") or []:
        if var.get("type") == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            matched = LABEL_VALUES.match(query)
            assert matched, f"variable {var['name']}: not label_values(...): {query}"
            found.append(matched.group(1))
    return found


def _as_promql(query: str) -> str:
    return GRAFANA_VARIABLE.sub(r"\1", GRAFANA_INTERVALS.sub("5m", query))


def _series(expr: str) -> set[str]:
    """The metric names an expression reads; each selector must name its metric."""
    names: list[str | None] = []

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            names.append(node.name)

    promql_parser.walk(promql_parser.parse(expr), visit)
    assert names and None not in names, f"a selector without a metric name in: {expr}"
    return {n for n in names if n}


def _rendered(*args: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    docs = render(*ON, *args)
    rules = [
        rule
        for doc in docs
        if doc["kind"] == "PrometheusRule"
        for group in doc["spec"]["groups"]
        for rule in group["rules"]
    ]
    (config_map,) = [
        d for d in docs if d["kind"] == "ConfigMap" and "dashboard" in d["metadata"]["name"]
    ]
    (text,) = config_map["data"].values()
    return rules, json.loads(text)


def test_every_expression_parses_and_reads_only_exported_series(exported: set[str]) -> None:
    rules, dashboard = _rendered()
    assert {r["alert"] for r in rules} == ALERTS
    queries = [r["expr"] for r in rules] + [_as_promql(q) for q in _queries(dashboard)]
    assert len(queries) > 40
    unknown: dict[str, set[str]] = {}
    read: set[str] = set()
    for query in queries:
        try:
            names = _series(query)
        except ValueError as exc:
            pytest.fail(f"does not parse ({exc}): {query}")
        read |= names
        missing = names - exported - PROMETHEUS_SERIES
        if missing:
            unknown[query] = missing
    assert unknown == {}
    # the dashboard covers what a cycle does, not only the operator
    assert {"rtrl_rlcycle_phase", "rtrl_ab_relative_difference", "rtrl_ab_verdict",
            "rtrl_training_loss", "rtrl_data_monitor", "rtrl_eval_gate_passed"} <= read  # fmt: skip
    for rule in rules:
        if "for" in rule:
            promql_parser.parse_duration(rule["for"])


def test_the_checks_catch_a_series_the_operator_does_not_serve(exported: set[str]) -> None:
    """The two checks above fail on what they are there to catch."""
    assert _series('max by (namespace) (rtrl_rlcycle_phase_typo{phase="Canary"}) == 1') - exported
    with pytest.raises(ValueError):
        _series("sum(rate(rtrl_reconcile_errors_total[5m])")
    with pytest.raises(AssertionError):
        _series('{__name__=~"rtrl_.*"}')


def test_off_by_default_and_configurable() -> None:
    kinds = {(d["kind"], d["metadata"]["name"]) for d in render()}
    assert ("PrometheusRule", "rtrl-operator") not in kinds
    assert ("ConfigMap", "rtrl-operator-dashboard") not in kinds
    docs = render(
        *ON,
        "--set", "metrics.dashboard.labelKey=dashboards",
        "--set", "metrics.dashboard.labelValue=rtrl",
        "--set", "metrics.dashboard.namespace=monitoring",
        "--set", "metrics.prometheusRule.stuckFor=90m",
        "--set", "metrics.prometheusRule.recentSeconds=600",
    )  # fmt: skip
    config_map = next(d for d in docs if d["metadata"]["name"] == "rtrl-operator-dashboard")
    assert config_map["metadata"]["labels"]["dashboards"] == "rtrl"
    assert config_map["metadata"]["namespace"] == "monitoring"
    dashboard = json.loads(config_map["data"]["rtrl-operator.json"])
    constants = {v["name"]: v["query"] for v in dashboard["templating"]["list"]}
    assert constants["operator_job"] == "rtrl-operator-metrics"
    assert constants["operator_namespace"] == "rtrl-system"
    rule = next(d for d in docs if d["kind"] == "PrometheusRule")
    by_name = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}
    assert by_name["RLCycleStuck"]["for"] == "90m"
    assert "> 600)" in by_name["RLCycleRolledBack"]["expr"]
    # the metrics Service's name is the job a ServiceMonitor scrapes it as
    service = next(d for d in docs if d["kind"] == "Service" and "metrics" in d["metadata"]["name"])
    assert f'job="{service["metadata"]["name"]}"' in by_name["RTRLOperatorDown"]["expr"]
    # off with the metrics: nothing to graph or alert on
    kinds = {d["kind"] for d in render(*ON, "--set", "metrics.enabled=false")}
    assert "PrometheusRule" not in kinds


def test_the_service_monitor_keeps_the_series_namespace() -> None:
    """The series' ``namespace`` label is the RLCycle's; without honorLabels Prometheus would
    rename it exported_namespace and overwrite it with the operator's, and every query by
    namespace in the dashboard and the alerts would read the wrong one."""
    docs = render("--set", "metrics.serviceMonitor.enabled=true")
    monitor = next(d for d in docs if d["kind"] == "ServiceMonitor")
    assert monitor["spec"]["endpoints"][0]["honorLabels"] is True
