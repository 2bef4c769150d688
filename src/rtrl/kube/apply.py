"""Carry out a plan: each action is idempotent, so a plan interrupted by a crash is simply
planned and applied again."""

from __future__ import annotations

import functools
import logging
import queue
import threading
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from rtrl.core.api.names import API_VERSION
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
            "apiVersion": API_VERSION,
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


class EventPoster:
    """Posts Events from one background thread, in the order they were submitted, so that a
    round ends with its last change, not with its Events (a round still running when the
    next Job finishes delays the reaction to it). Best effort, as Events are."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._pending = 0
        self._idle = threading.Condition(self._lock)

    def submit(self, post: Callable[[], None]) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="rtrl-events", daemon=True)
                self._thread.start()
            self._pending += 1
        self._queue.put(post)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every submitted Event is posted (or failed); False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def _run(self) -> None:
        while True:
            post = self._queue.get()
            try:
                if post is not None:
                    post()
            except Exception:  # post_event logs its own failures; never stop the thread
                log.exception("posting an event failed")
            finally:
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()


EVENTS = EventPoster()


class RejectedError(KubeError):
    """The API server refused, as invalid (422), an object the operator derived from the
    RLCycle's spec: no retry can succeed until the spec (or the cluster) changes."""


def invalid_object(exc: KubeError) -> bool:
    """A 422 that refuses the object as it would be (``<Kind> "<name>" is invalid: ...``),
    not one that says a JSON patch's ``test`` no longer holds (which the API server answers
    with the same status and reason, and a generic message)."""
    return exc.status == 422 and " is invalid: " in (exc.detail or str(exc))


def _rejected(exc: KubeError, kind: str, name: str) -> KubeError:
    if exc.status != 422:
        return exc
    detail = exc.detail or str(exc)
    return RejectedError(f"the API server rejected {kind} {name}: {detail}", 422, exc.reason)


def apply(client: KubeClient, rlcycle: dict[str, Any], actions: list[Action]) -> None:
    """Carry out ``actions`` in order (Events last). A create or merge patch the server
    refuses as invalid raises :class:`RejectedError`; other failures raise KubeError."""
    meta = rlcycle["metadata"]
    namespace = meta["namespace"]
    uids: dict[tuple[str, str], str] = {("RLCycle", meta["name"]): meta.get("uid", "")}
    # Events go last, in their order, posted from a background thread (EVENTS): they are a
    # courtesy, and the round's changes (a status, a Job) should not wait for them.
    actions = [a for a in actions if not isinstance(a, Emit)] + [
        a for a in actions if isinstance(a, Emit)
    ]
    events: KubeClient | None = None
    for action in actions:
        if isinstance(action, Create):
            manifest = {
                **action.manifest,
                "metadata": {**action.manifest["metadata"], "namespace": namespace},
            }
            try:
                created = client.create(manifest)
            except KubeError as exc:
                raise _rejected(exc, action.kind, action.name) from None
            if created is not None:
                uids[(action.kind, action.name)] = created["metadata"].get("uid", "")
                log.info("created %s %s", action.kind, action.name)
        elif isinstance(action, Delete):
            if client.delete(action.kind, namespace, action.name):
                log.info("deleted %s %s", action.kind, action.name)
        elif isinstance(action, Patch):
            json_patch = isinstance(action.patch, list)
            try:
                answer = client.patch(
                    action.kind, namespace, action.name, action.patch, json_patch=json_patch
                )
            except KubeError as exc:
                if not json_patch or exc.status != 422 or invalid_object(exc):
                    raise _rejected(exc, action.kind, action.name) from None
                log.info("patch of %s %s no longer applies; replanning", action.kind, action.name)
            else:
                log.info("patched %s %s", action.kind, action.name)
                _wrote_conditionally(client, action, namespace, answer)
        elif isinstance(action, PatchStatus):
            patch_status(
                client, action.kind, namespace, action.name, action.status,
                seen=action.resource_version,
            )  # fmt: skip
        elif isinstance(action, Emit):
            uid = uids.get((action.kind, action.name), "")
            if events is None:
                events = KubeClient(client.api)  # not the round's client: another thread
            EVENTS.submit(functools.partial(post_event, events, namespace, {"uid": uid}, action))
            log.info("%s %s/%s: %s", action.reason, action.kind, action.name, action.message)


def _wrote_conditionally(
    client: KubeClient, action: Patch, namespace: str, answer: dict[str, Any] | None
) -> None:
    """A merge patch conditional on a resourceVersion (the RLCycle's finalizers) is the
    round's own write of the object: a status write of it later in the round is
    conditional on the version it answered (``patch_status``), not the one first seen."""
    meta = action.patch.get("metadata") if isinstance(action.patch, dict) else None
    written = ((answer or {}).get("metadata") or {}).get("resourceVersion")
    if isinstance(meta, dict) and meta.get("resourceVersion") and written:
        client.written[(action.kind, namespace, action.name)] = str(written)


def patch_status(
    client: KubeClient,
    kind: str,
    namespace: str,
    name: str,
    status: dict[str, Any],
    *,
    seen: str = "",
) -> dict[str, Any] | None:
    """Merge ``status`` into the object's status subresource. With ``seen`` (the
    resourceVersion the round decided on) the write is conditional: it applies to that
    version, or to what this client's own earlier write of the object answered (a round
    may write an object twice), and the API server answers 409 if anyone else changed the
    object since (KubeError)."""
    body: dict[str, Any] = {"status": status}
    key = (kind, namespace, name)
    version = client.written.get(key, seen) if seen else ""
    if version:
        body = {"metadata": {"resourceVersion": version}, **body}
    answer = client.patch(kind, namespace, name, body, sub="status")
    written = ((answer or {}).get("metadata") or {}).get("resourceVersion")
    if version and written:
        client.written[key] = str(written)
    return answer


def write_status(client: KubeClient, rlcycle: dict[str, Any], status: dict[str, Any]) -> bool:
    """Merge ``status`` into the RLCycle's status, unless that would change nothing (a
    resync of an idle RLCycle costs reads only), conditional on the version the round read
    (``patch_status``). Returns whether it wrote."""
    old = rlcycle.get("status") or {}
    if all(old.get(key) == value for key, value in status.items()):
        return False
    meta = rlcycle["metadata"]
    seen = str(meta.get("resourceVersion") or "")
    patch_status(client, "RLCycle", meta["namespace"], meta["name"], status, seen=seen)
    return True


__all__ = [
    "EVENTS",
    "EventPoster",
    "RejectedError",
    "api_version",
    "apply",
    "patch_status",
    "post_event",
    "write_status",
]
