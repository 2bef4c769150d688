"""The webhooks the operator calls: notifications (``status.outbox``) and the confirm webhook
of approval gates. Both URLs live in Secrets of the RLCycle's namespace and carry tokens
(Slack's, Teams'), so a URL is read when it is needed and is never logged, raised, put in
an Event or a status: every error that could hold it goes through :func:`redact`.

Notifications are delivered from a small pool of threads, never by the round itself, so a
slow or dead receiver never delays a cycle; each webhook gets them one at a time, in the
order they were decided. A failed delivery is retried with backoff
(:data:`MAX_ATTEMPTS` tries in all), then given up. The reconciler learns what is done
(:meth:`Notifier.done`) in its next round, whose plan drops it from the outbox; what this
process has not delivered when it dies is still in the outbox, and the next one sends it
(at-least-once: a receiver dedupes by the entry's id).

Where a webhook may go is the admin's, not the RLCycle author's: a redirect is never
followed (it answered with the redirect, which is a failed delivery: an RLCycle's webhook
redirected to any address had the operator POST there), the admin's policy may limit the
hosts (``policy.webhookHosts``), and the URL's Secret must carry the policy's label, as
the credentials Secret must (:mod:`rtrl.core.api.policy`).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import http.client
import json
import logging
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from rtrl.core.api.common import parse_duration
from rtrl.core.api.names import API_VERSION
from rtrl.core.api.policy import TenancyPolicy
from rtrl.core.api.rlcycle import RLCyclePhase

from .client import KubeClient, KubeError

log = logging.getLogger("rtrl.kube")

TIMEOUT_SECONDS = 5.0
MAX_ATTEMPTS = 5
FIRST_BACKOFF_SECONDS = 1.0
MAX_BACKOFF_SECONDS = 60.0
_URL = re.compile(r"^https?://[^\s/?#]+[^\s]*$")


class WebhookError(Exception):
    """A webhook could not be called; the message names no URL."""


def redact(text: str, url: str) -> str:
    """``text`` without ``url`` or any part of it that may carry a token (host, port, a
    path segment, a query value): those become ``<redacted>``."""
    pieces = {url, url.rstrip("/")}
    with contextlib.suppress(ValueError):  # a URL urllib cannot split has its pieces below
        parts = urlsplit(url)
        pieces |= {parts.netloc, parts.path, parts.query}
    pieces |= {p for p in re.split(r"[/:?&=#@;,\[\]]+", url) if len(p) >= 4}
    pieces -= {"http", "https"}
    for piece in sorted((p for p in pieces if p and p != "/"), key=len, reverse=True):
        text = text.replace(piece, "<redacted>")
    return text


def secret_url(
    client: KubeClient, namespace: str, ref: Mapping[str, Any], policy: TenancyPolicy
) -> str:
    """The URL in Secret ``ref.name``, key ``ref.key``; WebhookError (naming the Secret and
    key, never the value) when it is missing, not an http(s) URL, in a Secret without the
    policy's label, or to a host the policy does not allow."""
    name, key = str(ref.get("name") or ""), str(ref.get("key") or "")
    try:
        secret = KubeClient.get(client, "Secret", namespace, name)
    except KubeError as exc:
        raise WebhookError(f"cannot read Secret {name}: HTTP {exc.status} {exc.reason}") from None
    if secret is None:
        raise WebhookError(f"Secret {name} not found")
    label = policy.secret_label_pair()
    labels = (secret.get("metadata") or {}).get("labels") or {}
    if label is not None and labels.get(label[0]) != label[1]:
        raise WebhookError(
            f"Secret {name} does not carry the label {label[0]}={label[1]} that marks a Secret "
            "for RLCycles"
        )
    raw = (secret.get("data") or {}).get(key)
    if raw is None:
        raise WebhookError(f"Secret {name} has no key {key}")
    try:
        url = base64.b64decode(str(raw), validate=True).decode().strip()
    except (binascii.Error, UnicodeDecodeError):
        raise WebhookError(f"Secret {name} key {key} is not text") from None
    if not _URL.match(url):
        raise WebhookError(f"Secret {name} key {key} does not hold an http(s) URL")
    try:
        parts = urlsplit(url)
        host, port = parts.hostname or "", parts.port
    except ValueError:
        raise WebhookError(f"Secret {name} key {key} does not hold an http(s) URL") from None
    if not policy.allows_webhook_host(host, port):
        # The host is not named: a webhook URL is a secret, all of it.
        raise WebhookError(
            f"Secret {name} key {key}: the URL's host is not one the operator's policy lets "
            "webhooks reach (policy.webhookHosts)"
        )
    return url


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """A redirect is the webhook's answer, never followed: the Secret's URL is where the
    admin's policy let the operator POST, and a redirect could send it anywhere (the
    cluster's own services, a cloud's metadata address)."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


_OPENER = urllib.request.build_opener(_NoRedirects)


def post(url: str, document: Mapping[str, Any], content_type: str, event_id: str = "") -> int:
    """POST ``document`` as JSON; the HTTP status. WebhookError (redacted) when there was
    no answer."""
    headers = {"Content-Type": content_type, "User-Agent": "rtrl-operator"}
    if event_id:
        headers["Idempotency-Key"] = event_id
    try:
        request = urllib.request.Request(
            url, data=json.dumps(document).encode(), headers=headers, method="POST"
        )
        with _OPENER.open(request, timeout=TIMEOUT_SECONDS) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        exc.close()
        return int(exc.code)
    except (OSError, ValueError, http.client.HTTPException) as exc:
        problem = redact(f"{type(exc).__name__}: {exc}", url)
    # raised here, not in the handler: the exception urllib raised (which may name the URL)
    # must not ride along as this one's __context__
    raise WebhookError(problem)


# --- the bodies -----------------------------------------------------------------------


def document(rlcycle: Mapping[str, Any], entry: Mapping[str, Any]) -> dict[str, Any]:
    """rtrl's JSON notification: the outbox entry and the RLCycle it is about."""
    meta = rlcycle.get("metadata") or {}
    return {
        "id": entry["id"],
        "event": entry["event"],
        "time": entry["time"],
        "rlcycle": {
            "namespace": meta.get("namespace"),
            "name": meta.get("name"),
            "uid": meta.get("uid"),
        },
        "cycle": entry.get("cycle", 0),
        "checkpoint": entry.get("checkpoint"),
        "message": entry.get("message", ""),
    }


