"""What the planning core asks the kube layer to do; plain data, applied in order.

Every action is idempotent when applied: a Create whose object already exists and a Delete
whose object is gone both count as done, so a plan can be applied again after a crash.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rtrl.core.api.rlcycle import NotificationEvent


@dataclass(frozen=True)
class Create:
    """Create ``manifest``; "already exists" is success (fixed child names)."""

    manifest: dict[str, Any]

    @property
    def kind(self) -> str:
        return str(self.manifest["kind"])

    @property
    def name(self) -> str:
        return str(self.manifest["metadata"]["name"])


@dataclass(frozen=True)
class Delete:
    """Delete an object of the RLCycle's namespace, its dependents in the background."""

    api_version: str
    kind: str
    name: str


@dataclass(frozen=True)
class PatchStatus:
    """Merge ``status`` into the status subresource of an object of the namespace.

    ``resource_version``: the version of the object the plan decided on. The write then
    applies only to that version (or to the round's own earlier write of the object): an
    object changed since, by anyone else, answers 409, and the next round decides on what
    is there now. A status is a record of what happened (a step's summary, a phase); written
    from a stale view, it would undo what a newer round recorded (two operators active at
    once: kopf's peering is no fencing lease)."""

    api_version: str
    kind: str
    name: str
    status: dict[str, Any]
    resource_version: str = ""


@dataclass(frozen=True)
class Patch:
    """Patch an object of the namespace: a JSON merge patch (dict) or a JSON patch (list).

    A JSON patch may start with ``test`` operations that make it apply only to the state it
    was planned for; when they no longer hold (it was applied already, or someone changed
    the field), the API answers 422 and the patch counts as done: the next plan sees the
    new state and decides again."""

    api_version: str
    kind: str
    name: str
    patch: dict[str, Any] | list[dict[str, Any]]


@dataclass(frozen=True)
class Emit:
    """Post a Kubernetes Event about ``kind``/``name`` (the RLCycle or a Checkpoint)."""

    kind: str
    name: str
    reason: str
    message: str
    warning: bool = False
    # The notification events (spec.notifications) this Event also is: a decision or a
    # phase change a webhook may want to hear of (rtrl.planning.notify).
    notify: tuple[NotificationEvent, ...] = ()


Action = Create | Delete | Patch | PatchStatus | Emit
