"""A pod's volumes and downward-API fields on this machine (``rtrl_localkube.pods`` says how a
pod spec maps onto it): each volume is a local directory, written as the kubelet writes it."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# (kind, namespace, name) -> the object, or None when it does not exist
Reader = Callable[[str, str, str], dict[str, Any] | None]
# (pod, audience or None, seconds) -> a service-account token bound to the pod
TokenSource = Callable[[dict[str, Any], str | None, int], str]


class SetupError(Exception):
    """The container cannot start (missing Secret, no command...): the pod fails, with this
    message, not the runner."""


SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


def in_cluster_kubeconfig(api_server: str, mounts: list[tuple[str, str]]) -> Path | None:
    """A kubeconfig for the service account whose token is mounted at
    :data:`SERVICE_ACCOUNT_DIR` (written beside that volume), or None without one."""
    local = next((Path(path) for mount, path in mounts if mount == SERVICE_ACCOUNT_DIR), None)
    if not api_server or local is None or not (local / "token").exists():
        return None
    config = local.parent / f"{local.name}.kubeconfig"
    config.write_text(
        json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "in-cluster",
            "clusters": [{"name": "in-cluster", "cluster": {
                "server": api_server, "certificate-authority": os.fspath(local / "ca.crt")}}],
            "users": [{"name": "service-account",
                       "user": {"tokenFile": os.fspath(local / "token")}}],
            "contexts": [{"name": "in-cluster",
                          "context": {"cluster": "in-cluster", "user": "service-account"}}],
        })
    )  # fmt: skip
    return config


def put(path: Path, text: str, mode: int = 0o644) -> None:
    """Write one file of a volume whole, as the kubelet swaps a volume's files in at once: the
    containers of one pod start on threads of their own and each writes the pod's volumes, so
    a file written in place could be read half-written, or gone (unlinked by another container
    just as this one set its mode: a pod never Ready in CI). A read-only copy left by a
    restarted container is replaced, not opened."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@dataclass
