"""The plugin's connection to the user's cluster: the kubeconfig (or the pod's service
account), the namespace, a client whose every request has a timeout, the few reads and the
one kind of write (a JSON merge patch of the RLCycle) the verbs make, and the one line a
failed request is told as.

The credentials are the user's kubeconfig (``--kubeconfig``, ``$KUBECONFIG``,
``~/.kube/config``; ``--context``), as for kubectl itself, so this module reads those
variables as kubectl does rather than through the operator's ``rtrl.settings``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kubernetes.client import ApiClient

from ..core.api.names import GROUP, LABEL_ARM, LABEL_CHECKPOINT, LABEL_RLCYCLE
from ..kube.client import KubeClient, KubeError, path
from . import render

FIELD_MANAGER = "kubectl-rtrl"
MERGE_PATCH = "application/merge-patch+json"
RESOURCE = f"rlcycle.{GROUP}"
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


class PluginError(Exception):
    """Refused or failed: the message is the one line the user reads."""


@dataclass
class Session:
    """The user's cluster and namespace, and the few requests the verbs make."""

    client: KubeClient
    namespace: str
    server: str

    def rlcycle(self, name: str) -> dict[str, Any]:
        found = self.client.get("RLCycle", self.namespace, name)
        if found is None:
            raise PluginError(f"RLCycle {name} not found in namespace {self.namespace}")
        return found

    def checkpoint(self, name: str) -> dict[str, Any] | None:
        return self.client.get("Checkpoint", self.namespace, name)

    def checkpoints_of(self, rlcycle: str) -> list[dict[str, Any]]:
        """The RLCycle's Checkpoints (``spec.rlCycle``), and the ones registered by hand for
        it (label ``rtrl.io/rlcycle``, e.g. its base model), newest first."""
        items = self.client.list("Checkpoint", self.namespace)
        mine = [
            c
            for c in items
            if render.spec(c).get("rlCycle") == rlcycle
            or (render.meta(c).get("labels") or {}).get(LABEL_RLCYCLE) == rlcycle
        ]
        return render.newest_first(mine)

    def rlcycles(self, all_namespaces: bool) -> list[dict[str, Any]]:
        answer = self.client.request(
            "GET", path("RLCycle", None if all_namespaces else self.namespace)
        )
        return list((answer or {}).get("items") or [])

    def children(self, checkpoint: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """The Checkpoint's Jobs and its canary Deployment(s), by the labels the operator
        puts on them (``rtrl.io/checkpoint``; the canary also ``rtrl.io/arm=canary``)."""
        jobs = self.client.list("Job", self.namespace, {LABEL_CHECKPOINT: checkpoint})
        canary = {LABEL_CHECKPOINT: checkpoint, LABEL_ARM: "canary"}
        return jobs, self.client.list("Deployment", self.namespace, canary)

    def events_of(self, kind: str, name: str, uid: str | None = None) -> list[dict[str, Any]]:
        """The Events about one object (core/v1, as the operator posts them). The field
        selector keeps the answer small; the filter here is what is relied on. With ``uid``,
        only this incarnation's: an object deleted and created again under its name leaves
        its Events for an hour, and they are not the new one's."""
        selector = f"involvedObject.kind={kind},involvedObject.name={name}"
        answer = self.client.request(
            "GET", path("Event", self.namespace), query={"fieldSelector": selector}
        )
        out = []
        for e in (answer or {}).get("items") or []:
            involved = e.get("involvedObject") or {}
            if involved.get("kind") != kind or involved.get("name") != name:
                continue
            if uid and involved.get("uid") and involved["uid"] != uid:
                continue  # an Event without a uid (posted by hand) cannot be told apart
            out.append(e)
        return out

    def patch_rlcycle(self, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        """A JSON merge patch of the RLCycle, field manager ``kubectl-rtrl``."""
        try:
            result = self.client.request(
                "PATCH",
                path("RLCycle", self.namespace, name),
                patch,
                content_type=MERGE_PATCH,
                query={"fieldManager": FIELD_MANAGER},
            )
        except KubeError as exc:
            if exc.status == 404:
                raise PluginError(
                    f"RLCycle {name} not found in namespace {self.namespace}"
                ) from None
            raise
        return dict(result or {})


class TimedApiClient(ApiClient):
    """An ``ApiClient`` whose every call has a timeout: a wrong or unroutable server must
    end in an error line, not a hang (KubeClient passes none)."""

    def __init__(self, configuration: Any, timeout: float):
        super().__init__(configuration)
        self.timeout = timeout

    def call_api(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("_request_timeout") is None and len(args) < 6:
            kwargs["_request_timeout"] = self.timeout
        return super().call_api(*args, **kwargs)


def _kubeconfig_paths(explicit: str | None) -> list[str]:
    if explicit:
        return [explicit]
    env = os.environ.get("KUBECONFIG")
    if env:
        return [p for p in env.split(os.pathsep) if p]
    return [os.path.expanduser("~/.kube/config")]


def connect(
    kubeconfig: str | None, context: str | None, namespace: str | None, timeout: float
) -> Session:
    """The kubeconfig's cluster and credentials; the namespace from ``-n``, else the
    context's, else ``default`` (as kubectl). In a pod with no kubeconfig: its service
    account."""
    from kubernetes import config as kconfig
    from kubernetes.client import Configuration

    configuration = Configuration()
    paths = _kubeconfig_paths(kubeconfig)
    files = [p for p in paths if Path(p).exists()]
    if kubeconfig and not files:
        raise PluginError(f"kubeconfig {kubeconfig} not found")
    try:
        if not files and os.environ.get("KUBERNETES_SERVICE_HOST") and not context:
            kconfig.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
            default_ns = (
                SERVICE_ACCOUNT_NAMESPACE.read_text().strip()
                if SERVICE_ACCOUNT_NAMESPACE.exists()
                else "default"
            )
        else:
            if not files:
                raise PluginError(
                    f"no kubeconfig found (looked at {', '.join(paths)}); "
                    "set KUBECONFIG or pass --kubeconfig"
                )
            config_file = os.pathsep.join(files)
            kconfig.load_kube_config(  # type: ignore[no-untyped-call]
                config_file=config_file,
                context=context,
                client_configuration=configuration,
                persist_config=False,
            )
            contexts, active = kconfig.list_kube_config_contexts(config_file)  # type: ignore[no-untyped-call]
            chosen = next((c for c in contexts if c.get("name") == context), None) or active
            default_ns = ((chosen or {}).get("context") or {}).get("namespace") or "default"
    except kconfig.ConfigException as exc:
        raise PluginError(f"kubeconfig: {render.one_line(exc)}") from None
    configuration.retries = 1
    client = KubeClient(TimedApiClient(configuration, timeout))
    return Session(client, namespace or default_ns, str(configuration.host))


def describe(exc: Exception, server: str) -> str:
    """One line for a failed request."""
    if isinstance(exc, KubeError) and exc.status in (401, 403):
        what = "unauthorized" if exc.status == 401 else "forbidden"
        return f"{what}: {render.one_line(exc)}"
    if isinstance(exc, KubeError) and exc.status:
        return render.one_line(exc)
    raw = str(exc)
    found = re.search(r"\[Errno -?\d+\] ([^'\")]+)", raw)
    if found:
        detail = found.group(1).strip()
    elif "timed out" in raw.lower() or "timeout" in raw.lower():
        detail = "timed out"
    else:
        detail = render.one_line(raw, 200)
    return f"cannot reach the Kubernetes API server at {server}: {detail}"


def is_transport_error(exc: Exception) -> bool:
    import urllib3

    return isinstance(exc, OSError | urllib3.exceptions.HTTPError)


# --- the requests the verbs make -----------------------------------------------------------
def token(*taken: object) -> str:
    """A new request value: the UTC time to the microsecond, never one already used."""
    value = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    n = 0
    candidate = value
    while candidate in taken:
        n += 1
        candidate = f"{value}-{n}"
    return candidate


def annotate(session: Session, name: str, rlc: dict[str, Any], key: str, status_key: str) -> str:
    current = (render.meta(rlc).get("annotations") or {}).get(key)
    value = token(current, render.status(rlc).get(status_key))
    session.patch_rlcycle(name, {"metadata": {"annotations": {key: value}}})
    print(f"{RESOURCE}/{name} annotated: {key}={value}")
    return value
