"""The network of the kubelet stand-in's pods: how a pod behind a headless Service finds its
peers by name, and which port a Job's rendezvous listens on.

**Names.** On a cluster, an Indexed Job's pod gets ``hostname: <job>-<i>`` from the Job
controller and ``subdomain: <service>`` from its template; the endpoint-slice controller lists
it (hostname and pod IP) in the headless Service's EndpointSlices, and the cluster DNS answers
``<job>-<i>.<service>.<namespace>.svc.cluster.local`` from those, so ``<job>-0.<service>``
resolves (through the pod's DNS search list) once, and only while, the API server lists an
endpoint with that hostname. Here the real controllers write the same objects, and
:class:`PodNetwork` plays the DNS: it watches every EndpointSlice, and a pod with a
``subdomain`` runs in a mount namespace of its own (``unshare --mount``) whose ``/etc/hosts``
is a file of the pod's, holding its own names (as a kubelet writes them) and every name the
Service's EndpointSlices give, in each form the search list would complete. The file is
rewritten in place whenever a slice changes (glibc reads ``/etc/hosts`` on every lookup), so
a rank that starts before the master's endpoint exists fails to resolve it and retries, as on
a cluster. Every pod shares this machine's network namespace, so the address a name maps to is
``127.0.0.1`` (the slices carry the pod IPs the kubelet reports, which nothing listens on).
The pod's arguments and environment keep the names; nothing is rewritten. Mount namespaces
need root: otherwise (or without ``unshare``) the runner falls back to rewriting
``<job>-<i>.<service>`` to ``127.0.0.1`` in arguments and env (``podprocess.rewrite``).

**Ports.** Pods have no network namespace of their own here, so two trainings that each
listen on the Service's port 29500 would collide (a retried Job's new pods while the old ones
still die, two cycles at once). A pod's ``MASTER_PORT`` is therefore replaced by a free port
chosen once per Job: every pod of one Job gets the same one, another Job another.

Serving pods collide the same way: the stable and the canary pod of an inference Deployment
both declare the engine's port (and the capture sidecar's). Each port a pod's containers
declare (``containerPort``) is given a host port for the pod's life (:meth:`PodNetwork.
host_port`): the port itself when no other live pod of this kubelet holds it and it is free,
else a free one. The kubelet runs the pod's containers as they listen here
(:meth:`PodNetwork.container`: declared ports and probes' numeric ports are host ports, so
a probe reaches this pod, not another). Where the pod's arguments and env values name a
declared port that was moved, they are rewritten to the host port: ``--port=8000`` /
``--port 8000`` (any flag ending in ``port``), ``127.0.0.1:8000``, ``0.0.0.0:8000``,
``localhost:8000`` and ``[::]:8000`` (with or without a scheme), and a variable named
``*PORT`` whose value is the port. Tests reach a pod's port through
:meth:`PodNetwork.host_port`.
"""

from __future__ import annotations

import copy
import os
import re
import shutil
import socket
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .processes import free_port
from .watchfeed import Server, Watch

SLICES = "/apis/discovery.k8s.io/v1/endpointslices"
SERVICE_LABEL = "kubernetes.io/service-name"
CLUSTER_DOMAIN = "cluster.local"
LOOPBACK = "127.0.0.1"
PORT_ENV = "MASTER_PORT"
UNSHARE = shutil.which("unshare")
# An address on this machine, with its port: what a pod's args and env name its ports by.
_LOCAL_ADDRESS = re.compile(
    r"(?<![\w.-])((?:[a-z][a-z0-9+.-]*://)?(?:0\.0\.0\.0|127\.0\.0\.1|localhost|\[::1?\])):"
    r"(\d{1,5})(?!\d)"
)
_PORT_FLAG = re.compile(r"^(--[A-Za-z0-9-]*port)(?:=(\d{1,5}))?$")
_PORT_VARIABLE = re.compile(r"(^|_)PORT$")


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def declared_ports(pod: Mapping[str, Any]) -> list[int]:
    """The ``containerPort`` of every container of the pod, in order, once each."""
    ports: list[int] = []
    for container in (pod.get("spec") or {}).get("containers") or []:
        for entry in container.get("ports") or []:
            port = int(entry.get("containerPort") or 0)
            if port and port not in ports:
                ports.append(port)
    return ports


# Bind the pod's hosts file over /etc/hosts inside the new mount namespace, then become the
# container's command (sh's $0 is the file, "$@" the command).
_BIND = 'mount --bind "$0" /etc/hosts && exec "$@"'


