"""``rtrl operator --metrics-port --log-format json`` as the chart runs it: Prometheus
metrics on /metrics derived from the reconciles and, through a real cycle to promotion, the
RLCycle's and Checkpoint's series equal to what their status says; JSON log lines naming the
RLCycle."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from rtrl.core.api.rlcycle import RLCyclePhase
from rtrl.planning.timeutil import parse_time
from rtrl_localkube.cycle_world import (
    ANALYSIS_PROMOTE,
    NAME,
    RTRL,
    STAGE_OK,
    base_checkpoint,
    deployment,
    rlcycle,
    script_all,
    status,
)
from rtrl_localkube.job_runner import JobRunner
from rtrl_localkube.processes import free_port
from tests.conftest import console_script
from tests.integration.conftest import KubeAPI

pytestmark = pytest.mark.timeout(240)

# What the steps "produce": every number the status can carry, so each series shows.
STAGE = {
    **STAGE_OK,
    "reward": {"mean": 0.31, "std": 0.42, "min": -1.0, "max": 1.0},
    # a monitor undefined for the set (no tool calls): no series, not a 0
    "monitors": {"edit_rate": 0.6, "clarification_rate": 0.05, "invalid_tool_call_rate": None,
                 "mean_completion_tokens": 212.5, "latency_p95_ms": 850.0},
}  # fmt: skip
TRAIN = {"summary": {"steps": 4, "tokens": 90000, "loss": 0.12, "kl": 0.003,
                     "clip_fraction": 0.02, "truncation_fraction": 0.001,
                     "tokens_per_second": 1234.5}}  # fmt: skip
ANALYSIS = {
    **ANALYSIS_PROMOTE,
    "metrics": [
        {**ANALYSIS_PROMOTE["metrics"][0], "relative_difference": 0.0333,
         "relative_ci_low": 0.008, "relative_ci_high": 0.058},
        {"name": "clarification_rate", "kind": "guardrail", "baseline": 0.05, "canary": 0.06,
         "difference": 0.01, "ci_low": -0.01, "ci_high": 0.03, "verdict": "ok"},
    ],
}  # fmt: skip


def scrape(port: int) -> str:
    """/metrics; a connection error fails the test (a "not in" check must not pass on an
    empty answer)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return str(response.read().decode())


def answers(port: int) -> bool:
    """Whether the operator serves /metrics yet (it starts listening after the API login)."""
    try:
        scrape(port)
    except OSError:
        return False
    return True


Labels = frozenset[tuple[str, str]]