def body(
    fmt: str, rlcycle: Mapping[str, Any], entry: Mapping[str, Any]
) -> tuple[dict[str, Any], str]:
    """The body of one notification in ``fmt`` (json, cloudevents, slack), and its content
    type."""
    doc = document(rlcycle, entry)
    if fmt == "slack":
        where = f"{doc['rlcycle']['namespace']}/{doc['rlcycle']['name']}"
        return {"text": f"rtrl {where}: {doc['event']}: {doc['message']}"}, "application/json"
    if fmt == "cloudevents":  # CloudEvents 1.0, structured content mode (JSON format)
        meta = rlcycle.get("metadata") or {}
        source = (
            f"/apis/{API_VERSION}/namespaces/{meta.get('namespace')}/rlcycles/{meta.get('name')}"
        )
        event: dict[str, Any] = {
            "specversion": "1.0",
            "id": doc["id"],
            "source": source,
            "type": f"io.rtrl.rlcycle.{str(doc['event']).lower()}",
            "time": doc["time"],
            "datacontenttype": "application/json",
            "data": doc,
        }
        if doc.get("checkpoint"):
            event["subject"] = doc["checkpoint"]
        return event, "application/cloudevents+json"
    return doc, "application/json"


# --- notifications --------------------------------------------------------------------


