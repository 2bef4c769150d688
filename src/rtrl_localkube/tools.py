"""The commands a platform engineer types, run against a control plane: kubectl, helm and
``rtrl operator``, each as a real process with its own kubeconfig."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from rtrl.core.api.policy import UNRESTRICTED
from rtrl_localkube.controlplane import ControlPlane
from rtrl_localkube.controlplane_setup import REPO
from rtrl_localkube.processes import die_with_parent, free_port

TOOLS_BIN = REPO / ".tools" / "bin"
# The operator's policy on a machine of one user, the admin and every RLCycle's author at
# once (rtrl.core.api.policy): what an OperatorProcess runs under unless told otherwise.
OPEN_POLICY_ENV = {"RTRL_POLICY": UNRESTRICTED.model_dump_json(by_alias=True)}


def tool(name: str) -> str:
    """``.tools/bin/<name>`` (helm, kubectl: `make tools`), the real binaries."""
    path = TOOLS_BIN / name
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: run `make tools`")
    return os.fspath(path)


@dataclass
class Cli:
    """kubectl and helm as one identity (a kubeconfig)."""

    kubeconfig: Path

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ)
        env["KUBECONFIG"] = os.fspath(self.kubeconfig)
        # kubectl finds the `kubectl rtrl` plugin (kubectl-rtrl) next to this Python
        path = [os.fspath(TOOLS_BIN), os.fspath(Path(sys.executable).parent), env.get("PATH", "")]
        env["PATH"] = os.pathsep.join(path)
        env["HELM_CACHE_HOME"] = os.fspath(self.kubeconfig.parent / "helm-cache")
        env["HELM_CONFIG_HOME"] = os.fspath(self.kubeconfig.parent / "helm-config")
        env["HELM_DATA_HOME"] = os.fspath(self.kubeconfig.parent / "helm-data")
        env.update(extra or {})
        return env

    def run(
        self, argv: list[str], *, check: bool = True, input: str | None = None, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            argv,
            env=self.env(),
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=REPO,
        )
        if check and result.returncode != 0:
            raise AssertionError(
                f"$ {' '.join(argv)}\nexit {result.returncode}\n{result.stdout}\n{result.stderr}"
            )
        return result

    def kubectl(self, *args: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
        return self.run([tool("kubectl"), *args], **kwargs)

    def helm(self, *args: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
        return self.run([tool("helm"), *args], **kwargs)

    def wait_established(self, *crds: str, timeout: float = 60) -> None:
        """Wait until each CRD (``crd/<name>``, or ``--all``) is Established. ``kubectl wait
        --for=condition=Established`` fails at once ("accessor error: <nil>") when it reads a
        CRD before the server has written any condition, which a loaded machine shows: the
        wait is retried until ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            left = max(1, int(deadline - time.monotonic()))
            result = self.kubectl(
                "wait", "--for=condition=Established", *crds, f"--timeout={left}s", check=False
            )
            if result.returncode == 0:
                return
            if time.monotonic() >= deadline or "accessor error" not in result.stderr:
                self.kubectl("wait", "--for=condition=Established", *crds, "--timeout=1s")
                return
            time.sleep(0.5)

    def get(self, *args: str) -> Any:
        """``kubectl get ... -o json``, decoded."""
        return yaml.safe_load(self.kubectl("get", *args, "-o", "json").stdout)


class OperatorProcess:
    """``rtrl operator`` as a local process, with the token of a ServiceAccount (the chart's),
    so that what it may do is exactly what that account's RBAC grants. Its output goes to a
    file, shown when a test fails."""

    def __init__(
        self,
        controlplane: ControlPlane,
        work: Path,
        *,
        service_account: tuple[str, str],
        args: list[str],
        env: Mapping[str, str] | None = None,
    ) -> None:
        work.mkdir(parents=True, exist_ok=True)
        token = controlplane.service_account_token(*service_account)
        self.kubeconfig = controlplane.kubeconfig(work / "operator.kubeconfig", token=token)
        self.log = work / "operator.log"
        environment = dict(os.environ)
        environment |= {
            "KUBECONFIG": os.fspath(self.kubeconfig),
            "RTRL_RESYNC_SECONDS": "1",
            "RTRL_ERROR_BACKOFF_SECONDS": "0.5",
        }
        environment.setdefault(*next(iter(OPEN_POLICY_ENV.items())))
        environment |= dict(env or {})
        rtrl = Path(sys.executable).parent / "rtrl"
        if not any(a == "--liveness" or a.startswith("--liveness=") for a in args):
            # a port of its own: the default, 8080, is anyone's on a shared machine (another
            # session's operator held it, and this one failed to start)
            args = [*args, "--liveness", f"http://127.0.0.1:{free_port()}/healthz"]
        argv = [os.fspath(rtrl), "operator", *args, "--log-format", "text"]
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                die_with_parent(argv), stdout=out, stderr=subprocess.STDOUT, env=environment,
                cwd=work,
            )  # fmt: skip

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for_log(self, text: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.output():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"operator never logged {text!r}:\n{self.output()}")
            time.sleep(0.1)

    def stop(self, timeout: float = 20) -> int:
        """SIGTERM, as the kubelet sends; its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return int(self.proc.returncode)
