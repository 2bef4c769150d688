"""The chart's feedback service (``feedback.enabled``) and the serving image it runs:
rendered, validated, its secrets by reference, its selectors apart from the operator's."""

from __future__ import annotations

import json
import os
import re
from typing import Any

import yaml

from tests.conftest import REPO
from tests.contract.test_chart import CHART, Yaml12Loader, run_helm
from tests.contract.test_images import PYPROJECT, copied, instructions

ON = ["--set", "feedback.enabled=true", "--set", "feedback.events=s3://rtrl-events/c/",
      "--set", "feedback.tokenSecret=fb-tokens"]  # fmt: skip


def render(*args: str) -> list[dict[str, Any]]:
    out = run_helm("template", "rtrl", os.fspath(CHART), "--namespace", "rtrl-system", *args)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.load_all(out.stdout, Loader=Yaml12Loader) if d]


def feedback_objects(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {
        d["kind"]: d
        for d in docs
        if d["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "feedback"
    }


def test_off_by_default() -> None:
    assert feedback_objects(render()) == {}


def test_the_deployment_and_service() -> None:
    docs = render(*ON, "--set", "storage.credentialsSecret=s3-creds",
                  "--set", "storage.endpointUrl=https://s3.example.com")  # fmt: skip
    objects = feedback_objects(docs)
    assert set(objects) == {"Deployment", "Service"}
    deployment, service = objects["Deployment"], objects["Service"]
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == ["rtrl-feedback"]
    assert container["image"] == "ghcr.io/rtrl/rtrl-serving:0.1.0"
    env = {e["name"]: e for e in container["env"]}
    assert env["RTRL_FEEDBACK_EVENTS"]["value"] == "s3://rtrl-events/c/"
    assert env["RTRL_FEEDBACK_LISTEN"]["value"] == "0.0.0.0:8082"
    assert env["AWS_ENDPOINT_URL"]["value"] == "https://s3.example.com"
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "s3-creds"
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    # the tokens: the whole Secret mounted (no subPath: a rotation reaches the pod)
    token_file = env["RTRL_FEEDBACK_TOKEN_FILE"]["value"]
    mount = next(m for m in container["volumeMounts"] if m["name"] == "tokens")
    assert "subPath" not in mount and token_file.startswith(mount["mountPath"] + "/")
    volume = next(v for v in pod["volumes"] if v["name"] == "tokens")["secret"]
    assert volume["secretName"] == "fb-tokens"
    assert volume["items"] == [{"key": "tokens", "path": token_file.rpartition("/")[2]}]
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert pod["automountServiceAccountToken"] is False
    # its own selector: the operator's Service and budget never pick a feedback pod
    operator = next(d for d in docs if d["kind"] == "Deployment" and d is not deployment)
    own = deployment["spec"]["selector"]["matchLabels"]
    assert own == service["spec"]["selector"]
    theirs = operator["spec"]["selector"]["matchLabels"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert not all(pod_labels.get(k) == v for k, v in theirs.items())
    assert service["spec"]["ports"] == [
        {"name": "http", "port": 8082, "targetPort": "http", "protocol": "TCP"}
    ]


def test_credentials_of_its_own_win_over_the_operators() -> None:
    docs = render(*ON, "--set", "storage.credentialsSecret=s3-creds",
                  "--set", "feedback.credentialsSecret=fb-s3")  # fmt: skip
    container = feedback_objects(docs)["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"]["name"] for e in container["env"]
            if "valueFrom" in e and "secretKeyRef" in e["valueFrom"]}  # fmt: skip
    assert refs == {"AWS_ACCESS_KEY_ID": "fb-s3", "AWS_SECRET_ACCESS_KEY": "fb-s3"}


def test_required_values_are_named() -> None:
    for missing, says in (
        (["--set", "feedback.enabled=true", "--set", "feedback.tokenSecret=t"],
         "feedback.events: the events root URI"),
        (["--set", "feedback.enabled=true", "--set", "feedback.events=s3://bucket-x/e/"],
         "feedback.tokenSecret: the Secret holding the clients' bearer tokens"),
        ([*ON, "--set", "feedback.events=http://x"], "/feedback/events"),
        ([*ON, "--set", "feedback.replicas=0"], "/feedback/replicas"),
    ):  # fmt: skip
        out = run_helm("template", "rtrl", os.fspath(CHART), *missing)
        assert out.returncode != 0
        assert says in out.stderr, out.stderr


SERVING = REPO / "images" / "serving" / "Dockerfile"


def test_the_serving_image_has_no_entrypoint_and_runs_non_root() -> None:
    steps = instructions(SERVING)
    assert not [rest for word, rest in steps if word == "ENTRYPOINT"]
    users = [rest for word, rest in steps if word == "USER"]
    assert users and re.fullmatch(r"[1-9]\d*:[1-9]\d*", users[-1]), users
    installs = [rest for word, rest in steps if word == "RUN" and "pip install" in rest]
    assert installs and all('".[serving]"' in rest for rest in installs), installs
    assert {"src/rtrl/", "src/rtrl_serving/"} <= set(copied(SERVING))
    scripts = PYPROJECT["project"]["scripts"]
    assert scripts["rtrl-feedback"].startswith("rtrl_serving.")
    chart_command = json.dumps(["rtrl-feedback"])
    assert chart_command in json.dumps(
        feedback_objects(render(*ON))["Deployment"]["spec"]["template"]["spec"]["containers"][0][
            "command"
        ]
    )


def test_numeric_limits_render_as_the_integers_the_service_parses() -> None:
    """Helm reads values.yaml's numbers as floats: ``quote`` of 1048576 gave
    ``"1.048576e+06"``, which rtrl-feedback refuses, so its pod never started."""
    from rtrl_serving.feedback.cli import build_parser

    for extra in ([], ["--set", "feedback.maxBodyBytes=2097152", "--set", "feedback.maxEvents=50"]):
        (deployment,) = [d for k, d in feedback_objects(render(*ON, *extra)).items()
                         if k == "Deployment"]  # fmt: skip
        env = {e["name"]: e.get("value") for e in deployment["spec"]["template"]["spec"]
               ["containers"][0]["env"]}  # fmt: skip
        body, events = env["RTRL_FEEDBACK_MAX_BODY_BYTES"], env["RTRL_FEEDBACK_MAX_EVENTS"]
        assert re.fullmatch(r"[0-9]+", body) and re.fullmatch(r"[0-9]+", events), (body, events)
        # as the pod reads them: from its environment
        args = build_parser(environ={k: v for k, v in env.items() if v}).parse_args([])
        assert (args.max_body_bytes, args.max_events) == (
            (1048576, 1000) if not extra else (2097152, 50)
        )
