"""Writes charts/rtrl-operator/README.md from Chart.yaml and the `# --` comments of
values.yaml (the helm-docs convention), so that `helm show readme` tells chart users every
value, its type, its default and what it does. tests/contract/test_chart.py fails when the
committed README differs from what this prints.

    python tools/chart_readme.py          # rewrite the README
    python tools/chart_readme.py --check  # exit 1 when it is out of date
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import yaml

CHART = Path(__file__).resolve().parent.parent / "charts" / "rtrl-operator"
KEY = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z0-9_]+):")
INTRO = """\
## Install

```sh
helm install rtrl charts/rtrl-operator -n rtrl-system --create-namespace \\
    --set image.repository=REGISTRY/rtrl-operator     # built from images/operator/Dockerfile
kubectl rollout status deployment/rtrl-operator -n rtrl-system
```

Then declare an RLCycle next to the inference Deployment it improves: the repository's
`examples/` hold a namespace, the object-store Secret (placeholders), the Deployment, the
base Checkpoint and the RLCycle, in the order to apply them (docs/helm.md, "Quick start").
`helm uninstall` keeps the CRDs, and so every RLCycle and Checkpoint (`crds.keep`).
"""


def described_keys(text: str) -> list[tuple[str, str]]:
    """(dotted key path, description) for every key preceded by a `# --` comment."""
    out: list[tuple[str, str]] = []
    path: list[tuple[int, str]] = []
    pending: list[str] | None = None
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("# --"):
            pending = [stripped.removeprefix("# --").strip()]
            continue
        if stripped.startswith("#") and pending is not None:
            pending.append(stripped.removeprefix("#").strip())
            continue
        match = KEY.match(line)
        if match is None:
            if not stripped:
                pending = None
            continue
        indent = len(match["indent"])
        while path and path[-1][0] >= indent:
            path.pop()
        path.append((indent, match["key"]))
        if pending is not None:
            out.append((".".join(k for _, k in path), " ".join(pending)))
        pending = None
    return out


def lookup(values: dict[str, Any], dotted: str) -> Any:
    node: Any = values
    for part in dotted.split("."):
        node = node[part]
    return node


def type_name(value: Any) -> str:
    for kind, name in ((bool, "bool"), (int, "int"), (float, "float"), (str, "string")):
        if isinstance(value, kind):
            return name
    return "list" if isinstance(value, list) else "object"


def cell(text: str) -> str:
    return text.replace("|", "\\|")


def readme() -> str:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    text = (CHART / "values.yaml").read_text()
    values = yaml.safe_load(text)
    lines = [
        f"# {chart['name']}",
        "",
        f"![Version: {chart['version']}](https://img.shields.io/badge/Version-{chart['version']}-informational)"
        f" ![AppVersion: {chart['appVersion']}](https://img.shields.io/badge/AppVersion-{chart['appVersion']}-informational)",
        "",
        " ".join(chart["description"].split()),
        "",
        f"Home: {chart['home']}. Kubernetes {chart['kubeVersion']}.",
        "",
        INTRO,
        "## Values",
        "",
        "Generated from values.yaml by tools/chart_readme.py; values.schema.json checks each one.",
        "",
        "| Key | Type | Default | Description |",
        "|-----|------|---------|-------------|",
    ]
    for dotted, description in described_keys(text):
        value = lookup(values, dotted)
        default = json.dumps(value, separators=(",", ":"))
        lines.append(
            f"| `{dotted}` | {type_name(value)} | `{cell(default)}` | {cell(description)} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    target = CHART / "README.md"
    text = readme()
    if "--check" in argv:
        if not target.exists() or target.read_text() != text:
            print(f"{target} is out of date: run python tools/chart_readme.py", file=sys.stderr)
            return 1
        return 0
    target.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
