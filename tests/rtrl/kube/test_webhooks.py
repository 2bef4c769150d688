"""The webhooks the operator calls (rtrl.kube.webhooks), against a real HTTP server on
127.0.0.1: a URL's token never shows in an error, whatever urllib raises; a delivery that
fails is retried with backoff, in order per webhook, then given up with its reason; the
bodies of the three formats. (The URL's Secret is read on the real control plane in
tests/e2e/test_notifications.py; here the lookup is replaced.)"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from rtrl.kube import webhooks
from rtrl.kube.webhooks import Notifier, WebhookError, body, post, redact

TOKEN = "T0KEN-9f8e7d6c"


class Server:
    def __init__(self) -> None:
        self.codes: list[int] = []  # answers in turn; 200 once they run out
        self.bodies: list[dict[str, Any]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                server.bodies.append(json.loads(self.rfile.read(length)))
                code = server.codes.pop(0) if server.codes else 200
                self.send_response(code)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.http.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}/hooks/{TOKEN}"


@pytest.fixture
def server() -> Iterator[Server]:
    s = Server()
    yield s
    s.http.shutdown()
    s.http.server_close()


@pytest.mark.parametrize(
    "url",
    [
        f"http://hooks.example:{TOKEN}/x",  # urllib names the port it cannot read
        f"http://[::1/{TOKEN}",
        f"http://127.0.0.1:9/services/{TOKEN}",
        f"http://no-such-host.invalid/x?token={TOKEN}",
    ],
)
def test_an_error_never_shows_the_url_or_its_token(url: str) -> None:
    with pytest.raises(WebhookError) as caught:
        post(url, {"a": 1}, "application/json")
    assert TOKEN not in str(caught.value)
    assert caught.value.__cause__ is None and caught.value.__context__ is None


def test_redact_takes_every_piece_that_may_carry_a_token() -> None:
    url = f"https://hooks.slack.com/services/{TOKEN}/B0?sig={TOKEN}x"
    text = f"failed: {url}; host hooks.slack.com; path /services/{TOKEN}/B0; sig {TOKEN}x"
    assert TOKEN not in redact(text, url)


def test_the_three_bodies() -> None:
    rlcycle = {"metadata": {"namespace": "ml", "name": "composer", "uid": "u-1"}}
    entry = {
        "id": "abc",
        "event": "Promoted",
        "time": "2026-12-02T00:00:00Z",
        "cycle": 3,
        "checkpoint": "composer-3",
        "message": "composer-3 now serves composer-vllm",
    }
    doc, kind = body("json", rlcycle, entry)
    assert kind == "application/json"
    assert doc == {**entry, "rlcycle": {"namespace": "ml", "name": "composer", "uid": "u-1"}}
    event, kind = body("cloudevents", rlcycle, entry)
    assert kind == "application/cloudevents+json"
    assert {k: event[k] for k in ("specversion", "id", "type", "source", "subject")} == {
        "specversion": "1.0",
        "id": "abc",
        "type": "io.rtrl.rlcycle.promoted",
        "source": "/apis/rtrl.io/v1alpha1/namespaces/ml/rlcycles/composer",
        "subject": "composer-3",
    }
    assert event["data"] == doc and event["datacontenttype"] == "application/json"
    text, kind = body("slack", rlcycle, entry)
    assert text == {"text": "rtrl ml/composer: Promoted: composer-3 now serves composer-vllm"}


def rlcycle_with(outbox: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "metadata": {"namespace": "ml", "name": "composer", "uid": "u-1"},
        "spec": {"notifications": [{"name": "ops", "urlSecret": {"name": "s", "key": "k"}}]},
        "status": {"outbox": outbox},
    }


def entries(n: int) -> list[dict[str, Any]]:
    return [
        {"id": f"id{i}", "event": "CanaryStep", "time": "2026-12-02T00:00:00Z",
         "message": f"step {i}", "targets": ["ops"]}
        for i in range(n)
    ]  # fmt: skip


def drive(notifier: Notifier, rlcycle: dict[str, Any], until: Any, timeout: float = 10) -> None:
    """What the reconciler does: submit, and again when told (or when a retry is due)."""
    woken = threading.Event()
    notifier.woken = lambda ns, name: woken.set()
    deadline = time.monotonic() + timeout
    while not until():
        assert time.monotonic() < deadline, notifier.done("ml", "composer")
        wait = notifier.submit(None, rlcycle)  # type: ignore[arg-type]
        woken.wait(wait if wait is not None else 0.2)
        woken.clear()


def test_a_failed_delivery_is_retried_with_backoff_in_order_then_delivered(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(webhooks, "secret_url", lambda client, ns, ref, policy: server.url)
    monkeypatch.setattr(webhooks, "FIRST_BACKOFF_SECONDS", 0.05)
    server.codes = [500, 503]
    notifier = Notifier()
    rlcycle = rlcycle_with(entries(3))
    drive(notifier, rlcycle, lambda: len(notifier.done("ml", "composer")[0]) == 3)
    assert [b["message"] for b in server.bodies] == ["step 0", "step 0", "step 0", "step 1",
                                                      "step 2"]  # fmt: skip
    assert notifier.done("ml", "composer")[1] == ()


def test_a_delivery_is_given_up_after_its_tries_and_says_why_without_the_url(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(webhooks, "secret_url", lambda client, ns, ref, policy: server.url)
    monkeypatch.setattr(webhooks, "FIRST_BACKOFF_SECONDS", 0.01)
    server.codes = [500] * webhooks.MAX_ATTEMPTS
    notifier = Notifier()
    drive(notifier, rlcycle_with(entries(1)), lambda: notifier.done("ml", "composer")[1])
    assert notifier.done("ml", "composer")[1] == (("id0", "ops", "HTTP 500"),)
    assert len(server.bodies) == webhooks.MAX_ATTEMPTS
    # dropped from the outbox, it is forgotten
    notifier.submit(None, rlcycle_with([]))  # type: ignore[arg-type]
    assert notifier.done("ml", "composer") == (frozenset(), ())


# --- where a webhook may go: the admin's policy, not the RLCycle's author (issue 32) -------


class Redirecting:
    """A webhook that answers every POST with a redirect to ``to`` (an address of the
    cluster's own, a cloud's metadata service: here another server of the test's)."""

    def __init__(self, to: str, code: int) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self.send_response(code)
                self.send_header("Location", to)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.http.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}/hook"


