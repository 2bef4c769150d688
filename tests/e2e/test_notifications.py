"""Notifications and approval gates on the real control plane: the operator (a process with
the chart's ServiceAccount token) posts a cycle's phase changes and decisions to webhooks
whose URLs it reads from a Secret, in the three formats, to an HTTP server of the test's
own; a manual gate holds a canary step until ``kubectl rtrl approve`` (the real plugin);
a confirm webhook answering 403 holds it, 200 releases it. The URLs' token never shows in
the RLCycle, its Events or the operator's log, also when a delivery fails."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from rtrl.core.api.yamlfile import load_all
from rtrl.validation import validate_document
from rtrl_localkube.api import KubeAPI
from rtrl_localkube.controlplane import ControlPlane
from rtrl_localkube.cycle_world import (
    ANALYSIS_CONTINUE,
    ANALYSIS_PROMOTE,
    NAME,
    RTRL,
    commit_result,
    condition,
    events,
    script_all,
    setup_namespace,
    status,
    wait_phase,
)
from rtrl_localkube.kubelet import Kubelet
from rtrl_localkube.outcomes import Succeed
from rtrl_localkube.tools import Cli, OperatorProcess
from tests.conftest import REPO
from tests.e2e.test_manifests import server_verdict

pytestmark = pytest.mark.timeout(300)
CKPT = "composer-1"
TOKEN = "T0KEN-s3cr3t-4a7f9e"  # what a Slack or Teams URL carries: never to be shown
CONTINUE = ANALYSIS_CONTINUE


class Receiver:
    """An HTTP server on 127.0.0.1 in a thread: what it was sent, by path; what it answers
    on each path (200 unless told)."""

    def __init__(self) -> None:
        self.received: list[dict[str, Any]] = []
        self.answers: dict[str, int] = {}
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length)
                kind = self.path.strip("/").split("/")[0]
                with receiver.lock:
                    receiver.received.append(
                        {
                            "kind": kind,
                            "headers": {k.lower(): v for k, v in self.headers.items()},
                            "body": json.loads(body),
                        }
                    )
                    code = receiver.answers.get(kind, 200)
                self.send_response(code)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def url(self, kind: str) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/{kind}/hooks/{TOKEN}"

    def of(self, kind: str) -> list[dict[str, Any]]:
        with self.lock:
            return [r for r in self.received if r["kind"] == kind]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    server = Receiver()
    try:
        yield server
    finally:
        server.close()


def hooks_secret(kube: KubeAPI, receiver: Receiver) -> None:
    kinds = ("json", "cloudevents", "slack", "broken", "confirm")
    kube.create(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "hooks"},
            "stringData": {kind: receiver.url(kind) for kind in kinds},
        }
    )


def notification(name: str, fmt: str, key: str | None = None, **more: Any) -> dict[str, Any]:
    return {"name": name, "format": fmt, "urlSecret": {"name": "hooks", "key": key or fmt}, **more}


def rollout(approval: str, **more: Any) -> dict[str, Any]:
    return {
        "steps": [
            {"weight": 25, "minDuration": "1s"},
            {"weight": 50, "minDuration": "1s", "approval": approval},
        ],
        "readyTimeout": "30s",
        "analysis": {"maxDuration": "1h", "interval": "1s"},
        **more,
    }


def records(kube: KubeAPI) -> list[dict[str, Any]]:
    return list(status(kube, "Checkpoint", CKPT).get("rollout") or [])


def promote_from_now_on(node: Kubelet, scratch: Path) -> None:
    node.script("*-analyze-*", Succeed(before=commit_result("analyze", ANALYSIS_PROMOTE, scratch)))


def state(kube: KubeAPI, operator: OperatorProcess) -> str:
    """What a failed wait shows."""
    rlc = status(kube, "RLCycle", NAME)
    return f"RLCycle status: {rlc}\n--- operator\n{operator.output()[-5000:]}"


def assert_token_nowhere(kube: KubeAPI, operator: OperatorProcess) -> None:
    rlcycle = kube.get(RTRL, "RLCycle", NAME)
    assert TOKEN not in json.dumps(rlcycle)
    assert TOKEN not in json.dumps(kube.get(RTRL, "Checkpoint", CKPT))
    assert not [e for e in events(kube) if TOKEN in e[2]]
    assert TOKEN not in operator.output()


def test_a_cycle_is_notified_in_three_formats_and_a_manual_gate_waits_for_approve(  # noqa: PLR0917 - pytest passes fixtures by name
    kube_api: KubeAPI,
    job_runner: Kubelet,
    operator: OperatorProcess,
    admin: Cli,
    receiver: Receiver,
    tmp_path: Path,
) -> None:
    script_all(job_runner, tmp_path, analyze=CONTINUE)
    receiver.answers["broken"] = 500
    hooks_secret(kube_api, receiver)
    setup_namespace(
        kube_api,
        tmp_path,
        rollout=rollout("manual"),
        notifications=[
            notification("ops", "json"),
            notification("events", "cloudevents"),
            notification("chat", "slack", events=["AwaitingApproval", "Promoted"]),
            notification("down", "json", key="broken", events=["CycleStarted"]),
        ],
    )
    ns = kube_api.namespace
    early = admin.kubectl("rtrl", "approve", NAME, "-n", ns, check=False)
    assert early.returncode == 1 and "waits at no approval gate" in early.stderr, early

    def why() -> str:
        return state(kube_api, operator)

    # The gate holds the canary at 25% while its analyses go on.
    kube_api.wait_for(
        lambda: status(kube_api, "RLCycle", NAME).get("phase") == "AwaitingApproval",
        timeout=120,
        message=why,
    )
    kube_api.wait_for(
        lambda: (records(kube_api) or [{}])[0].get("analyses", 0) >= 3, timeout=60, message=why
    )
    assert [r["weight"] for r in records(kube_api)] == [25]
    waiting = status(kube_api, "RLCycle", NAME)["awaitingApproval"]
    assert waiting["mode"] == "manual" and waiting["weight"] == 50
    out = admin.kubectl("rtrl", "approve", NAME, "-n", ns)
    assert "rtrl.io/approve=" in out.stdout
    kube_api.wait_for(lambda: len(records(kube_api)) == 2, timeout=60, message=why)
    promote_from_now_on(job_runner, tmp_path / "results")  # at 50%, not before
    wait_phase(kube_api, "Checkpoint", CKPT, "Promoted", timeout=120)
    assert [r["weight"] for r in records(kube_api)] == [25, 50]
    assert records(kube_api)[0]["approved"].startswith("rtrl.io/approve=")
    kube_api.wait_for(
        lambda: (
            not status(kube_api, "RLCycle", NAME).get("outbox") and len(receiver.of("slack")) >= 2
        ),
        timeout=60,
        message=why,
    )

    # json: one document per decision, each once, in order
    docs = [r["body"] for r in receiver.of("json")]
    order = [d["event"] for d in docs]
    expected = ["CycleStarted", "CanaryStarted", "AwaitingApproval", "Approved", "CanaryStep",
                "Promoted", "CycleCompleted"]  # fmt: skip
    assert [e for e in order if e in expected] == expected, order
    assert len({d["id"] for d in docs}) == len(docs)  # at-least-once, here exactly once
    promoted = next(d for d in docs if d["event"] == "Promoted")
    assert promoted["rlcycle"] == {
        "namespace": ns,
        "name": NAME,
        "uid": kube_api.get(RTRL, "RLCycle", NAME)["metadata"]["uid"],
    }
    assert promoted["checkpoint"] == CKPT and promoted["cycle"] == 1
    json_headers = receiver.of("json")[0]["headers"]
    assert json_headers["content-type"] == "application/json"
    assert json_headers["idempotency-key"] == docs[0]["id"]
    # CloudEvents 1.0, structured mode
    ce = next(r for r in receiver.of("cloudevents") if r["body"]["data"]["event"] == "Promoted")
    assert ce["headers"]["content-type"] == "application/cloudevents+json"
    body = ce["body"]
    assert body["specversion"] == "1.0" and body["id"] == promoted["id"]
    assert body["type"] == "io.rtrl.rlcycle.promoted"
    assert body["source"] == f"/apis/rtrl.io/v1alpha1/namespaces/{ns}/rlcycles/{NAME}"
    assert body["subject"] == CKPT and body["datacontenttype"] == "application/json"
    # Slack: text only, and only the events asked for
    texts = [r["body"] for r in receiver.of("slack")]
    assert all(set(t) == {"text"} for t in texts)
    assert [t["text"].split(": ")[1] for t in texts] == ["AwaitingApproval", "Promoted"]
    assert texts[1]["text"] == f"rtrl {ns}/{NAME}: Promoted: {CKPT} now serves composer-vllm"

    # A receiver answering 500 is retried, then given up: a condition and an Event, and
    # the cycle went on regardless.
    kube_api.wait_for(
        lambda: condition(kube_api, "NotificationsDelivered").get("reason") == "DeliveryFailed",
        timeout=60,
        message=why,
    )
    assert len(receiver.of("broken")) == 5
    assert "HTTP 500" in condition(kube_api, "NotificationsDelivered")["message"]
    assert any(reason == "NotificationFailed" for _, reason, _ in events(kube_api))
    assert_token_nowhere(kube_api, operator)


def test_a_confirm_webhook_answering_403_holds_the_step_and_200_releases_it(
    kube_api: KubeAPI,
    job_runner: Kubelet,
    operator: OperatorProcess,
    receiver: Receiver,
    tmp_path: Path,
) -> None:
    script_all(job_runner, tmp_path, analyze=CONTINUE)
    receiver.answers["confirm"] = 403
    hooks_secret(kube_api, receiver)
    hook = {"urlSecret": {"name": "hooks", "key": "confirm"}, "interval": "1s"}
    setup_namespace(kube_api, tmp_path, rollout=rollout("webhook", confirmWebhook=hook))

    def why() -> str:
        return state(kube_api, operator)

    kube_api.wait_for(lambda: len(receiver.of("confirm")) >= 3, timeout=120, message=why)
    assert [r["weight"] for r in records(kube_api)] == [25]
    st = status(kube_api, "RLCycle", NAME)
    assert st["phase"] == "AwaitingApproval" and st["awaitingApproval"]["mode"] == "webhook"
    assert "HTTP 403" in condition(kube_api, "AwaitingApproval")["message"]
    question = receiver.of("confirm")[-1]["body"]
    assert question["name"] == NAME and question["gate"] == "step" and question["weight"] == 50
    receiver.answers["confirm"] = 200
    kube_api.wait_for(lambda: len(records(kube_api)) == 2, timeout=60, message=why)
    promote_from_now_on(job_runner, tmp_path / "results")
    wait_phase(kube_api, "Checkpoint", CKPT, "Promoted", timeout=120)
    assert [r["weight"] for r in records(kube_api)] == [25, 50]
    assert records(kube_api)[0]["approved"] == "confirm webhook answered 200"
    assert_token_nowhere(kube_api, operator)


def test_the_notifications_example_applies(
    controlplane: ControlPlane, release: str, namespace: str
) -> None:
    """examples/notifications/ (not applied with examples/: it replaces the quick start's
    RLCycle) is accepted by the API server and by rtrl validate."""
    for path in sorted((REPO / "examples" / "notifications").glob("*.yaml")):
        for doc in load_all(path.read_text()):
            if doc.get("kind") == "RLCycle":
                assert server_verdict(controlplane, namespace, doc) == "", path
                assert not validate_document(doc), path
