"""Carry out a plan: each action is idempotent, so a plan interrupted by a crash is simply
planned and applied again."""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Any

from rtrl.planning import Create, Delete, Emit, Patch, PatchStatus
from rtrl.planning.actions import Action
from rtrl.planning.timeutil import iso

from .client import KubeClient, KubeError, api_version

log = logging.getLogger("rtrl.kube")
COMPONENT = "rtrl-operator"


def post_event(client: KubeClient, namespace: str, involved: dict[str, Any], emit: Emit) -> None:
    """A core/v1 Event about ``involved`` (kind, name, uid); failures are logged, never
    fatal: an Event is a courtesy, the status is the record."""
    now = iso(datetime.now(UTC))
    body = {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{emit.name}.", "namespace": namespace},
        "involvedObject": {
            "apiVersion": "rtrl.io/v1alpha1",
            "kind": emit.kind,
            "name": emit.name,
            "namespace": namespace,
            **({"uid": involved["uid"]} if involved.get("uid") else {}),
        },
        "reason": emit.reason,
        "message": emit.message[:1024],
        "type": "Warning" if emit.warning else "Normal",
        "source": {"component": COMPONENT},
        "reportingComponent": COMPONENT,
        "reportingInstance": COMPONENT,
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }
    try:
        client.create(body)
    except Exception as exc:
        log.warning("could not post event %s on %s/%s: %s", emit.reason, emit.kind, emit.name, exc)


def apply(client: KubeClient, rlcycle: dict[str, Any], actions: list[Action]) -> None:
    meta = rlcycle["metadata"]
    namespace = meta["namespace"]
    uids: dict[tuple[str, str], str] = {("RLCycle", meta["name"]): meta.get("uid", "")}
    # Events go last, in their order: they are a courtesy, and the round's first change (a
    # status, a Job) should not wait for them.
    actions = [a for a in actions if not isinstance(a, Emit)] + [
        a for a in actions if isinstance(a, Emit)
    ]
    for action in actions:
        if isinstance(action, Create):
            manifest = {
                **action.manifest,
                "metadata": {**action.manifest["metadata"], "namespace": namespace},
            }
            created = client.create(manifest)
            if created is not None:
                uids[(action.kind, action.name)] = created["metadata"].get("uid", "")
                log.info("created %s %s", action.kind, action.name)
        elif isinstance(action, Delete):
            if client.delete(action.kind, namespace, action.name):
                log.info("deleted %s %s", action.kind, action.name)
        elif isinstance(action, Patch):
            json_patch = isinstance(action.patch, list)
            try:
                client.patch(
                    action.kind, namespace, action.name, action.patch, json_patch=json_patch
                )
            except KubeError as exc:
                if not (json_patch and exc.status == 422):
                    raise
                log.info("patch of %s %s no longer applies; replanning", action.kind, action.name)
            else:
                log.info("patched %s %s", action.kind, action.name)
        elif isinstance(action, PatchStatus):
            client.patch(
                action.kind, namespace, action.name, {"status": action.status}, sub="status"
            )
        elif isinstance(action, Emit):
            uid = uids.get((action.kind, action.name), "")
            post_event(client, namespace, {"uid": uid}, action)
            log.info("%s %s/%s: %s", action.reason, action.kind, action.name, action.message)


def write_status(client: KubeClient, rlcycle: dict[str, Any], status: dict[str, Any]) -> bool:
    """Merge ``status`` into the RLCycle's status, unless that would change nothing (a
    resync of an idle RLCycle costs reads only). Returns whether it wrote."""
    old = rlcycle.get("status") or {}
    if all(old.get(key) == value for key, value in status.items()):
        return False
    meta = rlcycle["metadata"]
    client.patch("RLCycle", meta["namespace"], meta["name"], {"status": status}, sub="status")
    return True


__all__ = ["api_version", "apply", "post_event", "write_status"]
