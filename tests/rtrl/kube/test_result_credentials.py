"""Which credentials the operator reads an RLCycle's step results with, and where (issue 32:
``spec.storage.endpoint`` pointed at a listener received the operator's own S3 key,
``Credential=AKIA...``, in the signature of every result read).

A real HTTP listener stands for the endpoint a spec names and records the Authorization
header of every request; the operator's own key is in its environment, as the chart puts
it there. The reads: with the RLCycle's own credentials (its credentialsSecret) wherever
it points; with the operator's identity only at its own endpoint or one the admin allows;
otherwise not at all. (tests/e2e/test_tenancy.py shows the same through the running
operator on the real control plane.)"""

from __future__ import annotations

import base64
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from rtrl.core.api.policy import TenancyPolicy
from rtrl.core.store import read_committed_json
from rtrl.kube.observe import read_secret, result_credentials

OPERATOR_KEY = "AKIAOPERATOROWNKEY1"
RLCYCLE_KEY = "AKIARLCYCLEOWNKEY22"


class Listener:
    def __init__(self) -> None:
        self.authorizations: list[str] = []
        listener = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                listener.authorizations.append(self.headers.get("Authorization") or "")
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_HEAD = do_GET  # noqa: N815

            def log_message(self, *args: Any) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.http.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"


@pytest.fixture
def listener(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> Iterator[Listener]:
    for name in ("AWS_ENDPOINT_URL", "AWS_PROFILE", "RTRL_STORAGE_CREDENTIALS_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", OPERATOR_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "operator-secret")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    server = Listener()
    yield server
    server.http.shutdown()
    server.http.server_close()


class Secrets:
    """The Kubernetes client as read_secret uses it: the RLCycle's credentials Secret."""

    def __init__(self, data: dict[str, str], labels: dict[str, str] | None = None) -> None:
        encoded = {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}
        self.secret = {"metadata": {"name": "s3", "labels": labels or {}}, "data": encoded}

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return self.secret if (kind, name) == ("Secret", "s3") else None


OWN = {"AWS_ACCESS_KEY_ID": RLCYCLE_KEY, "AWS_SECRET_ACCESS_KEY": "rlcycle-private-value"}
RESULT = "s3://artifacts/composer/composer-1/stage/stage.json"


def read(storage: dict[str, Any], secret: Any, policy: TenancyPolicy) -> bool:
    """What observe does for one result: whether it read it (with what it reads it)."""
    readable, credentials = result_credentials(storage, secret, policy)
    if readable:
        read_committed_json(RESULT, endpoint_url=storage.get("endpoint"), credentials=credentials)
    return readable


def test_the_rlcycles_own_credentials_go_to_its_endpoint(listener: Listener) -> None:
    storage = {"endpoint": listener.url, "credentialsSecret": "s3"}
    secret = read_secret(Secrets(OWN), "ml", "s3")  # type: ignore[arg-type]
    assert read(storage, secret, TenancyPolicy(endpoints=[listener.url]))
    assert listener.authorizations, "no request reached the endpoint"
    for header in listener.authorizations:
        assert f"Credential={RLCYCLE_KEY}/" in header, header
        assert OPERATOR_KEY not in header


def test_the_operators_key_never_goes_to_an_endpoint_the_admin_did_not_allow(
    listener: Listener,
) -> None:
    """Before: every result read of such an RLCycle was signed with the operator's key."""
    storage = {"endpoint": listener.url, "serviceAccountName": "role"}
    assert not read(storage, None, TenancyPolicy())
    assert listener.authorizations == []
    # with a credentials Secret too: an endpoint the admin did not allow is not read at all
    secret = read_secret(Secrets(OWN), "ml", "s3")  # type: ignore[arg-type]
    assert not read({**storage, "credentialsSecret": "s3"}, secret, TenancyPolicy())
    assert listener.authorizations == []


def test_an_endpoint_the_admin_allows_is_read_with_the_operators_identity(
    listener: Listener,
) -> None:
    storage = {"endpoint": listener.url + "/"}
    assert read(storage, None, TenancyPolicy(endpoints=[listener.url]))
    assert all(f"Credential={OPERATOR_KEY}/" in h for h in listener.authorizations)


def test_a_secret_without_both_keys_reads_nothing(listener: Listener) -> None:
    storage = {"endpoint": listener.url, "credentialsSecret": "s3"}
    secret = read_secret(Secrets({"AWS_ACCESS_KEY_ID": RLCYCLE_KEY}), "ml", "s3")  # type: ignore[arg-type]
    assert secret[0].missing_keys == ("AWS_SECRET_ACCESS_KEY",)
    assert not read(storage, secret, TenancyPolicy(endpoints=["*"]))
    assert listener.authorizations == []


def test_the_secret_state_carries_its_labels_never_its_values() -> None:
    state, credentials = read_secret(Secrets(OWN, {"rtrl.io/rlcycle-secret": "true"}), "ml", "s3")  # type: ignore[arg-type]
    assert state.labels == {"rtrl.io/rlcycle-secret": "true"}
    assert credentials is not None and RLCYCLE_KEY not in repr(credentials)
    assert "private-value" not in repr(state) + repr(credentials)
