"""A canary's records (a Checkpoint's ``status.rollout``, one per step) as the typed
:class:`~rtrl.core.api.checkpoint.RolloutRecord`: read once when a canary round starts
(:func:`read_records`), changed as attributes, written back by :func:`written`.

A record another rtrl version wrote may hold a field this one does not know: it is kept as
it was and written back, never acted on (as Kubernetes clients treat fields they do not
know). A value this rtrl cannot take (a weight over 100, a decision it has no word for) is
a :class:`RecordError` naming the field: the canary cannot be driven from a record it
cannot read, and :mod:`.rollout` rolls it back saying so."""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, ValidationError

from rtrl.core.api.checkpoint import RolloutRecord
from rtrl.core.api.errors import error_message, format_loc


class Record(RolloutRecord):
    """A record as a round holds it: fields this rtrl does not know are kept as they were."""

    model_config = ConfigDict(extra="allow")


class RecordError(ValueError):
    """A record holds a value this rtrl cannot take; the message names the field."""


def read_records(ck: dict[str, Any]) -> list[Record]:
    """``ck``'s canary records, oldest first; a :class:`RecordError` for the first one this
    rtrl cannot read."""
    raw = (ck.get("status") or {}).get("rollout") or []
    if not isinstance(raw, list):
        raise RecordError(f"status.rollout: a list of records expected, not {type(raw).__name__}")
    records = []
    for i, entry in enumerate(raw):
        try:
            records.append(Record.model_validate(entry))
        except ValidationError as exc:
            errors = exc.errors()
            more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
            where = format_loc(("status", "rollout", i, *errors[0]["loc"]))
            raise RecordError(f"{where}: {error_message(errors[0])}{more}") from None
    return records


def written(records: list[Record]) -> list[dict[str, Any]]:
    """``records`` as ``status.rollout`` holds them (camelCase, unset fields left out)."""
    return [r.model_dump(mode="json", by_alias=True, exclude_none=True) for r in records]


def step_index(records: list[Record]) -> int:
    """The index in ``spec.rollout.steps`` the current canary record runs: its ``step``, or
    for a record written before rtrl kept it, the number of records before it."""
    step = records[-1].step
    return step if step is not None else len(records) - 1
