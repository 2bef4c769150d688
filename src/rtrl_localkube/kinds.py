"""The resources the emulator knows (:class:`Kind`: discovery and write rules), read from
the built-in list and from CRDs, and the API server's error and timestamp formats."""

from __future__ import annotations

import copy
import datetime
import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kmock
import yaml

REPO = Path(__file__).resolve().parents[2]
PROJECT_CRDS = sorted((REPO / "crds").glob("*.yaml"))
KOPF_PEERING_CRDS = REPO / "charts" / "rtrl-operator" / "files" / "kopf-peering-crds.yaml"


@dataclass(frozen=True)
class Kind:
    """What the emulator knows of one resource: enough for discovery and for write rules."""

    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool
    status_subresource: bool
    singular: str = ""
    shortnames: tuple[str, ...] = ()
    categories: tuple[str, ...] = ()

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def resource(self) -> kmock.resource:
        return kmock.resource(group=self.group, version=self.version, plural=self.plural)


BUILTIN_KINDS: tuple[Kind, ...] = (
    Kind("", "v1", "pods", "Pod", True, True, "pod", ("po",)),
    Kind("", "v1", "services", "Service", True, True, "service", ("svc",)),
    Kind("", "v1", "configmaps", "ConfigMap", True, False, "configmap", ("cm",)),
    Kind("", "v1", "secrets", "Secret", True, False, "secret"),
    Kind("", "v1", "events", "Event", True, False, "event", ("ev",)),
    Kind("batch", "v1", "jobs", "Job", True, True, "job"),
    Kind("batch", "v1", "cronjobs", "CronJob", True, True, "cronjob", ("cj",)),
    Kind("events.k8s.io", "v1", "events", "Event", True, False, "event", ("ev",)),
    Kind("apps", "v1", "deployments", "Deployment", True, True, "deployment", ("deploy",)),
    Kind("coordination.k8s.io", "v1", "leases", "Lease", True, False, "lease"),
    Kind(
        "apiextensions.k8s.io",
        "v1",
        "customresourcedefinitions",
        "CustomResourceDefinition",
        False,
        True,
        "customresourcedefinition",
        ("crd", "crds"),
    ),
)
VERBS = ("create", "delete", "get", "list", "patch", "update", "watch")


def kinds_from_crd(crd: Mapping[str, Any]) -> list[Kind]:
    """The served versions of a CustomResourceDefinition document."""
    spec = crd["spec"]
    names = spec["names"]
    return [
        Kind(
            group=spec["group"],
            version=version["name"],
            plural=names["plural"],
            kind=names["kind"],
            namespaced=spec.get("scope", "Namespaced") == "Namespaced",
            status_subresource="status" in (version.get("subresources") or {}),
            singular=names.get("singular", names["kind"].lower()),
            shortnames=tuple(names.get("shortNames", ())),
            categories=tuple(names.get("categories", ())),
        )
        for version in spec["versions"]
        if version.get("served", True)
    ]


def load_crds(paths: Iterable[Path]) -> list[dict[str, Any]]:
    """The CRD documents in these files (parsed once per process: emulators start per test)."""
    return [copy.deepcopy(doc) for path in paths for doc in _parse_yaml(Path(path))]


@functools.cache
def _parse_yaml(path: Path) -> tuple[dict[str, Any], ...]:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    return tuple(doc for doc in yaml.load_all(path.read_text(), Loader=loader) if doc)


def now_rfc3339() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def api_error(status: int, reason: str, message: str) -> kmock.KubernetesError:
    """An error rendered as a Kubernetes ``Status`` with a real reason (``NotFound``, ...)."""
    return kmock.KubernetesError(
        status=status, reason=reason, message=message, details={"causes": []}
    )
