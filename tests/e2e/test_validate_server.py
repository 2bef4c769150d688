"""``rtrl validate`` and the real API server judge YAML alike: the same manifest text, sent
to the server as a YAML body (server-side dry run, strict field validation), gets the same
verdict as offline. Fixed cases for what the reader decides (duplicate keys, dates,
Kubernetes' booleans and integers, merge keys, keys that are numbers, numbers JSON cannot
hold), then random scalars in random fields of the example and random JSON values planted
in it, within a fixed budget (derandomized under CI, like tests/contract/test_validate_fuzz.py).
"""

from __future__ import annotations

import json
import os
import re
import ssl
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rtrl.validation import validate_document, validate_file
from rtrl_localkube.controlplane import ControlPlane
from tests.conftest import REPO
from tests.contract.mutants import set_at
from tests.e2e.test_manifests import server_verdict

pytestmark = pytest.mark.timeout(300)

SERVER_FUZZ = settings(
    max_examples=40,
    deadline=timedelta(seconds=10),
    derandomize=bool(os.environ.get("CI")),
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

# The example, without its namespace (each test has its own), as text and as a value.
EXAMPLE = (REPO / "examples" / "rlcycle.yaml").read_text().replace("  namespace: ml-serving\n", "")


def server_yaml_verdict(cp: ControlPlane, namespace: str, text: str) -> str:
    """Empty when the API server accepts ``text`` as a YAML body (dry run, strict field
    validation), else its message: the server decodes the YAML itself, with the library
    kubectl uses (sigs.k8s.io/yaml), so duplicate keys and scalars are its own verdict."""
    query = urllib.parse.urlencode({"dryRun": "All", "fieldValidation": "Strict"})
    url = f"{cp.url}/apis/rtrl.io/v1alpha1/namespaces/{namespace}/rlcycles?{query}"
    request = urllib.request.Request(url, data=text.encode(), method="POST")
    request.add_header("Authorization", f"Bearer {cp.admin_token}")
    request.add_header("Content-Type", "application/yaml")
    request.add_header("Accept", "application/json")
    context = ssl.create_default_context(cafile=os.fspath(cp.ca_file))
    try:
        with urllib.request.urlopen(request, timeout=10, context=context):
            return ""
    except urllib.error.HTTPError as exc:
        return str(json.loads(exc.read() or b"{}").get("message") or exc)


def offline_verdict(text: str) -> str:
    """``rtrl validate``'s problems for ``text``, one per line (empty when valid)."""
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "manifest.yaml"
        path.write_text(text)
        report = validate_file(path)
    return "\n".join(str(problem) for _, problem in report.problems)


def edit(old: str, new: str) -> str:
    assert old in EXAMPLE, old
    return EXAMPLE.replace(old, new, 1)


NAME = "  name: composer\n"
SAME = {
    # case: (manifest text, accepted by both)
    "as-is": (EXAMPLE, True),
    "duplicate-spec-key": (
        edit("    zeroStage: 2\n", "    zeroStage: 2\n    zeroStage: 3\n"),
        False,
    ),
    "duplicate-metadata-key": (edit(NAME, NAME + "  name: other\n"), False),
    "date-in-an-annotation": (edit(NAME, NAME + "  annotations: {at: 2026-01-01}\n"), True),
    "date-as-a-duration": (edit("interval: 5h", "interval: 2026-01-01"), False),
    "y-is-true": (edit("activationCheckpointing: true", "activationCheckpointing: y"), True),
    "off-is-false": (edit("activationCheckpointing: true", "activationCheckpointing: off"), True),
    "go-octal": (edit("zeroStage: 2", "zeroStage: 0o2"), True),
    "leading-zero-octal": (edit("zeroStage: 2", "zeroStage: 02"), True),
    "no-sexagesimal": (edit("zeroStage: 2", "zeroStage: 0:2"), False),
    "hex": (edit("historyLimit: 20", "historyLimit: 0x14"), True),
    "underscores": (edit("minInteractions: 200000", "minInteractions: 200_000"), True),
    "exponent-without-dot": (edit("learningRate: 1.0e-6", "learningRate: 1e-6"), True),
    "float-too-large": (edit("maxRegression: 0.01}", "maxRegression: 1e400}"), False),
    "infinity": (edit("maxRegression: 0.01}", "maxRegression: .inf}"), False),
    "not-a-number": (edit("maxRegression: 0.01}", "maxRegression: .nan}"), False),
    "over-int64": (edit("historyLimit: 20", "historyLimit: 9223372036854775808"), False),
    "merge-key": (
        edit(NAME, NAME + "  labels:\n    <<: &base {app: composer}\n    tier: ml\n"),
        True,
    ),
    "alias-of-a-map": (
        edit(NAME, NAME + "  labels: &l {app: composer}\n  annotations: *l\n"),
        True,
    ),
    "number-and-boolean-keys": (edit(NAME, NAME + "  labels: {1: a, true: b}\n"), True),
    "null-key": (edit(NAME, NAME + "  labels: {~: a}\n"), False),
}


@pytest.mark.parametrize("case", sorted(SAME))
def test_the_server_and_rtrl_validate_read_yaml_alike(
    case: str, controlplane: ControlPlane, release: str, namespace: str
) -> None:
    text, accepted = SAME[case]
    server = server_yaml_verdict(controlplane, namespace, text)
    offline = offline_verdict(text)
    assert (server == "") == accepted, f"server: {server or 'accepted'}"
    assert (offline == "") == accepted, f"rtrl validate: {offline or 'valid'}"


STRICTER = {
    # what rtrl validate refuses though the server accepts it (docs/validation.md)
    "binary": edit(NAME, NAME + "  annotations: {a: !!binary Y29tcG9zZXI=}\n"),
    "set": edit(NAME, NAME + "  annotations: !!set {a, b}\n"),
}


@pytest.mark.parametrize("case", sorted(STRICTER))
def test_tags_json_cannot_hold_are_refused_though_the_server_converts_them(
    case: str, controlplane: ControlPlane, release: str, namespace: str
) -> None:
    text = STRICTER[case]
    assert server_yaml_verdict(controlplane, namespace, text) == ""
    assert f"the tag !!{case} is not accepted" in offline_verdict(text)


# --- random scalars, random values ---------------------------------------------------------

# The example's block lines holding a plain scalar, in spec (metadata is the server's own).
SPEC = EXAMPLE.index("\nspec:\n")
SCALAR_LINES = [
    m.start(2)
    for m in re.finditer(r"^( +[A-Za-z]+: )([^{\[#\n][^#\n]*?) *(?:#.*)?$", EXAMPLE, re.MULTILINE)
    if m.start() > SPEC
]
TRICKY = ["y", "N", "on", "Off", "yes", "~", "null", "true", "2026-01-01", "12:30", "1:30:00",
          ".5", "1.", "+5", "-0", "08", "017", "0o17", "0x1f", "0b11", "1_0", ".inf", "1e400",
          "9223372036854775807", "5h", "30m", "0", "-1", "''", '""']  # fmt: skip
scalars = st.one_of(
    st.sampled_from(TRICKY),
    st.integers(-(2**63), 2**63 - 1).map(str),  # beyond: refused offline (docs/validation.md)
    st.floats(allow_nan=False, allow_infinity=False).map(repr),
    st.from_regex(
        r"[-+]?(0[xob])?[0-9a-f_]{1,5}(\.[0-9]{0,3})?([eE][-+]?[0-9]{1,3})?", fullmatch=True
    ),
)


@SERVER_FUZZ
@given(where=st.sampled_from(SCALAR_LINES), scalar=scalars)
def test_random_scalars_in_random_fields_get_the_servers_verdict(
    controlplane: ControlPlane, release: str, namespace: str, where: int, scalar: str
) -> None:
    end = EXAMPLE.index("\n", where)
    text = EXAMPLE[:where] + scalar + EXAMPLE[end:]
    server = server_yaml_verdict(controlplane, namespace, text)
    offline = offline_verdict(text)
    assert bool(server) == bool(offline), (
        f"server: {server or 'accepted'}; rtrl: {offline or 'valid'}"
    )


BODY = json.loads(json.dumps(yaml.safe_load(EXAMPLE)))


def _spec_paths(node: Any, path: tuple[Any, ...]) -> list[tuple[Any, ...]]:
    paths = [path]
    if isinstance(node, dict):
        for key, value in node.items():
            paths += _spec_paths(value, (*path, key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            paths += _spec_paths(value, (*path, index))
    return paths


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(st.characters(codec="ascii", min_codepoint=32), max_size=12),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(
            st.text(st.characters(codec="ascii", min_codepoint=32), max_size=8), inner, max_size=4
        )
    ),
    max_leaves=12,
)


@SERVER_FUZZ
@given(path=st.sampled_from(_spec_paths(BODY["spec"], ("spec",))[1:]), value=json_values)
def test_random_values_in_random_fields_get_the_servers_verdict(
    controlplane: ControlPlane, release: str, namespace: str, path: tuple[Any, ...], value: Any
) -> None:
    body = set_at(BODY, path, value)
    server = server_verdict(controlplane, namespace, body)
    offline = validate_document(body)
    assert bool(server) == bool(offline), (
        f"server: {server or 'accepted'}; rtrl: {offline or 'valid'}"
    )
