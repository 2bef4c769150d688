"""`rtrl validate`: the examples pass, every invalid example fails naming its field, and the
two validators (pydantic models, CRD schema + CEL) agree on every mutation of the examples
that a CRD can express."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from resource import RLIMIT_AS, setrlimit
from typing import Any

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


def test_the_adapter_examples_are_valid() -> None:
    """examples/adapters/ (not applied with examples/: its RLCycle needs an engine with LoRA
    and a base RLCycle whose sidecar follows the routing table, docs/adapters.md)."""
    paths = sorted((REPO / "examples" / "adapters").glob("*.yaml"))
    out = _rtrl_validate(*(p.relative_to(REPO) for p in paths))
    assert paths and out.returncode == 0, out.stdout + out.stderr
    assert "RLCycle/composer-acme valid" in out.stdout


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
    huge = tmp_path / "huge.yaml"
    huge.write_text(("#" * 1023 + "\n") * 3 * 1024 + "a: 1\n")  # just over 3 MiB
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"a: \xff\xfe\n")
    out = _rtrl_validate(broken, empty, tmp_path / "missing.yaml", huge, binary)
    assert out.returncode == 1
    assert sorted(out.stdout.splitlines()) == sorted(
        [
            f"{broken}: not valid YAML: line 2, column 1: did not find expected ',' or ']' "
            "(while parsing a flow sequence at line 1)",
            f"{empty}: no YAML documents in file",
            f"{tmp_path / 'missing.yaml'}: [Errno 2] No such file or directory: "
            f"'{tmp_path / 'missing.yaml'}'",
            f"{huge}: larger than 3 MiB, the API server's request limit",
            f"{binary}: not UTF-8 text (byte 3)",
        ]
    )
    assert "5 of 5 file(s) invalid" in out.stderr


# --- hostile and malformed files: bounded, one line each, the other files still judged ----

EXAMPLE = (REPO / "examples" / "rlcycle.yaml").read_text()


def _edit(old: str, new: str) -> str:
    """The RLCycle example with one edit (``old`` must occur in it)."""
    assert old in EXAMPLE, old
    return EXAMPLE.replace(old, new, 1)


def _line_of(text: str, needle: str) -> int:
    return text[: text.index(needle)].count("\n") + 1


def billion_laughs(levels: int = 9) -> str:
    """An RLCycle of ~500 bytes whose aliases expand to 9**levels values in its spec."""
    lines = ['l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, levels)]
    head = "apiVersion: rtrl.io/v1alpha1\nkind: RLCycle\nmetadata: {name: lol}\n"
    return head + "\n".join(lines) + f"\nspec: {{laughs: *l{levels - 1}}}\n"


_MEASURE = """
import json, resource, sys, time
from pathlib import Path
from rtrl.validation import validate_file
validate_file(Path(sys.argv[2]))  # warm: imports, the schema, the CEL programs
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.process_time()  # CPU, not wall: the check is work done, not the machine's load
report = validate_file(Path(sys.argv[1]))
seconds = time.process_time() - start
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
problems = [str(p) for _, p in report.problems]
print(json.dumps({"seconds": seconds, "rss_kib": grown, "problems": problems}))
"""


def _measure(path: Path) -> dict[str, Any]:
    """``validate_file(path)`` in a fresh process under a 2 GiB address-space limit: its
    CPU seconds, its growth of peak RSS (KiB) and its problems."""

    def limit() -> None:
        setrlimit(RLIMIT_AS, (2 * 2**30, 2 * 2**30))

    out = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(path), str(REPO / "examples" / "rlcycle.yaml")],
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=limit,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    result: dict[str, Any] = json.loads(out.stdout)
    return result


def test_an_alias_bomb_is_refused_at_once_in_bounded_memory(tmp_path: Path) -> None:
    """Nine levels of nine aliases: 387,420,489 strings from 540 bytes. The reader counts
    values with aliases expanded and stops past its cap, before any of them is built."""
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(billion_laughs())
    assert bomb.stat().st_size < 600
    measured = _measure(bomb)
    assert measured["seconds"] < 1.0, measured
    assert measured["rss_kib"] < 20 * 1024, measured
    [problem] = measured["problems"]
    assert problem == (
        "l4[5]: line 8: the alias *l3 expands to 7,381 values, which takes the document "
        "past the 50,000 it may hold"
    )


def test_fifty_thousand_rollout_steps_are_refused_in_under_a_second(tmp_path: Path) -> None:
    """2.7 MiB of steps, under the size cap: the reader stops counting at its value cap and
    names the list that holds them, so nothing downstream pays for 50,000 steps."""
    steps = "".join("      - {weight: 5, minDuration: 30m, minSamples: 20000}\n" * 50_000)
    manifest = tmp_path / "steps.yaml"
    manifest.write_text(_edit("    steps:\n", "    steps:\n" + steps))
    measured = _measure(manifest)
    assert measured["seconds"] < 1.0, measured
    [problem] = measured["problems"]
    assert problem.startswith("spec.rollout.steps: line "), problem
    assert "more than 50,000 values in one document (this list holds" in problem


def test_lists_longer_than_the_schema_allows_are_refused_before_the_schema() -> None:
    """Under the reader's caps but over the CRD's maxItems: the size check answers alone,
    before the schema and CEL walk every step (3 s for 5,000 steps before it did)."""
    body = yaml.safe_load(EXAMPLE)
    body["spec"]["rollout"]["steps"] = [{"weight": 5, "minDuration": "30m"}] * 5_000
    limit = _schema_max_items(("spec", "rollout", "steps"))
    start = time.perf_counter()
    problems = validate_document(body)
    assert time.perf_counter() - start < 0.2
    assert [str(p) for p in problems] == [
        f"spec.rollout.steps: List should have at most {limit} items, not 5000"
    ]
    assert validate_with_crd(body) == problems  # the CRD half alone checks sizes first too


def _schema_max_items(path: tuple[str, ...]) -> int:
    from rtrl.core.api import RESOURCES
    from rtrl.crdgen import openapi_schema

    node = openapi_schema(RESOURCES["RLCycle"])
    for key in path:
        node = node["properties"][key]
    limit: int = node["maxItems"]
    return limit


MALFORMED = {
    # name: (file text, the one line expected after "<file>: ")
    "kind-is-a-list.yaml": (
        _edit("kind: RLCycle", "kind: []"),
        "?/composer: kind: must be one of RLCycle, Checkpoint, got []",
    ),
    "name-is-null.yaml": (
        _edit("  name: composer\n", "  name: null\n"),
        "RLCycle/?: metadata.name: required field is missing",
    ),
    "int-over-int64.yaml": (
        _edit("minSamples: 20000}", "minSamples: 9223372036854775808}"),
        f"spec.rollout.steps[0].minSamples: line {_line_of(EXAMPLE, 'minSamples: 20000}')}: "
        "integer 9223372036854775808 is out of range: Kubernetes stores 64-bit integers",
    ),
    "date-as-duration.yaml": (  # a string, as Kubernetes reads it; then not a duration
        _edit("interval: 5h", "interval: 2026-01-01"),
        "RLCycle/composer: spec.schedule.interval: invalid duration '2026-01-01': use a "
        "number and a unit (ms, s, m, h, d), e.g. 30m or 1h30m",
    ),
    "binary-name.yaml": (
        _edit("  name: composer\n", "  name: !!binary Y29tcG9zZXI=\n"),
        "metadata.name: line 7: the tag !!binary is not accepted: a manifest holds only "
        "strings, numbers, booleans, null, lists and maps (JSON)",
    ),
    "set-of-suites.yaml": (
        _edit("suites: [replay, tasks, behaviour]", "suites: !!set {replay, tasks}"),
        f"spec.eval.suites: line {_line_of(EXAMPLE, 'suites: [')}: the tag !!set is not "
        "accepted: a manifest holds only strings, numbers, booleans, null, lists and maps (JSON)",
    ),
    "infinite-gate.yaml": (
        _edit("maxRegression: 0.01}", "maxRegression: .inf}"),
        f"spec.eval.gates[0].maxRegression: line {_line_of(EXAMPLE, 'maxRegression: 0.01}')}: "
        ".inf is not a JSON number",
    ),
    "nested-1000-deep.yaml": (
        _edit(
            "  historyLimit: 20\n", "  historyLimit: 20\n  extra: " + "[" * 1000 + "]" * 1000 + "\n"
        ),
        None,  # a line saying it is nested too deep (libyaml's words or the reader's)
    ),
}


def test_malformed_documents_are_one_line_each_and_the_other_files_are_still_judged(
    tmp_path: Path,
) -> None:
    files = []
    for name, (text, _) in MALFORMED.items():
        files.append(tmp_path / name)
        files[-1].write_text(text)
    annotated = tmp_path / "date-in-an-annotation.yaml"  # valid: the date is a string
    annotated.write_text(
        _edit("  name: composer\n", "  name: composer\n  annotations: {at: 2026-01-01}\n")
    )
    out = _rtrl_validate(*files, annotated, REPO / "examples" / "checkpoint-base.yaml")
    assert "Traceback" not in out.stderr, out.stderr
    assert out.returncode == 1
    lines = out.stdout.splitlines()
    for path, (_, expected) in zip(files, MALFORMED.values(), strict=True):
        mine = [line for line in lines if line.startswith(f"{path}: ")]
        assert len(mine) == 1, (path.name, lines)
        if expected is None:
            assert "nest" in mine[0], mine
        else:
            assert mine[0] == f"{path}: {expected}"
    assert f"{annotated}: RLCycle/composer valid" in lines
    assert any(line.endswith("checkpoint-base.yaml: Checkpoint/composer-0 valid") for line in lines)
    assert f"{len(files)} of {len(files) + 2} file(s) invalid" in out.stderr


def test_duplicate_keys_are_refused_with_their_line_and_the_next_documents_judged(
    tmp_path: Path,
) -> None:
    checkpoint = (REPO / "examples" / "checkpoint-base.yaml").read_text()
    doubled = _edit("    zeroStage: 2\n", "    zeroStage: 2\n    zeroStage: 3\n")
    broken = EXAMPLE.replace("zeroStage: 2", "zeroStage: 7")
    manifest = tmp_path / "three.yaml"
    manifest.write_text(f"{checkpoint}\n---\n{doubled}\n---\n{broken}")
    first = checkpoint.count("\n") + 2 + _line_of(EXAMPLE, "zeroStage: 2")
    out = _rtrl_validate(manifest)
    assert out.returncode == 1
    assert out.stdout.splitlines() == [
        f"{manifest}: document 2: spec.training.zeroStage: line {first + 1}: duplicate key "
        f"(first at line {first})",
        f"{manifest}: RLCycle/composer: spec.training.zeroStage: "
        "Input should be less than or equal to 3",
    ]


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


KUBERNETES_SCALARS = {
    # plain scalar in a field: valid, as the API server reads it (tests/e2e/test_validate_server.py)
    ("activationCheckpointing: true", "activationCheckpointing: y"): True,  # YAML 1.1's bool
    ("activationCheckpointing: true", "activationCheckpointing: off"): True,
    ("zeroStage: 2", "zeroStage: 0o2"): True,  # Go's octal
    ("historyLimit: 20", "historyLimit: 024"): True,  # a leading 0: octal, 20
    ("historyLimit: 20", "historyLimit: 0x14"): True,
    ("zeroStage: 2", "zeroStage: 0:2"): False,  # no sexagesimal: a string
    ("interval: 5h", "interval: 2026-01-01"): False,  # a date stays a string: no duration
}


def test_plain_scalars_are_read_as_kubernetes_reads_them(tmp_path: Path) -> None:
    """goyaml.v2's rules (kubectl's and the API server's YAML), where PyYAML's differ."""
    files: dict[Path, tuple[str, bool]] = {}
    for (old, new), valid in KUBERNETES_SCALARS.items():
        files[tmp_path / f"{len(files)}.yaml"] = (new, valid)
        (tmp_path / f"{len(files) - 1}.yaml").write_text(_edit(old, new))
    out = _rtrl_validate(*files)
    for path, (new, valid) in files.items():
        verdict = next(line for line in out.stdout.splitlines() if line.startswith(f"{path}: "))
        assert verdict.endswith("RLCycle/composer valid") == valid, (new, verdict)


def test_yaml_is_read_as_kubernetes_reads_it(tmp_path: Path) -> None:
    """``1e-6`` is a number to kubectl (YAML 1.2), a string to plain PyYAML (YAML 1.1)."""
    text = (REPO / "examples" / "rlcycle.yaml").read_text()
    assert "learningRate: 1.0e-6" in text
    manifest = tmp_path / "rlcycle.yaml"
    manifest.write_text(text.replace("learningRate: 1.0e-6", "learningRate: 1e-6"))
    out = _rtrl_validate(manifest)
    assert out.returncode == 0, out.stdout
