"""The Helm chart, with a real helm (installed by `make tools` into .tools/bin): it lints
strictly, renders valid manifests for every ci/*-values.yaml, grants exactly the RBAC the
code lists, runs the operator hardened, carries the generated CRDs unchanged, and its
values schema rejects bad values with the value's path."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from rtrl.kube import rbac
from rtrl.validation import validate_with_crd, validate_with_models
from tests.conftest import REPO

CHART = REPO / "charts" / "rtrl-operator"
CI_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
K8S_VERSION = "1.30.0"
# Custom kinds kubernetes-validate has no schema for, and how they are checked instead.
RTRL_KINDS = {"RLCycle", "Checkpoint"}
OTHER_CUSTOM_KINDS = {"KopfPeering", "ClusterKopfPeering", "ServiceMonitor", "PrometheusRule"}


@cache
def helm() -> str:
    for candidate in (os.environ.get("HELM"), REPO / ".tools" / "bin" / "helm"):
        if candidate and Path(candidate).is_file():
            return os.fspath(candidate)
    found = shutil.which("helm")
    if found:
        return found
    message = "helm is not installed: run `make tools` (make test does)"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


def run_helm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([helm(), *args], capture_output=True, text=True, timeout=60)


class Yaml12Loader(yaml.SafeLoader):
    """PyYAML follows YAML 1.1, where ``1e-06`` (how helm's toYaml writes 1.0e-6) is a
    string; the API server's YAML 1.2 reads a number, and so does this loader."""


Yaml12Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$"),
    list("-+0123456789."),
)


def render(*args: str) -> list[dict[str, Any]]:
    out = run_helm("template", "rtrl", os.fspath(CHART), "--namespace", "rtrl-system", *args)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.load_all(out.stdout, Loader=Yaml12Loader) if d]


def render_values(values: Path) -> list[dict[str, Any]]:
    return render("-f", os.fspath(values))


ids = [p.name.removesuffix("-values.yaml") for p in CI_VALUES]


def test_the_ci_values_cover_the_required_setups() -> None:
    assert {"defaults", "namespaced", "ha", "gitops"} <= set(ids)


@pytest.mark.parametrize("values", CI_VALUES, ids=ids)
def test_lint_strict(values: Path) -> None:
    out = run_helm("lint", "--strict", os.fspath(CHART), "-f", os.fspath(values))
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("values", CI_VALUES, ids=ids)
def test_every_rendered_manifest_is_valid(values: Path) -> None:
    docs = render_values(values)
    problems = []
    for doc in docs:
        label = f"{doc['kind']}/{doc['metadata']['name']}"
        if doc["kind"] in RTRL_KINDS:
            problems += [f"{label}: {p}" for p in validate_with_models(doc)]
            problems += [f"{label}: {p}" for p in validate_with_crd(doc)]
        elif doc["kind"] in OTHER_CUSTOM_KINDS:
            assert set(doc) <= {"apiVersion", "kind", "metadata", "spec"}, label
        else:
            try:
                kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
            except kubernetes_validate.ValidationError as exc:
                problems.append(f"{label}: {exc.message} at {list(exc.path)}")
    assert problems == []


def _grants(rules: list[dict[str, Any]]) -> dict[tuple[str, str], set[str]]:
    out: dict[tuple[str, str], set[str]] = {}
    for rule in rules:
        assert "resourceNames" not in rule and "nonResourceURLs" not in rule
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                out.setdefault((group, resource), set()).update(rule["verbs"])
    return out


def _values(values: Path) -> dict[str, Any]:
    return yaml.safe_load(values.read_text()) or {}


