"""Offline validation of rtrl manifests, the two ways the cluster will judge them.

1. The pydantic models (what the operator enforces; the better messages). Validation is
   strict JSON-mode on the object as the API server stores it, so types follow the API
   server: ``8.0`` is the integer 8 (the server stores 8), ``8.5`` is not an integer,
   ``"true"`` is not a boolean.
2. The generated CRD schema, as the API server applies it: unknown fields rejected (strict
   field validation), scalar defaults filled in, the OpenAPI schema checked, then every
   ``x-kubernetes-validations`` CEL rule evaluated (with cel-python).

``rtrl validate`` reports both, so a manifest that passes here is accepted by the API
server and by the operator alike. Files come from users and may be hostile: they are read
within bounds (``core.api.manifest_yaml``: size, nesting, values, aliases expanded; no
duplicate keys, JSON types only), sizes are checked against the schema's ``maxItems`` and
``maxLength`` before the schema and CEL (whose cost grows with them), and any failure is a
one-line problem of its document, never a traceback. Rules the CRD cannot express (listed in
docs/validation.md) are caught by the models only; the operator then marks the RLCycle
with the ``InvalidSpec`` condition instead of acting on it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import Any

import celpy
import jsonschema
from celpy import celtypes
from celpy.evaluation import CELEvalError
from pydantic import ValidationError

from .core.api import API_VERSION, GROUP, RESOURCES, Resource
from .core.api.common import CEL_KEY
from .core.api.errors import error_message, format_loc
from .core.api.manifest_yaml import MAX_BYTES, Loaded, Refused, load_manifests, manifest_text
from .crdgen import openapi_schema

Json = Any


@dataclass(frozen=True, order=True)
class Problem:
    """One thing wrong with a manifest, located by a field path such as
    ``spec.rollout.steps[1].weight``."""

    path: str
    message: str
    source: str = "model"  # "model" (pydantic) or "crd" (schema / CEL)

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


@dataclass(frozen=True)
class Document:
    """One YAML document of a manifest file."""

    file: str
    index: int  # position in the file (0-based)
    body: Json

    @property
    def label(self) -> str:
        if isinstance(self.body, dict):
            kind = self.body.get("kind")
            meta = self.body.get("metadata")
            name = meta.get("name") if isinstance(meta, dict) else None
            return f"{_name(kind)}/{_name(name)}"
        return f"document {self.index + 1}"


def _name(value: Json) -> str:
    """A kind or a name for a label: itself if it is a short string, else ``?``."""
    return value if isinstance(value, str) and 0 < len(value) <= 253 else "?"


def _short(value: Json, limit: int = 60) -> str:
    """``repr(value)`` for a message, cut to ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def load_documents(path: Path) -> Iterator[Document | Refused]:
    """The non-empty documents of ``path``, read within bounds: a Document, or the
    Refused that says why one was refused. Unreadable files raise OSError, files too
    large or not UTF-8 ValueError."""
    with path.open("rb") as stream:
        text = manifest_text(stream.read(MAX_BYTES + 1))
    for loaded in load_manifests(text):
        yield (
            Document(str(path), loaded.index, loaded.body) if isinstance(loaded, Loaded) else loaded
        )


def is_rtrl_document(body: Json) -> bool:
    """Whether a document claims the rtrl.io group; others (a Deployment in the same
    file) are not rtrl's to judge and are skipped."""
    if not isinstance(body, dict):
        return True
    api_version = body.get("apiVersion")
    return not isinstance(api_version, str) or api_version.split("/")[0] == GROUP


def resource_for(body: Json) -> Resource | Problem:
    """The rtrl kind of a document, or the Problem that it is not one."""
    if not isinstance(body, dict):
        return Problem("", "a manifest must be a mapping (apiVersion, kind, metadata, spec)")
    api_version, kind = body.get("apiVersion"), body.get("kind")
    if api_version != API_VERSION:
        return Problem("apiVersion", f"must be {API_VERSION!r}, got {_short(api_version)}")
    if not isinstance(kind, str) or kind not in RESOURCES:
        return Problem("kind", f"must be one of {', '.join(RESOURCES)}, got {_short(kind)}")
    return RESOURCES[kind]


# --- 0. sizes, before anything whose cost grows with them ---------------------------------


