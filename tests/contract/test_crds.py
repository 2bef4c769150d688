"""The committed CRDs are exactly what the API types generate, and they are CRDs the API
server accepts: structural schemas, valid defaults, compilable CEL, resolvable columns."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import pytest
import yaml

from rtrl.core.api import RESOURCES
from rtrl.core.api.common import CEL_KEY
from rtrl.crdgen import crd, crd_files, drifted, openapi_schema
from rtrl.validation import validate_document, validate_with_crd
from tests.conftest import REPO, console_script

CRDS = REPO / "crds"


def _nodes(schema: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    out = [(path or ".", schema)]
    for name, sub in schema.get("properties", {}).items():
        out += _nodes(sub, f"{path}.{name}")
    if isinstance(schema.get("additionalProperties"), dict):
        out += _nodes(schema["additionalProperties"], f"{path}.*")
    if "items" in schema:
        out += _nodes(schema["items"], f"{path}[]")
    return out


def test_committed_crds_match_the_types() -> None:
    assert drifted(CRDS) == [], "crds/ drifted from src/rtrl/core/api: run `make crds`"
    assert sorted(p.name for p in CRDS.glob("*.yaml")) == sorted(crd_files())


def test_rtrl_crds_regenerates_byte_identical_files(tmp_path: Path) -> None:
    rtrl = console_script("rtrl")
    subprocess.run([rtrl, "crds", "--out", str(tmp_path)], check=True, capture_output=True)
    first = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    out = subprocess.run(
        [rtrl, "crds", "--out", str(tmp_path)], check=True, capture_output=True, text=True
    )
    assert "up to date" in out.stdout
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == first
    assert first == {p.name: p.read_bytes() for p in CRDS.glob("*.yaml")}


def test_rtrl_crds_check_reports_drift(tmp_path: Path) -> None:
    rtrl = console_script("rtrl")
    subprocess.run([rtrl, "crds", "--out", str(tmp_path)], check=True, capture_output=True)
    target = tmp_path / "rlcycles.rtrl.io.yaml"
    target.write_text(target.read_text().replace("shortNames:\n    - rlc", "shortNames:\n    - rl"))
    out = subprocess.run([rtrl, "crds", "--check", "--out", str(tmp_path)], capture_output=True)
    assert out.returncode == 1
    assert b"rlcycles.rtrl.io.yaml: differs" in out.stderr


@pytest.mark.parametrize("kind", sorted(RESOURCES))
def test_names_scope_and_subresources(kind: str) -> None:
    resource = RESOURCES[kind]
    doc = yaml.safe_load((CRDS / f"{resource.crd_name}.yaml").read_text())
    assert doc["apiVersion"] == "apiextensions.k8s.io/v1"
    spec = doc["spec"]
    assert spec["group"] == "rtrl.io"
    assert spec["scope"] == "Namespaced"
    assert spec["names"]["categories"] == ["rtrl"]
    assert spec["names"]["shortNames"] == {"RLCycle": ["rlc"], "Checkpoint": ["ckpt"]}[kind]
    (version,) = spec["versions"]
    assert version["name"] == "v1alpha1" and version["served"] and version["storage"]
    assert version["subresources"] == {"status": {}}


def test_printer_columns_tell_the_state_at_a_glance() -> None:
    def columns(kind: str) -> list[str]:
        version = crd(RESOURCES[kind])["spec"]["versions"][0]
        return [c["name"] for c in version["additionalPrinterColumns"] if not c.get("priority")]

    assert columns("RLCycle") == [
        "Phase", "Serving", "Candidate", "Canary", "Cycle", "Next Run", "Age"
    ]  # fmt: skip
    assert columns("Checkpoint") == ["Phase", "Cycle", "Parent", "Eval", "Decision", "Age"]


@pytest.mark.parametrize("kind", sorted(RESOURCES))
def test_printer_columns_point_at_real_fields(kind: str) -> None:
    resource = RESOURCES[kind]
    schema = openapi_schema(resource)
    for column in resource.columns:
        node: dict[str, Any] = schema
        parts = column.json_path.strip(".").split(".")
        if parts[0] == "metadata":
            continue
        for part in parts:
            field, indexed = part.removesuffix("[-1:]"), part.endswith("[-1:]")
            assert field in node.get("properties", {}), f"{column.name}: {column.json_path}"
            node = node["properties"][field]
            if indexed:  # the last item of a list
                assert node["type"] == "array", column.name
                node = node["items"]
        expected = {"integer": "integer", "string": "string", "date": "string"}[column.type]
        assert node["type"] == expected, column.name


@pytest.mark.parametrize("kind", sorted(RESOURCES))
def test_schema_is_structural(kind: str) -> None:
    """The API server's structural-schema rules (apiextensions.k8s.io/v1)."""
    schema = openapi_schema(RESOURCES[kind])
    for path, node in _nodes(schema):
        for banned in ("$ref", "anyOf", "oneOf", "allOf", "not", "$defs", "title", "examples"):
            assert banned not in node, f"{kind} {path}: {banned}"
        assert node.get("uniqueItems") is not True, f"{kind} {path}: uniqueItems"
        if path != ".metadata":
            assert "type" in node, f"{kind} {path}: every node needs a type"
        if "properties" in node:
            assert node["type"] == "object" and "additionalProperties" not in node, path
        if node.get("type") == "array":
            assert "items" in node, path
        if node.get("x-kubernetes-list-type") == "map":
            for key in node["x-kubernetes-list-map-keys"]:
                assert key in node["items"]["required"], f"{path}: map key {key} not required"