@dataclass
class Delivery:
    """One entry of the outbox to one notification, as this process has tried it."""

    state: str = "pending"  # pending, sending, sent, failed
    attempts: int = 0
    due: float = 0.0  # time.monotonic() of the next try
    error: str = ""


Key = tuple[str, str]  # (namespace, RLCycle name)


class Notifier:
    """Delivers outbox entries from a pool of threads, retried with backoff; ``woken`` is
    called with the RLCycle's namespace and name when a delivery has ended, so that its
    reconciler drops it from the outbox."""

    def __init__(self, workers: int = 2) -> None:
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="rtrl-notify")
        self._lock = threading.Lock()
        self._state: dict[Key, dict[str, Delivery]] = {}
        self.woken: Callable[[str, str], None] = lambda namespace, name: None
        # The admin's policy (set when the operator starts: rtrl.kube.reconcile.start).
        self.policy = TenancyPolicy()

    def reset(self) -> None:
        """Forget every delivery (the operator starts again, in tests): what is still in
        an outbox is sent again."""
        with self._lock:
            self._state.clear()
        _ANSWERS.clear()

    def done(self, namespace: str, name: str) -> tuple[frozenset[str], tuple[tuple[str, ...], ...]]:
        """``("<id>/<target>", ...)`` delivered or given up, and ``(id, target, why)`` of
        those given up."""
        with self._lock:
            state = dict(self._state.get((namespace, name)) or {})
        ended = frozenset(k for k, d in state.items() if d.state in ("sent", "failed"))
        failed = tuple(
            (*k.split("/", 1), d.error) for k, d in sorted(state.items()) if d.state == "failed"
        )
        return ended, failed

    def submit(self, client: KubeClient, rlcycle: Mapping[str, Any]) -> float | None:
        """Start the deliveries of ``rlcycle``'s outbox that are due; seconds until the next
        one is (None: none waits). What is no longer in the outbox is forgotten."""
        meta = rlcycle.get("metadata") or {}
        key = (str(meta.get("namespace")), str(meta.get("name")))
        outbox = (rlcycle.get("status") or {}).get("outbox") or []
        specs = {
            str(n.get("name")): n
            for n in (rlcycle.get("spec") or {}).get("notifications") or []
            if isinstance(n, dict)
        }
        now = time.monotonic()
        wait: float | None = None
        with self._lock:
            state = self._state.setdefault(key, {})
            wanted = {f"{e.get('id')}/{t}" for e in outbox for t in e.get("targets") or []}
            for stale in set(state) - wanted:
                del state[stale]
            if not state and not wanted:
                del self._state[key]
            busy: set[str] = set()  # one delivery at a time per webhook, in outbox order
            for entry in outbox:
                for target in entry.get("targets") or []:
                    delivery = state.setdefault(f"{entry.get('id')}/{target}", Delivery())
                    if delivery.state in ("sent", "failed") or target in busy:
                        continue
                    busy.add(target)
                    if delivery.state != "pending" or target not in specs:
                        continue
                    if delivery.due > now:
                        left = delivery.due - now
                        wait = left if wait is None else min(wait, left)
                        continue
                    delivery.state = "sending"
                    self._pool.submit(
                        self._deliver, client, key, dict(rlcycle), dict(entry), specs[target]
                    )
        return wait

    def _deliver(
        self,
        client: KubeClient,
        key: Key,
        rlcycle: dict[str, Any],
        entry: dict[str, Any],
        spec: Mapping[str, Any],
    ) -> None:
        target = str(spec.get("name"))
        error = ""
        try:
            url = secret_url(client, key[0], spec.get("urlSecret") or {}, self.policy)
            document, content_type = body(str(spec.get("format") or "json"), rlcycle, entry)
            status = post(url, document, content_type, str(entry["id"]))
            if not 200 <= status < 300:
                error = f"HTTP {status}"
        except WebhookError as exc:
            error = str(exc)
        except Exception as exc:  # never let a delivery take the thread down
            error = f"{type(exc).__name__}"
        with self._lock:
            delivery = (self._state.get(key) or {}).get(f"{entry['id']}/{target}")
            if delivery is None:
                return
            delivery.attempts += 1
            if not error:
                delivery.state = "sent"
            elif delivery.attempts >= MAX_ATTEMPTS:
                delivery.state, delivery.error = "failed", error
            else:
                backoff = FIRST_BACKOFF_SECONDS * 2 ** (delivery.attempts - 1)
                delivery.state, delivery.error = "pending", error
                delivery.due = time.monotonic() + min(backoff, MAX_BACKOFF_SECONDS)
            attempts = delivery.attempts
        if error:
            log.warning(
                "notification %s of %s/%s (%s) failed, attempt %d of %d: %s",
                target, key[0], key[1], entry["event"], attempts, MAX_ATTEMPTS, error,
            )  # fmt: skip
        else:
            log.info("notified %s of %s/%s: %s %s", target, key[0], key[1], entry["event"],
                     entry["id"])  # fmt: skip
        try:
            self.woken(*key)
        except Exception:  # the loop may be closing
            log.debug("could not wake %s/%s", *key)