@pytest.mark.parametrize("values", CI_VALUES, ids=ids)
def test_rbac_grants_exactly_what_the_code_uses(values: Path) -> None:
    config = _values(values)
    namespaces = config.get("watchNamespaces") or []
    namespaced, cluster = rbac.required(
        clusterwide=not namespaces, peering=int(config.get("replicas", 1)) > 1
    )
    docs = render_values(values)
    roles = {(d.get("metadata", {}).get("namespace"), d["metadata"]["name"]): d for d in docs}
    cluster_roles = [d for d in docs if d["kind"] == "ClusterRole"]
    ns_roles = [d for d in docs if d["kind"] == "Role"]
    assert len(cluster_roles) == 1
    if not namespaces:
        assert ns_roles == []
        assert _grants(cluster_roles[0]["rules"]) == rbac.merge(
            {k: tuple(v) for k, v in namespaced.items()}, {k: tuple(v) for k, v in cluster.items()}
        )
    else:
        assert _grants(cluster_roles[0]["rules"]) == cluster
        assert sorted(r["metadata"]["namespace"] for r in ns_roles) == sorted(namespaces)
        for role in ns_roles:
            assert _grants(role["rules"]) == namespaced
    # Every role is bound to the operator's ServiceAccount, and nothing else is.
    sa = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"][
        "serviceAccountName"
    ]
    bindings = [d for d in docs if d["kind"] in {"RoleBinding", "ClusterRoleBinding"}]
    assert len(bindings) == len(cluster_roles) + len(ns_roles)
    for binding in bindings:
        ref = binding["roleRef"]
        ns = binding["metadata"].get("namespace") if ref["kind"] == "Role" else None
        assert (ns, ref["name"]) in roles
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": sa, "namespace": "rtrl-system"}
        ]


def test_the_code_permissions_cover_kopf_and_rtrl() -> None:
    namespaced, cluster = rbac.required(clusterwide=True, peering=True)
    assert namespaced[("", "events")] >= {"create"}
    assert ("kopf.dev", "clusterkopfpeerings") in cluster
    namespaced, cluster = rbac.required(clusterwide=False, peering=True)
    assert ("kopf.dev", "kopfpeerings") in namespaced
    assert ("", "namespaces") in cluster


