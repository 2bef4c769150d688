"""A stand-in for a Gateway API implementation's data plane (no gateway controller or proxy
runs here): which Service an HTTPRoute sends a request to, by the matching rules of the
Gateway API spec (``HTTPRouteRule.matches``, v1.6):

- a match applies when its path (``Exact``; ``PathPrefix`` element by element, a trailing
  ``/`` ignored), its method, every header (names case-insensitive, only the first entry
  of a name counts; ``Exact`` or ``RegularExpression``, matched whole as RE2 does in
  Envoy) and every query parameter (names case-sensitive) agree with the request;
- among the applicable matches of all rules, precedence goes to an ``Exact`` path match,
  then the ``PathPrefix`` match with the most characters, then a method match, then the
  most header matches, then the most query parameter matches; ties go to the first rule
  in list order (one route only: the cross-route tie-breaks, creation time and name, do
  not arise);
- the chosen rule's backendRefs are picked in proportion to their ``weight`` (default 1;
  0 never).

And the edge in front of it: :func:`bucket`, ``fnv1a_32(unit id) mod 100``, the value an
auth proxy writes into the ``rollout.bucketHeader`` header (docs/canary.md).
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

DEFAULT_MATCH: dict[str, Any] = {"path": {"type": "PathPrefix", "value": "/"}}


def fnv1a_32(data: bytes) -> int:
    value = 0x811C9DC5
    for byte in data:
        value = ((value ^ byte) * 0x01000193) & 0xFFFFFFFF
    return value


def bucket(unit_id: str) -> int:
    """The bucket the edge gives a user (or session): a stable hash of its id, mod 100."""
    return fnv1a_32(unit_id.encode()) % 100


@dataclass(frozen=True)
class Request:
    path: str = "/"
    method: str = "GET"
    headers: Mapping[str, str] = field(default_factory=dict)
    query: Mapping[str, str] = field(default_factory=dict)

    def header(self, name: str) -> str | None:
        return next((v for k, v in self.headers.items() if k.lower() == name.lower()), None)


def _value_matches(kind: str, expected: str, actual: str | None) -> bool:
    if actual is None:
        return False
    if kind == "RegularExpression":
        return re.fullmatch(expected, actual) is not None
    return actual == expected


def path_matches(path_match: Mapping[str, Any], path: str) -> bool:
    kind = path_match.get("type", "PathPrefix")
    value = str(path_match.get("value", "/"))
    if kind == "Exact":
        return path == value
    if kind == "RegularExpression":
        return re.fullmatch(value, path) is not None
    prefix = value.rstrip("/")
    return not prefix or path == prefix or path.startswith(prefix + "/")


def _first_per_name(entries: list[dict[str, Any]], fold: bool) -> list[dict[str, Any]]:
    seen: set[str] = set()
    out = []
    for entry in entries:
        name = str(entry["name"]).lower() if fold else str(entry["name"])
        if name not in seen:
            seen.add(name)
            out.append(entry)
    return out


def applies(match: Mapping[str, Any], request: Request) -> bool:
    if not path_matches(match.get("path") or DEFAULT_MATCH["path"], request.path):
        return False
    if match.get("method") and match["method"] != request.method:
        return False
    for entry in _first_per_name(list(match.get("headers") or []), fold=True):
        actual = request.header(str(entry["name"]))
        if not _value_matches(entry.get("type", "Exact"), str(entry["value"]), actual):
            return False
    for entry in _first_per_name(list(match.get("queryParams") or []), fold=False):
        actual = request.query.get(str(entry["name"]))
        if not _value_matches(entry.get("type", "Exact"), str(entry["value"]), actual):
            return False
    return True


def precedence(match: Mapping[str, Any]) -> tuple[int, int, int, int, int]:
    """Higher wins: exact path, prefix length, method, header matches, query matches."""
    path = match.get("path") or DEFAULT_MATCH["path"]
    kind = path.get("type", "PathPrefix")
    return (
        int(kind == "Exact"),
        len(str(path.get("value", "/"))) if kind == "PathPrefix" else 0,
        int(bool(match.get("method"))),
        len(_first_per_name(list(match.get("headers") or []), fold=True)),
        len(_first_per_name(list(match.get("queryParams") or []), fold=False)),
    )


def select_rule(route: Mapping[str, Any], request: Request) -> dict[str, Any] | None:
    """The rule that serves ``request``; None where no rule matches (a 404)."""
    best: tuple[tuple[int, ...], dict[str, Any]] | None = None
    for rule in (route.get("spec") or {}).get("rules") or []:
        for match in rule.get("matches") or [DEFAULT_MATCH]:
            if applies(match, request):
                key = precedence(match)
                if best is None or key > best[0]:  # strictly: ties stay with the first
                    best = (key, rule)
    return best[1] if best else None


def pick(refs: list[dict[str, Any]], rng: random.Random) -> str | None:
    """A backendRef's Service name, in proportion to the weights; None if all are 0."""
    weights = [int(ref.get("weight", 1)) for ref in refs]
    total = sum(weights)
    if total <= 0:
        return None
    at = rng.randrange(total)
    for ref, weight in zip(refs, weights, strict=True):
        if at < weight:
            return str(ref["name"])
        at -= weight
    raise AssertionError("unreachable")


def backend(route: Mapping[str, Any], request: Request, rng: random.Random) -> str | None:
    """The Service ``request`` reaches through ``route``; None for a 404 or a 500."""
    rule = select_rule(route, request)
    return pick(list(rule.get("backendRefs") or []), rng) if rule else None
