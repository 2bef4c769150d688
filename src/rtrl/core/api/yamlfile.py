"""YAML as Kubernetes reads it.

PyYAML implements YAML 1.1, where ``1e-6`` (no dot) is a *string*; kubectl and the API
server read YAML 1.2, where it is a number. A manifest that the cluster accepts must not be
rejected offline, so every rtrl component loads YAML through this module.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import yaml


class _Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2's float syntax (exponent without a dot, no sign required)."""


_FLOAT = re.compile(
    r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.VERBOSE,
)
# Replace (not add to) the float resolver, keeping the other implicit resolvers.
_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:float"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT, list("-+0123456789."))


def load(text: str) -> Any:
    """The single YAML (or JSON) document in ``text``."""
    return yaml.load(text, Loader=_Loader)


def load_all(text: str) -> Iterator[Any]:
    """Every YAML document in ``text``."""
    return yaml.load_all(text, Loader=_Loader)