@pytest.mark.parametrize("values", CI_VALUES, ids=ids)
def test_output_is_hardened(values: Path) -> None:
    text = run_helm("template", "rtrl", os.fspath(CHART), "-f", os.fspath(values)).stdout
    docs = render_values(values)
    # No wildcard RBAC.
    for doc in docs:
        for rule in doc.get("rules") or []:
            for key in ("apiGroups", "resources", "verbs"):
                assert "*" not in rule.get(key, []), (doc["metadata"]["name"], rule)
    # No secret values: no Secret objects, credentials only by reference.
    assert not any(d["kind"] == "Secret" for d in docs)
    secret_keys = r"(?im)^\s*-?\s*(password|token|secretAccessKey|aws_secret_access_key)\s*:\s*\S"
    assert not re.search(secret_keys, text)
    assert not re.search(r"AKIA[0-9A-Z]{16}", text)  # an AWS access key id
    pods = [d for d in docs if d["kind"] in {"Deployment", "StatefulSet", "DaemonSet", "Job"}]
    assert pods
    for workload in pods:
        spec = workload["spec"]["template"]["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        for container in spec["containers"] + spec.get("initContainers", []):
            ctx = container["securityContext"]
            assert ctx["runAsNonRoot"] is True
            assert ctx["readOnlyRootFilesystem"] is True
            assert ctx["allowPrivilegeEscalation"] is False
            assert ctx["capabilities"]["drop"] == ["ALL"]
            for env in container.get("env", []):
                if env["name"].startswith("AWS_") and "KEY" in env["name"]:
                    assert "value" not in env, env
            assert {"livenessProbe", "readinessProbe", "resources"} <= set(container)
        tmp = [v for v in spec["volumes"] if v["name"] == "tmp"]
        assert tmp and "emptyDir" in tmp[0]


def _crd_documents(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == "CustomResourceDefinition"}


def test_chart_crds_are_identical_to_crds_dir() -> None:
    source = sorted(p.name for p in (REPO / "crds").glob("*.yaml"))
    copies = sorted(p.name for p in (CHART / "files" / "crds").glob("*.yaml"))
    assert copies == source, "run `make crds`"
    for name in source:
        assert (CHART / "files" / "crds" / name).read_bytes() == (
            REPO / "crds" / name
        ).read_bytes(), f"charts/rtrl-operator/files/crds/{name} drifted: run `make crds`"
    peering = REPO / "tests" / "integration" / "kopf-peering-crds.yaml"
    assert (CHART / "files" / "kopf-peering-crds.yaml").read_bytes() == peering.read_bytes()


KEEP = "  annotations:\n    helm.sh/resource-policy: keep\n"


def test_rendered_crds_are_the_generated_documents_plus_keep() -> None:
    out = run_helm("template", "rtrl", os.fspath(CHART), "--set", "replicas=2")
    assert out.returncode == 0, out.stderr
    rendered = {}
    for chunk in re.split(r"^---\n", out.stdout, flags=re.M):
        if "kind: CustomResourceDefinition" in chunk:
            body = re.sub(r"^# Source: .*\n", "", chunk, flags=re.M)
            rendered[yaml.safe_load(body)["metadata"]["name"]] = body
    expected = {}
    for path in [
        *(REPO / "crds").glob("*.yaml"),
        REPO / "tests/integration/kopf-peering-crds.yaml",
    ]:
        for doc_text in re.split(r"^---\n", path.read_text(), flags=re.M):
            doc = yaml.safe_load(doc_text)
            expected[doc["metadata"]["name"]] = doc_text
    assert set(rendered) == set(expected)
    for name, body in rendered.items():
        assert KEEP in body, name
        # Byte for byte, once the keep annotation is taken out (helm adds blank lines only).
        assert body.replace(KEEP, "", 1).strip() == expected[name].strip(), name


def test_crds_toggles() -> None:
    assert _crd_documents(render("--set", "crds.install=false")) == {}
    kept = _crd_documents(render())
    assert all(
        d["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep" for d in kept.values()
    )
    unkept = _crd_documents(render("--set", "crds.keep=false"))
    assert set(unkept) == {"rlcycles.rtrl.io", "checkpoints.rtrl.io"}
    assert all("annotations" not in d["metadata"] for d in unkept.values())


def test_replicas_bring_peering_and_a_disruption_budget() -> None:
    single = render()
    assert not [d for d in single if d["kind"] in {"PodDisruptionBudget", "ClusterKopfPeering"}]
    args = next(d for d in single if d["kind"] == "Deployment")["spec"]["template"]["spec"][
        "containers"
    ][0]["args"]
    assert "--standalone" in args and "--all-namespaces" in args
    ha = render("--set", "replicas=3")
    kinds = [d["kind"] for d in ha]
    assert "PodDisruptionBudget" in kinds and "ClusterKopfPeering" in kinds
    assert {"clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev"} <= set(_crd_documents(ha))
    args = next(d for d in ha if d["kind"] == "Deployment")["spec"]["template"]["spec"][
        "containers"
    ][0]["args"]
    assert "--peering=rtrl-operator" in args and "--standalone" not in args
    namespaced = render("--set", "replicas=2", "--set", "watchNamespaces={a,b}")
    peerings = [d for d in namespaced if d["kind"] == "KopfPeering"]
    assert sorted(p["metadata"]["namespace"] for p in peerings) == ["a", "b"]


def test_gitops_rlcycles_render_in_their_namespace() -> None:
    docs = render_values(CHART / "ci" / "gitops-values.yaml")
    cycles = [d for d in docs if d["kind"] == "RLCycle"]
    assert [c["metadata"]["name"] for c in cycles] == ["composer", "composer-acme"]
    assert all(c["metadata"]["namespace"] == "ml-serving" for c in cycles)


def test_storage_credentials_by_reference() -> None:
    docs = render("--set", "storage.credentialsSecret=s3-creds")
    env = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"][
        "containers"
    ][0]["env"]
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in env if "valueFrom" in e}
    assert refs["AWS_ACCESS_KEY_ID"] == {"name": "s3-creds", "key": "AWS_ACCESS_KEY_ID"}
    assert refs["AWS_SECRET_ACCESS_KEY"]["name"] == "s3-creds"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--set", "replicas=-1"], "at '/replicas': minimum: got -1, want 1"),
        (["--set", "watchNamespaces=x"], "at '/watchNamespaces': got string, want array"),
        (["--set", "replica=2"], "additional properties 'replica' not allowed"),
        (["--set", "securityContext.runAsNonRoot=false"], "/securityContext/runAsNonRoot"),
        (["--set", "securityContext.readOnlyRootFilesystem=false"], "readOnlyRootFilesystem"),
        (["--set", "operator.logFormat=xml"], "/operator/logFormat"),
        (["--set", "watchNamespaces={Bad_NS}"], "/watchNamespaces/0"),
        (["--set", "image.pullPolicy=Sometimes"], "/image/pullPolicy"),
        (["--set-json", 'rlcycles=[{"name":"x"}]'], "missing property 'spec'"),
    ],
    ids=lambda v: str(v)[:40],
)
def test_bad_values_are_rejected_by_the_schema(args: list[str], message: str) -> None:
    out = run_helm("template", "rtrl", os.fspath(CHART), *args)
    assert out.returncode != 0
    assert message in out.stderr, out.stderr


