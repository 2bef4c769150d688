"""``make quickstart`` (``python -m rtrl_localkube.quickstart``): from a clone to a cycle on
this machine, through the chart and a real engine, with no cloud account (docs/helm.md,
"Try it on this machine").

What it starts, each a real piece (only the kubelet is a stand-in: pods run as local
processes, ``src/rtrl_localkube/kubelet.py``), and stops on Ctrl-C, SIGTERM or ``make
quickstart-down``:

1. a local S3 (moto's server) holding the buckets the examples name, and the tiny coding
   model (:mod:`rtrl_localkube.tinymodel`) committed where ``examples/checkpoint-base.yaml``
   says, as a user uploads a base model;
2. the real control plane (etcd, kube-apiserver, kube-controller-manager) and the kubelet
   stand-in, which runs vLLM's image as ``.venv-vllm`` and every rtrl image as this
   checkout's environment;
3. ``helm install`` of ``charts/rtrl-operator`` with the feedback service, its store
   credentials and bearer tokens in Secrets; the chart's operator pod runs ``rtrl
   operator`` (its image's entrypoint) from this checkout as its ServiceAccount;
4. ``kubectl apply`` of the examples as this machine needs them
   (:mod:`rtrl_localkube.quickstart_manifests`, written under ``<dir>/examples`` to read):
   vLLM behind the capture sidecar the operator injects, the Service, the base Checkpoint
   and the RLCycle, suspended;
5. simulated users (:mod:`rtrl_localkube.quickstart_users`): a few hours ago's traffic
   replayed through the Service and its feedback posted, until the seal CronJob has sealed
   it; then ``kubectl patch`` lifts ``suspend`` and live users keep asking while
   ``kubectl get rlc,ckpt -w`` shows the cycle: stage, training, eval, the canary's own
   vLLM, and the decision.

It prints what to type next, and keeps everything running for that until stopped
(``--exit-after-decision`` stops at the decision: the end-to-end test runs it so).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import yaml

from . import quickstart_manifests as qm
from .controlplane import ControlPlane
from .kubelet import Kubelet
from .quickstart_machine import (
    ACCESS_KEY,
    PID_FILE,
    SECRET_KEY,
    QuickstartError,
    claim,
    decided_checkpoint,
    local_s3,
    prerequisites,
    say,
    service_urls,
    wait_for,
)
from .quickstart_users import CLOCK_HEADER, Served, Users
from .tools import Cli, tool

DEFAULT_DIR = qm.REPO / ".quickstart"
RELEASE, RELEASE_NAMESPACE = "rtrl", "rtrl-system"
OPERATOR_IMAGE = "registry.example.com/rtrl-operator"
STORE_SECRET, TOKENS_SECRET = "rtrl-store", "rtrl-feedback-tokens"
# What every pod gets: DeepSpeed on CPU, no model hub, and the sidecars' simulated clock.
KUBELET_ENV = {
    "DS_ACCELERATOR": "cpu",
    "HF_HUB_OFFLINE": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "RTRL_CAPTURE_CLOCK_HEADER": CLOCK_HEADER,
}
SERVING_TIMEOUT = 20 * 60.0  # vLLM's first start on a loaded 2-core machine
SEAL_TIMEOUT = 5 * 60.0
DECISION_TIMEOUT = 45 * 60.0
FEEDBACK_PORT = 8082  # the chart's feedback.port


# --- the run -----------------------------------------------------------------------------


class Quickstart:
    """One run, its files under ``root``."""

    def __init__(self, root: Path, binaries: Path, *, replay: int, stop: threading.Event):
        self.root = root
        self.binaries = binaries
        self.replay_count = replay
        self.stop = stop
        self.token = secrets.token_hex(24)
        self.timings: dict[str, float] = {}
        self.started = time.monotonic()

    def mark(self, name: str) -> None:
        self.timings[name] = time.monotonic() - self.started

    def run(self, *, exit_after_decision: bool) -> str:
        with contextlib.ExitStack() as stack:
            say(f"rtrl quick start in {self.root} (Ctrl-C or `make quickstart-down` stops it)")
            endpoint = stack.enter_context(local_s3())
            say(f"local S3 (moto) at {endpoint}: buckets {', '.join(qm.BUCKETS)}")
            self.publish_model()
            cp = stack.enter_context(ControlPlane(self.root / "cluster", self.binaries))
            say(f"kube-apiserver {cp.version} at {cp.url}, ready in {cp.startup_seconds:.0f}s")
            kubelet = stack.enter_context(
                Kubelet(
                    cp,
                    self.root / "kubelet",
                    extra_env=KUBELET_ENV,
                )
            )
            self.cp, self.kubelet, self.cli = cp, kubelet, Cli(cp.admin_kubeconfig)
            self.install_chart(endpoint)
            self.wait_operator()
            self.apply_examples(endpoint)
            self.mark("applied")
            users = Users(self.serving_urls, "", self.token)
            self.wait_serving()
            self.replay(users)
            self.wait_sealed()
            watch = self.start_watch()
            stack.callback(self.end_watch, watch)
            live = threading.Thread(
                target=users.keep_asking,
                args=(self.stop, lambda served: self.post(users, served)),
                daemon=True,
            )
            live.start()
            self.run_cmd("kubectl", "patch", "rlc", qm.RLCYCLE, "-n", qm.NAMESPACE,
                         "--type=merge", "-p", '{"spec":{"suspend":false}}')  # fmt: skip
            decision = self.wait_decision()
            self.mark("decision")
            self.show_status()
            self.summary(decision, staying=not exit_after_decision)
            if not exit_after_decision:
                self.stop.wait()
            say("stopping: the operator, the pods, the control plane, the S3")
            return decision
        raise AssertionError("unreachable")

    # --- the steps ---------------------------------------------------------------------

    def publish_model(self) -> None:
        from .tinymodel import publish

        say(f"publishing the tiny coding model to {qm.MODEL_URI} (built once, then cached)")
        manifest = publish(qm.MODEL_URI)
        say(f"  committed {len(manifest.files)} files")

    def run_cmd(self, name: str, *args: str, show: bool = True) -> str:
        """``kubectl``/``helm`` as the admin, echoed as the user would type it."""
        if show:
            say("$ " + " ".join([name, *args]))
        result = self.cli.run([tool(name), *args], check=False, timeout=180)
        if result.returncode != 0:
            raise QuickstartError(f"{name} {' '.join(args)}: exit {result.returncode}\n"
                                  f"{result.stdout}{result.stderr}")  # fmt: skip
        return result.stdout

    def install_chart(self, endpoint: str) -> None:
        self.run_cmd("kubectl", "create", "namespace", RELEASE_NAMESPACE)
        self.run_cmd("kubectl", "-n", RELEASE_NAMESPACE, "create", "secret", "generic",
                     STORE_SECRET, f"--from-literal=AWS_ACCESS_KEY_ID={ACCESS_KEY}",
                     f"--from-literal=AWS_SECRET_ACCESS_KEY={SECRET_KEY}", show=False)  # fmt: skip
        say(f"$ kubectl -n {RELEASE_NAMESPACE} create secret generic {STORE_SECRET} ...")
        self.run_cmd("kubectl", "-n", RELEASE_NAMESPACE, "create", "secret", "generic",
                     TOKENS_SECRET, f"--from-literal=tokens={self.token}", show=False)  # fmt: skip
        say(f"$ kubectl -n {RELEASE_NAMESPACE} create secret generic {TOKENS_SECRET} ...")
        values = qm.chart_values(endpoint, credentials=STORE_SECRET, tokens=TOKENS_SECRET)
        policy = self.root / "policy-values.yaml"  # the admin's tenancy policy (tenancy.md)
        policy.write_text(yaml.safe_dump(qm.policy_values(endpoint), sort_keys=False))
        self.run_cmd("helm", "install", RELEASE, "charts/rtrl-operator", "-n", RELEASE_NAMESPACE,
                     "--set", f"image.repository={OPERATOR_IMAGE}", *values,
                     "-f", os.fspath(policy))  # fmt: skip
        self.run_cmd("kubectl", "wait", "--for=condition=Established", "crd/rlcycles.rtrl.io",
                     "crd/checkpoints.rtrl.io", "--timeout=60s", show=False)  # fmt: skip

    def wait_operator(self) -> None:
        """The chart's operator pod, Ready (its /healthz answers)."""
        say("waiting for the operator's pod (the chart's Deployment) to be ready")
        self.run_cmd("kubectl", "-n", RELEASE_NAMESPACE, "rollout", "status",
                     f"deployment/{RELEASE}-operator", "--timeout=5m")  # fmt: skip
        self.mark("operator")

    def apply_examples(self, endpoint: str) -> None:
        folder = self.root / "examples"
        folder.mkdir(parents=True, exist_ok=True)
        for name, doc in qm.manifests(endpoint, ACCESS_KEY, SECRET_KEY).items():
            (folder / name).write_text(yaml.safe_dump(doc, sort_keys=False))
        say(f"the examples, as this machine needs them: {folder}")
        print(self.run_cmd("kubectl", "apply", "-f", os.fspath(folder)), end="", flush=True)

    def serving_urls(self) -> list[str]:
        hosts = service_urls(self.cp, self.kubelet, qm.NAMESPACE, qm.SERVICE)
        return [f"{host}/v1" for host in hosts]

    def wait_serving(self) -> None:
        say(f"waiting for vLLM behind the capture sidecar (Service {qm.SERVICE}): "
            "minutes on two cores")  # fmt: skip
        wait_for(
            "a ready vLLM pod with the capture sidecar",
            self.serving_urls,
            SERVING_TIMEOUT,
            stop=self.stop,
        )
        self.mark("serving")
        say(f"serving after {self.timings['serving']:.0f}s: "
            + self.run_cmd("kubectl", "get", "pods", "-n", qm.NAMESPACE, "--no-headers",
                           show=False).strip().replace("\n", "; "))  # fmt: skip

    def feedback_urls(self) -> list[str]:
        service = f"{RELEASE}-operator-feedback"
        hosts = service_urls(self.cp, self.kubelet, RELEASE_NAMESPACE, service)
        return [f"{host}/v1/feedback" for host in hosts]

    def post(self, users: Users, served: list[Served]) -> int:
        urls = wait_for("the feedback service", self.feedback_urls, 120, stop=self.stop)
        users.feedback_url = urls[0]
        return users.post_feedback(served)

    def replay(self, users: Users) -> None:
        now = datetime.now(UTC)
        start = now.replace(minute=0, second=0, microsecond=0) - timedelta(hours=3)
        say(
            f"replaying {self.replay_count} requests of {start:%H:00}-{start:%H:50} UTC "
            f"through Service {qm.SERVICE} (header {CLOCK_HEADER}), then their feedback"
        )
        began = time.monotonic()
        served = users.replay(start, timedelta(minutes=50), self.replay_count)
        good = sum(s.good for s in served)
        took = time.monotonic() - began
        accepted = self.post(users, served)
        self.mark("replayed")
        say(f"  {len(served)} served in {took:.0f}s ({good} answers the users kept), "
            f"{accepted} feedback events accepted")  # fmt: skip

    def sealed_hours(self) -> list[str]:
        import boto3

        bucket, _, prefix = qm.SHARDS.removeprefix("s3://").partition("/")
        listing = boto3.client("s3").list_objects_v2(Bucket=bucket, Prefix=f"{prefix}_sealed/")
        return [item["Key"] for item in listing.get("Contents") or []]

    def wait_sealed(self) -> None:
        say(f"waiting for the seal CronJob {qm.RLCYCLE}-seal (every minute) to seal that hour")
        markers = wait_for(
            "the replayed hour sealed", self.sealed_hours, SEAL_TIMEOUT, 5, stop=self.stop
        )
        self.mark("sealed")
        say(f"  sealed: {', '.join(markers)}")

    def start_watch(self) -> list[subprocess.Popen[bytes]]:
        """``kubectl get rlc -w`` and ``kubectl get ckpt -w`` (kubectl watches one resource
        type at a time), their lines on this terminal."""
        watches = []
        for kind in ("rlc", "ckpt"):
            say(f"$ kubectl get {kind} -n {qm.NAMESPACE} -w")
            watches.append(
                subprocess.Popen(
                    [tool("kubectl"), "get", kind, "-n", qm.NAMESPACE, "-w"],
                    env=self.cli.env(),
                    stdin=subprocess.DEVNULL,
                )
            )
        return watches

    @staticmethod
    def end_watch(watches: list[subprocess.Popen[bytes]]) -> None:
        for watch in watches:
            watch.terminate()
        for watch in watches:
            with contextlib.suppress(subprocess.TimeoutExpired):
                watch.wait(5)

    def wait_decision(self) -> str:
        name, phase = wait_for("the cycle's decision", lambda: decided_checkpoint(self.cp),
                               DECISION_TIMEOUT, 3, self.stop)  # fmt: skip
        time.sleep(3)  # the watch's last lines
        say(f"decision: Checkpoint {name} {phase}")
        return str(phase)

    def show_status(self) -> None:
        """``kubectl rtrl status``: the cycle, the canary's A/B table, why it decided."""
        with contextlib.suppress(QuickstartError):
            print(self.run_cmd("kubectl", "rtrl", "status", qm.RLCYCLE, "-n", qm.NAMESPACE),
                  flush=True)  # fmt: skip

    def summary(self, decision: str, *, staying: bool) -> None:
        kubeconfig = self.cp.admin_kubeconfig
        times = ", ".join(f"{k} {v / 60:.1f} min" for k, v in self.timings.items())
        stop = (
            "Stop everything: Ctrl-C here, or `make quickstart-down`."
            if staying
            else "(--exit-after-decision: stopping everything now.)"
        )
        print(
            f"""
The cycle ended {decision} ({times}).

Next, in another terminal:
  export KUBECONFIG={kubeconfig}
  export PATH={qm.REPO / ".tools" / "bin"}:{Path(sys.executable).parent}:$PATH
  kubectl rtrl status {qm.RLCYCLE} -n {qm.NAMESPACE}     # the cycle, its canary's A/B table
  kubectl rtrl history {qm.RLCYCLE} -n {qm.NAMESPACE}    # every checkpoint
  kubectl rtrl trigger {qm.RLCYCLE} -n {qm.NAMESPACE}    # the next cycle now
  kubectl rtrl rollback {qm.RLCYCLE} -n {qm.NAMESPACE}   # back to the previous checkpoint
  kubectl get pods,jobs,cronjobs -n {qm.NAMESPACE}
The examples it applied: {self.root / "examples"}; pod logs: {self.root / "kubelet"}.
{stop}
""",
            flush=True,
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m rtrl_localkube.quickstart",
        description="rtrl on this machine: the control plane, the chart, a real vLLM, "
        "simulated users and one cycle to a decision (docs/helm.md).",
    )
    parser.add_argument(
        "--dir",
        type=Path,
        default=DEFAULT_DIR,
        help=f"where its files go (emptied first; default {DEFAULT_DIR})",
    )
    parser.add_argument(
        "--replay",
        type=int,
        default=240,
        metavar="N",
        help="requests of earlier traffic to replay before the first cycle",
    )
    parser.add_argument("--exit-after-decision", action="store_true",
                        help="stop everything once the cycle has decided")  # fmt: skip
    args = parser.parse_args(argv)
    stop = threading.Event()

    def interrupt(*_: object) -> None:
        """Ctrl-C or SIGTERM (``make quickstart-down``): stop at once, whatever step runs
        (the exception unwinds it, and the run's ExitStack stops what it started); a
        second signal during that cleanup is ignored, so the cleanup finishes."""
        if not stop.is_set():
            stop.set()
            say("stopping: the operator, the pods, the control plane, the S3")
            raise QuickstartError("stopped")

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, interrupt)
    root = args.dir.resolve()
    try:
        binaries = prerequisites()
        claim(root)
        Quickstart(root, binaries, replay=args.replay, stop=stop).run(
            exit_after_decision=args.exit_after_decision
        )
    except (QuickstartError, FileNotFoundError) as exc:
        if stop.is_set():  # asked to stop: everything it started is stopped
            say("stopped")
            return 0
        print(f"quickstart: {exc}", file=sys.stderr)
        return 1
    finally:
        with contextlib.suppress(FileNotFoundError):
            (root / PID_FILE).unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