def pod_names(hostname: str, subdomain: str, namespace: str) -> list[str]:
    """The names ``hostname`` answers to behind Service ``subdomain``: the FQDN and each
    shorter form a pod's search list (``<ns>.svc.cluster.local svc.cluster.local
    cluster.local``) completes to it."""
    fqdn = f"{hostname}.{subdomain}.{namespace}.svc.{CLUSTER_DOMAIN}"
    return [
        fqdn,
        f"{hostname}.{subdomain}.{namespace}.svc",
        f"{hostname}.{subdomain}.{namespace}",
        f"{hostname}.{subdomain}",
    ]


class PodNetwork:
    """The cluster DNS (from EndpointSlices) and the per-Job rendezvous ports of one kubelet."""

    def __init__(self, server: Server) -> None:
        self.resolves = UNSHARE is not None and os.geteuid() == 0
        self._lock = threading.Lock()
        # (namespace, service) -> slice name -> hostnames of its endpoints
        self._slices: dict[tuple[str, str], dict[str, list[str]]] = {}
        # pod uid -> (its hosts file, namespace, service, its own hostname)
        self._files: dict[str, tuple[Path, str, str, str]] = {}
        self._ports: dict[str, int] = {}
        # pod uid -> its declared ports' host ports; the host ports live pods hold
        self._pod_ports: dict[str, dict[int, int]] = {}
        self._held: set[int] = set()
        self._watch = Watch(server, "EndpointSlice", SLICES, self._feed)

    def start(self) -> None:
        if self.resolves:
            self._watch.start()

    def stop(self) -> None:
        self._watch.stop()
        if self._watch.is_alive():
            self._watch.join(5)

    # --- names -------------------------------------------------------------------------

    def resolved(self, pod: Mapping[str, Any]) -> bool:
        """Whether this pod's peers are found by name (a subdomain, and root): then its
        arguments and env are left as written."""
        return self.resolves and bool((pod.get("spec") or {}).get("subdomain"))

    def wrap(self, pod: Mapping[str, Any], argv: list[str], pod_dir: Path) -> list[str]:
        """``argv`` run with the pod's own ``/etc/hosts`` (unchanged where not :meth:`resolved`)."""
        if not self.resolved(pod):
            return argv
        meta, spec = pod["metadata"], pod["spec"]
        hosts = pod_dir / "etc-hosts"
        hostname = str(spec.get("hostname") or meta["name"])
        with self._lock:
            self._files[meta["uid"]] = (hosts, meta["namespace"], str(spec["subdomain"]), hostname)
            self._write(meta["uid"])
        assert UNSHARE is not None
        return [UNSHARE, "--mount", "--propagation", "private", "--", "sh", "-c", _BIND,
                os.fspath(hosts), *argv]  # fmt: skip

    def release(self, pod: Mapping[str, Any]) -> None:
        """The pod's life ended: its hosts file is no longer kept current, its ports are
        free for other pods."""
        with self._lock:
            self._files.pop(pod["metadata"]["uid"], None)
            self._held -= set(self._pod_ports.pop(pod["metadata"]["uid"], {}).values())

    def _feed(self, _kind: str, event: str, obj: dict[str, Any]) -> None:
        meta = obj["metadata"]
        service = (meta.get("labels") or {}).get(SERVICE_LABEL)
        if not service:
            return
        key = (meta["namespace"], service)
        hostnames = [e["hostname"] for e in obj.get("endpoints") or [] if e.get("hostname")]
        with self._lock:
            slices = self._slices.setdefault(key, {})
            if event == "DELETED":
                slices.pop(meta["name"], None)
            else:
                slices[meta["name"]] = hostnames
            for uid, (_, namespace, subdomain, _) in list(self._files.items()):
                if (namespace, subdomain) == key:
                    self._write(uid)

    def _write(self, uid: str) -> None:
        """Pod ``uid``'s hosts file from what the API server holds now (under the lock). In
        place: the file is bind-mounted, so a new inode would not be seen."""
        path, namespace, subdomain, own = self._files[uid]
        lines = [f"{LOOPBACK}\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
        # What a kubelet writes for the pod itself.
        lines.append(f"{LOOPBACK}\t{pod_names(own, subdomain, namespace)[0]}\t{own}")
        peers = sorted(
            {h for hosts in self._slices.get((namespace, subdomain), {}).values() for h in hosts}
        )
        lines += [f"{LOOPBACK}\t" + " ".join(pod_names(h, subdomain, namespace)) for h in peers]
        with path.open("a+") as out:
            out.seek(0)
            out.truncate()
            out.write("\n".join(lines) + "\n")

    # --- ports -------------------------------------------------------------------------

    def host_ports(self, pod: Mapping[str, Any]) -> dict[int, int]:
        """The host port of each port the pod declares, chosen on first use (module
        docstring) and kept until :meth:`release`."""
        uid = pod["metadata"]["uid"]
        with self._lock:
            known = self._pod_ports.get(uid)
            if known is not None:
                return dict(known)
            chosen: dict[int, int] = {}
            for port in declared_ports(pod):
                host = port if port not in self._held and _bindable(port) else free_port()
                while host in self._held:
                    host = free_port()
                chosen[port] = host
                self._held.add(host)
            self._pod_ports[uid] = chosen
            return dict(chosen)

    def host_port(self, pod: Mapping[str, Any], port: int | str) -> int:
        """Where the pod's ``port`` (a number, or a container port's name) listens on this
        machine."""
        if isinstance(port, str) and not port.isdigit():
            named = {
                str(entry.get("name")): int(entry["containerPort"])
                for container in (pod.get("spec") or {}).get("containers") or []
                for entry in container.get("ports") or []
                if entry.get("name")
            }
            if port not in named:
                raise KeyError(f"pod {pod['metadata']['name']} has no port named {port!r}")
            port = named[port]
        number = int(port)
        return self.host_ports(pod).get(number, number)

    def container(self, pod: Mapping[str, Any], container: Mapping[str, Any]) -> dict[str, Any]:
        """``container`` as it listens here: a copy whose declared ports, and the numeric
        ports of its probes, are the host ports (what a probe of it connects to)."""
        ports = self.host_ports(pod)
        out = copy.deepcopy(dict(container))
        for entry in out.get("ports") or []:
            entry["containerPort"] = ports.get(int(entry["containerPort"]), entry["containerPort"])
        for kind in ("readinessProbe", "livenessProbe", "startupProbe"):
            probe = out.get(kind) or {}
            for action in ("httpGet", "tcpSocket"):
                port = (probe.get(action) or {}).get("port")
                if isinstance(port, int) or (isinstance(port, str) and port.isdigit()):
                    probe[action]["port"] = ports.get(int(port), int(port))
        return out

    def args(self, pod: Mapping[str, Any], argv: list[str]) -> list[str]:
        """``argv`` with the pod's moved ports rewritten (module docstring)."""
        moved = {p: h for p, h in self.host_ports(pod).items() if p != h}
        if not moved:
            return argv
        out: list[str] = []
        for i, given in enumerate(argv):
            word = given
            flag = _PORT_FLAG.match(word)
            previous = _PORT_FLAG.match(argv[i - 1]) if i else None
            if flag and flag.group(2) and int(flag.group(2)) in moved:
                word = f"{flag.group(1)}={moved[int(flag.group(2))]}"
            elif previous and not previous.group(2) and word.isdigit() and int(word) in moved:
                word = str(moved[int(word)])
            out.append(_moved_addresses(word, moved))
        return out

    def env(self, pod: Mapping[str, Any], env: dict[str, str]) -> dict[str, str]:
        """``env`` with the Job's own rendezvous port (module docstring), where it names one,
        and the pod's moved ports."""
        moved = {p: h for p, h in self.host_ports(pod).items() if p != h}
        if moved:
            env = {
                name: (
                    str(moved[int(value)])
                    if name != PORT_ENV and _PORT_VARIABLE.search(name)
                    and value.isdigit() and int(value) in moved
                    else _moved_addresses(value, moved)
                )
                for name, value in env.items()
            }  # fmt: skip
        if PORT_ENV not in env:
            return env
        labels = (pod.get("metadata") or {}).get("labels") or {}
        job = labels.get("batch.kubernetes.io/controller-uid") or pod["metadata"]["uid"]
        with self._lock:
            port = self._ports.get(job) or self._ports.setdefault(job, free_port())
        return {**env, PORT_ENV: str(port)}


def _moved_addresses(text: str, moved: Mapping[int, int]) -> str:
    def replace(match: re.Match[str]) -> str:
        port = int(match.group(2))
        return f"{match.group(1)}:{moved[port]}" if port in moved else match.group(0)

    return _LOCAL_ADDRESS.sub(replace, text)