@pytest.mark.parametrize("kind", sorted(RESOURCES))
def test_every_field_is_described(kind: str) -> None:
    schema = openapi_schema(RESOURCES[kind])
    undocumented = [
        path
        for path, node in _nodes(schema)
        if path not in {".", ".metadata"}
        and not path.endswith(("[]", ".*"))
        and not node.get("description")
    ]
    assert undocumented == []


@pytest.mark.parametrize("kind", sorted(RESOURCES))
def test_defaults_are_valid_values(kind: str) -> None:
    for path, node in _nodes(openapi_schema(RESOURCES[kind])):
        if "default" in node:
            jsonschema.Draft4Validator(node).validate(node["default"]), path  # type: ignore[func-returns-value]


@pytest.mark.parametrize("kind", sorted(RESOURCES))
def test_cel_rules_compile_and_lists_they_walk_are_bounded(kind: str) -> None:
    env = celpy.Environment()
    rules = 0
    for path, node in _nodes(openapi_schema(RESOURCES[kind])):
        for rule in node.get(CEL_KEY, []):
            env.compile(rule["rule"])  # raises on a syntax error
            assert rule["message"], path
            rules += 1
        if CEL_KEY in node and node.get("type") == "array":
            # The API server's CEL cost budget needs bounded lists.
            assert "maxItems" in node, f"{path}: CEL over an unbounded list"
    assert rules >= (6 if kind == "RLCycle" else 0)


def test_eval_gates_rule_walks_bounded_lists() -> None:
    eval_spec = openapi_schema(RESOURCES["RLCycle"])["properties"]["spec"]["properties"]["eval"]
    assert eval_spec["properties"]["gates"]["maxItems"] == 64
    assert eval_spec["properties"]["suites"]["maxItems"] == 4  # each suite once
    assert eval_spec["properties"]["gates"]["items"]["properties"]["metric"]["maxLength"] == 128


def test_kubernetes_validate_accepts_the_crd_documents() -> None:
    out = subprocess.run(
        [
            console_script("kubernetes-validate"),
            "--strict",
            "-k",
            "1.30.0",
            *map(str, CRDS.glob("*.yaml")),
        ],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("passed") == len(RESOURCES)


# --- bounded inputs (issue 19) ----------------------------------------------------------

# Left unbounded on purpose: apiVersion and kind (the API server checks them), and the
# date-times (a format) and enums (a closed set).
_UNBOUNDED_OK = {".apiVersion", ".kind"}


def _bounded_problems(kind: str) -> list[str]:
    problems = []
    for path, node in _nodes(openapi_schema(RESOURCES[kind])):
        if path in _UNBOUNDED_OK:
            continue
        kind_of = node.get("type")
        if kind_of == "array" and "maxItems" not in node:
            problems.append(f"{path}: a list without maxItems")
        if isinstance(node.get("additionalProperties"), dict) and "maxProperties" not in node:
            problems.append(f"{path}: a map without maxProperties")
        if kind_of == "string" and not ({"maxLength", "enum", "format"} & node.keys()):
            problems.append(f"{path}: a string without maxLength")
        if kind_of == "integer" and "maximum" not in node:
            problems.append(f"{path}: an integer without maximum")
        elif kind_of == "integer" and int(float(node["maximum"])) != node["maximum"]:
            # The API server reads maximum as a float64 and refuses a CRD whose integer
            # maximum it cannot hold exactly (2**63 - 1 becomes 2**63).
            problems.append(f"{path}: maximum {node['maximum']} is not exact as a float64")
        if kind_of == "number" and path.startswith(".spec") and "maximum" not in node:
            problems.append(f"{path}: a number of the spec without maximum")
    return problems


@pytest.mark.parametrize("kind", sorted(RESOURCES))
def test_every_list_map_string_and_count_is_bounded(kind: str) -> None:
    """What the API server stores is bounded in size, and what a spec sets in value: no
    list is read item by item for seconds, no integer reaches 2**53."""
    assert _bounded_problems(kind) == []


def test_durations_in_the_crd_bound_the_digits_of_each_part() -> None:
    spec = openapi_schema(RESOURCES["RLCycle"])["properties"]["spec"]["properties"]
    interval = spec["schedule"]["properties"]["interval"]
    assert interval["maxLength"] == 32
    pattern = re.compile(interval["pattern"])
    assert pattern.fullmatch("9999d") and pattern.fullmatch("1h30m")
    assert not pattern.fullmatch("10000d") and not pattern.fullmatch("3000000d")


def test_credentials_in_the_endpoint_are_refused_by_both_validators_without_echo() -> None:
    body = yaml.safe_load((REPO / "examples" / "rlcycle.yaml").read_text())
    body["spec"]["storage"]["endpoint"] = "http://AKIAKEY:VerySecret@minio.example.com:9000"
    crd_problems = validate_with_crd(body)
    assert [p.path for p in crd_problems] == ["spec.storage.endpoint"]
    everything = " ".join(map(str, validate_document(body)))
    assert "credentialsSecret" in everything
    assert "VerySecret" not in everything and "AKIAKEY" not in everything
