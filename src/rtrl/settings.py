"""The operator's settings, read once from the environment when it starts.

Every ``RTRL_*`` variable the operator process reads is named here, with its default, so
that one place says what can be tuned; the rest of the operator gets a frozen
:class:`Settings` and never looks at ``os.environ``. A value that does not parse is an
error naming the variable, raised at startup rather than in the middle of a round.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from pydantic import ValidationError

from rtrl.core.api.errors import error_message, format_loc
from rtrl.core.api.policy import TenancyPolicy

T = TypeVar("T", int, float)


class SettingsError(ValueError):
    """An environment variable has a value the operator cannot use."""


@dataclass(frozen=True)
class Settings:
    # Seconds between reconciles when nothing happens (schedules are requeued exactly).
    resync_seconds: float = 30.0
    # A reconcile that fails (API or store unreachable) is retried after this delay.
    error_backoff_seconds: float = 5.0
    # If > 0, a round reads everything live at least this often (seconds), whatever the
    # cache holds. Off by default: the watches keep the cache whole (a re-list refreshes
    # it), and a timer would make every idle RLCycle list its namespace (bench/scale.py).
    live_read_seconds: float = 0.0
    # sys.setswitchinterval while the operator runs (see rtrl.kube.reconcile.start).
    switch_interval: float = 0.0005
    # A standby replica takes over this long after the active one stopped renewing its
    # peering record (kopf's default is 60 s).
    peering_lifetime: int = 60
    # A file that gets one JSON line per round (bench/operator_latency.py); None: no trace.
    round_trace: str | None = None
    # What an RLCycle's author may make the operator do (rtrl.core.api.policy), as the
    # chart's ``policy`` values in JSON (RTRL_POLICY); unset: nothing beyond its own objects.
    policy: TenancyPolicy = field(default_factory=TenancyPolicy)

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if environ is None else environ
        return cls(
            resync_seconds=_number(env, "RTRL_RESYNC_SECONDS", cls.resync_seconds),
            error_backoff_seconds=_number(
                env, "RTRL_ERROR_BACKOFF_SECONDS", cls.error_backoff_seconds
            ),
            live_read_seconds=_number(env, "RTRL_LIVE_READ_SECONDS", cls.live_read_seconds),
            switch_interval=_number(env, "RTRL_SWITCH_INTERVAL", cls.switch_interval),
            peering_lifetime=_integer(env, "RTRL_PEERING_LIFETIME", cls.peering_lifetime),
            round_trace=env.get("RTRL_ROUND_TRACE") or None,
            policy=_policy(env),
        )


def _policy(env: Mapping[str, str]) -> TenancyPolicy:
    raw = env.get(POLICY_ENV)
    if raw is None or not raw.strip():
        return TenancyPolicy()
    try:
        return TenancyPolicy.model_validate_json(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = format_loc(("policy", *first["loc"])) if first["loc"] else "policy"
        more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        raise SettingsError(f"{POLICY_ENV}: {where}: {error_message(first)}{more}") from None


POLICY_ENV = "RTRL_POLICY"


def _number(env: Mapping[str, str], variable: str, default: float) -> float:
    return _parsed(env, variable, default, float, "a number")


def _integer(env: Mapping[str, str], variable: str, default: int) -> int:
    return _parsed(env, variable, default, int, "an integer")


def _parsed(env: Mapping[str, str], variable: str, default: T, parse: Callable[[str], T],
            what: str) -> T:  # fmt: skip
    raw = env.get(variable)
    if raw is None:
        return default
    try:
        return parse(raw)
    except ValueError:
        raise SettingsError(f"{variable}={raw!r}: not {what} (default {default})") from None
