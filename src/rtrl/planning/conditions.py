"""metav1.Condition bookkeeping: ``lastTransitionTime`` moves only when ``status`` does."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from rtrl.core.api.reasons import ConditionType

from .timeutil import iso

# The API's bound on a status or condition message (core/api); a longer one would make the
# server refuse the whole status write, in every round.
MAX_MESSAGE = 32768


def bounded(message: str) -> str:
    """``message``, cut to what the API accepts."""
    return message if len(message) <= MAX_MESSAGE else message[: MAX_MESSAGE - 1] + "…"


class Conditions:
    """The conditions of one object, updated in place from their previous values."""

    def __init__(self, previous: list[dict[str, Any]] | None, now: datetime, generation: int):
        self._previous = {c["type"]: c for c in previous or [] if "type" in c}
        self._now = now
        self._generation = generation
        self._current: dict[str, dict[str, Any]] = {}
        self.transitions: list[dict[str, Any]] = []

    def set(
        self, type_: ConditionType, status: bool | None, reason: str, message: str = ""
    ) -> None:
        text = "Unknown" if status is None else ("True" if status else "False")
        old = self._previous.get(type_)
        changed = old is None or old.get("status") != text
        self._current[type_] = {
            "type": type_,
            "status": text,
            "reason": reason,
            "message": bounded(message),
            "lastTransitionTime": (
                iso(self._now) if changed or old is None else old["lastTransitionTime"]
            ),
            "observedGeneration": self._generation,
        }
        if changed or (old is not None and old.get("reason") != reason):
            self.transitions.append(self._current[type_])

    def previous_status(self, type_: ConditionType) -> str | None:
        old = self._previous.get(type_)
        return None if old is None else old.get("status")

    def previous_message(self, type_: ConditionType) -> str:
        return str((self._previous.get(type_) or {}).get("message") or "")

    def to_list(self) -> list[dict[str, Any]]:
        """All conditions, those not set this time kept as they were."""
        merged = {**self._previous, **self._current}
        return [merged[t] for t in sorted(merged)]
