"""`rtrl validate`: the examples pass, every invalid example fails naming its field, and the
two validators (pydantic models, CRD schema + CEL) agree on every mutation of the examples
that a CRD can express."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from rtrl.validation import validate_document, validate_with_crd, validate_with_models
from tests.conftest import REPO, console_script
from tests.contract.mutants import MODEL_ONLY, MUTATIONS, Json, set_at

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


@pytest.fixture(scope="module")
def invalid_run() -> subprocess.CompletedProcess[str]:
    """One ``rtrl validate`` of every invalid example (as CI would run it on a directory)."""
    return _rtrl_validate(*(p.relative_to(REPO) for p in INVALID))


def test_every_invalid_example_fails(invalid_run: subprocess.CompletedProcess[str]) -> None:
    assert invalid_run.returncode == 1
    assert f"{len(INVALID)} of {len(INVALID)} file(s) invalid" in invalid_run.stderr


@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.name)
def test_invalid_example_fails_naming_its_field(
    path: Path, invalid_run: subprocess.CompletedProcess[str]
) -> None:
    lines = invalid_run.stdout.splitlines()
    expected = _expectation(path)
    relative = path.relative_to(REPO)
    assert any(line.startswith(f"{relative}: ") and f": {expected}" in line for line in lines), (
        f"expected a line with {expected!r}, got:\n{invalid_run.stdout}"
    )


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


def test_there_are_many_mutations() -> None:
    assert len(MUTATIONS) > 300


@pytest.mark.parametrize(("label", "body"), MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_models_and_crd_agree(label: str, body: Json) -> None:
    models = validate_with_models(body)
    crd = validate_with_crd(body)
    assert bool(models) == bool(crd), f"models: {models}\ncrd: {crd}"


@pytest.mark.parametrize("label", sorted(MODEL_ONLY))
def test_documented_model_only_rules(label: str) -> None:
    path, value = MODEL_ONLY[label]
    body = set_at(yaml.safe_load((REPO / "examples" / "rlcycle.yaml").read_text()), path, value)
    assert validate_with_models(body)
    assert not validate_with_crd(body)
    assert label in (REPO / "docs" / "validation.md").read_text()


def test_every_cel_rule_rejects_something() -> None:
    """No CEL rule is vacuous: each one is what rejects at least one tested manifest."""
    from rtrl.core.api import RESOURCES
    from rtrl.core.api.common import CEL_KEY
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
