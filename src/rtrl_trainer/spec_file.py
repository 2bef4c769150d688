"""Config files of the ``rtrl-job`` steps: the relevant part of an RLCycle spec.

The operator hands each Job the RLCycle as it is, and a person running a step locally
writes only the part it needs, so a config file may be a whole RLCycle manifest, its
``spec``, or a mapping with just the step's sections (``data``/``reward`` for stage,
``training`` for train). Fields are validated by the API's own types, and every error
names the file or flag and the field, in the words ``rtrl validate`` uses.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from rtrl.core.api.errors import error_message, format_loc
from rtrl.core.api.rlcycle import RLCycleSpec
from rtrl.core.api.yamlfile import load

M = TypeVar("M", bound=BaseModel)

# Top-level keys of an RLCycle spec a step does not use but must tolerate, so that the
# operator can pass the spec through as it is.
SPEC_KEYS = frozenset(
    field.alias or name for name, field in RLCycleSpec.model_fields.items()
) | frozenset(RLCycleSpec.model_fields)


class ConfigError(ValueError):
    """The configuration is unusable; the message names the file or flag and the field."""


def load_sections(
    path: Path,
    sections: Sequence[str],
    *,
    extra: Sequence[str] = (),
    optional: Sequence[str] = (),
) -> tuple[dict[str, dict[str, Any]], str]:
    """The mappings ``sections`` (and ``extra``, keys outside an RLCycle spec) of a config
    file, each ``{}`` when absent, and the path they sit under (``spec`` for a manifest,
    empty otherwise) for messages naming fields. ``optional`` keys are outside the spec
    too, but only returned where the file has them (``adapter: {}`` asks for defaults)."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"--config {path}: cannot read: {exc.strerror}") from None
    try:
        doc = load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML or JSON: {' '.join(str(exc).split())}") from None
    if doc is None:
        doc = {}
    wanted = " and/or ".join([*sections, *extra, *optional])
    if not isinstance(doc, dict):
        raise ConfigError(
            f"{path}: expected a mapping (an RLCycle, its spec, or {wanted}), "
            f"got {type(doc).__name__}"
        )
    base = ""
    if "spec" in doc or "kind" in doc or "apiVersion" in doc:
        if doc.get("kind", "RLCycle") != "RLCycle":
            raise ConfigError(f"{path}: kind: expected RLCycle, got {doc.get('kind')!r}")
        doc, base = doc.get("spec"), "spec"
        if not isinstance(doc, dict):
            raise ConfigError(f"{path}: spec: expected a mapping")
    where = f"{base}." if base else ""
    outside = (*extra, *optional)
    unknown = sorted(str(k) for k in doc if k not in SPEC_KEYS and k not in outside)
    if unknown:
        raise ConfigError(
            f"{path}: {where}{unknown[0]}: unknown field (expected {wanted}, "
            "or a whole RLCycle spec)"
        )
    found: dict[str, dict[str, Any]] = {}
    present = [name for name in optional if name in doc]
    for name in (*sections, *extra, *present):
        section = doc.get(name)
        if section is None:
            section = {}
        if not isinstance(section, dict):
            label = f"{where}{name}" if name in sections else name
            raise ConfigError(f"{path}: {label}: expected a mapping")
        found[name] = section
    return found, base


def to_json(value: Any) -> str:
    """A document as JSON for strict validation. YAML may hold dates or other non-JSON
    scalars; as strings they fail validation with a message naming the field."""
    return json.dumps(value, default=str)


def validation_problems(
    exc: ValidationError, *, where: str, path: str, flags: Mapping[str, str]
) -> str:
    """One clause per problem: ``FILE: spec.data.maturity: ...``, or ``--maturity
    (data.maturity): ...`` for a value that came from a flag."""
    lines = []
    for error in exc.errors():
        loc = tuple(error["loc"])
        flag = flags.get(str(loc[0])) if loc else None
        field = format_loc((path, *loc))
        if flag is not None:
            lines.append(f"{flag} ({field}): {error_message(error)}")
        else:
            lines.append(f"{where}: {field}: {error_message(error)}")
    return "; ".join(lines)


def validate_section(
    model: type[M], doc: Mapping[str, Any], *, where: str, path: str,
    flags: Mapping[str, str] | None = None,
) -> M:  # fmt: skip
    """``doc`` as the API type ``model`` (strict JSON mode, as the API server sees it), or a
    ConfigError naming the file or flag and each field at fault."""
    try:
        return model.model_validate_json(to_json(doc), strict=True)
    except ValidationError as exc:
        raise ConfigError(
            validation_problems(exc, where=where, path=path, flags=flags or {})
        ) from None


# --- times: the steps' --now / --since flags and the form result documents use -----------


def time_arg(text: str) -> datetime:
    """argparse type of the steps' ``--now`` / ``--since`` flags."""
    try:
        return parse_time(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_time(text: str) -> datetime:
    """An ISO 8601 instant (``2026-01-05T12:00:00Z``); a naive one is taken as UTC."""
    try:
        value = datetime.fromisoformat(text.strip())
    except ValueError:
        raise ValueError(f"{text!r} is not an ISO 8601 time (e.g. 2026-01-05T12:00:00Z)") from None
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def format_time(value: datetime | None) -> str | None:
    """``value`` as ISO 8601 UTC with a ``Z`` (the form stage.json uses), or None."""
    if value is None:
        return None
    return value.astimezone(UTC).isoformat().replace("+00:00", "Z")
