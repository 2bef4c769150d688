"""The versioned base of the files the Job steps commit and the operator reads back.

Each step (``rtrl-job stage|train|eval|analyze``) runs in the trainer image and commits one
JSON document; the operator, ``kubectl rtrl``, the metrics and the demo read it, possibly
from another rtrl version than the one that wrote it. So each file is one model here, and
both sides go through it:

- a step builds the model and writes :meth:`StepResult.to_json`: a key the contract does
  not name is a bug in the step (:meth:`StepResult.written` refuses it);
- a reader calls :meth:`StepResult.read`: a file of an older version it knows is upgraded
  (``version`` absent: 1, the format before the files carried one), a newer one is refused
  with an error that says so, a key it does not know is kept and ignored (a newer step may
  add some), and a field of the wrong type is an error naming the field.

Pure: no I/O; the caller reads and commits the bytes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, ClassVar, Self

from pydantic import BaseModel, ConfigDict, ValidationError

# Errors named in a ResultError's message at most (a broken file may have hundreds).
MAX_ERRORS = 3


class ResultError(ValueError):
    """A document that is not a valid result file of its kind: its message names the file,
    the field and the problem (never the document's values beyond the one at fault)."""


class ResultPart(BaseModel):
    """A part of a result file: unknown keys kept and ignored, numbers finite."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class StepResult(ResultPart):
    """One result file. Subclasses set ``FILE``, ``VERSION`` (with ``version``'s default
    equal to it) and, from version 2 on, :meth:`upgrade`."""

    FILE: ClassVar[str] = ""
    VERSION: ClassVar[int] = 1

    version: int = 1

    @classmethod
    def upgrade(cls, doc: dict[str, Any], version: int) -> dict[str, Any]:
        """A document of an older ``version`` as this version reads it (none so far)."""
        return doc

    @classmethod
    def read(cls, doc: Any) -> Self:
        """The model of a committed document (parsed JSON); :class:`ResultError` when it is
        not one of a version this rtrl reads."""
        if not isinstance(doc, Mapping):
            raise ResultError(f"{cls.FILE}: not a JSON object but {type(doc).__name__}")
        version = doc.get("version", 1)
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise ResultError(f"{cls.FILE}: version: {version!r} is not a version number")
        if version > cls.VERSION:
            raise ResultError(
                f"{cls.FILE}: version {version} is newer than this rtrl reads (1 to "
                f"{cls.VERSION}): the step that wrote it is newer than the reader; upgrade rtrl"
            )
        data = cls.upgrade(dict(doc), version) if version < cls.VERSION else dict(doc)
        data["version"] = cls.VERSION
        return cls._validate(data)

    @classmethod
    def written(cls, fields: Mapping[str, Any]) -> Self:
        """The model of a document a step is about to write: as :meth:`read`, and a key the
        contract does not name (at any depth) is a :class:`TypeError` (a bug in the step)."""
        model = cls._validate({**fields, "version": cls.VERSION})
        unknown = _extra_keys(model, "")
        if unknown:
            raise TypeError(f"{cls.FILE}: not in the contract: {', '.join(unknown)}")
        return model

    @classmethod
    def _validate(cls, data: dict[str, Any]) -> Self:
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise ResultError(f"{cls.FILE}: {_words(exc)}") from None

    def document(self) -> dict[str, Any]:
        """The document as written: the version first, then the fields the step set."""
        dumped = self.model_dump(mode="json", exclude_unset=True)
        dumped.pop("version", None)
        return {"version": self.version, **dumped}

    def to_json(self, *, sort_keys: bool = False) -> str:
        """The file's bytes (NaN and infinity refused: JSON cannot carry them)."""
        return json.dumps(self.document(), indent=2, sort_keys=sort_keys, allow_nan=False) + "\n"


def _words(exc: ValidationError) -> str:
    """``metrics.0.baseline: Field required; decision: Input should be ...``"""
    parts = []
    for error in exc.errors()[:MAX_ERRORS]:
        where = ".".join(str(p) for p in error["loc"]) or "(document)"
        parts.append(f"{where}: {error['msg']}")
    more = exc.error_count() - MAX_ERRORS
    return "; ".join(parts) + (f" (and {more} more)" if more > 0 else "")


def _extra_keys(value: Any, where: str) -> list[str]:
    """The keys a model (and the models in it) holds that its class does not name."""
    found: list[str] = []
    if isinstance(value, ResultPart):
        found += [f"{where}{key}" for key in value.model_extra or {}]
        for name in type(value).model_fields:
            found += _extra_keys(getattr(value, name), f"{where}{name}.")
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            found += _extra_keys(item, f"{where}{index}.")
    elif isinstance(value, dict):
        for key, item in value.items():
            found += _extra_keys(item, f"{where}{key}.")
    return found
