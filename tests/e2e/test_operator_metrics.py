"""``rtrl operator --metrics-port --log-format json`` as the chart runs it: Prometheus
metrics on /metrics derived from the reconciles, and JSON log lines naming the RLCycle."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from rtrl_localkube.cycle_world import NAME, base_checkpoint, deployment, rlcycle, script_all
from rtrl_localkube.job_runner import JobRunner
from rtrl_localkube.processes import free_port
from tests.conftest import console_script
from tests.integration.conftest import KubeAPI

pytestmark = pytest.mark.timeout(120)


def scrape(port: int) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1) as response:
            return str(response.read().decode())
    except OSError:
        return ""


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
        script_all(job_runner, tmp_path)
        kube_api.create(deployment(tmp_path))
        kube_api.create(base_checkpoint(tmp_path))
        kube_api.create(rlcycle(tmp_path))
        wanted = (
            f'rtrl_decisions_total{{action="create",kind="Job",namespace="{kube_api.namespace}"}}'
        )
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
        # ... and a deleted Checkpoint's series are gone from the next scrapes.
        kube_api.delete("rtrl.io/v1alpha1", "Checkpoint", f"{NAME}-1")
        kube_api.wait_for(
            lambda: (t := scrape(metrics)) != "" and f'checkpoint="{NAME}-1"' not in t,
            timeout=20,
            message=lambda: scrape(metrics)[-3000:],
        )
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
