"""Everything rtrl changes inside kopf, in one place, against the one kopf version it pins.

kopf's public API does not reach these three; each is a private part of kopf 1.45 that rtrl
replaces or wraps, and :func:`install` applies them once (``rtrl.handlers`` calls it). The
logs read the running handler's object through :func:`handler_body`, also private to kopf.
:data:`FINGERPRINTS` holds a hash of the source of every kopf function a fix stands in for or
relies on: :func:`drifted` names those whose source changed, so that a kopf upgrade that
moves them fails ``tests/rtrl/test_kopf_fixes.py`` instead of the operator in production.

1. **Index readiness, linear.** kopf holds every object's first event until the index
   handlers have seen the whole initial listing: each listed object gets a toggle in one
   ToggleSet, dropped once indexed, and each object's worker then waits on the set's
   condition. kopf notifies every waiter at each toggle made or dropped, and each re-evaluates
   the set: quadratic in the objects listed (1,000 RLCycles and 10,000 Checkpoints: over 10
   minutes before the first round, bench/scale.py). Adding or dropping a toggle changes no
   toggle's own state, at most the set's: so notify only when the set's state changed.
2. **No finalizer for the reconciler daemon.** kopf puts a finalizer on every object that has
   a daemon, so that it can stop the daemon before the object goes. rtrl's reconciler needs
   none (it ends once its RLCycle is gone; the garbage collector removes the children), and a
   finalizer would make every RLCycle, and its CRD, undeletable whenever no operator runs.
3. **A watch stream that breaks mid-event is reconnected, not fatal.** kopf decodes each line
   of a watch response with ``json.loads(line.decode())``; a line that is not UTF-8 JSON (the
   last line of a stream cut mid-event, bytes damaged on the way) raises out of kopf's watch
   loop, which ends its watcher task for good: the operator stays up and never hears of that
   kind again (kopf issue 1276, open). Here such a stream ends with a warning instead, and
   kopf's loop watches again from the last resourceVersion it saw, as after any disconnect.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import kopf
from kopf._cogs.aiokits import aiotoggles
from kopf._cogs.clients import api as kopf_api
from kopf._cogs.clients import watching as kopf_watching
from kopf._core.actions import execution as kopf_execution

KOPF_VERSION = "1.45.2"
logger = logging.getLogger(__name__)

# The source of each kopf function the fixes replace or rely on, hashed (sha256, first 16 hex
# digits) as kopf 1.45.2 ships it: rtrl's versions below assume exactly this behaviour.
FINGERPRINTS: dict[str, str] = {
    "aiotoggles.ToggleSet.make_toggle": "354b83ba5188615f",
    "aiotoggles.ToggleSet.drop_toggle": "434b23b721ea2e78",
    "aiotoggles.ToggleSet.drop_toggles": "497f86cc1160dd77",
    "aiotoggles.ToggleSet.__init__": "e359f1392c56d4ce",
    "kopf_api.stream": "5ef0c6f1a54acf3b",
    "kopf_watching.watch_objs": "52b7dcbdb6cd6315",
    "kopf_watching.continuous_watch": "e84c2b044d828e98",
}
_ORIGINAL: dict[str, Callable[..., Any]] = {
    "aiotoggles.ToggleSet.make_toggle": aiotoggles.ToggleSet.make_toggle,
    "aiotoggles.ToggleSet.drop_toggle": aiotoggles.ToggleSet.drop_toggle,
    "aiotoggles.ToggleSet.drop_toggles": aiotoggles.ToggleSet.drop_toggles,
    "aiotoggles.ToggleSet.__init__": aiotoggles.ToggleSet.__init__,
    "kopf_api.stream": kopf_api.stream,
    "kopf_watching.watch_objs": kopf_watching.watch_objs,
    "kopf_watching.continuous_watch": kopf_watching.continuous_watch,
}


def fingerprint(function: Callable[..., Any]) -> str:
    return hashlib.sha256(inspect.getsource(function).encode()).hexdigest()[:16]


def drifted() -> list[str]:
    """The kopf functions whose source is not the one the fixes were written against."""
    return [name for name, digest in FINGERPRINTS.items()
            if fingerprint(_ORIGINAL[name]) != digest]  # fmt: skip


# --- 1. index readiness, linear ------------------------------------------------------------
async def _make_toggle(
    self: aiotoggles.ToggleSet, __val: bool = False, *, name: str | None = None
) -> aiotoggles.Toggle:
    toggle = aiotoggles.Toggle(__val, name=name, condition=self._condition)
    async with self._condition:
        before = self.is_on()
        self._toggles.add(toggle)
        if self.is_on() != before:
            self._condition.notify_all()
    return toggle


async def _drop_toggles(self: aiotoggles.ToggleSet, toggles: Any) -> None:
    async with self._condition:
        before = self.is_on()
        self._toggles.difference_update(toggles)
        if self.is_on() != before:
            self._condition.notify_all()


async def _drop_toggle(self: aiotoggles.ToggleSet, toggle: aiotoggles.Toggle) -> None:
    await _drop_toggles(self, (toggle,))


# --- 2. no finalizer for a daemon ------------------------------------------------------------
def without_finalizer(registry: kopf.OperatorRegistry, handler_id: str) -> None:
    """The daemon ``handler_id`` of ``registry`` requires no finalizer; objects that still
    carry it from an earlier rtrl lose it (kopf removes a finalizer no handler requires)."""
    spawning = registry._spawning  # kopf 1.45 (pinned) keeps the daemons here
    for index, handler in enumerate(spawning._handlers):
        if handler.id == handler_id:
            spawning._handlers[index] = dataclasses.replace(handler, requires_finalizer=False)
            return
    raise RuntimeError(f"kopf registered no daemon {handler_id!r}")


# --- 3. a broken watch stream is reconnected -------------------------------------------------
async def _stream(url: str, **kwargs: Any) -> AsyncIterator[Any]:
    """kopf's ``api.stream``, ending quietly where a line does not decode: kopf's watch loop
    then watches again from the last resourceVersion it yielded (nothing is skipped)."""
    try:
        async for event in _ORIGINAL["kopf_api.stream"](url, **kwargs):
            yield event
    except ValueError as exc:  # UnicodeDecodeError and json.JSONDecodeError
        # the URL names the kind and namespace; its query holds no credentials
        logger.warning(
            "a watch stream broke mid-event (%s at byte %s); watching again: %s",
            type(exc).__name__, getattr(exc, "start", getattr(exc, "pos", "?")),
            url.split("?", maxsplit=1)[0],
        )  # fmt: skip


# --- the running handler's object, for the logs ----------------------------------------------
def handler_body() -> Any:
    """The body of the object whose kopf handler runs in this context (None outside one):
    what rtrl.logs names in each line. kopf keeps it in a private context variable."""
    return getattr(kopf_execution.cause_var.get(None), "body", None)


def install() -> None:
    """Apply the fixes to the kopf imported in this process (idempotent)."""
    aiotoggles.ToggleSet.make_toggle = _make_toggle  # type: ignore[method-assign]
    aiotoggles.ToggleSet.drop_toggle = _drop_toggle  # type: ignore[method-assign]
    aiotoggles.ToggleSet.drop_toggles = _drop_toggles  # type: ignore[method-assign]
    kopf_api.stream = _stream  # watching.py calls it as api.stream
