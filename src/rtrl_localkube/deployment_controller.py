"""The Deployment controller, as far as the operator can tell: a thread that reports every
Deployment rolled out and ready (``observedGeneration``, ``replicas``, ``updatedReplicas``,
``readyReplicas``) shortly after its spec changes, except those a test says never become
ready (a canary whose model never loads)."""

from __future__ import annotations

import fnmatch
import threading
from typing import Any

from rtrl_localkube.api import KubeAPI


class DeploymentController:
    def __init__(self, api: KubeAPI, *, poll_interval: float = 0.05):
        self.api = api
        self.poll_interval = poll_interval
        self.never_ready: list[str] = []  # fnmatch patterns of Deployment names
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="deployments", daemon=True)
        self.errors: list[BaseException] = []

    def __enter__(self) -> DeploymentController:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        if self.errors:
            raise self.errors[0]

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_interval):
            try:
                for dep in self.api.list("apps/v1", "Deployment"):
                    self._reconcile(dep)
            except Exception as exc:
                if not self._stop.is_set():
                    self.errors.append(exc)
                    return

    def _reconcile(self, dep: dict[str, Any]) -> None:
        meta, spec = dep["metadata"], dep.get("spec") or {}
        if any(fnmatch.fnmatch(meta["name"], p) for p in self.never_ready):
            ready = 0
        else:
            ready = int(spec.get("replicas", 1))
        want = {
            "observedGeneration": meta.get("generation", 1),
            "replicas": int(spec.get("replicas", 1)),
            "updatedReplicas": int(spec.get("replicas", 1)),
            "readyReplicas": ready,
            "availableReplicas": ready,
        }
        if {k: (dep.get("status") or {}).get(k) for k in want} != want:
            self.api.patch("apps/v1", "Deployment", meta["name"], {"status": want},
                           subresource="status")  # fmt: skip
