"""The kopf no-op baseline of ``bench/operator_latency.py``: run as
``kopf run --standalone -n default bench/operator_noop.py``.

Its only action is a status patch: when a Job labelled ``rtrl.io/bench=noop`` has a
``Complete`` condition, it sets ``status.noopSeen`` on that Job (once). It also watches the
RLCycles with a handler that does nothing, so that its RSS next to rtrl's covers kopf
holding the same objects. Settings match ``rtrl.handlers.configure`` where they matter
(Events off, the same watch timeouts, scanning left on).
"""

from typing import Any

import kopf


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.posting.enabled = False
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330


@kopf.on.event("batch", "v1", "jobs", labels={"rtrl.io/bench": "noop"})
def job_changed(status: kopf.Status, patch: kopf.Patch, **_: Any) -> None:
    conditions = status.get("conditions") or []
    done = any(c.get("type") == "Complete" and c.get("status") == "True" for c in conditions)
    if done and not status.get("noopSeen"):
        patch.status["noopSeen"] = True


@kopf.on.event("rtrl.io", "v1alpha1", "rlcycles")
def rlcycle_changed(**_: Any) -> None:
    pass