def check_sizes(body: Json) -> list[Problem]:
    """Lists, maps and strings longer than the schema allows (``maxItems``,
    ``maxProperties``, ``maxLength``), found without descending into them: the schema, CEL
    and the models all grow with their size (50,000 rollout steps took over 10 s), so
    validation stops here when any is found. Messages in the models' words."""
    resource = resource_for(body)
    if isinstance(resource, Problem):
        return []
    problems = []
    stack: list[tuple[Json, Json, tuple[int | str, ...]]] = [(body, _schema(resource.kind), ())]
    while stack:
        value, schema, path = stack.pop()
        if isinstance(value, list):
            if len(value) > schema.get("maxItems", len(value)):
                message = f"List should have at most {schema['maxItems']} items, not {len(value)}"
                problems.append(Problem(format_loc(path), message, "crd"))
            elif "items" in schema:
                stack.extend((v, schema["items"], (*path, i)) for i, v in enumerate(value))
        elif isinstance(value, dict):
            if len(value) > schema.get("maxProperties", len(value)):
                limit = schema["maxProperties"]
                message = f"Dictionary should have at most {limit} items, not {len(value)}"
                problems.append(Problem(format_loc(path), message, "crd"))
            elif "properties" in schema:
                props = schema["properties"]
                stack.extend((value[k], props[k], (*path, k)) for k in value if k in props)
            elif isinstance(schema.get("additionalProperties"), dict):
                extra = schema["additionalProperties"]
                stack.extend((v, extra, (*path, k)) for k, v in value.items())
        elif isinstance(value, str) and len(value) > schema.get("maxLength", len(value)):
            message = f"String should have at most {schema['maxLength']} characters"
            problems.append(Problem(format_loc(path), message, "crd"))
    return sorted(problems)


# --- 1. the models ----------------------------------------------------------------------


def validate_with_models(body: Json) -> list[Problem]:
    """Problems the pydantic models find (empty when valid)."""
    resource = resource_for(body)
    if isinstance(resource, Problem):
        return [resource]
    # The operator sees what the API server stored, where null fields were pruned.
    body = _prune_nulls_and_default(body, _schema(resource.kind))
    try:
        resource.model.model_validate_json(json.dumps(body), strict=True)
    except ValidationError as exc:
        return sorted({Problem(format_loc(e["loc"]), error_message(e)) for e in exc.errors()})
    return []


# --- 2. the CRD schema ------------------------------------------------------------------


@cache
def _schema(kind: str) -> Json:
    return openapi_schema(RESOURCES[kind])


def _date_time(value: object) -> bool:
    if not isinstance(value, str):
        return True
    try:
        datetime.fromisoformat(value)
    except ValueError:
        return False
    return "T" in value


_FORMATS = jsonschema.FormatChecker(formats=())
_FORMATS.checks("date-time")(_date_time)


def _walk(
    value: Json, schema: Json, path: tuple[int | str, ...]
) -> Iterator[tuple[Json, Json, tuple[int | str, ...]]]:
    """Every (value, schema, path) pair of a document, parents before children."""
    yield value, schema, path
    if isinstance(value, dict) and "properties" in schema:
        for key, sub in schema["properties"].items():
            if key in value:
                yield from _walk(value[key], sub, (*path, key))
    elif isinstance(value, dict) and isinstance(schema.get("additionalProperties"), dict):
        for key, item in value.items():
            yield from _walk(item, schema["additionalProperties"], (*path, key))
    elif isinstance(value, list) and "items" in schema:
        for index, item in enumerate(value):
            yield from _walk(item, schema["items"], (*path, index))


def _prune_nulls_and_default(value: Json, schema: Json) -> Json:
    """What the API server stores: nulls of non-nullable fields dropped, scalar defaults
    filled in on every object that is present, and a whole number written as a float
    (``8.0``) stored as the integer it is where the schema wants an integer."""
    if schema.get("type") == "integer" and isinstance(value, float) and value.is_integer():
        return int(value) if abs(value) < 2**63 else value  # else not an int64: a float
    if isinstance(value, dict) and "properties" in schema:
        out = {k: v for k, v in value.items() if v is not None or k not in schema["properties"]}
        for key, sub in schema["properties"].items():
            if key in out:
                out[key] = _prune_nulls_and_default(out[key], sub)
            elif "default" in sub:
                out[key] = sub["default"]
        return out
    if isinstance(value, list) and "items" in schema:
        return [_prune_nulls_and_default(item, schema["items"]) for item in value]
    if isinstance(value, dict) and isinstance(schema.get("additionalProperties"), dict):
        return {
            k: _prune_nulls_and_default(v, schema["additionalProperties"]) for k, v in value.items()
        }
    return value


def _to_cel(value: Json, schema: Json) -> celtypes.Value:
    """A JSON value as the CEL type the API server gives it (``number`` is always double)."""
    kind = schema.get("type")
    if isinstance(value, bool):
        return celtypes.BoolType(value)
    if isinstance(value, int | float) and kind == "number":
        return celtypes.DoubleType(float(value))
    if isinstance(value, int):
        return celtypes.IntType(value)
    if isinstance(value, float):
        return celtypes.DoubleType(value)
    if isinstance(value, str):
        return celtypes.StringType(value)
    if isinstance(value, list):
        return celtypes.ListType([_to_cel(v, schema.get("items", {})) for v in value])
    if isinstance(value, dict):
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        return celtypes.MapType(
            {
                celtypes.StringType(k): _to_cel(
                    v, props.get(k, extra if isinstance(extra, dict) else {})
                )
                for k, v in value.items()
            }
        )
    raise TypeError(f"cannot express {type(value).__name__} in CEL")


@cache
def _cel_program(rule: str) -> celpy.Runner:
    env = celpy.Environment()
    return env.program(env.compile(rule))


