"""The real API server and ``rtrl validate`` judge manifests alike: every example applies,
every file in examples/invalid/ and every generated mutant of the examples gets the same
verdict from both, except the rules docs/validation.md lists as the operator's alone. And
``kubectl get`` shows the printer columns as a platform engineer reads them."""

from __future__ import annotations

import json
import subprocess
import urllib.error
import urllib.parse
from pathlib import Path
from typing import Any

import pytest
import yaml

from rtrl.core.api.yamlfile import load, load_all
from rtrl.validation import validate_document
from rtrl_localkube.controlplane import ControlPlane
from rtrl_localkube.tools import Cli
from tests.conftest import REPO, console_script
from tests.contract.mutants import MODEL_ONLY, MUTATIONS, set_at

pytestmark = pytest.mark.timeout(300)

EXAMPLES = REPO / "examples"
INVALID = sorted((EXAMPLES / "invalid").glob("*.yaml"))
PLURALS = {"RLCycle": "rlcycles", "Checkpoint": "checkpoints"}


def server_verdict(cp: ControlPlane, namespace: str, body: dict[str, Any]) -> str:
    """Empty when the API server accepts ``body`` (created with dry run, strict field
    validation, as kubectl does), else its message. A status is judged as the operator
    writes it, through the status subresource (a create ignores it)."""
    body = json.loads(json.dumps(body))
    status = body.pop("status", None)
    kind = body.get("kind")
    plural = PLURALS.get(kind) if isinstance(kind, str) else None
    if plural is None or body.get("apiVersion") != "rtrl.io/v1alpha1":
        return f"no such kind: {body.get('apiVersion')}/{kind}"
    if isinstance(body.get("metadata"), dict):
        body["metadata"].pop("namespace", None)
    base = f"/apis/rtrl.io/v1alpha1/namespaces/{namespace}/{plural}"
    query = urllib.parse.urlencode({"dryRun": "All", "fieldValidation": "Strict"})
    try:
        if status is None:
            cp.request("POST", f"{base}?{query}", body)
            return ""
        # a status is only ever written to an object that exists
        created = cp.request("POST", base, body)
        name = created["metadata"]["name"]
        try:
            cp.request(
                "PATCH",
                f"{base}/{name}/status?{query}",
                {"status": status},
                content_type="application/merge-patch+json",
            )
        finally:
            cp.request("DELETE", f"{base}/{name}")
        return ""
    except urllib.error.HTTPError as exc:
        answer = json.loads(exc.read() or b"{}")
        return str(answer.get("message") or exc)


def test_every_example_applies(admin: Cli, release: str) -> None:
    """The quick start's one command: the examples are complete (namespace and Secret
    included, the namespace first by file name) and the server accepts every one."""
    try:
        out = admin.kubectl("apply", "-f", "examples/").stdout
        assert "namespace/ml-serving" in out, out
        assert "secret/s3-creds created" in out, out
        assert "rlcycle.rtrl.io/composer created" in out, out
        assert "checkpoint.rtrl.io/composer-0 created" in out, out
        assert "deployment.apps/composer-vllm created" in out, out
    finally:
        admin.kubectl("delete", "-f", "examples/", "--wait=false", check=False)


@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.name)
def test_invalid_examples_are_rejected_by_both(
    path: Path, controlplane: ControlPlane, release: str, namespace: str
) -> None:
    verdicts = [server_verdict(controlplane, namespace, doc) for doc in load_all(path.read_text())]
    offline = subprocess.run([console_script("rtrl"), "validate", str(path)], capture_output=True)
    assert offline.returncode == 1
    assert any(verdicts), f"the API server accepts {path.name}, rtrl validate rejects it"


def test_mutants_get_the_same_verdict_from_the_server_and_rtrl_validate(
    controlplane: ControlPlane, release: str, namespace: str
) -> None:
    disagree = []
    for label, body in MUTATIONS:
        server = server_verdict(controlplane, namespace, body)
        offline = validate_document(body)
        if bool(server) != bool(offline):
            problems = "; ".join(map(str, offline))
            disagree.append(f"{label}: server: {server or 'accepted'}; rtrl: {problems or 'valid'}")
    assert not disagree, f"{len(disagree)} of {len(MUTATIONS)} differ:\n" + "\n".join(disagree)


