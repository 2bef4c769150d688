"""`rtrl validate`: the examples pass, every invalid example fails naming its field, and the
two validators (pydantic models, CRD schema + CEL) agree on every mutation of the examples
that a CRD can express."""

from __future__ import annotations

import copy
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from rtrl.manifests import validate_document, validate_with_crd, validate_with_models
from tests.conftest import REPO, console_script

EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
INVALID = sorted((REPO / "examples" / "invalid").glob("*.yaml"))


def _rtrl_validate(*files: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [console_script("rtrl"), "validate", *map(str, files)],
        capture_output=True,
        text=True,
        cwd=REPO,
    )


def _expectation(path: Path) -> str:
    match = re.search(r"^# expect: (.+)$", path.read_text(), re.MULTILINE)
    assert match, f"{path.name} lacks an '# expect: <field path>: <message>' line"
    return match.group(1).strip()


def test_examples_are_valid() -> None:
    out = _rtrl_validate(*(p.relative_to(REPO) for p in EXAMPLES))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "RLCycle/composer valid" in out.stdout
    assert "Checkpoint/composer-0 valid" in out.stdout
    assert "Deployment/composer-vllm skipped (not rtrl.io)" in out.stdout


def test_there_are_at_least_twelve_invalid_examples() -> None:
    assert len(INVALID) >= 12


@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.name)
def test_invalid_example_fails_naming_its_field(path: Path) -> None:
    out = _rtrl_validate(path.relative_to(REPO))
    assert out.returncode == 1
    lines = out.stdout.splitlines()
    expected = _expectation(path)
    relative = path.relative_to(REPO)
    assert any(line.startswith(f"{relative}: ") and f": {expected}" in line for line in lines), (
        f"expected a line with {expected!r}, got:\n{out.stdout}"
    )
    assert "1 of 1 file(s) invalid" in out.stderr


@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.name)
def test_both_validators_reject_each_invalid_example(path: Path) -> None:
    body = yaml.safe_load(path.read_text())
    assert validate_with_models(body), "the models accept it"
    assert validate_with_crd(body), "the CRD schema accepts it: the API server would too"


def test_secret_values_never_appear_in_errors() -> None:
    out = _rtrl_validate(REPO / "examples" / "invalid" / "inline-credentials.yaml")
    assert "example-not-a-secret" not in out.stdout + out.stderr
    assert "AKIAEXAMPLE" not in out.stdout + out.stderr


def test_one_line_per_error_with_file_object_and_path(tmp_path: Path) -> None:
    body = yaml.safe_load((REPO / "examples" / "rlcycle.yaml").read_text())
    body["spec"]["training"]["zeroStage"] = 7
    body["spec"]["rollout"]["steps"][0]["weight"] = 0
    del body["spec"]["data"]["shards"]
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump_all([body, {"apiVersion": "v1", "kind": "ConfigMap"}]))
    out = _rtrl_validate(bad, Path("examples/checkpoint-base.yaml"))
    assert out.returncode == 1
    assert sorted(out.stdout.splitlines()) == sorted(
        [
            f"{bad}: RLCycle/composer: spec.data.shards: required field is missing",
            f"{bad}: RLCycle/composer: spec.rollout.steps[0].weight: "
            "Input should be greater than or equal to 1",
            f"{bad}: RLCycle/composer: spec.training.zeroStage: "
            "Input should be less than or equal to 3",
            "examples/checkpoint-base.yaml: Checkpoint/composer-0 valid",
        ]
    )


def test_unreadable_and_non_yaml_files_are_reported(tmp_path: Path) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text("spec: [unclosed\n")
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing\n")
    out = _rtrl_validate(broken, empty, tmp_path / "missing.yaml")
    assert out.returncode == 1
    assert f"{broken}: not valid YAML" in out.stdout
    assert f"{empty}: no YAML documents in file" in out.stdout
    assert "missing.yaml: [Errno 2] No such file or directory" in out.stdout
    assert "3 of 3 file(s) invalid" in out.stderr


