"""Readiness probes of the kubelet stand-in: a container with an ``httpGet`` or ``tcpSocket``
``readinessProbe`` is ready only once its probe passes, as on a cluster. A real inference
server (vLLM) takes minutes to load its model: until ``/health`` answers, its pod must not
count as Ready, or a Deployment's rollout (and rtrl's canary) would move on too early.

What a kubelet does, as far as these pods need it: the first probe after
``initialDelaySeconds``, then one every ``periodSeconds`` (default 10), each with
``timeoutSeconds`` (default 1); ready after ``successThreshold`` (default 1) successes in a
row, unready after ``failureThreshold`` (default 3) failures in a row. ``httpGet`` succeeds
on a status from 200 to 399; its ``port`` is a number or the name of one of the container's
``ports``; every pod shares this machine's network, so the probe goes to ``host`` or
127.0.0.1. ``tcpSocket`` succeeds when a connection opens. ``exec`` and ``grpc`` probes are
not run: such a container is ready once it runs, as before.
"""

from __future__ import annotations

import http.client
import socket
import threading
from collections.abc import Callable, Mapping
from typing import Any


class ProbeError(ValueError):
    """The probe names a port the container does not declare."""


def probe_port(container: Mapping[str, Any], port: int | str) -> int:
    """A probe's ``port``: a number, or the name of one of the container's ports."""
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for declared in container.get("ports") or []:
        if declared.get("name") == port:
            return int(declared["containerPort"])
    raise ProbeError(f"readinessProbe port {port!r}: the container has no port of that name")


def check_once(container: Mapping[str, Any], probe: Mapping[str, Any]) -> bool:
    """One probe of ``container``: whether it passed."""
    timeout = float(probe.get("timeoutSeconds", 1))
    try:
        if "httpGet" in probe:
            get = probe["httpGet"]
            conn = http.client.HTTPConnection(
                get.get("host") or "127.0.0.1", probe_port(container, get["port"]), timeout=timeout
            )
            try:
                headers = {h["name"]: h["value"] for h in get.get("httpHeaders") or []}
                conn.request("GET", get.get("path") or "/", headers=headers)
                return 200 <= conn.getresponse().status < 400
            finally:
                conn.close()
        tcp = probe["tcpSocket"]
        address = (tcp.get("host") or "127.0.0.1", probe_port(container, tcp["port"]))
        with socket.create_connection(address, timeout=timeout):
            return True
    except (OSError, http.client.HTTPException, ProbeError):
        return False


def runs_probe(container: Mapping[str, Any]) -> bool:
    """Whether the container's readiness is decided by a probe run here."""
    probe = container.get("readinessProbe") or {}
    return "httpGet" in probe or "tcpSocket" in probe


class ReadinessProber:
    """Probes one running container until ``stop`` is set; calls ``changed`` whenever its
    readiness flips. :attr:`ready` is what the pod's status reports."""

    def __init__(
        self, container: Mapping[str, Any], changed: Callable[[], None], stop: threading.Event
    ) -> None:
        self.container = container
        self.probe: Mapping[str, Any] = container.get("readinessProbe") or {}
        self.changed = changed
        self.stop = stop
        self.ready = False
        self.thread = threading.Thread(target=self._run, name="readiness", daemon=True)

    def start(self) -> ReadinessProber:
        self.thread.start()
        return self

    def _run(self) -> None:
        probe = self.probe
        period = float(probe.get("periodSeconds", 10))
        to_pass = int(probe.get("successThreshold", 1))
        to_fail = int(probe.get("failureThreshold", 3))
        passed = failed = 0
        if self.stop.wait(float(probe.get("initialDelaySeconds", 0))):
            return
        while not self.stop.is_set():
            if check_once(self.container, probe):
                passed, failed = passed + 1, 0
            else:
                passed, failed = 0, failed + 1
            ready = self.ready
            if passed >= to_pass:
                ready = True
            elif failed >= to_fail:
                ready = False
            if ready != self.ready and not self.stop.is_set():
                self.ready = ready
                self.changed()
            self.stop.wait(period)
