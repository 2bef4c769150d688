"""The console scripts a user types exist, answer --help, and fail clearly on what this
version does not have (or cannot reach)."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

from rtrl_localkube.tools import tool
from tests.conftest import REPO, console_script


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, cwd=REPO)


def test_rtrl_help_lists_commands() -> None:
    out = _run(console_script("rtrl"), "--help")
    assert out.returncode == 0
    for command in ("crds", "validate", "shards"):
        assert command in out.stdout


def test_rtrl_job_names_missing_steps() -> None:
    out = _run(console_script("rtrl-job"), "deploy", "--config", "x.yaml")
    assert out.returncode == 2
    assert "step 'deploy' is not available in this version (available: stage" in out.stderr


def test_rtrl_job_stage_answers_help() -> None:
    out = _run(console_script("rtrl-job"), "stage", "--help")
    assert out.returncode == 0
    for flag in ("--shards", "--checkpoint", "--out", "--config", "--now", "--since", "--ranks"):
        assert flag in out.stdout


def test_kubectl_plugin_validates_like_rtrl() -> None:
    plugin = console_script("kubectl-rtrl")
    ok = _run(plugin, "validate", "examples/rlcycle.yaml")
    assert ok.returncode == 0 and "RLCycle/composer valid" in ok.stdout
    bad = _run(plugin, "validate", "examples/invalid/zero-stage-4.yaml")
    assert bad.returncode == 1 and "spec.training.zeroStage" in bad.stdout


def test_kubectl_plugin_cluster_verbs_fail_clearly_without_a_cluster(tmp_path: Path) -> None:
    plugin = console_script("kubectl-rtrl")
    env = {**os.environ, "KUBECONFIG": os.fspath(tmp_path / "missing")}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    for verb in ("status", "rollback", "pause"):  # reads, annotates, edits spec
        out = subprocess.run(
            [plugin, verb, "composer"], capture_output=True, text=True, cwd=REPO, env=env
        )
        assert out.returncode == 1, out.stderr
        assert out.stderr.startswith("error: no kubeconfig found") and out.stderr.count("\n") == 1
    usage = _run(plugin, "rollback")
    assert usage.returncode == 2 and "RLCYCLE" in usage.stderr
    helped = _run(plugin, "--help")
    assert helped.returncode == 0 and "rollback" in helped.stdout


def test_a_stage_pod_does_not_import_torch() -> None:
    """Steps are imported on demand: eval's torch/transformers never slow a stage pod."""
    code = (
        "import sys\n"
        "from rtrl_trainer.cli import build_parser\n"
        "build_parser('stage')\n"
        "assert 'torch' not in sys.modules, 'stage imported torch'\n"
    )
    out = _run(sys.executable, "-c", code)
    assert out.returncode == 0, out.stderr


def test_the_operator_process_does_not_import_pyarrow() -> None:
    """`rtrl operator` parses only its own subcommand: the shard reader (pyarrow) and the
    demo are never loaded into the long-running operator process."""
    code = (
        "import sys\n"
        "from rtrl.cli import build_parser\n"
        "build_parser('operator').parse_args(['operator', '-n', 'default'])\n"
        "import rtrl.handlers\n"
        "assert 'pyarrow' not in sys.modules, 'the operator imported pyarrow'\n"
        "assert 'rtrl_demo.demo' not in sys.modules, 'the operator imported the demo'\n"
    )
    out = _run(sys.executable, "-c", code)
    assert out.returncode == 0, out.stderr


def test_every_command_and_the_operator_say_their_version() -> None:
    """One version, the distribution's, from every console script (`--version`) and in the
    operator's first log line; rtrl-job, rtrl-capture and rtrl-feedback had none."""
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    for script in ("rtrl", "rtrl-job", "rtrl-capture", "rtrl-feedback", "kubectl-rtrl"):
        out = _run(console_script(script), "--version")
        assert (out.returncode, out.stdout.strip()) == (0, f"{script} {version}"), out.stderr
    operator = _run(console_script("rtrl"), "operator", "--log-format", "json")
    assert operator.returncode == 2  # no --namespace: after the first line
    first = (operator.stdout + operator.stderr).splitlines()[0]
    assert f"rtrl operator {version} (kopf " in first, first


def complete_in_bash(line: str) -> list[str]:
    """What bash offers after ``line``, with the script of `rtrl completion bash` loaded."""
    bin_dir = os.path.dirname(console_script("rtrl"))
    script = (
        'source <(rtrl completion bash); read -ra COMP_WORDS <<< "$LINE"; '
        '[[ "$LINE" == *" " ]] && COMP_WORDS+=(""); COMP_CWORD=$((${#COMP_WORDS[@]} - 1)); '
        '_rtrl_complete; printf "%s\\n" "${COMPREPLY[@]}"'
    )
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "LINE": line}
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    return [w for w in out.stdout.splitlines() if w]


def test_rtrl_completes_in_bash_from_its_parser() -> None:
    assert complete_in_bash("rtrl va") == ["validate"]
    assert "operator" in complete_in_bash("rtrl ") and "completion" in complete_in_bash("rtrl ")
    assert complete_in_bash("rtrl operator --log") == ["--log-format"]
    assert complete_in_bash("rtrl operator --log-format ") == ["text", "json"]
    assert complete_in_bash("rtrl completion ") == ["bash", "zsh"]


def test_kubectl_completes_the_plugin_through_kubectl_complete_rtrl() -> None:
    """The real kubectl runs `kubectl_complete-rtrl` from the PATH for `kubectl rtrl ...`."""
    bin_dir = os.path.dirname(console_script("kubectl-rtrl"))
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "KUBECONFIG": os.devnull}
    out = subprocess.run([tool("kubectl"), "__complete", "rtrl", "st"],
                         capture_output=True, text=True, env=env)  # fmt: skip
    assert out.stdout.splitlines() == ["status", ":4"], (out.stdout, out.stderr)
    out = subprocess.run([tool("kubectl"), "__complete", "rtrl", "rollback", "--"],
                         capture_output=True, text=True, env=env)  # fmt: skip
    assert "--to" in out.stdout.splitlines(), out.stdout
