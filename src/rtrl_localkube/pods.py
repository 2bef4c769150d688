"""Run a pod's containers as local processes: what a kubelet and its container runtime do,
as far as rtrl's pods need it. Used by the kubelet stand-in of the real control plane
(``src/rtrl_localkube/kubelet.py``) and by the Job runner of the emulated one
(``src/rtrl_localkube/job_runner.py``).

How a pod spec maps onto this machine:

- Command: ``command`` + ``args`` with Kubernetes ``$(VAR)`` expansion (``$$`` escapes). A bare
  executable that exists next to ``sys.executable`` (``rtrl-job``, ``rtrl``, ``python``...)
  resolves there; others go through ``PATH``. Image entrypoints are not known, except the
  operator image's (:data:`ENTRYPOINTS`: ``rtrl operator``, as images/operator/Dockerfile
  says): another container without ``command`` cannot start.
- The API from inside a pod: a container that mounts its service-account token where
  Kubernetes puts it (``podvolumes.SERVICE_ACCOUNT_DIR``) gets ``KUBECONFIG`` naming a
  kubeconfig beside its volumes, for the runner's ``api_server``, with that volume's token
  file (``tokenFile``) and CA: what in-cluster configuration reads from
  ``KUBERNETES_SERVICE_HOST`` and those files, which no process here can reach at their
  absolute paths. So the chart's operator runs as a pod, as its ServiceAccount.
- Images: every image "is" this machine's environment, except vLLM's official image
  (:data:`VLLM_IMAGES`), which is the vLLM venv (``make vllm``): its ``python3`` /
  ``python`` is that venv's interpreter, so ``python3 -m vllm.entrypoints.openai.api_server``
  runs as in the image; its environment gets the engine's CPU defaults
  (``rtrl_localkube.engine.CPU_ENV``) and a ``VLLM_ASSETS_CACHE`` in the pod's directory (a
  container's filesystem is its own) beneath the container's own, and it runs under the
  engine's supervisor, so that the server's EngineCore child dies with the pod.
- Environment: only ``PATH``, ``HOME``, the runner's ``extra_env`` (e.g. ``DS_ACCELERATOR=cpu``,
  ``TORCH_EXTENSIONS_DIR``, ``AWS_*`` for moto) and the container's own: ``value``,
  ``valueFrom.secretKeyRef`` / ``configMapKeyRef`` (read from the API), ``valueFrom.fieldRef``
  (``metadata.name``, ``.namespace``, ``.uid``, ``metadata.labels['k']`` /
  ``metadata.annotations['k']``, ``spec.nodeName``, ``spec.serviceAccountName``,
  ``status.podIP``, ``status.hostIP``); ``envFrom`` Secrets and ConfigMaps.
- Volumes: ``configMap``, ``secret`` and ``downwardAPI`` volumes are written into a directory
  per pod (``items`` with their ``mode``, else the volume's ``defaultMode``, else 0644; a
  key missing from an ``optional`` source is skipped; files are the runner's user's, as
  it switches no users); ``projected`` volumes too, their ``serviceAccountToken`` sources
  from the TokenRequest API when the runner has one (the real server's admission adds such
  a volume to every pod that mounts its service-account token); ``emptyDir`` is an empty
  directory; a ``persistentVolumeClaim`` is one directory per claim shared by the runner's
  pods; ``hostPath`` is used as is. A volumeMount's ``mountPath`` (``subPath`` included) is
  **rewritten** to that directory wherever it starts an argument or an env value, or follows
  ``=`` in one (``--config=/etc/rtrl/step.json``). Paths a program builds itself from a mount
  path it did not receive this way are not rewritten.
- Networking: one network namespace for all pods; a port a pod declares that another pod
  holds is moved to a free one, in its args and env (``podnet.py``). Hostnames
  ``<job>-<i>.<subdomain>[...]`` (an Indexed Job's pods behind a headless Service, e.g.
  ``MASTER_ADDR``) in env values and args become ``127.0.0.1``. ``status.podIP`` is the
  address the pod's status reports (the kubelet's, from a pod CIDR), which nothing listens
  on.
- Output: stdout and stderr go to one log file per container; with
  ``terminationMessagePolicy: FallbackToLogsOnError`` a failed container's termination message
  is the last 20 lines / 4096 bytes of that output.
- Stopping: SIGTERM to the container's process group, SIGKILL after the grace period.
- Identity: by default every container runs as the runner's user. With ``identities`` (a
  runner started as root), a container whose ``securityContext`` (its own over the pod's)
  names ``runAsUser`` runs as that uid, ``runAsGroup`` (else the uid) as its gid and the
  pod's ``fsGroup`` as a supplementary group, through ``setpriv``: with ``capabilities.drop:
  [ALL]`` no capability at all (inheritable and bounding sets emptied), with
  ``allowPrivilegeEscalation: false`` ``no_new_privs``. Its volumes then get the kubelet's
  ownership: an ``emptyDir`` is mode 0777, Secret/ConfigMap files group ``fsGroup``. As that
  user may not run this checkout's interpreter (a venv under ``/root``), a console script of
  the venv (``rtrl-job``...) runs under ``IDENTITY_PYTHON`` with the venv's site-packages;
  where that user cannot reach this checkout at all (a clone under a 0700 directory), the
  container runs as the runner's uid (root) with the securityContext's capabilities: none.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rtrl_localkube.engine import CPU_ENV, EngineError, check_installed, supervised
from rtrl_localkube.podprocess import expand_vars
from rtrl_localkube.podprocess import rewrite as rewrite_for_local
from rtrl_localkube.processes import KILL_GRACE_SECONDS, die_with_parent, kill_group

from .podimages import entrypoint, is_vllm_image
from .podnet import PodNetwork
from .podprocess import BIN, tail
from .podvolumes import PodSources, SetupError, in_cluster_kubeconfig

# An interpreter of this Python version that other users can run (the venv's may not be).
IDENTITY_PYTHON = Path(f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}")
SITE_PACKAGES = (
    Path(sys.prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
)
SITE_PACKAGES = SITE_PACKAGES / "site-packages"
_CONSOLE_SCRIPT = re.compile(r"^from ([\w.]+) import (\w+)$", re.MULTILINE)
# SIGTERM to SIGKILL for the engine's supervisor: the kubelet's own cap (podlife.py)
VLLM_STOP_GRACE = 3.0


def reachable_by(path: Path, uid: int, gids: set[int]) -> bool:
    """Whether ``uid`` (with groups ``gids``, no capability) can search every directory
    down to ``path`` and read it, by the permission bits."""

    def allowed(info: os.stat_result, bit: int) -> bool:
        if info.st_uid == uid:
            return bool(info.st_mode & (bit << 6))
        if info.st_gid in gids:
            return bool(info.st_mode & (bit << 3))
        return bool(info.st_mode & bit)

    try:
        path = path.resolve()
        if not all(allowed(parent.stat(), 0o1) for parent in path.parents):
            return False
        return allowed(path.stat(), 0o4)
    except OSError:
        return False


class CancelledError(Exception):
    """The pod was deleted (or the runner stopped) while its container ran."""


@dataclass(frozen=True)
class Termination:
    """How a container ended: ``state.terminated`` of its status."""

    exit_code: int
    reason: str
    message: str = ""


def job_of(pod: Mapping[str, Any]) -> str:
    """The name of the Job that owns ``pod`` ("" for other pods): its hostnames are rewritten."""
    labels = (pod.get("metadata") or {}).get("labels") or {}
    return str(labels.get("batch.kubernetes.io/job-name") or labels.get("job-name") or "")


@dataclass
class PodRunner(PodSources):
    """Runs containers of pods read through ``read``; one per kubelet or Job runner. With a
    ``network`` (the kubelet's), pods behind a headless Service find their peers by name and
    each Job gets a rendezvous port of its own (``podnet.py``)."""

    network: PodNetwork | None = None
    # the API server's URL, for a pod that mounts its service-account token (module docstring)
    api_server: str = ""

    def _hostnames_job(self, pod: Mapping[str, Any]) -> str:
        """The Job whose pod hostnames are rewritten to loopback in args and env: none where
        the names resolve (``podnet.py``)."""
        if self.network is not None and self.network.resolved(pod):
            return ""
        return job_of(pod)

    def environment(
        self,
        pod: dict[str, Any],
        container: dict[str, Any],
        mounts: list[tuple[str, str]],
        base: Mapping[str, str] | None = None,
    ) -> dict[str, str]:
        env = {key: os.environ[key] for key in ("PATH", "HOME") if key in os.environ}
        env |= self.extra_env
        kubeconfig = in_cluster_kubeconfig(self.api_server, mounts)
        if kubeconfig is not None:
            env["KUBECONFIG"] = os.fspath(kubeconfig)
        if is_vllm_image(str(container.get("image", ""))):
            env |= CPU_ENV
        env |= dict(base or {})
        namespace = pod["metadata"]["namespace"]
        job = self._hostnames_job(pod)
        for source in container.get("envFrom") or []:
            kind = "Secret" if "secretRef" in source else "ConfigMap"
            ref = source.get("secretRef") or source.get("configMapRef") or {}
            data = self.keyed(kind, namespace, ref.get("name", ""))
            if data is None and not ref.get("optional"):
                raise SetupError(f"{kind} {ref.get('name')!r} of envFrom not found")
            prefix = source.get("prefix", "")
            env |= {prefix + key: value for key, value in (data or {}).items()}
        for var in container.get("env") or []:
            name = var["name"]
            if "valueFrom" not in var:
                value = expand_vars(str(var.get("value", "")), env)
                env[name] = rewrite_for_local(value, mounts, job)
                continue
            source = var["valueFrom"]
            if "secretKeyRef" in source or "configMapKeyRef" in source:
                kind = "Secret" if "secretKeyRef" in source else "ConfigMap"
                ref = source.get("secretKeyRef") or source.get("configMapKeyRef")
                data = self.keyed(kind, namespace, ref["name"])
                if data is None or ref["key"] not in data:
                    if ref.get("optional"):
                        continue
                    raise SetupError(
                        f"env {name}: {kind} {ref['name']!r} key {ref['key']!r} missing"
                    )
                env[name] = data[ref["key"]]
            elif "fieldRef" in source:
                try:
                    env[name] = self.field(pod, source["fieldRef"]["fieldPath"])
                except SetupError as exc:
                    raise SetupError(f"env {name}: {exc}") from None
            else:
                raise SetupError(f"env {name}: valueFrom {sorted(source)} is not supported")
        return env if self.network is None else self.network.env(pod, env)

    def argv(
        self,
        pod: Mapping[str, Any],
        container: Mapping[str, Any],
        env: Mapping[str, str],
        mounts: list[tuple[str, str]],
    ) -> list[str]:
        command = list(container.get("command") or []) or entrypoint(str(container.get("image")))
        if not command:
            raise SetupError("no command: image entrypoints are not known here, set `command`")
        job = self._hostnames_job(pod)
        words = [*command, *(container.get("args") or [])]
        argv = [rewrite_for_local(expand_vars(str(w), env), mounts, job) for w in words]
        if is_vllm_image(str(container.get("image", ""))) and argv[0] in ("python", "python3"):
            try:
                argv[0] = os.fspath(check_installed())
            except EngineError as exc:
                raise SetupError(str(exc)) from None
        elif "/" not in argv[0] and (BIN / argv[0]).exists():
            argv[0] = os.fspath(BIN / argv[0])
        return argv if self.network is None else self.network.args(pod, argv)

    def identity(
        self, pod: Mapping[str, Any], container: Mapping[str, Any]
    ) -> tuple[list[str], int, int, int | None] | None:
        """(setpriv words, uid, gid, fsGroup) of the container's ``securityContext``, or
        None where it runs as the runner's user (module docstring)."""
        if not self.identities or os.geteuid() != 0:
            return None
        pod_ctx = (pod.get("spec") or {}).get("securityContext") or {}
        ctx = {**pod_ctx, **(container.get("securityContext") or {})}
        uid = ctx.get("runAsUser")
        if uid is None:
            return None
        gid = int(ctx.get("runAsGroup", uid))
        fs_group = pod_ctx.get("fsGroup")
        groups = {gid} | ({int(fs_group)} if fs_group is not None else set())
        if not reachable_by(SITE_PACKAGES, int(uid), groups):
            # This checkout is where that user cannot reach it (a clone under a 0700 dir):
            # the container keeps the runner's uid, with the securityContext's capabilities.
            uid, gid, fs_group = 0, 0, None
        words = ["setpriv", f"--reuid={uid}", f"--regid={gid}"]  # as root: the bounding set
        # is what an exec'd program gets, so --bounding-set=-all leaves it no capability
        words.append(f"--groups={fs_group}" if fs_group is not None else "--clear-groups")
        if "ALL" in ((ctx.get("capabilities") or {}).get("drop") or []):
            words += ["--inh-caps=-all", "--bounding-set=-all"]
        if ctx.get("allowPrivilegeEscalation") is False:
            words.append("--no-new-privs")
        return words, int(uid), gid, fs_group

    @staticmethod
    def _own_volumes(
        pod: Mapping[str, Any], pod_dir: Path, uid: int, gid: int, fs_group: int | None
    ) -> None:
        """The ownership a kubelet gives volumes: emptyDirs 0777, the files of Secret,
        ConfigMap, downwardAPI and projected volumes group fsGroup; the container's working
        dir its user's."""
        for volume in (pod.get("spec") or {}).get("volumes") or []:
            path = pod_dir / "volumes" / volume["name"]
            if not path.is_dir():
                continue
            if "emptyDir" in volume:
                path.chmod(0o777)
            elif {"secret", "configMap", "downwardAPI", "projected"} & set(volume):
                for item in [path, *path.rglob("*")]:
                    os.chown(item, 0, fs_group if fs_group is not None else 0)
        os.chown(pod_dir / "workdir", uid, gid)

    @staticmethod
    def _for_user(argv: list[str], uid: int) -> list[str]:
        """A console script of this venv, run under an interpreter any user can run."""
        script = Path(argv[0])
        if uid == 0:
            return argv
        if script.parent != BIN or not script.is_file():
            return argv
        found = _CONSOLE_SCRIPT.search(script.read_text(errors="replace"))
        if found is None:
            return argv
        if not IDENTITY_PYTHON.exists():
            raise SetupError(f"runAsUser: {IDENTITY_PYTHON} is needed to run {script.name}")
        boot = (
            "import site, sys; site.addsitedir(sys.argv.pop(1)); "
            f"from {found.group(1)} import {found.group(2)} as main; "
            f"sys.argv[0] = {script.name!r}; sys.exit(main())"
        )
        return [os.fspath(IDENTITY_PYTHON), "-c", boot, os.fspath(SITE_PACKAGES), *argv[1:]]

    # --- running ---------------------------------------------------------------------------

    def run(
        self,
        pod: dict[str, Any],
        container: dict[str, Any],
        *,
        cancel: threading.Event,
        deadline: float | None = None,
        base_env: Mapping[str, str] | None = None,
        on_start: Callable[[subprocess.Popen[bytes]], None] | None = None,
        grace: Callable[[], float] | float = KILL_GRACE_SECONDS,
    ) -> Termination:
        """Run ``container`` of ``pod`` to its end. Raises :class:`CancelledError` when ``cancel``
        is set meanwhile (the process group is killed first); ``deadline``
        (``time.monotonic``) kills it with reason DeadlineExceeded. ``grace``: seconds from
        SIGTERM to SIGKILL, or a function read at that moment."""
        meta = pod["metadata"]
        pod_dir = self.work_dir / meta["namespace"] / meta["name"]
        log_path = pod_dir / f"{container['name']}.log"
        pod_dir.mkdir(parents=True, exist_ok=True)
        try:
            mounts = self.volumes(pod, container, pod_dir)
            env = self.environment(pod, container, mounts, base_env)
            if is_vllm_image(str(container.get("image", ""))):
                env.setdefault("VLLM_ASSETS_CACHE", os.fspath(pod_dir / "vllm-assets"))
            argv = self.argv(pod, container, env, mounts)
        except SetupError as exc:
            log_path.write_text(f"{exc}\n")
            return Termination(128, "ContainerCannotRun", str(exc))
        workdir = pod_dir / "workdir"
        workdir.mkdir(exist_ok=True)
        identity = self.identity(pod, container)
        if identity is not None:
            words, uid, gid, fs_group = identity
            self._own_volumes(pod, pod_dir, uid, gid, fs_group)
            try:
                argv = [*words, *self._for_user(argv, uid)]
            except SetupError as exc:
                log_path.write_text(f"{exc}\n")
                return Termination(128, "ContainerCannotRun", str(exc))
        if self.network is not None:
            argv = self.network.wrap(pod, argv, pod_dir)  # outermost: mounting needs root
        with log_path.open("ab") as log:
            log.write(f"$ {' '.join(argv)}\n".encode())
            log.flush()
            try:
                launch = (
                    supervised(argv, VLLM_STOP_GRACE)
                    if is_vllm_image(str(container.get("image", "")))
                    else die_with_parent(argv)
                )
                proc = subprocess.Popen(
                    launch,
                    env=env,
                    cwd=workdir,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # its own process group, killed as a whole
                )
            except OSError as exc:
                return Termination(128, "StartError", f"{argv[0]}: {exc.strerror}")
        if on_start is not None:
            on_start(proc)
        while True:
            try:
                code = proc.wait(0.02)
                break
            except subprocess.TimeoutExpired:
                pass
            seconds = grace() if callable(grace) else grace
            if cancel.is_set():
                kill_group(proc, seconds)
                raise CancelledError
            if deadline is not None and time.monotonic() > deadline:
                kill_group(proc, seconds)
                return Termination(137, "DeadlineExceeded")
        if cancel.is_set():
            raise CancelledError
        if code == 0:
            return Termination(0, "Completed")
        exit_code = 128 - code if code < 0 else code  # killed by a signal: 128 + signal
        message = ""
        if container.get("terminationMessagePolicy") == "FallbackToLogsOnError":
            message = tail(log_path)
        return Termination(exit_code, "Error", message)

    def logs(self, prefix: str, namespace: str | None = None) -> str:
        """The output of the pods whose name starts with ``prefix`` (a Job's pods, or one
        pod), oldest first, each under a header with the pod's name."""
        parts = []
        if not self.work_dir.is_dir():
            return ""
        dirs = [self.work_dir / namespace] if namespace else sorted(self.work_dir.iterdir())
        pods = [pod for ns_dir in dirs if ns_dir.is_dir() for pod in ns_dir.glob(f"{prefix}*")]
        for pod_dir in sorted(pods, key=os.path.getmtime):
            for log in sorted(pod_dir.glob("*.log")):
                parts.append(f"--- {pod_dir.name} ---\n{log.read_text(errors='replace')}")
        return "\n".join(parts)
