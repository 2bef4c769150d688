"""The two patch formats the API server applies, as the in-memory cluster and the emulator
apply them: RFC 7386 JSON merge patches and RFC 6902 JSON patches (``test`` included, which
is how the operator's writes guard against a lost update).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any


class PatchConflictError(Exception):
    """A JSON patch's ``test`` failed or its path does not exist (the API server's 422)."""


def _unescape(token: str) -> str:
    return token.replace("~1", "/").replace("~0", "~")


def _parent(doc: Any, path: str) -> tuple[Any, str]:
    if not path.startswith("/"):
        raise PatchConflictError(f"bad JSON pointer {path!r}")
    tokens = [_unescape(t) for t in path[1:].split("/")]
    node = doc
    for token in tokens[:-1]:
        try:
            node = node[int(token)] if isinstance(node, list) else node[token]
        except (KeyError, IndexError, ValueError, TypeError) as exc:
            raise PatchConflictError(f"path {path!r} does not exist") from exc
    return node, tokens[-1]


def _get(doc: Any, path: str) -> Any:
    node, last = _parent(doc, path)
    try:
        return node[int(last)] if isinstance(node, list) else node[last]
    except (KeyError, IndexError, ValueError, TypeError) as exc:
        raise PatchConflictError(f"path {path!r} does not exist") from exc


def json_patch(doc: dict[str, Any], ops: list[dict[str, Any]]) -> dict[str, Any]:
    """RFC 6902 ``test``/``add``/``replace``/``remove`` on a copy of ``doc``; all or
    nothing: a failed ``test`` or a missing path raises :class:`PatchConflictError`."""
    out = copy.deepcopy(doc)
    for op in ops:
        kind, path = op.get("op"), str(op.get("path", ""))
        if kind == "test":
            if _get(out, path) != op.get("value"):
                raise PatchConflictError(f"test of {path} failed")
            continue
        if kind not in ("add", "replace", "remove"):
            raise PatchConflictError(f"unsupported op {kind!r}")
        node, last = _parent(out, path)
        value = copy.deepcopy(op.get("value"))
        key: int | str
        if isinstance(node, list):
            key = len(node) if last == "-" else int(last)
            if kind == "add" and 0 <= key <= len(node):
                node.insert(key, value)
                continue
            if not 0 <= key < len(node):
                raise PatchConflictError(f"index {last} of {path} out of range")
        elif isinstance(node, dict):
            if kind == "add":
                node[last] = value
                continue
            if last not in node:
                raise PatchConflictError(f"{kind} {path}: no such member")
            key = last
        else:
            raise PatchConflictError(f"{path}: parent is not a container")
        if kind == "replace":
            node[key] = value
        else:
            del node[key]
    return out


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch: objects merge recursively, ``None`` deletes, the rest
    (lists included) replaces."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out
