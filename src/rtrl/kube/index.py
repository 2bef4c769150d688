"""The fields a round finds its objects by, so that it reads its own and not its namespace's.

A round of one RLCycle reads its children by the ``rtrl.io/rlcycle`` label, and of the
namespace's Checkpoints only those it can look at (:func:`rtrl.kube.observe
.relevant_checkpoints`): its own (``spec.rlCycle``), the rolled-back ones (``status.phase``),
those its Deployments serve (``spec.uri``) and those it names, with their lineage (by name).
With 1,000 RLCycles of 10 Checkpoints in a namespace, a filter over the namespace made every
round cost 10,000 Checkpoints (bench/scale.py); the watch cache keeps these fields indexed
(:class:`rtrl.kube.cache.ObjectCache`), and a live read is indexed the same way
(:class:`ListFinder`), so both answer a round the same.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

from ..core.api.names import LABEL_RLCYCLE

# A field: its value in an object, or None when the object has none (not indexed).
Field = Callable[[Mapping[str, Any]], str | None]


def _label(obj: Mapping[str, Any]) -> str | None:
    value = ((obj.get("metadata") or {}).get("labels") or {}).get(LABEL_RLCYCLE)
    return str(value) if value is not None else None


def _spec(key: str) -> Field:
    def value(obj: Mapping[str, Any]) -> str | None:
        found = (obj.get("spec") or {}).get(key)
        return str(found) if found else None

    return value


def uri_key(uri: str | None) -> str | None:
    """A checkpoint URI as indexed: without its trailing slashes (planning's ``same_uri``)."""
    return uri.rstrip("/") or None if uri else None


def _uri(obj: Mapping[str, Any]) -> str | None:
    return uri_key((obj.get("spec") or {}).get("uri"))


def _phase(obj: Mapping[str, Any]) -> str | None:
    found = (obj.get("status") or {}).get("phase")
    return str(found) if found else None


LABEL = "label"  # the rtrl.io/rlcycle label: every kind
# kind -> field name -> value; every kind has LABEL
FIELDS: dict[str, dict[str, Field]] = {
    "Checkpoint": {"rlCycle": _spec("rlCycle"), "uri": _uri, "phase": _phase},
}


def fields_of(kind: str) -> dict[str, Field]:
    return {LABEL: _label, **FIELDS.get(kind, {})}


def values(kind: str, obj: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``(field, value)`` of each field ``obj`` has a value for."""
    out = []
    for field, get in fields_of(kind).items():
        value = get(obj)
        if value is not None:
            out.append((field, value))
    return out


class Finder(Protocol):
    """A namespace's objects of one kind, found by name or by a field's value."""

    def named(self, name: str) -> dict[str, Any] | None: ...

    def find(self, field: str, value: str) -> list[dict[str, Any]]: ...


class ListFinder:
    """A :class:`Finder` over a listed namespace (a live read)."""

    def __init__(self, kind: str, items: Iterable[dict[str, Any]]) -> None:
        self._names: dict[str, dict[str, Any]] = {}
        self._by: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for item in items:
            self._names[str((item.get("metadata") or {}).get("name"))] = item
            for pair in values(kind, item):
                self._by.setdefault(pair, []).append(item)

    def named(self, name: str) -> dict[str, Any] | None:
        return self._names.get(name)

    def find(self, field: str, value: str) -> list[dict[str, Any]]:
        return list(self._by.get((field, value), ()))


__all__ = ["FIELDS", "LABEL", "Finder", "ListFinder", "fields_of", "uri_key", "values"]
