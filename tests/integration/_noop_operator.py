"""A minimal kopf operator for the harness test: on RLCycle creation it writes a status.

Loaded by ``kopf run`` as a file, so it is a plain module with module-level handlers.
"""

from typing import Any

import kopf


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """The test runs it with a registry of its own, which has no login handler by default."""
    return kopf.login_via_client(**kwargs)


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.scanning.disabled = True  # no CRD/namespace watching: resources are fixed here
    settings.persistence.finalizer = "rtrl.io/harness-test"


@kopf.on.create("rtrl.io", "v1alpha1", "rlcycles")
def created(spec: kopf.Spec, patch: kopf.Patch, **_: Any) -> None:
    patch.status["phase"] = "Seen"
    patch.status["deployment"] = spec.get("target", {}).get("deployment")


@kopf.on.delete("rtrl.io", "v1alpha1", "rlcycles")
def deleted(**_: Any) -> None:
    pass
