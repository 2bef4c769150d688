"""A real Kubernetes control plane on this machine: etcd, kube-apiserver and
kube-controller-manager, as local processes on 127.0.0.1.

The binaries are built from the Go module proxy by ``tools/controlplane/build.sh`` (``make
controlplane``; the Makefile passes their directory in ``RTRL_CONTROLPLANE``). Nothing here
is emulated: the API server validates, defaults, runs CEL and admission (the defaults plus
OwnerReferencesPermissionEnforcement, as on OpenShift), authorises with RBAC and signs
service-account tokens; the controller manager runs the real Job, Deployment, ReplicaSet,
garbage-collector, namespace, TTL-after-finished, EndpointSlice and service-account
controllers. Only the kubelet is a stand-in (``src/rtrl_localkube/kubelet.py``): no container
runtime exists here.

Identities: ``admin`` (group ``system:masters``) for the tests themselves, and
``system:kube-controller-manager``, which starts each controller with its own service
account (``--use-service-account-credentials``), so they run under the API server's own
bootstrap RBAC.

:meth:`ControlPlane.stop` ends the processes by pid (SIGTERM, then SIGKILL), and so does an
``atexit`` hook when a test run dies before the fixture's teardown; a run killed outright
takes them along (each is started with a parent-death signal).
"""

from __future__ import annotations

import atexit
import contextlib
import http.client
import json
import os
import secrets
import signal
import socket
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .api import write_kubeconfig
from .controlplane_setup import service_account_key
from .processes import die_with_parent, free_port, kill_group

READY_TIMEOUT = 90.0
STOP_GRACE = 10.0
SERVICE_CIDR = "10.96.0.0/16"
# Controllers the tests rely on are in kube-controller-manager's default set ("*"); the ones
# that need a cloud or node CIDRs skip themselves.
CONTROLLERS = "*"


class ControlPlaneError(RuntimeError):
    """The control plane could not be started (the message says which part and why)."""


@dataclass
class _Process:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    argv: list[str] = field(default_factory=list)  # as given to _spawn (for a restart)


