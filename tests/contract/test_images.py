"""The two Dockerfiles build what the chart and the step Jobs run, checked without a Docker
engine: every file they COPY exists and reaches the build context (.dockerignore), every
first-party package their code imports is copied, their entrypoints are console scripts
pyproject.toml defines, and `make images` tags them with the chart's appVersion, the tag
the chart and examples/rlcycle.yaml name."""

from __future__ import annotations

import ast
import fnmatch
import json
import os
import re
import subprocess
import tomllib
from pathlib import Path

import pytest

from rtrl.core.api.yamlfile import load
from tests.conftest import REPO

DOCKERFILES = {
    "rtrl-operator": REPO / "images" / "operator" / "Dockerfile",
    "rtrl-trainer": REPO / "images" / "trainer" / "Dockerfile",
    "rtrl-serving": REPO / "images" / "serving" / "Dockerfile",
}
FIRST_PARTY = {"rtrl", "rtrl_trainer", "rtrl_serving", "rtrl_localkube", "rtrl_demo"}
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def instructions(path: Path) -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` of a Dockerfile, continuation lines joined."""
    text = re.sub(r"\\\n", " ", path.read_text())
    found = []
    for raw in text.splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            found.append((word.upper(), rest.strip()))
    return found


def copied(path: Path) -> list[str]:
    """The build-context sources of COPY/ADD (not ``--from`` another stage)."""
    sources = []
    for word, rest in instructions(path):
        if word in ("COPY", "ADD"):
            parts = rest.split()
            if any(p.startswith("--from") for p in parts):
                continue
            sources += [p for p in parts if not p.startswith("--")][:-1]
    return sources


def ignored(relative: str) -> bool:
    """Whether .dockerignore keeps ``relative`` out of the build context (the last pattern
    matching it or one of its parents wins; ``!`` lets it through)."""
    patterns = [
        line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]  # fmt: skip
    parts = relative.strip("/").split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    result = False
    for line in patterns:
        negate = line.startswith("!")
        pattern = line.lstrip("!").strip("/")
        globbed = pattern.replace("**/", "*")
        if any(fnmatch.fnmatchcase(p, pattern) or fnmatch.fnmatchcase(p, globbed)
               for p in prefixes):  # fmt: skip
            result = not negate
    return result


@pytest.mark.parametrize("image", sorted(DOCKERFILES))
def test_every_copied_source_exists_and_reaches_the_context(image: str) -> None:
    sources = copied(DOCKERFILES[image])
    assert sources
    for source in sources:
        assert (REPO / source).exists(), f"{image}: COPY {source}: no such file"
        assert not ignored(source), f"{image}: COPY {source}: excluded by .dockerignore"
    # and what the engine must not receive
    for heavy in (".venv", ".tools", ".git", "tests", "src/rtrl/__pycache__"):
        assert ignored(heavy), heavy


@pytest.mark.parametrize("image", sorted(DOCKERFILES))
def test_copied_code_imports_only_copied_packages(image: str) -> None:
    """Module-level imports of first-party packages (a function's own, such as ``rtrl
    demo``'s, run only when called)."""
    sources = [s for s in copied(DOCKERFILES[image]) if s.startswith("src/")]
    packages = {Path(s).name for s in sources}
    missing = set()
    for source in sources:
        for module in (REPO / source).rglob("*.py"):
            tree = ast.parse(module.read_text())
            for node in tree.body + [n for b in tree.body if isinstance(b, ast.If | ast.Try)
                                     for n in ast.walk(b)]:  # fmt: skip
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                for name in names:
                    top = name.split(".")[0]
                    if top in FIRST_PARTY and top not in packages:
                        missing.add(f"{module.relative_to(REPO)}: {name}")
    assert not missing, sorted(missing)


@pytest.mark.parametrize(
    ("image", "extra", "entrypoint"),
    [
        ("rtrl-operator", "operator", ["rtrl", "operator"]),
        ("rtrl-trainer", "trainer", ["rtrl-job"]),
    ],
)
def test_entrypoints_are_console_scripts_of_the_installed_extra(
    image: str, extra: str, entrypoint: list[str]
) -> None:
    steps = instructions(DOCKERFILES[image])
    (last,) = [json.loads(rest) for word, rest in steps if word == "ENTRYPOINT"]
    assert last == entrypoint
    scripts = PYPROJECT["project"]["scripts"]
    assert last[0] in scripts, f"{image}: ENTRYPOINT {last[0]} is not in [project.scripts]"
    module = scripts[last[0]].split(":")[0]
    package_dir = f"src/{module.split('.')[0]}"
    assert any(s.rstrip("/") == package_dir for s in copied(DOCKERFILES[image])), module
    installs = [rest for word, rest in steps if word == "RUN" and "pip install" in rest]
    assert installs and all(f'".[{extra}]"' in rest for rest in installs), installs
    assert extra in PYPROJECT["project"]["optional-dependencies"]


def test_step_jobs_run_a_console_script_of_the_trainer_image() -> None:
    """The operator's step Jobs set ``command``: it must exist in the trainer image."""
    source = (REPO / "src" / "rtrl" / "planning" / "manifests" / "jobs.py").read_text()
    commands = set(re.findall(r'command = \["([\w-]+)"\]', source))
    assert commands == {"rtrl-job", "torchrun"}, commands
    assert "rtrl-job" in PYPROJECT["project"]["scripts"]  # torchrun: torch's own script


def test_make_images_tags_both_with_the_charts_app_version() -> None:
    chart = load((REPO / "charts" / "rtrl-operator" / "Chart.yaml").read_text())
    version = str(chart["appVersion"])
    plan = subprocess.run(
        ["make", "-n", "images", "push-images", "REGISTRY=registry.example.com"],
        cwd=REPO, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    for name, dockerfile in DOCKERFILES.items():
        image = f"registry.example.com/{name}:{version}"
        assert f"docker build -f {dockerfile.relative_to(REPO)} -t {image} ." in plan, plan
        assert f"docker push {image}" in plan, plan
    # the trainer image the example RLCycle names is the one this version builds
    example = load((REPO / "examples" / "rlcycle.yaml").read_text())
    assert example["spec"]["training"]["image"] == f"registry.example.com/rtrl-trainer:{version}"


def test_make_images_says_when_no_docker_engine_is_reachable(tmp_path: Path) -> None:
    env = {**os.environ, "DOCKER_HOST": f"unix://{tmp_path}/no-engine.sock"}
    out = subprocess.run(["make", "images", "REGISTRY=registry.example.com"], cwd=REPO,
                         capture_output=True, text=True, env=env)  # fmt: skip
    assert out.returncode != 0
    assert ("make images: no Docker engine is reachable" in out.stderr
            or "make images: docker is not installed" in out.stderr), out.stderr  # fmt: skip
    unset = subprocess.run(["make", "images", "REGISTRY="], cwd=REPO, capture_output=True,
                           text=True, env=env)  # fmt: skip
    assert unset.returncode != 0 and "set REGISTRY" in unset.stderr
