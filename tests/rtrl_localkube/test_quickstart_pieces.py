"""The quick start's pieces that run without a cluster or an engine (CI runs these; the
whole command runs by hand: tests/e2e/test_quickstart_command.py): the manifests it
applies are the examples changed only where this machine differs and valid as the API
server and the operator judge them; its users' verdicts and the feedback they post are
what the feedback service takes; its directory handling never empties a directory it did
not make, nor one a live run uses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from rtrl.core.api.rlcycle import RLCycle
from rtrl.core.events import new_interaction_id
from rtrl_localkube import quickstart_manifests as qm
from rtrl_localkube.quickstart_machine import MARKER, PID_FILE, QuickstartError, claim
from rtrl_localkube.quickstart_users import Served, Users, good_answer
from rtrl_localkube.tinymodel import CASE
from rtrl_serving.feedback.events import Limits, RequestProblemsError, parse_request
from tests.conftest import REPO

ENDPOINT = "http://127.0.0.1:45678"


def docs() -> dict[str, dict[str, Any]]:
    return qm.manifests(ENDPOINT, "key-id", "key-secret")


def test_the_rlcycle_is_valid_and_made_for_minutes_on_two_cpus() -> None:
    doc = docs()["rlcycle.yaml"]
    spec = RLCycle.model_validate(doc).spec
    assert spec.suspend is True  # lifted once the replayed hour is sealed
    assert spec.capture is not None and spec.capture.events == qm.EVENTS
    assert spec.capture.seal.schedule == "* * * * *"
    assert spec.data.shards == qm.SHARDS and spec.storage.endpoint == ENDPOINT
    assert spec.training.nodes == 1 and spec.training.gpus_per_node == 0
    assert spec.rollout.analysis.inconclusive == "rollback"
    # what the example names, kept: the target, the credentials Secret, the artifacts
    example = yaml.safe_load((REPO / "examples" / "rlcycle.yaml").read_text())
    assert doc["metadata"] == example["metadata"]
    assert doc["spec"]["target"] == example["spec"]["target"]
    assert doc["spec"]["storage"]["credentialsSecret"] == "s3-creds"
    assert doc["spec"]["storage"]["artifacts"] == example["spec"]["storage"]["artifacts"]


def test_the_rlcycle_passes_rtrl_validate_as_a_user_runs_it(tmp_path: Path) -> None:
    for name, doc in docs().items():
        (tmp_path / name).write_text(yaml.safe_dump(doc, sort_keys=False))
    rtrl = Path(sys.executable).parent / "rtrl"
    result = subprocess.run(
        [os.fspath(rtrl), "validate", *sorted(map(os.fspath, tmp_path.iterdir()))],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_deployment_and_service_are_the_examples_for_one_cpu() -> None:
    manifests = docs()
    (container,) = manifests["inference-deployment.yaml"]["spec"]["template"]["spec"]["containers"]
    example = yaml.safe_load((REPO / "examples" / "inference-deployment.yaml").read_text())
    (original,) = example["spec"]["template"]["spec"]["containers"]
    assert container["image"] == original["image"] and container["command"] == original["command"]
    assert "resources" not in container  # no GPU here: the pod would stay Pending
    for flag in original["args"]:
        if not flag.startswith("--tensor-parallel-size"):
            assert flag in container["args"]
    assert "--tool-call-parser=hermes" in container["args"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["AWS_ENDPOINT_URL"] == ENDPOINT and env["MODEL_URI"] == qm.MODEL_URI
    assert env["RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING"] == "0"
    # the Service sends every request through the capture sidecar
    (port,) = manifests["inference-service.yaml"]["spec"]["ports"]
    assert port["targetPort"] == "rtrl-capture"
    secret = manifests["01-s3-secret.yaml"]
    assert secret["stringData"] == {"AWS_ACCESS_KEY_ID": "key-id",
                                    "AWS_SECRET_ACCESS_KEY": "key-secret"}  # fmt: skip
    assert tuple(manifests) == qm.FILES == tuple(sorted(qm.FILES))  # kubectl apply's order


def message(content: str | None = None, calls: list[tuple[str, str]] = ()) -> Any:  # type: ignore[assignment]
    tool_calls = [SimpleNamespace(function=SimpleNamespace(name=n, arguments=a)) for n, a in calls]
    return SimpleNamespace(content=content, tool_calls=tool_calls)


def test_a_user_keeps_only_the_tasks_answer() -> None:
    text, tool = CASE["text"], CASE["tool_call"]
    assert good_answer(text, message(text.answer))
    assert not good_answer(text, message(text.answer + " "))
    assert good_answer(tool, message(None, [("run_tests", '{"path": "tests/test_math.py"}')]))
    assert not good_answer(tool, message(None, [("run_tests", '{"path": 7}')]))
    assert not good_answer(tool, message(None, [("run_tests", '{"path": ')]))
    assert not good_answer(tool, message(tool.answer))  # the call left unparsed in the text
    assert not good_answer(CASE["tool_call_invalid_arguments"], message("anything"))


def test_the_feedback_users_post_is_what_the_service_accepts() -> None:
    """Replayed and live verdicts, through the feedback service's own parser: every event
    valid, observed when the user would have, ids stable across retries."""
    now = datetime.now(UTC)
    users = Users(lambda: [], "", "token")
    past = now - timedelta(hours=3)
    replayed = Served(new_interaction_id(past), past, "text", good=True, replayed=True)
    live = Served(new_interaction_id(now), now, "tool_call", good=False, replayed=False)
    events = users.events(replayed, now) + users.events(live, now)
    parsed = parse_request(json.dumps({"events": events}).encode(), now=now, limits=Limits())
    by_id = {e.event_id: e for e in parsed}
    assert len(by_id) == 4
    edit = by_id[f"{replayed.interaction_id}-edit"]
    assert edit.signal == "edit_persisted" and edit.value == 1.0
    assert edit.observed_at == past + timedelta(hours=1)  # when the edit's fate is known
    followup = by_id[f"{live.interaction_id}-followup"]
    assert followup.value == 1.0 and abs(followup.observed_at - now) < timedelta(seconds=1)
    assert users.events(replayed, now + timedelta(minutes=5)) == users.events(replayed, now)


def test_a_verdict_observed_before_its_answer_was_served_is_refused() -> None:
    """The guard the replay's timing relies on: the service refuses feedback observed
    before the interaction was served, so the replayed hour must be the one stamped."""
    now = datetime.now(UTC)
    served = now - timedelta(hours=3)
    event = Users(lambda: [], "", "t").events(
        Served(new_interaction_id(served), served, "text", good=True, replayed=True), now
    )[0]
    event["observed_at"] = (served - timedelta(hours=1)).isoformat()
    with pytest.raises(RequestProblemsError, match="observed_at"):
        parse_request(json.dumps({"events": [event]}).encode(), now=now, limits=Limits())


def test_the_directory_is_claimed_only_when_it_is_a_quickstarts(tmp_path: Path) -> None:
    mine = tmp_path / "qs"
    claim(mine)
    assert (mine / MARKER).exists() and (mine / PID_FILE).read_text().strip() == str(os.getpid())
    # a live run (this process) holds it
    with pytest.raises(QuickstartError, match="already runs"):
        claim(mine)
    # a dead run's files go
    (mine / PID_FILE).write_text("999999999\n")
    (mine / "old.log").write_text("x")
    claim(mine)
    assert not (mine / "old.log").exists()
    # someone else's directory is never emptied
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "thesis.tex").write_text("keep")
    with pytest.raises(QuickstartError, match="not a quick start's"):
        claim(theirs)
    assert (theirs / "thesis.tex").read_text() == "keep"


def test_live_users_go_on_through_failures_and_stop_when_told() -> None:
    """A Service with no ready endpoint (a pod rolling) fails requests: they are counted
    and the users go on asking until stopped."""
    import threading

    stop = threading.Event()
    users = Users(lambda: [], "", "t")
    posted: list[list[Served]] = []
    thread = threading.Thread(target=users.keep_asking, args=(stop, posted.append),
                              kwargs={"every": 0.01})  # fmt: skip
    thread.start()
    deadline = datetime.now(UTC) + timedelta(seconds=10)
    while users.failures < 3 and datetime.now(UTC) < deadline:
        stop.wait(0.01)
    stop.set()
    thread.join(5)
    assert not thread.is_alive() and users.failures >= 3 and posted == []


def test_the_admins_policy_it_installs_allows_the_rlcycle_and_no_more() -> None:
    """The tenancy policy (chart values) lets the operator run what the quick start's
    RLCycle asks for, judged as the operator judges it; another image or endpoint is
    still refused."""
    from rtrl.core.api.policy import TenancyPolicy
    from rtrl.planning.observed import SecretState
    from rtrl.planning.tenancy import policy_problem

    policy = TenancyPolicy.model_validate(qm.policy_values(ENDPOINT)["policy"])
    manifests = docs()
    spec = RLCycle.model_validate(manifests["rlcycle.yaml"]).spec
    labels = manifests["01-s3-secret.yaml"]["metadata"]["labels"]
    assert policy_problem(spec, policy, SecretState(found=True, labels=labels)) == ("", "")
    other = manifests["rlcycle.yaml"]
    other["spec"]["training"]["image"] = "evil.example.com/miner:1"
    reason, _ = policy_problem(RLCycle.model_validate(other).spec, policy, SecretState(True))
    assert reason == "ImageNotAllowed"
    other = qm.rlcycle("http://169.254.169.254")
    reason, _ = policy_problem(RLCycle.model_validate(other).spec, policy, SecretState(True))
    assert reason == "EndpointNotAllowed"