@pytest.mark.parametrize("label", sorted(MODEL_ONLY))
def test_operator_only_rules_are_accepted_by_the_server_and_documented(
    label: str, controlplane: ControlPlane, release: str, namespace: str
) -> None:
    path, value = MODEL_ONLY[label]
    body = set_at(load((EXAMPLES / "rlcycle.yaml").read_text()), path, value)
    assert server_verdict(controlplane, namespace, body) == ""
    assert validate_document(body)
    assert label in (REPO / "docs" / "validation.md").read_text()


def test_names_the_operator_cannot_use_are_rejected_by_the_server(
    controlplane: ControlPlane, release: str, namespace: str
) -> None:
    """Child Jobs, Services and Checkpoints derive their names from the RLCycle's: a name
    with a dot or over 40 characters would be accepted and then fail every cycle."""
    body = load((EXAMPLES / "rlcycle.yaml").read_text())
    for name in ("composer.v2", "c" * 41):
        rejected = server_verdict(controlplane, namespace, set_at(body, ("metadata", "name"), name))
        assert "metadata.name" in rejected, rejected
        assert validate_document(set_at(body, ("metadata", "name"), name))
    longest = set_at(body, ("metadata", "name"), "c" * 40)
    assert server_verdict(controlplane, namespace, longest) == ""


def test_integral_floats_are_integers_to_both(
    controlplane: ControlPlane, release: str, namespace: str
) -> None:
    """``8.0`` is the integer 8 to the API server (it stores 8); ``8.5`` is not an integer."""
    body = load((EXAMPLES / "rlcycle.yaml").read_text())
    whole = set_at(set_at(body, ("spec", "training", "gpusPerNode"), 8.0),
                   ("spec", "data", "minInteractions"), 200000.0)  # fmt: skip
    assert server_verdict(controlplane, namespace, whole) == ""
    assert validate_document(whole) == []
    half = set_at(body, ("spec", "training", "gpusPerNode"), 8.5)
    assert server_verdict(controlplane, namespace, half)
    assert validate_document(half)


def test_printer_columns_read_by_kubectl(admin: Cli, release: str, namespace: str) -> None:
    body = load((EXAMPLES / "rlcycle.yaml").read_text())
    body["metadata"]["namespace"] = namespace
    admin.kubectl("create", "-f", "-", input=yaml.safe_dump(body))
    status = {"phase": "Canary", "serving": "composer-41", "candidate": "composer-42",
              "canaryWeight": 25, "cycle": 42, "nextRun": "2099-01-01T00:00:00Z"}  # fmt: skip
    admin.kubectl("patch", "rlc", "composer", "-n", namespace, "--subresource=status",
                  "--type=merge", "-p", json.dumps({"status": status}))  # fmt: skip
    header, row = admin.kubectl("get", "rlc", "-n", namespace).stdout.splitlines()
    assert header.split() == ["NAME", "PHASE", "SERVING", "CANDIDATE", "CANARY", "CYCLE",
                              "NEXT", "RUN", "AGE"]  # fmt: skip
    cells = row.split()
    assert cells[:6] == ["composer", "Canary", "composer-41", "composer-42", "25", "42"]
    assert cells[6] == "2099-01-01T00:00:00Z", row  # a future time, not "<invalid>"


def test_kubectl_get_ckpt_shows_the_last_canary_decision(
    admin: Cli, release: str, namespace: str
) -> None:
    """The Decision column is a JSONPath the real server evaluates (`[-1:]`, the last
    rollout record), empty before any canary step."""
    ckpt = load((EXAMPLES / "checkpoint-base.yaml").read_text())
    ckpt["metadata"]["namespace"] = namespace
    admin.kubectl("apply", "-f", "-", input=json.dumps(ckpt))
    name = ckpt["metadata"]["name"]
    table = admin.kubectl("get", "ckpt", name, "-n", namespace).stdout.splitlines()
    assert table[0].split()[:6] == ["NAME", "PHASE", "CYCLE", "PARENT", "EVAL", "DECISION"]
    assert "promote" not in table[1]
    steps = [
        {"weight": 10, "startedAt": "2026-01-01T00:00:00Z", "decision": "continue"},
        {"weight": 50, "startedAt": "2026-01-01T01:00:00Z", "decision": "promote"},
    ]
    admin.kubectl(
        "patch", "ckpt", name, "-n", namespace, "--subresource=status", "--type=merge",
        "-p", json.dumps({"status": {"phase": "Promoted", "rollout": steps}}),
    )  # fmt: skip
    row = admin.kubectl("get", "ckpt", name, "-n", namespace).stdout.splitlines()[1].split()
    assert row[1] == "Promoted" and "promote" in row, row