class Listener:
    """Any request at all, of any method, counted: what a redirect must never reach."""

    def __init__(self) -> None:
        self.requests: list[str] = []
        listener = self

        class Handler(BaseHTTPRequestHandler):
            def _any(self) -> None:
                listener.requests.append(f"{self.command} {self.path}")
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_GET = do_POST = do_PUT = _any  # noqa: N815

            def log_message(self, *args: Any) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.http.serve_forever, daemon=True).start()
        # another host than the webhook's own (127.0.0.1): the loopback's other name
        self.url = f"http://localhost:{self.http.server_address[1]}/latest/meta-data/"


@pytest.mark.parametrize("code", [301, 302, 303, 307, 308])
def test_a_redirect_is_the_answer_and_is_never_followed(code: int) -> None:
    """Before: urllib followed 301/302/303 (as a GET) to any address the webhook named."""
    listener = Listener()
    hook = Redirecting(listener.url, code)
    try:
        assert post(hook.url, {"a": 1}, "application/json") == code
        time.sleep(0.2)
        assert listener.requests == []
    finally:
        for s in (hook, listener):
            s.http.shutdown()
            s.http.server_close()


class FakeSecrets:
    """The Kubernetes client as secret_url uses it: one Secret, with labels."""

    def __init__(self, url: str, labels: dict[str, str]) -> None:
        import base64

        self.secret = {
            "metadata": {"name": "hook", "labels": labels},
            "data": {"url": base64.b64encode(url.encode()).decode()},
        }

    def request(self, method: str, path: str, **_: Any) -> dict[str, Any]:
        """GET of the one Secret (secret_url reads through KubeClient.get, uncached)."""
        assert (method, path) == ("GET", "/api/v1/namespaces/ml/secrets/hook"), path
        return self.secret


def test_the_policy_limits_the_hosts_a_webhook_may_reach() -> None:
    from rtrl.core.api.policy import TenancyPolicy

    ref = {"name": "hook", "key": "url"}
    marked = {"rtrl.io/rlcycle-secret": "true"}
    policy = TenancyPolicy(webhook_hosts=["hooks.slack.com", "*.ops.example:8443"])
    for allowed in ("https://hooks.slack.com/services/x", "https://a.ops.example:8443/h"):
        assert webhooks.secret_url(FakeSecrets(allowed, marked), "ml", ref, policy) == allowed  # type: ignore[arg-type]
    for refused in (
        "http://169.254.169.254/latest/meta-data/",
        "https://kubernetes.default.svc/api",
        "https://a.ops.example/h",  # the wrong port
        "https://ops.example:8443/h",  # *.ops.example is its subdomains only
        f"https://hooks.slack.com.attacker.example/{TOKEN}",
    ):
        with pytest.raises(WebhookError, match=r"policy\.webhookHosts") as caught:
            webhooks.secret_url(FakeSecrets(refused, marked), "ml", ref, policy)  # type: ignore[arg-type]
        assert TOKEN not in str(caught.value) and "attacker" not in str(caught.value)


def test_a_webhook_secret_must_carry_the_policys_label() -> None:
    from rtrl.core.api.policy import UNRESTRICTED, TenancyPolicy

    ref = {"name": "hook", "key": "url"}
    unmarked = FakeSecrets("https://hooks.slack.com/services/x", {})
    with pytest.raises(WebhookError, match=r"does not carry the label rtrl\.io/rlcycle-secret"):
        webhooks.secret_url(unmarked, "ml", ref, TenancyPolicy())  # type: ignore[arg-type]
    assert webhooks.secret_url(unmarked, "ml", ref, UNRESTRICTED)  # type: ignore[arg-type]