def samples(text: str) -> dict[tuple[str, Labels], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def expected(rlc: dict[str, Any], ck: dict[str, Any]) -> dict[tuple[str, Labels], float]:
    """The series the RLCycle's and the Checkpoint's status make, built here from the
    status as read from the API server (the operator builds them from its cache)."""
    ns, name = rlc["metadata"]["namespace"], rlc["metadata"]["name"]
    out: dict[tuple[str, Labels], float] = {}

    def put(series: str, value: float, **labels: str) -> None:
        out[(series, frozenset({"namespace": ns, "rlcycle": name, **labels}.items()))] = value

    st = rlc["status"]
    for p in RLCyclePhase:
        put("rtrl_rlcycle_phase", 1.0 if p.value == st["phase"] else 0.0, phase=p.value)
    put("rtrl_rlcycle_cycle", st["cycle"])
    put("rtrl_canary_weight_percent", st["canaryWeight"])
    put("rtrl_rlcycle_cycle_started_timestamp_seconds",
        parse_time(st["cycleStartedAt"]).timestamp())  # type: ignore[union-attr]  # fmt: skip
    c = {"checkpoint": ck["metadata"]["name"]}
    cs = ck["status"]
    put("rtrl_checkpoint_phase", 1.0, **c, phase=cs["phase"])
    put("rtrl_checkpoint_cycle", ck["spec"]["cycle"], **c)
    for field in ("startedAt", "completedAt"):
        series = f"rtrl_checkpoint_{field.removesuffix('At')}_timestamp_seconds"
        put(series, parse_time(cs[field]).timestamp(), **c)  # type: ignore[union-attr]
    data, training = cs["data"], cs["training"]
    for field, series in (("interactions", "interactions"), ("tokens", "tokens"),
                          ("onPolicyFraction", "on_policy_fraction")):  # fmt: skip
        put(f"rtrl_data_{series}", data[field], **c)
    for stat, v in data["reward"].items():
        put("rtrl_data_reward", v, **c, stat=stat)
    for monitor, v in data["monitors"].items():
        put("rtrl_data_monitor", v, **c, monitor=monitor)
    trained = {"loss": "loss", "kl": "kl", "clipFraction": "clip_fraction", "steps": "steps",
               "truncationFraction": "truncation_fraction",
               "tokensPerSecond": "tokens_per_second"}  # fmt: skip
    for field, series in trained.items():
        put(f"rtrl_training_{series}", training[field], **c)
    put("rtrl_eval_passed", 1.0 if cs["eval"]["verdict"] == "Passed" else 0.0, **c)
    for g in cs["eval"]["gates"]:
        put("rtrl_eval_gate_passed", 1.0 if g["passed"] else 0.0, **c, metric=g["metric"])
        put("rtrl_eval_gate_value", g["candidate"], **c, metric=g["metric"], arm="candidate")
    step = cs["rollout"][-1]
    put("rtrl_ab_weight_percent", step["weight"], **c)
    put("rtrl_ab_decision", 1.0, **c, decision=step["decision"])
    for arm in ("baseline", "canary"):
        put("rtrl_ab_samples", step[f"{arm}Samples"], **c, arm=arm)
    for row in step["metrics"]:
        m = {**c, "metric": row["name"]}
        put("rtrl_ab_difference", row["difference"], **m)
        put("rtrl_ab_verdict", 1.0, **m, verdict=row["verdict"])
        if "relativeDifference" in row:
            put("rtrl_ab_relative_difference", row["relativeDifference"], **m)
            put("rtrl_ab_relative_difference_interval", row["relativeCiLow"], **m, bound="low")
            put("rtrl_ab_relative_difference_interval", row["relativeCiHigh"], **m, bound="high")
    return out


def mismatches(port: int, kube_api: KubeAPI, checkpoint: str) -> list[str]:
    rlc = kube_api.get(RTRL, "RLCycle", NAME) or {}
    ck = kube_api.get(RTRL, "Checkpoint", checkpoint) or {}
    got = samples(scrape(port))
    return [
        f"{series}{dict(labels)}: {got.get((series, labels))} != status {value}"
        for (series, labels), value in expected(rlc, ck).items()
        if got.get((series, labels)) != float(value)
    ]


@pytest.mark.usefixtures("release")  # the chart's CRDs, also when this test runs alone
def test_metrics_port_and_json_logs(
    kube_api: KubeAPI, job_runner: JobRunner, deployment_controller: Any, tmp_path: Path
) -> None:
    metrics, health = free_port(), free_port()
    log = tmp_path / "operator.log"
    env = dict(os.environ, KUBECONFIG=os.fspath(kube_api.kubeconfig), RTRL_RESYNC_SECONDS="1")
    args = [
        console_script("rtrl"), "operator", "--namespace", kube_api.namespace, "--standalone",
        "--liveness", f"http://127.0.0.1:{health}/healthz",
        "--metrics-port", str(metrics), "--log-format", "json",
    ]  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        script_all(job_runner, tmp_path, stage=STAGE, train=TRAIN, analyze=ANALYSIS)
        kube_api.create(deployment(tmp_path))
        kube_api.create(base_checkpoint(tmp_path))
        kube_api.create(rlcycle(tmp_path))
        wanted = (
            f'rtrl_decisions_total{{action="create",kind="Job",namespace="{kube_api.namespace}"}}'
        )
        kube_api.wait_for(lambda: answers(metrics), timeout=30,
                          message=lambda: log.read_text(errors="replace")[-4000:])  # fmt: skip
        kube_api.wait_for(
            lambda: wanted in scrape(metrics),
            timeout=30,
            message=lambda: log.read_text(errors="replace")[-4000:],
        )
        text = scrape(metrics)
        assert (
            f'rtrl_canary_weight_percent{{namespace="{kube_api.namespace}",rlcycle="{NAME}"}}'
            in text
        )
        assert "process_cpu_seconds_total" in text
        # The per-Checkpoint series, from the operator's cache at scrape time: eval gates.
        kube_api.wait_for(
            lambda: f'rtrl_eval_gate_passed{{checkpoint="{NAME}-1"' in scrape(metrics),
            timeout=40,
            message=lambda: scrape(metrics)[-3000:],
        )
        # Through the canary to promotion: every series equals what the statuses say.
        kube_api.wait_for(
            lambda: (
                status(kube_api, "Checkpoint", f"{NAME}-1").get("phase") == "Promoted"
                and status(kube_api, "RLCycle", NAME).get("phase") == "Idle"
            ),
            timeout=120,
            message=lambda: (
                f"{status(kube_api, 'Checkpoint', f'{NAME}-1')}\n"
                + log.read_text(errors="replace")[-3000:]
            ),
        )
        kube_api.wait_for(
            lambda: not mismatches(metrics, kube_api, f"{NAME}-1"),
            timeout=20,
            message=lambda: "\n".join(mismatches(metrics, kube_api, f"{NAME}-1")),
        )
        text = scrape(metrics)
        ident = f'checkpoint="{NAME}-1",namespace="{kube_api.namespace}",rlcycle="{NAME}"'
        # Numbers the status does not hold are not reported: no 0 stands in for them.
        assert f'rtrl_data_monitor{{{ident},monitor="invalid_tool_call_rate"}}' not in text
        assert f"rtrl_training_grad_norm{{{ident}}}" not in text
        assert 'metric="clarification_rate"' in text  # the guardrail's row is there ...
        assert f'rtrl_ab_relative_difference{{{ident},metric="clarification_rate"}}' not in text
        # ... and a deleted Checkpoint's series are gone from the next scrapes.
        kube_api.delete("rtrl.io/v1alpha1", "Checkpoint", f"{NAME}-1")
        kube_api.wait_for(
            lambda: f'checkpoint="{NAME}-1"' not in scrape(metrics),
            timeout=20,
            message=lambda: scrape(metrics)[-3000:],
        )
        assert f'rtrl_rlcycle_phase{{namespace="{kube_api.namespace}"' in scrape(metrics)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    entries = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    assert entries, log.read_text()[-2000:]
    created = [e for e in entries if e["message"].startswith("created Job")]
    assert created and all(e.get("rlcycle") == NAME for e in created), created[:3]
    assert any(e.get("checkpoint") for e in entries if "Checkpoint" in e["message"])
