"""``kubectl rtrl`` as a live view on the real control plane, with the operator running a
cycle of scripted steps (the real Job and Deployment controllers, the kubelet stand-in):
``status --watch`` in a real terminal (tmux) redrawing as the cycle moves, ``wait``'s exit
codes for a cycle promoted, one rolled back and a timeout, and ``list -A`` across two
namespaces. Each command runs as a user types it: kubectl finding the plugin on PATH."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from rtrl.core.results import AnalysisCause, AnalysisMetric, AnalysisResult, CauseKind, Decision
from rtrl_localkube.api import KubeAPI
from rtrl_localkube.cycle_world import (
    ANALYSIS_ROLLBACK,
    NAME,
    RTRL,
    commit_result,
    rlcycle,
    script_all,
    setup_namespace,
    status,
    wait_phase,
)
from rtrl_localkube.kubelet import Kubelet
from rtrl_localkube.outcomes import Succeed
from rtrl_localkube.tools import Cli, tool

pytestmark = pytest.mark.timeout(300)
CKPT = "composer-1"
# An analysis that holds the canary at its step (the last one: until promoted by hand),
# with today's relative change, always-valid interval and verdict.
HOLD = AnalysisResult(
    decision=Decision.CONTINUE,
    cause=AnalysisCause(kind=CauseKind.INCONCLUSIVE),
    reasons=["edit_persistence: inconclusive"],
    baseline_samples=5000,
    canary_samples=5000,
    metrics=[
        AnalysisMetric(name="edit_persistence", kind="goal", baseline=0.6, canary=0.62,
                       difference=0.02, ci_low=-0.005, ci_high=0.045, relative_difference=0.0333,
                       relative_ci_low=-0.0083, relative_ci_high=0.075, verdict="inconclusive"),
    ],
).document()  # fmt: skip


def hold_the_canary(node: Kubelet, scratch: Path) -> None:
    script_all(node, scratch)
    node.script("*-analyze-*", Succeed(before=commit_result("analyze", HOLD, scratch / "res")))


class Terminal:
    """A tmux session of its own (its own server socket) running one command in a clean
    environment (``env -i``: the test process' LINES and COLUMNS would override the
    terminal's size), as a fresh login's terminal would."""

    def __init__(
        self, socket: Path, command: str, env: dict[str, str], size: tuple[int, int] = (160, 100)
    ) -> None:
        # a fixed size whatever attaches (or not), and the pane kept after the command ends
        # so that its exit status can be read
        config = socket.with_suffix(".conf")
        width, height = size
        config.write_text(f"set -g default-size {width}x{height}\nset -g remain-on-exit on\n")
        self.base = ["tmux", "-S", os.fspath(socket), "-f", os.fspath(config)]
        exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
        # The command's exit status goes to a file: tmux's own (#{pane_dead_status}) was
        # sometimes still missing 20 s after the pane's terminal closed. The shell catches
        # SIGINT with a trap (reset to the default in the command it starts), so Ctrl-C
        # reaches the command as in a login shell and the shell lives to write the status.
        self.status_file = socket.with_suffix(".status")
        script = (f"trap true INT; env -i {exports} {command}; "
                  f"echo $? > {shlex.quote(os.fspath(self.status_file))}")  # fmt: skip
        self.tmux("new-session", "-d", "-s", "rtrl", "-x", str(width), "-y", str(height),
                  f"sh -c {shlex.quote(script)}")  # fmt: skip

    def tmux(self, *args: str) -> str:
        done = subprocess.run([*self.base, *args], capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr
        return done.stdout

    def screen(self) -> str:
        return self.tmux("capture-pane", "-p", "-t", "rtrl")

    def wait_for(self, predicate: Callable[[str], bool], timeout: float = 90) -> str:
        deadline = time.monotonic() + timeout
        while True:
            shown = self.screen()
            if predicate(shown):
                return shown
            if time.monotonic() > deadline:
                raise AssertionError(f"the screen never showed it:\n{shown}")
            time.sleep(0.3)

    def exit_status(self, timeout: float = 20) -> str:
        """The command's exit status once it ended (as ``$?`` says it: 128 + N for a
        signal N), "running" if it had not ended within ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.status_file.exists() and (text := self.status_file.read_text().strip()):
                return text
            time.sleep(0.2)
        return "running"

    def close(self) -> None:
        subprocess.run([*self.base, "kill-server"], capture_output=True, timeout=30)