@dataclass
class ControlPlane:
    """One control plane, its files under ``root``. Use as a context manager."""

    root: Path
    binaries: Path
    admission_plugins: tuple[str, ...] = ("OwnerReferencesPermissionEnforcement",)
    # what the API server and the controller manager are started with, besides the defaults
    apiserver_args: tuple[str, ...] = ()
    url: str = ""
    ca_file: Path = field(default_factory=Path)
    admin_token: str = field(default_factory=lambda: secrets.token_hex(16))
    startup_seconds: float = 0.0
    _processes: list[_Process] = field(default_factory=list)
    _watches: set[http.client.HTTPSConnection] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    # --- the public face ---------------------------------------------------------------

    @property
    def version(self) -> str:
        return (self.binaries / "VERSION").read_text().strip()

    @property
    def gateway_api_crds(self) -> list[Path]:
        return sorted((self.binaries / "gateway-api").glob("*.yaml"))

    def kubeconfig(
        self, path: Path, *, token: str | None = None, namespace: str = "default"
    ) -> Path:
        """A kubeconfig for this server with ``token`` (the admin's by default)."""
        token = token or self.admin_token
        return write_kubeconfig(
            path,
            self.url,
            namespace,
            token=token,
            name="rtrl-test",
            user="user",
            ca_file=self.ca_file,
        )

    @property
    def admin_kubeconfig(self) -> Path:
        return self.root / "admin.kubeconfig"

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        token: str | None = None,
        content_type: str = "application/json",
        timeout: float = 10.0,
    ) -> Any:
        """One API request as the admin (or ``token``); the decoded JSON answer. HTTP errors
        raise :class:`urllib.error.HTTPError` (its ``read()`` is the Status object)."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("Authorization", f"Bearer {token or self.admin_token}")
        req.add_header("Accept", "application/json")
        if data is not None:
            req.add_header("Content-Type", content_type)
        context = ssl.create_default_context(cafile=os.fspath(self.ca_file))
        with urllib.request.urlopen(req, timeout=timeout, context=context) as response:
            raw = response.read()
        return json.loads(raw) if raw else None

    def watch(
        self, path: str, resource_version: str, *, timeout_seconds: int = 30
    ) -> Iterator[dict[str, Any]]:
        """The watch events of ``path`` (a list URL) after ``resource_version``, until the
        server ends the watch (after ``timeout_seconds``) or :meth:`close_watches` is called.
        A 410 Gone arrives as an event of type ERROR, as the API sends it."""
        query = urllib.parse.urlencode(
            {
                "watch": "1",
                "allowWatchBookmarks": "true",
                "resourceVersion": resource_version,
                "timeoutSeconds": str(timeout_seconds),
            }
        )
        host, port = urllib.parse.urlsplit(self.url).netloc.split(":")
        context = ssl.create_default_context(cafile=os.fspath(self.ca_file))
        conn = http.client.HTTPSConnection(host, int(port), context=context, timeout=60)
        with self._lock:
            self._watches.add(conn)
        try:
            conn.request(
                "GET",
                f"{path}?{query}",
                headers={"Authorization": f"Bearer {self.admin_token}"},
            )
            response = conn.getresponse()
            if response.status != 200:
                raise ControlPlaneError(f"watch {path}: HTTP {response.status} {response.read()!r}")
            for line in response:
                if line.strip():
                    yield json.loads(line)
        except (OSError, http.client.HTTPException, ValueError):
            if conn not in self._watches:
                return  # closed by close_watches()
            raise
        finally:
            with self._lock:
                self._watches.discard(conn)
            conn.close()

    def close_watches(self) -> None:
        """End every watch this object serves (their generators return)."""
        with self._lock:
            conns, self._watches = list(self._watches), set()
        for conn in conns:
            with contextlib.suppress(OSError):
                if conn.sock is not None:
                    conn.sock.shutdown(socket.SHUT_RDWR)

    def service_account_token(
        self, namespace: str, name: str, *, seconds: int = 7200, audience: str | None = None
    ) -> str:
        """A token of ServiceAccount ``namespace/name`` from the TokenRequest API, exactly
        what a pod of that ServiceAccount gets."""
        spec: dict[str, Any] = {"expirationSeconds": seconds}
        if audience:
            spec["audiences"] = [audience]
        answer = self.request(
            "POST",
            f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token",
            {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec},
        )
        return str(answer["status"]["token"])

    def logs(self, name: str, lines: int = 40) -> str:
        """The last lines of one component's log (etcd, kube-apiserver, ...)."""
        path = self.root / "logs" / f"{name}.log"
        try:
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""

    def __enter__(self) -> ControlPlane:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # --- start and stop ------------------------------------------------------------------

    def start(self) -> None:
        started = time.monotonic()
        atexit.register(self.stop)
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - started

    def _start(self) -> None:
        for sub in ("etcd", "certs", "logs"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        bin_dir = self.binaries / "bin"
        key = service_account_key(self.root / "certs" / "service-account.key")
        kcm_token = secrets.token_hex(16)
        tokens = self.root / "tokens.csv"
        tokens.write_text(
            f'{self.admin_token},admin,admin-uid,"system:masters"\n'
            f"{kcm_token},system:kube-controller-manager,kcm-uid\n"
        )
        tokens.chmod(0o600)

        etcd_port = free_port()
        self._spawn(
            "etcd",
            [
                os.fspath(bin_dir / "etcd"),
                f"--data-dir={self.root / 'etcd'}",
                f"--listen-client-url=http://127.0.0.1:{etcd_port}",
                f"--listen-peer-url=http://127.0.0.1:{free_port()}",
            ],
        )
        self._wait("etcd", lambda: _http_ok(f"http://127.0.0.1:{etcd_port}/health"))

        port = free_port()
        self.url = f"https://127.0.0.1:{port}"
        cert_dir = self.root / "certs"
        plugins = ",".join(self.admission_plugins)
        self._spawn(
            "kube-apiserver",
            [
                os.fspath(bin_dir / "kube-apiserver"),
                f"--etcd-servers=http://127.0.0.1:{etcd_port}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={port}",
                f"--cert-dir={cert_dir}",
                f"--token-auth-file={tokens}",
                "--authorization-mode=RBAC",
                f"--service-account-key-file={key}",
                f"--service-account-signing-key-file={key}",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                *([f"--enable-admission-plugins={plugins}"] if plugins else []),
                "--profiling=false",
                "--v=1",
                *self.apiserver_args,
            ],
        )
        # The API server writes its self-signed serving certificate (and the CA that signed
        # it) on start; clients verify against that bundle.
        self.ca_file = cert_dir / "apiserver.crt"
        self._wait("kube-apiserver", self._ready)
        self.kubeconfig(self.admin_kubeconfig)

        kcm_kubeconfig = self.kubeconfig(self.root / "kcm.kubeconfig", token=kcm_token)
        self._spawn(
            "kube-controller-manager",
            [
                os.fspath(bin_dir / "kube-controller-manager"),
                f"--kubeconfig={kcm_kubeconfig}",
                f"--authentication-kubeconfig={kcm_kubeconfig}",
                f"--authorization-kubeconfig={kcm_kubeconfig}",
                "--bind-address=127.0.0.1",
                f"--secure-port={free_port()}",
                f"--controllers={CONTROLLERS}",
                "--use-service-account-credentials",
                f"--service-account-private-key-file={key}",
                f"--root-ca-file={self.ca_file}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--leader-elect=false",
                # a test's Job reacts within a second, not after the default sync delays
                "--concurrent-job-syncs=5",
                "--node-monitor-grace-period=60s",
                "--v=1",
            ],
        )
        # The service-account controllers work once `default` exists in a namespace.
        self._wait(
            "kube-controller-manager",
            lambda: self._exists("/api/v1/namespaces/default/serviceaccounts/default"),
        )

    def restart_apiserver(self) -> float:
        """Kill kube-apiserver (SIGKILL, as a crash: no graceful drain) and start it again on
        the same port, certificates and etcd, whose data stays; etcd and the controllers keep
        running. Every watch and connection to it breaks. Returns the seconds until it is
        ready again (the chaos soak, ``bench/chaos.py``)."""
        index = next(i for i, p in enumerate(self._processes) if p.name == "kube-apiserver")
        old = self._processes[index]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(old.popen.pid, signal.SIGKILL)
        old.popen.wait(10)
        started = time.monotonic()
        self._spawn(old.name, old.argv)
        self._processes[index] = self._processes.pop()  # in its place: stop() keeps the order
        self._wait("kube-apiserver", self._ready)
        return time.monotonic() - started

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = self.root / "logs" / f"{name}.log"
        with log.open("ab") as out:
            popen = subprocess.Popen(
                die_with_parent(argv),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self._processes.append(_Process(name, popen, log, list(argv)))

    def _wait(self, name: str, ready: Any) -> None:
        process = next(p for p in self._processes if p.name == name)
        deadline = time.monotonic() + READY_TIMEOUT
        while True:
            if process.popen.poll() is not None:
                raise ControlPlaneError(
                    f"{name} exited with status {process.popen.returncode}:\n{self.logs(name)}"
                )
            with contextlib.suppress(OSError, urllib.error.URLError, ssl.SSLError):
                if ready():
                    return
            if time.monotonic() > deadline:
                raise ControlPlaneError(
                    f"{name} not ready after {READY_TIMEOUT:.0f}s:\n{self.logs(name)}"
                )
            time.sleep(0.1)

    def _ready(self) -> bool:
        if not self.ca_file.exists():
            return False
        context = ssl.create_default_context(cafile=os.fspath(self.ca_file))
        req = urllib.request.Request(self.url + "/readyz")
        req.add_header("Authorization", f"Bearer {self.admin_token}")
        try:
            with urllib.request.urlopen(req, timeout=2, context=context) as response:
                return bool(response.status == 200)
        except urllib.error.HTTPError:
            return False

    def _exists(self, path: str) -> bool:
        try:
            self.request("GET", path, timeout=2)
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return False
            raise
        return True

    def stop(self) -> None:
        """Stop every process by pid: the controllers first, etcd last."""
        for process in reversed(self._processes):
            kill_group(process.popen, STOP_GRACE)
        self._processes.clear()
        with contextlib.suppress(Exception):
            atexit.unregister(self.stop)


def _http_ok(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=2) as response:
        return bool(response.status == 200)