NOTIFIER = Notifier()


# --- the confirm webhook --------------------------------------------------------------


# The last answer of each gate's confirm webhook: (when, answer), by (uid, gate, since).
_ANSWERS: dict[tuple[str, ...], tuple[float, tuple[bool | None, str]]] = {}
_ANSWERS_MAX = 1024


def confirm(
    client: KubeClient, rlcycle: Mapping[str, Any], policy: TenancyPolicy
) -> tuple[bool | None, str]:
    """While ``status.awaitingApproval`` names a webhook gate: whether the confirm webhook
    releases it (HTTP 200, as Flagger's confirm-rollout), and why not, in words; asked at
    most once per ``confirmWebhook.interval`` (rounds woken by other events in between get
    its last answer). ``(None, "")`` when no webhook gate waits."""
    waiting = (rlcycle.get("status") or {}).get("awaitingApproval") or {}
    if waiting.get("mode") != "webhook":
        return None, ""
    meta = rlcycle.get("metadata") or {}
    hook = ((rlcycle.get("spec") or {}).get("rollout") or {}).get("confirmWebhook") or {}
    key = tuple(str(x) for x in (meta.get("uid"), waiting.get("gate"), waiting.get("since")))
    try:
        interval = parse_duration(str(hook.get("interval") or "1m"))
    except ValueError:
        interval = 60.0
    last = _ANSWERS.get(key)
    if last is not None and last[1][0] is not True and time.monotonic() - last[0] < interval:
        return last[1]
    answer = _ask(client, meta, hook, waiting, policy)
    if len(_ANSWERS) >= _ANSWERS_MAX:
        _ANSWERS.clear()
    _ANSWERS[key] = (time.monotonic(), answer)
    return answer


def _ask(
    client: KubeClient,
    meta: Mapping[str, Any],
    hook: Mapping[str, Any],
    waiting: Mapping[str, Any],
    policy: TenancyPolicy,
) -> tuple[bool | None, str]:
    question = {
        "name": meta.get("name"),
        "namespace": meta.get("namespace"),
        "phase": RLCyclePhase.AWAITING_APPROVAL,
        "gate": waiting.get("gate"),
        "checkpoint": waiting.get("checkpoint"),
        "weight": waiting.get("weight"),
        "since": waiting.get("since"),
    }
    try:
        url = secret_url(client, str(meta.get("namespace")), hook.get("urlSecret") or {}, policy)
        status = post(url, question, "application/json")
    except WebhookError as exc:
        return False, str(exc)
    return (True, "") if status == 200 else (False, f"it answered HTTP {status}")


__all__ = ["NOTIFIER", "Notifier", "WebhookError", "body", "confirm", "redact", "secret_url"]