class PodSources:
    """What a pod's containers are given from the API: Secret and ConfigMap data, downward-API
    fields, tokens, and each volume as a local directory. :class:`~rtrl_localkube.pods.PodRunner`
    runs the containers on top."""

    read: Reader
    work_dir: Path
    extra_env: dict[str, str]
    token: TokenSource | None = None
    pod_ip: str = "127.0.0.1"
    node_name: str = "localhost"
    identities: bool = False

    # --- what a container sees -------------------------------------------------------------

    def keyed(self, kind: str, namespace: str, name: str) -> dict[str, str] | None:
        """A Secret's (decoded) or ConfigMap's data, None if missing."""
        obj = self.read(kind, namespace, name)
        if obj is None:
            return None
        if kind == "Secret":
            return {k: base64.b64decode(v).decode() for k, v in (obj.get("data") or {}).items()}
        return dict(obj.get("data") or {})

    def field(self, pod: Mapping[str, Any], path: str) -> str:
        """A downward-API field of ``pod`` (``metadata.name``, ``metadata.labels['k']``...)."""
        meta = pod["metadata"]
        keyed = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
        if keyed:
            return str((meta.get(keyed.group(1)) or {}).get(keyed.group(2), ""))
        simple = {
            "metadata.name": meta["name"],
            "metadata.namespace": meta["namespace"],
            "metadata.uid": meta.get("uid", ""),
            "spec.nodeName": (pod.get("spec") or {}).get("nodeName") or self.node_name,
            "spec.serviceAccountName": (pod.get("spec") or {}).get("serviceAccountName", ""),
            "status.podIP": (pod.get("status") or {}).get("podIP") or self.pod_ip,
            "status.hostIP": self.pod_ip,
        }
        if path not in simple:
            raise SetupError(f"fieldRef {path!r} is not supported by this kubelet")
        return str(simple[path])

    def _write_items(
        self,
        target: Path,
        data: Mapping[str, str],
        items: list[dict[str, Any]] | None,
        *,
        mode: int | None = None,
        optional: bool = False,
    ) -> None:
        """One file per item (every key without ``items``), with the item's ``mode``, else
        ``mode`` (the volume's ``defaultMode``), else 0644, as the kubelet writes them. A
        missing key fails the volume unless the source is ``optional`` (then it is skipped)."""
        for item in items or [{"key": k, "path": k} for k in data]:
            if item["key"] not in data:
                if optional:
                    continue
                raise SetupError(f"key {item['key']!r} not found")
            put(target / item["path"], data[item["key"]],
                item.get("mode", mode if mode is not None else 0o644))  # fmt: skip

    def _keyed_volume(
        self,
        pod: dict[str, Any],
        source: Mapping[str, Any],
        kind: str,
        target: Path,
        mode: int | None = None,
    ) -> None:
        name = source.get("name") or source.get("secretName")
        data = self.keyed(kind, pod["metadata"]["namespace"], str(name))
        optional = bool(source.get("optional"))
        if data is None:
            if optional:
                return
            raise SetupError(f"{kind} {name!r} not found")
        mode = source.get("defaultMode", mode)
        self._write_items(target, data, source.get("items"), mode=mode, optional=optional)

    def _downward_volume(
        self, pod: dict[str, Any], source: Mapping[str, Any], target: Path
    ) -> None:
        for item in source.get("items") or []:
            if "fieldRef" not in item:
                raise SetupError(f"downwardAPI item {item.get('path')!r}: only fieldRef")
            put(target / item["path"], self.field(pod, item["fieldRef"]["fieldPath"]))

    def _projected_volume(
        self, pod: dict[str, Any], source: Mapping[str, Any], target: Path
    ) -> None:
        mode = source.get("defaultMode")
        for part in source.get("sources") or []:
            if "configMap" in part:
                self._keyed_volume(pod, part["configMap"], "ConfigMap", target, mode)
            elif "secret" in part:
                self._keyed_volume(pod, part["secret"], "Secret", target, mode)
            elif "downwardAPI" in part:
                self._downward_volume(pod, part["downwardAPI"], target)
            elif "serviceAccountToken" in part:
                if self.token is None:
                    raise SetupError("serviceAccountToken volumes need the TokenRequest API")
                spec = part["serviceAccountToken"]
                token = self.token(pod, spec.get("audience"), spec.get("expirationSeconds", 3607))
                put(target / spec["path"], token, mode if mode is not None else 0o644)
            else:
                raise SetupError(f"projected source {sorted(part)} is not supported")

    def volumes(
        self, pod: dict[str, Any], container: dict[str, Any], root: Path
    ) -> list[tuple[str, str]]:
        """Each volume as a local directory; (mountPath, local path) of the container's
        mounts, longest mount path first."""
        local: dict[str, Path] = {}
        for volume in pod["spec"].get("volumes") or []:
            name = volume["name"]
            path = root / "volumes" / name
            try:
                if "emptyDir" in volume:
                    path.mkdir(parents=True, exist_ok=True)
                elif "configMap" in volume or "secret" in volume:
                    kind = "ConfigMap" if "configMap" in volume else "Secret"
                    path.mkdir(parents=True, exist_ok=True)
                    self._keyed_volume(
                        pod, volume.get("configMap") or volume.get("secret") or {}, kind, path
                    )
                elif "downwardAPI" in volume:
                    path.mkdir(parents=True, exist_ok=True)
                    self._downward_volume(pod, volume["downwardAPI"], path)
                elif "projected" in volume:
                    path.mkdir(parents=True, exist_ok=True)
                    self._projected_volume(pod, volume["projected"], path)
                elif "persistentVolumeClaim" in volume:
                    claim = volume["persistentVolumeClaim"]["claimName"]
                    path = self.work_dir / "pvc" / claim
                    path.mkdir(parents=True, exist_ok=True)
                elif "hostPath" in volume:
                    path = Path(volume["hostPath"]["path"])
                else:
                    raise SetupError("this kind of volume is not supported")
            except SetupError as exc:
                raise SetupError(f"volume {name!r}: {exc}") from None
            local[name] = path
        mounts = []
        for mount in container.get("volumeMounts") or []:
            if mount["name"] not in local:
                raise SetupError(f"volumeMount {mount['name']!r} has no volume")
            path = local[mount["name"]] / mount.get("subPath", "")
            mounts.append((mount["mountPath"].rstrip("/") or "/", os.fspath(path)))
        return sorted(mounts, key=lambda m: len(m[0]), reverse=True)