def test_every_value_is_documented() -> None:
    """Each key in values.yaml has a comment above it, or sits in a documented default block
    (resources, security contexts, egress rules, ...) whose parent is commented."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    undocumented = []
    documented_blocks: list[int] = []  # indents of commented keys whose children are free
    previous = ""
    for line in lines:
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        while documented_blocks and indent <= documented_blocks[-1]:
            documented_blocks.pop()
        key = re.match(r"^\s*(-\s+)?([A-Za-z][\w.-]*):", line)
        if key and not line.lstrip().startswith("#"):
            commented = previous.lstrip().startswith("#")
            if not commented and not documented_blocks:
                # A parent mapping (no value on its line) is documented by its children.
                if line.rstrip().endswith(":"):
                    pass
                else:
                    undocumented.append(line.strip())
            if commented and line.rstrip().endswith(":"):
                documented_blocks.append(indent)
        previous = line
    assert undocumented == []


def test_dockerfile_runs_non_root_with_the_operator_extra_only() -> None:
    text = (REPO / "images" / "operator" / "Dockerfile").read_text()
    users = re.findall(r"^USER\s+(\S+)", text, flags=re.M)
    assert users and users[-1].split(":")[0] not in {"0", "root"}
    installs = re.findall(r"pip install[^\n]*", text)
    assert installs and all(".[operator]" in line for line in installs)
    assert not re.search(r"\[[^\]]*(dev|trainer)[^\]]*\]", text)
    assert re.search(r'^ENTRYPOINT \["rtrl", "operator"\]', text, flags=re.M)
    assert re.search(r"^FROM python:3\.\d+-slim", text, flags=re.M)


@pytest.mark.parametrize(
    ("release", "fullname"),
    [
        ("rtrl", "rtrl-operator"),  # the README's release: no `rtrl-rtrl-operator`
        ("rtrl-operator", "rtrl-operator"),
        ("prod", "prod-rtrl-operator"),
        ("rtrlx", "rtrlx-rtrl-operator"),  # a prefix of the chart name, not the project's
    ],
)
def test_object_names_do_not_stutter(release: str, fullname: str) -> None:
    out = run_helm("template", release, os.fspath(CHART), "--namespace", "rtrl-system")
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.load_all(out.stdout, Loader=Yaml12Loader) if d]
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    assert deployment["metadata"]["name"] == fullname
    names = {d["metadata"]["name"] for d in docs if d["kind"] != "CustomResourceDefinition"}
    assert not any("rtrl-rtrl" in n for n in names), names


def test_the_chart_readme_is_generated_from_values_yaml() -> None:
    """`helm show readme` is what chart users read: it lists every commented value and is
    regenerated (`make chart-readme`) whenever values.yaml changes."""
    script = REPO / "tools" / "chart_readme.py"
    out = subprocess.run([sys.executable, os.fspath(script), "--check"], capture_output=True)
    assert out.returncode == 0, out.stderr.decode()
    readme = (CHART / "README.md").read_text()
    values = (CHART / "values.yaml").read_text()
    assert readme.count("\n| `") == values.count("# --") > 40
    assert "| `watchNamespaces` | list | `[]` |" in readme
    shown = run_helm("show", "readme", os.fspath(CHART))
    assert shown.returncode == 0 and shown.stdout.startswith("# rtrl-operator"), shown.stderr