def validate_with_crd(body: Json) -> list[Problem]:
    """Problems the generated CRD schema finds, as the API server would (empty when valid)."""
    resource = resource_for(body)
    if isinstance(resource, Problem):
        return [resource]
    sizes = check_sizes(body)
    if sizes:
        return sizes
    schema = _schema(resource.kind)
    body = _prune_nulls_and_default(body, schema)
    problems: set[Problem] = set()

    # Strict field validation: unknown fields (metadata is the API server's own business),
    # reported, then pruned as the API server prunes them before the schema and CEL.
    for value, sub, path in _walk(body, schema, ()):
        if not isinstance(value, dict) or "properties" not in sub:
            continue
        for key in [k for k in value if k not in sub["properties"]]:
            if path[:1] != ("metadata",):
                problems.add(Problem(format_loc((*path, key)), "unknown field", "crd"))
            del value[key]  # a copy: _prune_nulls_and_default built it

    validator = jsonschema.Draft4Validator(schema, format_checker=_FORMATS)
    bad_paths: set[tuple[int | str, ...]] = set()
    for error in validator.iter_errors(body):
        path = tuple(error.absolute_path)
        message = error.message
        if error.validator == "required":  # blame the missing field, as pydantic does
            missing = next(f for f in error.validator_value if f not in error.instance)
            path, message = (*path, missing), "required field is missing"
        bad_paths.add(path)
        problems.add(Problem(format_loc(path), _schema_message(error, message), "crd"))
    # every path that holds a bad value, itself or below: one set lookup per node
    holds_bad = {bad[:n] for bad in bad_paths for n in range(len(bad) + 1)}

    for value, sub, path in _walk(body, schema, ()):
        rules = sub.get(CEL_KEY)
        # Like the API server, CEL runs only on values that are well-typed.
        if not rules or path in holds_bad:
            continue
        activation = {"self": _to_cel(value, sub)}
        for rule in rules:
            try:
                result = _cel_program(rule["rule"]).evaluate(activation)
            except CELEvalError as exc:
                message = f"rule {rule['rule']!r} could not be evaluated: {exc.args[0]}"
                problems.add(Problem(format_loc(path), message, "crd"))
                continue
            if result != celtypes.BoolType(True):
                field_path = [p for p in rule.get("fieldPath", "").split(".") if p]
                problems.add(Problem(format_loc((*path, *field_path)), rule["message"], "crd"))
    return sorted(problems)


def _schema_message(error: jsonschema.ValidationError, message: str) -> str:
    """jsonschema's message with the value it quotes cut short (it quotes a whole list
    that is too long)."""
    quoted = repr(error.instance)
    if message.startswith(quoted) and len(quoted) > 60:
        return _short(error.instance) + message[len(quoted) :]
    return message


# --- all ----------------------------------------------------------------------------------


def validate_document(body: Json) -> list[Problem]:
    """All problems: sizes first, alone if any (the rest would pay for them); else the
    models' (better messages) plus any the CRD finds at other paths."""
    sizes = check_sizes(body)
    if sizes:
        return sizes
    model = validate_with_models(body)
    crd = validate_with_crd(body)
    seen = {p.path for p in model}
    return model + [p for p in crd if p.path not in seen]


@dataclass(frozen=True)
class FileReport:
    """The verdict on one manifest file."""

    path: Path
    checked: list[Document]
    skipped: list[Document]  # documents of other API groups
    problems: list[tuple[Document | None, Problem]]


def validate_file(path: Path) -> FileReport:
    """Validate every rtrl document of a manifest file. Every outcome is a list of one-line
    problems: a document refused when read, or one that fails in a way nobody foresaw
    (an "internal error"), costs only itself; the other documents are still judged."""
    try:
        loaded = list(load_documents(path))
    except (OSError, ValueError) as exc:
        return FileReport(path, [], [], [(None, Problem("", str(exc)))])
    except Exception as exc:  # a reader bug must not hide the other files' verdicts
        return FileReport(path, [], [], [(None, _internal_error(exc))])
    checked, skipped = [], []
    several = len(loaded) > 1 or any(d.index > 0 for d in loaded)
    problems: list[tuple[Document | None, Problem]] = []
    for item in loaded:
        if isinstance(item, Refused):  # refused when read
            where = Document(str(path), item.index, None) if several else None
            problems.append((where, Problem(item.problem.path, str(item.problem.located))))
        elif not is_rtrl_document(item.body):
            skipped.append(item)
        else:
            checked.append(item)
            try:
                found = validate_document(item.body)
            except Exception as exc:
                found = [_internal_error(exc)]
            problems += [(item, problem) for problem in found]
    if not loaded:
        problems.append((None, Problem("", "no YAML documents in file")))
    return FileReport(path, checked, skipped, problems)


def _internal_error(exc: Exception) -> Problem:
    """What rtrl validate says when it fails itself: one line, the error's type only (its
    message may quote the manifest, secrets included)."""
    return Problem("", f"internal error of rtrl validate ({type(exc).__name__}); please report it")
