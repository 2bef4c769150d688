"""The operator's settings: today's defaults when nothing is set, and an error naming the
variable when a value does not parse."""

from __future__ import annotations

import pytest

from rtrl.core.api.policy import TenancyPolicy
from rtrl.settings import Settings, SettingsError


def test_defaults_when_nothing_is_set() -> None:
    assert Settings.from_environment({}) == Settings(
        resync_seconds=30.0,
        error_backoff_seconds=5.0,
        live_read_seconds=0.0,
        switch_interval=0.0005,
        peering_lifetime=60,
        round_trace=None,
        policy=TenancyPolicy(),
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


def test_without_a_policy_nothing_beyond_an_rlcycles_own_objects_is_allowed() -> None:
    policy = Settings.from_environment({}).policy
    assert policy.images == [] and policy.service_accounts == [] and policy.endpoints == []
    assert policy.max_resources == {} and policy.secret_label == "rtrl.io/rlcycle-secret=true"


def test_the_policy_comes_from_the_charts_json() -> None:
    """RTRL_POLICY as the chart renders it from values (helm template, the chart's own)."""
    import json

    from tests.contract.test_chart import CHART, run_helm

    out = run_helm(
        "template", "rtrl", str(CHART), "--set", "policy.images={registry.example.com/t:*}",
        "--set", "policy.jobServiceAccount=rtrl-steps", "--set-json", "policy.maxResources=null",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    value = json.loads(_env_value(out.stdout, "RTRL_POLICY"))  # the YAML string's text
    policy = Settings.from_environment({"RTRL_POLICY": value}).policy
    assert policy.allows_image("registry.example.com/t:1.0")
    assert policy.job_service_account == "rtrl-steps" and policy.max_resources is None


def _env_value(rendered: str, name: str) -> str:
    lines = rendered.splitlines()
    at = next(i for i, line in enumerate(lines) if line.strip() == f"- name: {name}")
    return lines[at + 1].split("value: ", 1)[1]


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ('{"images": ["a b"]}', "RTRL_POLICY: policy.images[0]: "),
        ('{"maxResources": {"cpu": "lots"}}', "maxResources.cpu: 'lots' must be a Kubernetes"),
        ('{"endpoints": ["http://k:s@minio"]}', "endpoints[0]: must not hold credentials"),
        ('{"imagez": []}', "RTRL_POLICY: policy.imagez: unknown field"),
        ("{", "RTRL_POLICY: policy: Invalid JSON"),
    ],
)
def test_a_policy_that_does_not_parse_names_the_variable_and_field(raw: str, message: str) -> None:
    with pytest.raises(SettingsError) as error:
        Settings.from_environment({"RTRL_POLICY": raw})
    assert message in str(error.value)
    assert "k:s" not in str(error.value)
