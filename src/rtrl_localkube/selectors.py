"""Label and field selectors on list and watch, as the API server parses and matches them."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from .kinds import api_error

_NAME = r"[A-Za-z0-9][-A-Za-z0-9_./]*"
_TERM = re.compile(
    rf"""^\s*(?:
        !\s*(?P<absent>{_NAME})
      | (?P<skey>{_NAME})\s+(?P<setop>in|notin)\s*\((?P<values>[^()]*)\)
      | (?P<ekey>{_NAME})\s*(?P<op>==|=|!=)\s*(?P<value>[-A-Za-z0-9_.]*)
      | (?P<present>{_NAME})
    )\s*$""",
    re.VERBOSE,
)


def _split_terms(selector: str) -> list[str]:
    """Split on the commas that are not inside ``(...)``."""
    terms: list[str] = []
    current: list[str] = []
    depth = 0
    for char in selector:
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        if char == "," and depth == 0:
            terms.append("".join(current))
            current = []
        else:
            current.append(char)
    terms.append("".join(current))
    return [term for term in terms if term.strip()]


def label_matcher(selector: str | None) -> Any:
    """A predicate on a labels dict for a Kubernetes label selector (set-based included)."""
    if not selector:
        return lambda labels: True
    checks: list[Callable[..., bool]] = []
    for term in _split_terms(selector):
        match = _TERM.match(term)
        if match is None:
            raise api_error(400, "BadRequest", f"unable to parse requirement: {term!r}")
        if match["absent"]:
            checks.append(lambda labels, k=match["absent"]: k not in labels)
        elif match["present"]:
            checks.append(lambda labels, k=match["present"]: k in labels)
        elif match["setop"]:
            values = {v.strip() for v in match["values"].split(",") if v.strip()}
            if match["setop"] == "in":
                checks.append(lambda labels, k=match["skey"], vs=values: labels.get(k) in vs)
            else:
                checks.append(lambda labels, k=match["skey"], vs=values: labels.get(k) not in vs)
        elif match["op"] == "!=":
            checks.append(lambda labels, k=match["ekey"], v=match["value"]: labels.get(k) != v)
        else:
            checks.append(lambda labels, k=match["ekey"], v=match["value"]: labels.get(k) == v)
    return lambda labels: all(check(labels) for check in checks)


def field_matcher(selector: str | None) -> Any:
    """A predicate on an object for ``path=value``/``path!=value`` field selectors."""
    if not selector:
        return lambda obj: True
    checks = []
    for term in _split_terms(selector):
        match = re.match(r"^\s*([A-Za-z0-9_.]+)\s*(==|=|!=)\s*(\S*)\s*$", term)
        if match is None:
            raise api_error(400, "BadRequest", f"invalid field selector: {term!r}")
        path, op, value = match.groups()

        def check(
            obj: Mapping[str, Any], path: str = path, op: str = op, value: str = value
        ) -> bool:
            current: Any = obj
            for part in path.split("."):
                current = current.get(part) if isinstance(current, Mapping) else None
            actual = "" if current is None else str(current)
            return (actual != value) if op == "!=" else (actual == value)

        checks.append(check)
    return lambda obj: all(check(obj) for check in checks)


def object_matcher(params: Mapping[str, str]) -> Any:
    labels = label_matcher(params.get("labelSelector"))
    fields = field_matcher(params.get("fieldSelector"))
    return lambda obj: labels((obj.get("metadata") or {}).get("labels") or {}) and fields(obj)
