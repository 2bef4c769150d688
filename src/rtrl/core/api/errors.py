"""Validation errors in the words a user needs: a field path such as
``spec.rollout.steps[1].weight`` and a message, from pydantic's error records.

Every place that validates API objects (``rtrl validate``, the operator, ``rtrl-job``
config files) reports errors this way, so a user sees one vocabulary everywhere.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from rtrl.core.redaction import redact

from .common import PATTERN_HINTS


def format_loc(loc: Iterable[int | str]) -> str:
    """``("spec", "steps", 1, "weight")`` -> ``spec.steps[1].weight``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def error_message(error: Mapping[str, Any]) -> str:
    """The message of one pydantic error record, without pydantic's jargon; never the
    input value, except for pattern mismatches of fields that hold no secrets, and those
    :func:`~rtrl.core.redaction.redact`-ed (a presigned URL given as a store URI)."""
    kind = error["type"]
    if kind == "extra_forbidden":
        return "unknown field"
    if kind == "missing":
        return "required field is missing"
    if kind == "string_pattern_mismatch":
        hint = PATTERN_HINTS.get(error["ctx"]["pattern"])
        if hint:
            return f"{redact(repr(error['input']))} {hint}"
    return str(error["msg"]).removeprefix("Value error, ")
