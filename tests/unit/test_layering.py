"""The import layering of DESIGN.md holds: handlers -> kube -> planning -> api, each
importing only to its right; the pure layers do no I/O; the operator never imports the
Job side. A new module must be placed in ALLOWED before it may import anything of rtrl."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import REPO

PACKAGES = {
    "rtrl": REPO / "src" / "rtrl",
    "rtrl_trainer": REPO / "src" / "rtrl_trainer",
}

LAYERS = ["handlers", "kube", "planning", "core.api"]
# component of rtrl -> components of rtrl it may import (itself always allowed)
ALLOWED: dict[str, set[str]] = {
    **{layer: set(LAYERS[i + 1 :]) for i, layer in enumerate(LAYERS)},
    "kube": {"planning", "core.api", "core.store"},
    "handlers": {*LAYERS[1:], "metrics"},
    "metrics": {"planning", "core.api"},
    "logs": set(),
    "core.store": set(),
    "core.cliargs": set(),
    "core.shards": {"core.store", "core.cliargs"},
    "crdgen": {"core.api"},
    "manifests": {"core.api", "crdgen"},
    "kubectl_plugin": {"core.api", "kube", "planning", "manifests", "cli", "abtable"},
    "local": {"planning", "core.api", "core.store", "core.shards", "core.cliargs", "abtable"},
    "abtable": set(),  # the A/B table's cells, shared by kubectl rtrl status and the demo
    "cli": {"*"},
    "__init__": set(),
    "core.__init__": set(),
}
# The Job side may use the shared libraries, never the operator's kube/handlers layers.
TRAINER_ALLOWED = {"core.api", "core.store", "core.shards", "planning", "core.cliargs"}
# Pure layers: decisions only, clock passed in, no I/O.
PURE = {"core.api", "planning"}
IO_MODULES = {
    "boto3", "botocore", "pyarrow", "kubernetes", "kopf", "requests", "urllib3", "socket",
    "subprocess", "http", "aiohttp", "torch", "deepspeed", "shutil",
}  # fmt: skip


def _imports(source: str, package: str) -> set[str]:
    """Absolute names imported by ``source``; ``package`` resolves relative imports."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = parts[: len(parts) - node.level + 1]
                prefix = ".".join(base + ([node.module] if node.module else []))
                if node.module is None:
                    names.update(f"{prefix}.{alias.name}" for alias in node.names)
                else:
                    names.add(prefix)
            else:
                names.add(node.module or "")
    return names


def _component(name: str) -> str:
    """rtrl's component of a dotted name: its first subpackage, or core's (``core.api``)."""
    parts = name.split(".")
    if len(parts) > 2 and parts[1] == "core":
        return f"core.{parts[2]}"
    return parts[1] if len(parts) > 1 else "__init__"


def violations(module: str, source: str, *, is_package: bool = False) -> list[str]:
    """What ``module`` (dotted name; an ``__init__`` when ``is_package``) imports that the
    layering forbids."""
    found = []
    package = module.split(".", maxsplit=1)[0]
    own = _component(module) if package == "rtrl" else None
    containing = module.removesuffix(".__init__") if is_package else module.rsplit(".", 1)[0]
    for name in sorted(_imports(source, containing)):
        top = name.split(".")[0]
        if package == "rtrl" and top == "rtrl_trainer":
            found.append(f"{module} imports {name}: the operator never imports the Job side")
        if top == "rtrl" and name != "rtrl":
            target = _component(name)
            if target.startswith("__"):  # rtrl/__init__.py: metadata only, imports nothing
                continue
            if package == "rtrl_trainer":
                if target not in TRAINER_ALLOWED:
                    found.append(f"{module} imports {name}: the Job side may not use {target}")
                continue
            assert own is not None
            if own not in ALLOWED:
                found.append(f"{module}: component {own!r} is not placed in the layering")
            elif target != own and "*" not in ALLOWED[own] and target not in ALLOWED[own]:
                found.append(f"{module} imports {name}: {own} may not import {target}")
        if own in PURE and top in IO_MODULES:
            found.append(f"{module} imports {name}: {own} is pure (no I/O)")
    return found


def _modules() -> list[tuple[str, Path]]:
    out = []
    for package, root in PACKAGES.items():
        for path in sorted(root.rglob("*.py")):
            parts = [package, *path.relative_to(root).with_suffix("").parts]
            out.append((".".join(parts), path))
    return out


MODULES = _modules()


@pytest.mark.parametrize(("module", "path"), MODULES, ids=[m for m, _ in MODULES])
def test_module_respects_the_layering(module: str, path: Path) -> None:
    is_package = module.endswith(".__init__")
    assert violations(module, path.read_text(), is_package=is_package) == []


def test_every_rtrl_component_is_placed() -> None:
    components = {_component(m) for m, _ in MODULES if m.startswith("rtrl.")}
    assert components <= set(ALLOWED), components - set(ALLOWED)


def test_the_checker_catches_violations() -> None:
    assert violations("rtrl.core.api.thing", "from rtrl.kube import client") == [
        "rtrl.core.api.thing imports rtrl.kube: core.api may not import kube"
    ]
    assert violations("rtrl.planning.core", "from ..handlers import x") == [
        "rtrl.planning.core imports rtrl.handlers: planning may not import handlers"
    ]
    assert violations("rtrl.planning.core", "import boto3") == [
        "rtrl.planning.core imports boto3: planning is pure (no I/O)"
    ]
    assert violations("rtrl.core.store.s3", "import rtrl_trainer.cli") == [
        "rtrl.core.store.s3 imports rtrl_trainer.cli: the operator never imports the Job side"
    ]
    assert violations("rtrl_trainer.train", "from rtrl.kube import jobs") == [
        "rtrl_trainer.train imports rtrl.kube: the Job side may not use kube"
    ]
    assert (
        violations("rtrl.handlers.rlcycle", "from ..kube import x\nfrom ..core.api import y") == []
    )
    assert violations("rtrl.core.api.__init__", "from .common import x", is_package=True) == []
    assert violations("rtrl.core.api.__init__", "from ...kube import x", is_package=True) == [
        "rtrl.core.api.__init__ imports rtrl.kube: core.api may not import kube"
    ]
    assert violations("rtrl.newthing", "from .api import x") == [
        "rtrl.newthing: component 'newthing' is not placed in the layering"
    ]
