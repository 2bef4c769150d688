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
"""

from __future__ import annotations

import os
import shutil
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
        """The pod's life ended: its hosts file is no longer kept current."""
        with self._lock:
            self._files.pop(pod["metadata"]["uid"], None)

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

    def env(self, pod: Mapping[str, Any], env: dict[str, str]) -> dict[str, str]:
        """``env`` with the Job's own rendezvous port (module docstring), where it names one."""
        if PORT_ENV not in env:
            return env
        labels = (pod.get("metadata") or {}).get("labels") or {}
        job = labels.get("batch.kubernetes.io/controller-uid") or pod["metadata"]["uid"]
        with self._lock:
            port = self._ports.get(job) or self._ports.setdefault(job, free_port())
        return {**env, PORT_ENV: str(port)}
