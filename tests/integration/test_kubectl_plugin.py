"""``kubectl rtrl`` against the emulated API server: what ``status`` and ``history`` print
from an RLCycle and Checkpoints written by hand (statuses through the status subresource,
as the operator writes them), the exact patches each verb applies (and that it applies
none when it refuses), and one clear line and exit 1 for every error.

The operator's side of these annotations and fields is tested in test_operator.py and the
planning unit tests; here the constants are checked to be the ones the planner reads.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from tests.conftest import console_script
from tests.integration.conftest import KubeAPI, write_kubeconfig

import rtrl.kubectl_plugin as plugin
from rtrl.core.api import names
from rtrl.kubectl_plugin import commands
from rtrl_localkube.cycle_world import RTRL, rlcycle

pytestmark = pytest.mark.timeout(60)

NAME = "composer"
BASE = "/apis/rtrl.io/v1alpha1/namespaces/default/rlcycles/composer"
NOW = datetime.now(UTC).replace(microsecond=0)


def ago(**delta: float) -> str:
    return (NOW - timedelta(**delta)).strftime("%Y-%m-%dT%H:%M:%SZ")


METRICS = [
    {"name": "edit_persistence", "baseline": 0.6, "canary": 0.62, "difference": 0.02,
     "ciLow": 0.005, "ciHigh": 0.035},
    {"name": "latency_ms", "baseline": 1200.0, "canary": 1180.0, "difference": -20.0,
     "ciLow": -45.5, "ciHigh": 4.25},
]  # fmt: skip
CANARY_ROLLOUT = [
    {"weight": 5, "startedAt": ago(hours=2), "endedAt": ago(hours=1), "analyses": 2,
     "decision": "continue", "reason": "edit_persistence: inconclusive",
     "baselineSamples": 5000, "canarySamples": 480, "metrics": METRICS},
    {"weight": 25, "startedAt": ago(hours=1), "analyses": 0},
]  # fmt: skip
CANARY_STATUS = {
    "phase": "Canary",
    "cycle": 2,
    "serving": "composer-1",
    "candidate": "composer-2",
    "lastPromoted": "composer-1",
    "canaryWeight": 25,
    "nextRun": ago(hours=-3),
    "message": "composer-2 at 25%: next analysis soon",
    "conditions": [
        {"type": "Ready", "status": "True", "reason": "Serving",
         "message": "composer-1 serves composer-vllm", "lastTransitionTime": ago(days=1)},
        {"type": "Progressing", "status": "True", "reason": "Canary",
         "message": "composer-2 at 25%", "lastTransitionTime": ago(hours=2)},
        {"type": "Degraded", "status": "True", "reason": "CycleFailed",
         "message": "composer-x: train failed", "lastTransitionTime": ago(days=1)},
        {"type": "InvalidSpec", "status": "False", "reason": "SpecValid", "message": "",
         "lastTransitionTime": ago(days=1)},
    ],
}  # fmt: skip


def checkpoint(name: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": RTRL,
        "kind": "Checkpoint",
        "metadata": {"name": name, "labels": {"rtrl.io/rlcycle": NAME}},
        "spec": {"uri": f"s3://bucket/{name}/", **spec},
    }


@pytest.fixture
def world(kube_api: KubeAPI, tmp_path: Path) -> KubeAPI:
    """An RLCycle at 25% of its canary: composer-0 (base) <- composer-1 (serving, promoted)
    <- composer-2 (canary)."""
    kube_api.create(rlcycle(tmp_path))
    set_status(kube_api, "RLCycle", NAME, CANARY_STATUS)
    kube_api.create(checkpoint("composer-0"))
    kube_api.create(checkpoint("composer-1", parent="composer-0", rlCycle=NAME, cycle=1))
    kube_api.create(checkpoint("composer-2", parent="composer-1", rlCycle=NAME, cycle=2))
    trained = {"training": {"steps": 4, "tokens": 90000, "loss": 0.12, "kl": 0.003}}
    evaluated = {"verdict": "Passed", "gates": [
        {"metric": "replay.kl", "candidate": 0.01, "parent": 0.0, "ciLow": 0.005,
         "ciHigh": 0.015, "passed": True}]}  # fmt: skip
    promoted = [{**CANARY_ROLLOUT[0], "weight": 50, "decision": "promote",
                 "reason": "edit_persistence: better", "endedAt": ago(hours=5)}]  # fmt: skip
    set_status(kube_api, "Checkpoint", "composer-1",
               {"phase": "Promoted", "reason": "Promoted", **trained, "eval": evaluated,
                "rollout": promoted})  # fmt: skip
    set_status(kube_api, "Checkpoint", "composer-2",
               {"phase": "Canary", "reason": "CanaryStarted", "message": "canary at 5%",
                "startedAt": ago(hours=4), **trained, "eval": evaluated,
                "data": {"interactions": 2000, "tokens": 90000, "onPolicyFraction": 0.95},
                "rollout": CANARY_ROLLOUT})  # fmt: skip
    return kube_api


@pytest.fixture
def writes(kube_api: KubeAPI) -> Iterator[list[tuple[str, str, Any]]]:
    """Every write the API applies from here on: (method, path, body)."""
    seen: list[tuple[str, str, Any]] = []
    kube_api.emulator.after_write = lambda method, path, body, _: seen.append((method, path, body))
    yield seen
    kube_api.emulator.after_write = None


def set_status(kube_api: KubeAPI, kind: str, name: str, status: dict[str, Any]) -> None:
    kube_api.patch(RTRL, kind, name, {"status": status}, subresource="status")


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = plugin.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def rlc(kube_api: KubeAPI) -> dict[str, Any]:
    return kube_api.get(RTRL, "RLCycle", NAME) or {}


# --- what the operator reads -----------------------------------------------------------------
def test_the_plugin_writes_what_the_operator_reads() -> None:
    assert commands.ANNOTATION_TRIGGER == names.ANNOTATION_TRIGGER
    assert commands.ANNOTATION_PROMOTE == names.ANNOTATION_PROMOTE
    assert commands.ANNOTATION_ROLLBACK == names.ANNOTATION_ROLLBACK


# --- status and history ----------------------------------------------------------------------
def test_status_summarises_the_rlcycle_and_its_canary(
    world: KubeAPI, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(capsys, "status", NAME)
    assert code == 0, err
    head: dict[str, str] = {}
    for line in out.split("\n\n")[0].splitlines()[1:]:
        found = re.match(r"\s+([A-Z][a-z ]+):\s+(.*)", line)
        if found:
            head[found.group(1)] = found.group(2)
    assert out.startswith("RLCycle default/composer:\n")
    assert head["Phase"] == "Canary (composer-2 at 25%: next analysis soon)"
    assert (head["Cycle"], head["Serving"], head["Candidate"]) == ("2", "composer-1", "composer-2")
    assert head["Canary weight"] == "25%"
    # 3 h after the objects were made; the test may run minutes later on a slow machine
    assert re.search(r"Z \(in (3h|2h[0-5]?[0-9]m)\)$", head["Next run"]), head["Next run"]
    # The unhealthy condition first and marked; the healthy ones after it.
    conditions = out.split("  Conditions:\n")[1].split("\n\n")[0].splitlines()
    assert conditions[0] == "    ! Degraded=True CycleFailed: composer-x: train failed"
    assert "    Ready=True Serving: composer-1 serves composer-vllm" in conditions
    assert "    InvalidSpec=False SpecValid" in conditions
    # The candidate, its rollout records and the A/B numbers.
    candidate = out.split("Candidate composer-2:\n")[1]
    assert "Phase:     Canary (CanaryStarted: canary at 5%)" in candidate
    assert "Eval:      Passed (1/1 gates passed)" in candidate
    assert "2000 interactions, 90000 tokens, 95.0% on-policy" in candidate
    rows = [line.split() for line in candidate.splitlines() if re.match(r"\s+\d+\s+\d+%", line)]
    assert rows[0] == ["1", "5%", ago(hours=2), ago(hours=1), "2", "continue", "5000", "480"]
    assert rows[1] == ["2", "25%", ago(hours=1), "running", "0", "-", "-", "-"]
    assert "Reason: edit_persistence: inconclusive" in candidate
    # A status written before relative intervals: the absolute numbers, labelled as such.
    metric = next(line.split() for line in candidate.splitlines() if "edit_persistence  " in line)
    assert metric == ["edit_persistence", "0.600", "0.620", "+0.020", "(abs)", "[+0.005,",
                      "+0.035]", "(abs)", "-"]  # fmt: skip
    latency = next(line.split() for line in candidate.splitlines() if "latency_ms" in line)
    assert latency == ["latency_ms", "1200.0", "1180.0", "-20.0", "(abs)", "[-45.5,", "+4.2]",
                       "(abs)", "-"]  # fmt: skip
    assert "      (abs): canary minus baseline" in candidate


def test_status_without_a_running_cycle_shows_the_last_one(
    world: KubeAPI, capsys: pytest.CaptureFixture[str]
) -> None:
    set_status(world, "RLCycle", NAME, {"phase": "Idle", "candidate": None, "canaryWeight": 0})
    code, out, _ = run(capsys, "status", NAME)
    assert code == 0
    assert "Last cycle composer-2:" in out and "Canary weight:  0%" in out


def test_status_json_prints_the_raw_objects(
    world: KubeAPI, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run(capsys, "status", NAME, "-o", "json")
    assert code == 0
    doc = json.loads(out)
    assert doc["kind"] == "List"
    assert [i["kind"] for i in doc["items"]] == ["RLCycle", "Checkpoint"]
    assert doc["items"][0]["status"]["canaryWeight"] == 25
    assert doc["items"][1]["status"]["rollout"][0]["metrics"] == METRICS


def test_history_lists_checkpoints_newest_first(
    world: KubeAPI, capsys: pytest.CaptureFixture[str]
) -> None:
    world.create(checkpoint("other-1", rlCycle="other", cycle=7) | {"metadata": {"name": "x-1"}})
    code, out, err = run(capsys, "history", NAME)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split() == ["NAME", "CYCLE", "PHASE", "PARENT", "EVAL", "DECISION",
                                "REASON", "AGE"]  # fmt: skip
    names = [line[2:].split()[0] for line in lines[1:4]]
    assert names == ["composer-2", "composer-1", "composer-0"]  # not x-1 of RLCycle other
    assert lines[1].split()[:6] == ["composer-2", "2", "Canary", "composer-1", "Passed", "continue"]
    assert "edit_persistence: inconclusive" in lines[1]
    assert lines[2].startswith("* composer-1 ")
    assert lines[2].split()[2:8] == ["1", "Promoted", "composer-0", "Passed", "promote",
                                     "edit_persistence:"]  # fmt: skip
    assert lines[3].split()[:-1] == ["composer-0", "-", "-", "-", "-", "-", "-"]
    assert re.fullmatch(r"\d+s", lines[3].split()[-1])
    assert lines[-1] == "(* serving: composer-1)"
    code, out, _ = run(capsys, "history", NAME, "-o", "json")
    names = [i["metadata"]["name"] for i in json.loads(out)["items"]]
    assert names == ["composer-2", "composer-1", "composer-0"]


# --- the verbs that change something ----------------------------------------------------------
def test_trigger_annotates_a_new_timestamp(
    world: KubeAPI, writes: list[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    set_status(world, "RLCycle", NAME, {"phase": "Idle"})
    writes.clear()
    code, out, err = run(capsys, "trigger", NAME)
    assert code == 0, err
    assert len(writes) == 1
    method, path, body = writes[0]
    assert (method, path) == ("PATCH", BASE)
    value = body["metadata"]["annotations"]["rtrl.io/trigger"]
    assert body == {"metadata": {"annotations": {"rtrl.io/trigger": value}}}
    moment = datetime.strptime(value, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC)
    assert abs((moment - datetime.now(UTC)).total_seconds()) < 60
    assert out == f"rlcycle.rtrl.io/composer annotated: rtrl.io/trigger={value}\n"
    assert "starts a cycle" in err
    # Each trigger is a new request, whatever the clock says.
    code, _, _ = run(capsys, "trigger", NAME)
    second = rlc(world)["metadata"]["annotations"]["rtrl.io/trigger"]
    assert code == 0 and second != value


def test_trigger_is_refused_while_suspended_or_pinned(
    world: KubeAPI, writes: list[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    world.patch(RTRL, "RLCycle", NAME, {"spec": {"suspend": True}})
    writes.clear()
    code, _, err = run(capsys, "trigger", NAME)
    assert code == 1 and "is suspended" in err and "kubectl rtrl resume composer" in err
    world.patch(RTRL, "RLCycle", NAME, {"spec": {"suspend": False, "pin": "composer-0"}})
    writes.clear()
    code, _, err = run(capsys, "trigger", NAME)
    assert code == 1 and "is pinned to composer-0" in err
    assert writes == []


def test_promote_annotates_only_during_a_canary(
    world: KubeAPI, writes: list[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(capsys, "promote", NAME)
    assert code == 0, err
    value = rlc(world)["metadata"]["annotations"]["rtrl.io/promote"]
    assert writes == [("PATCH", BASE, {"metadata": {"annotations": {"rtrl.io/promote": value}}})]
    assert "promotes composer-2 (canary at 25%) in place of composer-1" in err
    writes.clear()
    set_status(world, "RLCycle", NAME, {"phase": "Training"})
    writes.clear()
    code, out, err = run(capsys, "promote", NAME)
    assert code == 1 and out == ""
    assert err == (
        "error: RLCycle composer has no canary running (phase Training): "
        "promote acts only on a running canary\n"
    )
    assert writes == []


def test_rollback_aborts_the_canary(
    world: KubeAPI, writes: list[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run(capsys, "rollback", NAME)
    assert code == 0, err
    value = rlc(world)["metadata"]["annotations"]["rtrl.io/rollback"]
    assert writes == [("PATCH", BASE, {"metadata": {"annotations": {"rtrl.io/rollback": value}}})]
    assert "the canary of composer-2 is aborted: all traffic back to composer-1" in err


def test_rollback_with_no_canary_steps_back_to_the_parent(
    world: KubeAPI, writes: list[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    set_status(world, "RLCycle", NAME, {"phase": "Idle"})
    writes.clear()
    code, _, err = run(capsys, "rollback", NAME)
    assert code == 0, err
    assert [w[2]["metadata"]["annotations"] for w in writes] == [
        {"rtrl.io/rollback": rlc(world)["metadata"]["annotations"]["rtrl.io/rollback"]}
    ]
    assert "composer-1 is rolled back: composer-0 serves again" in err
    # The base model has no parent: refused, nothing written.
    set_status(world, "RLCycle", NAME, {"serving": "composer-0"})
    writes.clear()
    code, _, err = run(capsys, "rollback", NAME)
    assert (code, err) == (1, "error: composer-0 has no parent checkpoint to roll back to\n")
    assert writes == []


def test_rollback_to_pins_an_existing_checkpoint(
    world: KubeAPI, writes: list[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(capsys, "rollback", NAME, "--to", "composer-0")
    assert code == 0, err
    assert writes == [("PATCH", BASE, {"spec": {"pin": "composer-0"}})]
    assert rlc(world)["spec"]["pin"] == "composer-0"
    assert out == "rlcycle.rtrl.io/composer pinned to composer-0 (spec.pin: composer-0)\n"
    assert "kubectl rtrl resume --unpin composer" in err
    assert "GitOps" in err and "docs/kubectl.md" in err
    # A plain rollback while pinned would wait for the unpin: refused.
    writes.clear()
    code, _, err = run(capsys, "rollback", NAME)
    assert code == 1 and "is pinned to composer-0" in err and writes == []


def test_rollback_to_refuses_a_missing_or_untrained_checkpoint(
    world: KubeAPI, writes: list[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run(capsys, "rollback", NAME, "--to", "composer-9")
    assert (code, err) == (1, "error: Checkpoint composer-9 not found in namespace default\n")
    world.create(checkpoint("composer-3", parent="composer-1", rlCycle=NAME, cycle=3))
    set_status(world, "Checkpoint", "composer-3", {"phase": "Training"})
    writes.clear()
    code, _, err = run(capsys, "rollback", NAME, "--to", "composer-3")
    assert code == 1 and "composer-3 has no trained model (phase Training)" in err
    assert writes == []
    assert "pin" not in rlc(world)["spec"]


def test_pause_and_resume_patch_suspend_and_pin(
    world: KubeAPI, writes: list[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(capsys, "pause", NAME)
    assert code == 0, err
    assert writes == [("PATCH", BASE, {"spec": {"suspend": True}})]
    assert out == "rlcycle.rtrl.io/composer paused (spec.suspend: true)\n"
    assert "the running cycle (phase Canary) finishes" in err
    assert "spec.suspend is declarative" in err
    assert rlc(world)["spec"]["suspend"] is True
    writes.clear()
    code, out, err = run(capsys, "resume", NAME)
    assert writes == [("PATCH", BASE, {"spec": {"suspend": False}})]
    assert rlc(world)["spec"]["suspend"] is False
    world.patch(RTRL, "RLCycle", NAME, {"spec": {"pin": "composer-0"}})
    writes.clear()
    code, out, err = run(capsys, "resume", NAME)
    assert code == 0 and "still pinned to composer-0" in err
    writes.clear()
    code, out, err = run(capsys, "resume", "--unpin", NAME)
    assert code == 0
    assert writes == [("PATCH", BASE, {"spec": {"suspend": False, "pin": None}})]
    assert "pin" not in rlc(world)["spec"]
    assert out == "rlcycle.rtrl.io/composer resumed (spec.suspend: false, spec.pin removed)\n"


def test_spec_edits_warn_when_a_gitops_tool_applies_the_rlcycle(
    world: KubeAPI, capsys: pytest.CaptureFixture[str]
) -> None:
    tracking = {"argocd.argoproj.io/tracking-id": "composer:rtrl.io/RLCycle:ml/composer"}
    world.patch(RTRL, "RLCycle", NAME, {"metadata": {"annotations": tracking}})
    code, _, err = run(capsys, "pause", NAME)
    assert code == 0
    assert "warning: this RLCycle is applied by Argo CD (annotation " in err
    assert "if git sets spec.suspend, the next sync reverts this edit" in err


# --- errors ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "argv",
    [["status", "nope"], ["history", "nope"], ["trigger", "nope"], ["promote", "nope"],
     ["rollback", "nope"], ["pause", "nope"], ["resume", "nope"],
     ["rollback", "nope", "--to", "composer-0"]],
)  # fmt: skip
def test_a_missing_rlcycle_is_one_line_and_exit_1(
    world: KubeAPI, writes: list[Any], capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    code, out, err = run(capsys, *argv)
    assert (code, out, err) == (1, "", "error: RLCycle nope not found in namespace default\n")
    assert writes == []


def test_namespace_comes_from_the_flag_then_the_context(
    world: KubeAPI, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run(capsys, "status", NAME, "-n", "ml-serving")
    assert (code, err) == (1, "error: RLCycle composer not found in namespace ml-serving\n")
    other = write_kubeconfig(tmp_path / "other", world.url, "ml-serving")
    code, _, err = run(capsys, "--kubeconfig", str(other), "history", NAME)
    assert "namespace ml-serving" in err
    code, out, _ = run(capsys, "--kubeconfig", str(other), "-n", "default", "history", NAME)
    assert code == 0 and "composer-2" in out
    code, _, err = run(capsys, "status", NAME, "--context", "elsewhere")
    assert code == 1 and err.startswith("error: kubeconfig: ") and len(err.splitlines()) == 1


def test_forbidden_is_one_line(
    world: KubeAPI, writes: list[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    message = 'rlcycles.rtrl.io "composer" is forbidden: User "dev" cannot patch resource'
    status = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Forbidden",
              "message": message, "code": 403}  # fmt: skip
    world.emulator["patch"] << 403 << status
    code, out, err = run(capsys, "pause", NAME)
    assert code == 1 and out == ""
    assert err.startswith("error: forbidden: PATCH ") and message in err
    assert len(err.splitlines()) == 1


def test_an_unreachable_api_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv(
        "KUBECONFIG", os.fspath(write_kubeconfig(tmp_path / "kc", f"http://127.0.0.1:{port}", "x"))
    )
    code, out, err = run(capsys, "status", NAME)
    assert (code, out) == (1, "")
    assert err == (
        f"error: cannot reach the Kubernetes API server at http://127.0.0.1:{port}: "
        "Connection refused\n"
    )
    monkeypatch.setenv("KUBECONFIG", os.fspath(tmp_path / "missing"))
    code, _, err = run(capsys, "status", NAME)
    assert code == 1 and err.startswith("error: no kubeconfig found (looked at ")


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(capsys, "status")[0] == 2
    assert run(capsys, "frobnicate", NAME)[0] == 2
    assert run(capsys, "rollback", NAME, "--to")[0] == 2
    assert run(capsys)[0] == 2
    code, out, _ = run(capsys, "--help")
    assert code == 0 and all(verb in out for verb in commands.VERBS)


# --- the installed executable ----------------------------------------------------------------
def test_the_kubectl_rtrl_executable(world: KubeAPI) -> None:
    env = {**os.environ, "KUBECONFIG": os.fspath(world.kubeconfig)}
    exe = console_script("kubectl-rtrl")
    shown = subprocess.run([exe, "status", NAME], capture_output=True, text=True, env=env)
    assert shown.returncode == 0, shown.stderr
    assert "Candidate composer-2:" in shown.stdout and "edit_persistence" in shown.stdout
    paused = subprocess.run([exe, "pause", NAME], capture_output=True, text=True, env=env)
    assert paused.returncode == 0 and rlc(world)["spec"]["suspend"] is True
    missing = subprocess.run([exe, "promote", "nope"], capture_output=True, text=True, env=env)
    assert missing.returncode == 1
    assert missing.stderr == "error: RLCycle nope not found in namespace default\n"


def test_rollback_during_a_step_says_the_cycle_is_cancelled(
    world: KubeAPI, writes: list[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    set_status(world, "RLCycle", NAME, {"phase": "Training"})
    writes.clear()
    code, _, err = run(capsys, "rollback", NAME)
    assert code == 0 and len(writes) == 1
    assert "the running cycle (phase Training) is cancelled" in err
    code, _, err = run(capsys, "rollback", NAME, "--to", "composer-0")
    assert code == 0 and "it is cancelled and its Jobs stopped, and composer-0 serves" in err


# --- status --watch, list, wait (their runs against the real control plane: e2e) -------------
def test_watch_without_a_terminal_appends_a_frame_per_change(world: KubeAPI) -> None:
    """Piped, each frame is printed once, plain (no escapes), and again only when something
    shown changed; Ctrl-C (SIGINT) ends it with 0."""
    env = {**os.environ, "KUBECONFIG": os.fspath(world.kubeconfig)}
    env.pop("NO_COLOR", None)
    exe = console_script("kubectl-rtrl")
    watching = subprocess.Popen([exe, "get", NAME, "--watch"], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
    try:
        time.sleep(3)  # a few looks at nothing changing
        set_status(world, "RLCycle", NAME, {"phase": "Promoting", "canaryWeight": 100})
        time.sleep(2.5)
    finally:
        watching.send_signal(signal.SIGINT)
        out, err = watching.communicate(timeout=30)
    assert watching.returncode == 0, err
    frames = out.split("kubectl rtrl status composer -n default --watch (Ctrl-C to stop)")[1:]
    assert len(frames) == 2, out
    assert "Phase:          Canary (" in frames[0] and "Canary weight:  25%" in frames[0]
    assert "Phase:          Promoting (" in frames[1] and "Canary weight:  100%" in frames[1]
    assert "\x1b" not in out
    assert "└── composer-2" in frames[1] and "Events: none" in frames[1]


def test_list_and_wait_usage(world: KubeAPI, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "list")
    assert code == 0 and out.splitlines()[1].split()[:2] == ["composer", "Canary"]
    code, _, err = run(capsys, "list", "-n", "empty")
    assert (code, err) == (0, "No RLCycles found in empty namespace.\n")
    assert run(capsys, "wait", NAME)[0] == 2  # --for is required
    assert run(capsys, "wait", NAME, "--for=Done")[0] == 2
    assert run(capsys, "wait", NAME, "--for=Canary", "--timeout=soon")[0] == 2
    assert run(capsys, "status", NAME, "--watch", "-o", "json")[0] == 1
    # the canary is running: reached at once; an RLCycle phase it is not in: timed out
    code, _, err = run(capsys, "wait", NAME, "--for=Canary", "--timeout=0s")
    assert (code, err) == (0, "rlcycle.rtrl.io/composer: composer-2 reached Canary (is Canary)\n")
    code, _, err = run(capsys, "wait", NAME, "--for=idle", "--timeout=0s")
    assert (code, err) == (1, "error: timed out after 0s waiting for Idle "
                              "(rlcycle.rtrl.io/composer is Canary)\n")  # fmt: skip
    # a cycle that has ended is not waited for: the next one is
    set_status(world, "Checkpoint", "composer-2", {"phase": "Rejected", "message": "gate"})
    code, _, err = run(capsys, "wait", NAME, "--for=Promoted", "--timeout=0s")
    assert (code, err) == (1, "error: timed out after 0s waiting for Promoted "
                              "(no new cycle of rlcycle.rtrl.io/composer started)\n")  # fmt: skip