@pytest.fixture
def terminal(tmp_path: Path) -> Iterator[Callable[[str, dict[str, str]], Terminal]]:
    if shutil.which("tmux") is None:
        message = "tmux is missing: `make browser` installs it (with chromium)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    opened: list[Terminal] = []

    def open_(command: str, env: dict[str, str], size: tuple[int, int] = (160, 100)) -> Terminal:
        opened.append(Terminal(tmp_path / f"tmux-{len(opened)}", command, env, size))
        return opened[-1]

    yield open_
    for t in opened:
        t.close()


def line_of(screen: str, *words: str) -> list[str]:
    """The first line of the screen holding every word, split."""
    for line in screen.splitlines():
        if all(w in line.split() for w in words):
            return line.split()
    return []


def test_status_watch_redraws_a_live_cycle_in_a_terminal(  # noqa: PLR0917 (fixtures)
    kube_api: KubeAPI, node: Kubelet, operator: Any, admin: Cli, terminal: Any, tmp_path: Path
) -> None:
    ns = kube_api.namespace
    hold_the_canary(node, tmp_path)
    setup_namespace(kube_api, tmp_path)
    env = admin.env({"TERM": "xterm-256color", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"})
    env = {k: env[k] for k in ("PATH", "KUBECONFIG", "TERM", "LANG", "LC_ALL", "HOME")}
    screen = terminal(f"{tool('kubectl')} rtrl status {NAME} -n {ns} --watch", env)

    # The canary up at its last step, held there: the tree, the weight, the A/B row, Events.
    shown = screen.wait_for(
        lambda s: "Deployment" in s and "50%" in s and "edit_persistence" in s and "CanaryStep" in s
    )
    assert line_of(shown, "composer", "RLCycle")[2] == "Canary", shown
    assert line_of(shown, "Canary", "weight:") == ["Canary", "weight:", "50%"], shown
    assert line_of(shown, "└──", CKPT, "Checkpoint")[3] == "Canary", shown
    for step in ("stage", "train", "eval"):
        job = line_of(shown, f"{CKPT}-{step}-0", "Job")
        assert job[0] in ("├──", "└──") and job[3] == "Succeeded", (step, shown)
    canary = line_of(shown, "composer-vllm-canary", "Deployment")
    assert canary[5:8] == ["canary", "50%,", "1/1"], shown
    # the A/B row as the console and the report show it: relative change, always-valid CI
    ab = line_of(shown, "edit_persistence", "inconclusive")
    assert ab == ["edit_persistence", "0.600", "0.620", "+3.3%", "[-0.8%,", "+7.5%]",
                  "inconclusive"], shown  # fmt: skip
    assert line_of(shown, "replay.kl", "yes")[:4] == ["replay.kl", "0.010", "0.000", "+0.010"]
    assert line_of(shown, "Normal", "CanaryStarted", f"Checkpoint/{CKPT}"), shown
    # Step 1 asked 25%, but one canary pod next to one stable pod is 50%: the Candidate
    # block says what the canary got, as the RLCycle's weight does (it said 25%)
    assert line_of(shown, "(step:", "25%)")[:4] == ["1", "50%", "(step:", "25%)"], shown
    # Redrawn in place: one frame on the screen, not appended ones.
    assert shown.count("RLCycle") >= 2 and shown.count(f"Candidate {CKPT}:") == 1, shown

    # Promoted by hand while it watches: the same screen shows the phase change.
    admin.kubectl("rtrl", "promote", NAME, "-n", ns)
    shown = screen.wait_for(lambda s: line_of(s, "Checkpoint", "Promoted", "last"))
    assert line_of(shown, "Normal", "Promoted", f"RLCycle/{NAME}"), shown
    assert shown.count("Last cycle composer-1:") == 1, shown
    # Ctrl-C: exit 0.
    screen.tmux("send-keys", "-t", "rtrl", "C-c")
    assert screen.exit_status() == "0", screen.screen()


def test_status_watch_keeps_its_header_when_lines_wrap_in_a_narrow_terminal(
    kube_api: KubeAPI, release: str, admin: Cli, terminal: Any, tmp_path: Path
) -> None:
    """A terminal narrower than the frame's lines: the terminal wraps them, and a redraw
    that counted each as one row scrolled the screen, losing the header (and repeating the
    frame's tail) at every redraw. (``release``: the chart's CRDs; no operator runs: the
    status is written by hand, with a long message.)"""
    ns = kube_api.namespace
    setup_namespace(kube_api, tmp_path)
    message = "waiting for the canary to be ready: " + "a long message, " * 12
    kube_api.patch(RTRL, "RLCycle", NAME, {"status": {"phase": "Canary", "cycle": 1,
                   "serving": "composer-0", "message": message}}, subresource="status")  # fmt: skip
    env = admin.env({"TERM": "xterm-256color", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"})
    env = {k: env[k] for k in ("PATH", "KUBECONFIG", "TERM", "LANG", "LC_ALL", "HOME")}
    screen = terminal(f"{tool('kubectl')} rtrl status {NAME} -n {ns} --watch", env, (48, 24))
    # three redraws (one a second), each of more rows than the terminal has once wrapped
    shown = screen.wait_for(lambda s: "Events" in s or "more rows" in s)
    time.sleep(3.5)
    shown = screen.screen()
    top = shown.splitlines()[0]
    assert top.startswith("kubectl rtrl status composer -n"), shown
    assert shown.count("kubectl rtrl status") == 1 and shown.count("RLCycle ") == 1, shown
    assert all(len(line) < 48 for line in shown.splitlines()), shown
    last = [line for line in shown.splitlines() if line.strip()][-1]
    assert last.startswith("... ") and last.endswith("more rows: a larger terminal shows them")
    screen.tmux("send-keys", "-t", "rtrl", "C-c")
    assert screen.exit_status() == "0", screen.screen()


def wait_cmd(admin: Cli, ns: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [tool("kubectl"), "rtrl", "wait", NAME, "-n", ns, *args],
        env=admin.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def finished(process: subprocess.Popen[str], timeout: float = 120) -> tuple[int, str]:
    _, err = process.communicate(timeout=timeout)
    return process.returncode, err


def test_wait_exit_codes_and_list_across_namespaces(
    kube_api: KubeAPI, node: Kubelet, operator: Any, admin: Cli, tmp_path: Path
) -> None:
    ns = kube_api.namespace
    hold_the_canary(node, tmp_path)
    setup_namespace(kube_api, tmp_path)
    # started as the first cycle starts (or before): they wait for that one
    promoted = wait_cmd(admin, ns, "--for=Promoted", "--timeout=180s")
    canary = wait_cmd(admin, ns, "--for", "canary", "--timeout=180s")
    code, err = finished(canary)
    assert (code, err) == (0, f"rlcycle.rtrl.io/{NAME}: {CKPT} reached Canary (is Canary)\n")
    # Held at the canary: a short wait times out, as kubectl wait does (exit 1).
    started = time.monotonic()
    timed_out = wait_cmd(admin, ns, "--for=Promoted", "--timeout=2s")
    code, err = finished(timed_out)
    assert code == 1 and time.monotonic() - started < 30
    assert err == f"error: timed out after 2s waiting for Promoted ({CKPT} is Canary)\n"
    assert promoted.poll() is None  # still waiting
    admin.kubectl("rtrl", "promote", NAME, "-n", ns)
    code, err = finished(promoted)
    assert code == 0, err
    assert err == f"rlcycle.rtrl.io/{NAME}: {CKPT} reached Promoted (is Promoted)\n"

    # The next cycle is rolled back by its analysis: waiting for Promoted ends with exit 3.
    script_all(node, tmp_path, analyze=ANALYSIS_ROLLBACK)
    wait_phase(kube_api, "RLCycle", NAME, "Idle", timeout=60)
    rolled_back = wait_cmd(admin, ns, "--for=Promoted", "--timeout=180s")
    time.sleep(1)
    admin.kubectl("rtrl", "trigger", NAME, "-n", ns)
    code, err = finished(rolled_back)
    assert code == 3, err
    assert err.startswith(f"error: rlcycle.rtrl.io/{NAME}: composer-2 ended RolledBack, not "
                          "Promoted: ")  # fmt: skip
    assert "worse" in err and len(err.splitlines()) == 1
    # An RLCycle phase is read off the RLCycle; a usage error is 2.
    assert finished(wait_cmd(admin, ns, "--for=Idle", "--timeout=60s"))[0] == 0
    assert finished(wait_cmd(admin, ns, "--for=Done"))[0] == 2

    # list -A: this RLCycle and one in another namespace, whose status is set by hand.
    other = f"{ns}-b"
    admin.kubectl("create", "namespace", other)
    try:
        kube_api.create(rlcycle(tmp_path / "b"), namespace=other)
        suspended = {"phase": "Suspended", "cycle": 4, "serving": "composer-4"}
        kube_api.patch(RTRL, "RLCycle", NAME, {"status": suspended}, namespace=other,
                       subresource="status")  # fmt: skip
        out = admin.kubectl("rtrl", "list", "-A").stdout.splitlines()
        assert out[0].split() == ["NAMESPACE", "NAME", "PHASE", "SERVING", "CANDIDATE", "CANARY",
                                  "CYCLE", "NEXT", "RUN", "AGE"]  # fmt: skip
        rows = {line.split()[0]: line.split() for line in out[1:]}
        mine = status(kube_api, "RLCycle", NAME)
        assert rows[ns][:7] == [ns, NAME, "Idle", mine["serving"], mine.get("candidate", "-"),
                                "0%", "2"], out  # fmt: skip
        assert rows[ns][7] == "in", out  # the next scheduled run
        assert rows[other][:7] == [other, NAME, "Suspended", "composer-4", "-", "0%", "4"], out
        one = admin.kubectl("rtrl", "list", "-n", other).stdout.splitlines()
        assert [line.split()[:2] for line in one] == [["NAME", "PHASE"], [NAME, "Suspended"]]
    finally:
        admin.kubectl("delete", "namespace", other, "--wait=false", check=False)


def test_status_shows_the_events_of_this_rlcycle_not_of_a_deleted_one_of_its_name(
    kube_api: KubeAPI, release: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An RLCycle deleted and created again under the same name: the first one's Events
    (kept by the API server for an hour) were shown as the new one's. (``release``: the
    chart's CRDs; no operator runs.)"""
    from rtrl.kubectl_plugin import main as kubectl_rtrl

    def event(uid: str, reason: str) -> None:
        kube_api.create({
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"generateName": "composer."},
            "involvedObject": {"apiVersion": "rtrl.io/v1alpha1", "kind": "RLCycle",
                               "name": NAME, "namespace": kube_api.namespace, "uid": uid},
            "reason": reason, "message": f"{reason} of {uid}", "type": "Normal",
            "source": {"component": "rtrl"},
        })  # fmt: skip

    first = kube_api.create(rlcycle(tmp_path))
    event(first["metadata"]["uid"], "OldIncarnation")
    kube_api.delete(RTRL, "RLCycle", NAME)
    kube_api.wait_for(lambda: kube_api.get(RTRL, "RLCycle", NAME) is None)
    second = kube_api.create(rlcycle(tmp_path))
    event(second["metadata"]["uid"], "ThisIncarnation")
    capsys.readouterr()
    assert kubectl_rtrl(["status", NAME, "--kubeconfig", str(kube_api.kubeconfig)]) == 0
    out = capsys.readouterr().out
    assert "ThisIncarnation" in out and "OldIncarnation" not in out, out
