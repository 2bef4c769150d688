"""The operator's settings: today's defaults when nothing is set, and an error naming the
variable when a value does not parse."""

from __future__ import annotations

import pytest

from rtrl.settings import Settings, SettingsError


def test_defaults_when_nothing_is_set() -> None:
    assert Settings.from_environment({}) == Settings(
        resync_seconds=30.0,
        error_backoff_seconds=5.0,
        live_read_seconds=0.0,
        switch_interval=0.0005,
        peering_lifetime=60,
        round_trace=None,
    )


def test_values_from_the_environment() -> None:
    settings = Settings.from_environment(
        {"RTRL_RESYNC_SECONDS": "1", "RTRL_ERROR_BACKOFF_SECONDS": "0.5",
         "RTRL_PEERING_LIFETIME": "7", "RTRL_ROUND_TRACE": "/tmp/trace"}
    )  # fmt: skip
    assert (settings.resync_seconds, settings.error_backoff_seconds) == (1.0, 0.5)
    assert (settings.peering_lifetime, settings.round_trace) == (7, "/tmp/trace")
    assert Settings.from_environment({"RTRL_ROUND_TRACE": ""}).round_trace is None


@pytest.mark.parametrize("variable", ["RTRL_LIVE_READ_SECONDS", "RTRL_PEERING_LIFETIME"])
def test_a_bad_value_names_its_variable(variable: str) -> None:
    with pytest.raises(SettingsError, match=f"^{variable}='soon': not "):
        Settings.from_environment({variable: "soon"})