def test_unknown_rtrl_kind_is_rejected() -> None:
    problems = validate_document({"apiVersion": "rtrl.io/v1alpha1", "kind": "RLCycles"})
    assert [str(p) for p in problems] == [
        "kind: must be one of RLCycle, Checkpoint, got 'RLCycles'"
    ]


# --- the two validators agree -----------------------------------------------------------

Json = Any
_DELETE = object()


def _leaves(node: Json, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Json]]:
    yield path, node
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _leaves(value, (*path, key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _leaves(value, (*path, index))


def _set(body: Json, path: tuple[Any, ...], value: Json) -> Json:
    body = copy.deepcopy(body)
    node = body
    for part in path[:-1]:
        node = node[part]
    if value is _DELETE:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return body


def _wrong_values(value: Json) -> list[Json]:
    """Values of the wrong type or out of any plausible range for ``value``'s field."""
    if isinstance(value, bool):
        return ["yes", 1, None]
    if isinstance(value, int):
        return ["7", 1.5, -1, 10**9, True]
    if isinstance(value, float):
        return ["0.5", -1.0, 1e9, False]
    if isinstance(value, str):
        return [123, "", "UPPER case!", "x" * 2000, ["a"]]
    if isinstance(value, list):
        return [{}, "a", [], value * 20]
    if isinstance(value, dict):
        return [[], "a", {}, {**value, "unexpectedField": 1}]
    return []


def _mutations() -> Iterator[tuple[str, Json]]:
    for example in ("rlcycle.yaml", "checkpoint-base.yaml"):
        body = yaml.safe_load((REPO / "examples" / example).read_text())
        for path, value in _leaves(body["spec"], ("spec",)):
            label = ".".join(map(str, path))
            if len(path) > 1:
                yield f"{example}:{label}=<deleted>", _set(body, path, _DELETE)
            for i, wrong in enumerate(_wrong_values(value)):
                yield f"{example}:{label}=wrong{i}", _set(body, path, wrong)


def _handpicked() -> Iterator[tuple[str, Json]]:
    body = yaml.safe_load((REPO / "examples" / "rlcycle.yaml").read_text())
    cases = {
        "cron": (("spec", "schedule"), {"cron": "0 */5 * * *"}),
        "cron-and-interval": (("spec", "schedule"), {"cron": "@daily", "interval": "1h"}),
        "no-schedule": (("spec", "schedule"), {}),
        "cron-6-fields": (("spec", "schedule"), {"cron": "0 0 * * * *"}),
        "cron-names": (("spec", "schedule"), {"cron": "0 9 * jan-mar MON-FRI"}),
        "cron-step-0": (("spec", "schedule"), {"cron": "*/0 * * * *"}),
        "interval-0": (("spec", "schedule"), {"interval": "0s"}),
        "interval-compound": (("spec", "schedule"), {"interval": "1h30m"}),
        "steps-equal": (
            ("spec", "rollout", "steps"),
            [{"weight": 5, "minDuration": "1m"}, {"weight": 5, "minDuration": "1m"}],
        ),
        "steps-11": (
            ("spec", "rollout", "steps"),
            [{"weight": w, "minDuration": "1m"} for w in range(1, 12)],
        ),
        "steps-100": (("spec", "rollout", "steps"), [{"weight": 100, "minDuration": "1m"}]),
        "gatewayapi": (
            ("spec", "rollout", "router"),
            "gatewayapi",
        ),
        "gate-other-suite": (
            ("spec", "eval", "gates"),
            [{"metric": "behaviour.edit_rate", "maxRegression": 0.1}],
        ),
        "suites-duplicate": (("spec", "eval", "suites"), ["tasks", "tasks"]),
        "reward-zero": (
            ("spec", "reward"),
            {"editPersisted": 0, "dissatisfiedFollowup": 0, "latency": 0, "invalidToolCall": 0},
        ),
        "reward-only-clarification": (
            ("spec", "reward"),
            {
                "editPersisted": 0,
                "dissatisfiedFollowup": 0,
                "latency": 0.0,
                "invalidToolCall": 0,
                "askedClarification": -1,
            },
        ),
        "band-empty": (("spec", "rollout", "guardrails", "editRate"), {}),
        "sa-and-secret": (("spec", "storage", "serviceAccountName"), "rtrl-jobs"),
        "sa-only": (
            ("spec", "storage"),
            {"artifacts": "s3://rtrl-artifacts/x/", "serviceAccountName": "rtrl-jobs"},
        ),
        "file-uri": (("spec", "data", "shards"), "file:///var/lib/rtrl/shards/"),
        "s3-bucket-upper": (("spec", "data", "shards"), "s3://Interactions/x/"),
        "name-41": (("metadata", "name"), "a" * 41),
        "name-40": (("metadata", "name"), "a" * 40),
        "integer-as-float": (("spec", "training", "nodes"), 2.0),
        "float-as-integer": (("spec", "training", "learningRate"), 1),
        "status-ok": (("status",), {"phase": "Canary", "cycle": 3, "canaryWeight": 25}),
        "status-bad-phase": (("status",), {"phase": "Exploding"}),
        "status-condition": (
            ("status",),
            {
                "conditions": [
                    {
                        "type": "Ready",
                        "status": "True",
                        "reason": "Serving",
                        "lastTransitionTime": "2026-11-29T10:00:00Z",
                    }
                ]
            },
        ),
        "status-condition-bad-time": (
            ("status",),
            {
                "conditions": [
                    {
                        "type": "Ready",
                        "status": "True",
                        "reason": "Serving",
                        "lastTransitionTime": "yesterday",
                    }
                ]
            },
        ),
    }
    for label, (path, value) in cases.items():
        yield label, _set(body, path, value)


MUTATIONS = list(_mutations()) + list(_handpicked())


def test_there_are_many_mutations() -> None:
    assert len(MUTATIONS) > 300


@pytest.mark.parametrize(("label", "body"), MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_models_and_crd_agree(label: str, body: Json) -> None:
    models = validate_with_models(body)
    crd = validate_with_crd(body)
    assert bool(models) == bool(crd), f"models: {models}\ncrd: {crd}"


# Rules the CRD cannot express (docs/validation.md lists them); the operator reports them
# with the InvalidSpec condition.
MODEL_ONLY = {
    "cron-reversed-range": (("spec", "schedule"), {"cron": "30-10 * * * *"}),
    "steps-longer-than-max-duration": (("spec", "rollout", "analysis", "maxDuration"), "1h"),
}


@pytest.mark.parametrize("label", sorted(MODEL_ONLY))
def test_documented_model_only_rules(label: str) -> None:
    path, value = MODEL_ONLY[label]
    body = _set(yaml.safe_load((REPO / "examples" / "rlcycle.yaml").read_text()), path, value)
    assert validate_with_models(body)
    assert not validate_with_crd(body)
    assert label in (REPO / "docs" / "validation.md").read_text()


def test_every_cel_rule_rejects_something() -> None:
    """No CEL rule is vacuous: each one is what rejects at least one tested manifest."""
    from rtrl.api import RESOURCES
    from rtrl.api.common import CEL_KEY
    from rtrl.crdgen import openapi_schema

    messages = set()
    for resource in RESOURCES.values():
        stack = [openapi_schema(resource)]
        while stack:
            node = stack.pop()
            messages.update(rule["message"] for rule in node.get(CEL_KEY, []))
            stack.extend(node.get("properties", {}).values())
            stack.extend(n for n in (node.get("items"), node.get("additionalProperties")) if n)
    bodies = [yaml.safe_load(p.read_text()) for p in INVALID] + [b for _, b in MUTATIONS]
    triggered = {p.message for body in bodies for p in validate_with_crd(body)}
    assert messages - triggered == set()


def test_yaml_is_read_as_kubernetes_reads_it(tmp_path: Path) -> None:
    """``1e-6`` is a number to kubectl (YAML 1.2), a string to plain PyYAML (YAML 1.1)."""
    text = (REPO / "examples" / "rlcycle.yaml").read_text()
    assert "learningRate: 1.0e-6" in text
    manifest = tmp_path / "rlcycle.yaml"
    manifest.write_text(text.replace("learningRate: 1.0e-6", "learningRate: 1e-6"))
    out = _rtrl_validate(manifest)
    assert out.returncode == 0, out.stdout
