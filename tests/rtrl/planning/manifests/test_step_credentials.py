"""Store credentials reach step pods as files of the credentials Secret, never as environment
variables (the eval step runs model-written code: a process's environment is inherited by
everything it starts and readable at /proc/<pid>/environ)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from rtrl.core.api.policy import UNRESTRICTED
from rtrl.core.api.rlcycle import RLCycleSpec
from rtrl.core.api.yamlfile import load
from rtrl.core.store import credentials
from rtrl.core.store.retries import (
    BODY_ATTEMPTS_ENV,
    MAX_ATTEMPTS_ENV,
    RETRY_MODE_ENV,
    RetrySettings,
    retry_settings,
)
from rtrl.planning.manifests.jobs import (
    CREDENTIAL_KEYS,
    CREDENTIALS_DIR_ENV,
    checkpoint_manifest,
    job_manifest,
)
from rtrl.planning.manifests.names import STEPS
from rtrl.planning.tenancy import job_service_account
from tests.conftest import REPO

STARTED = datetime(2026, 11, 29, tzinfo=UTC)


def spec(**storage: Any) -> RLCycleSpec:
    raw = load((REPO / "examples" / "rlcycle.yaml").read_text())["spec"]
    raw["storage"] = {**raw["storage"], **storage}
    raw["storage"] = {k: v for k, v in raw["storage"].items() if v is not None}
    return RLCycleSpec.model_validate(raw)


def manifests(cycle_spec: RLCycleSpec) -> dict[str, dict[str, Any]]:
    rlcycle = {"metadata": {"name": "composer", "namespace": "ml", "uid": "rlc-uid"}}
    checkpoint = checkpoint_manifest(
        rlcycle, cycle_spec, cycle=1, parent="composer-0", now=STARTED, trigger=None
    )
    checkpoint["metadata"]["uid"] = "ck-uid"
    return {
        step: job_manifest(
            rlcycle,
            cycle_spec,
            checkpoint,
            step=step,
            attempt=0,
            args=[step, "--out=x"],
            service_account=job_service_account(cycle_spec, UNRESTRICTED),
        )
        for step in STEPS
    }


def pod(job: dict[str, Any]) -> dict[str, Any]:
    return dict(job["spec"]["template"]["spec"])


@pytest.mark.parametrize("step", STEPS)
def test_no_step_carries_credentials_in_its_environment(step: str) -> None:
    job = manifests(spec())[step]
    (container,) = pod(job)["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert not [e for e in container["env"] if "secretKeyRef" in (e.get("valueFrom") or {})]
    assert "envFrom" not in container
    assert "AWS_ACCESS_KEY_ID" not in env and "AWS_SECRET_ACCESS_KEY" not in env
    assert env["RTRL_STORAGE_CREDENTIALS_DIR"] == {
        "name": "RTRL_STORAGE_CREDENTIALS_DIR", "value": "/var/run/secrets/rtrl/storage"
    }  # fmt: skip
    assert env["AWS_DEFAULT_REGION"]["value"] == "us-east-1"  # endpoint and region stay env


@pytest.mark.parametrize("step", STEPS)
def test_the_secret_is_a_read_only_volume_of_the_two_keys(step: str) -> None:
    spec_ = pod(manifests(spec())[step])
    (volume,) = [v for v in spec_["volumes"] if "secret" in v]
    assert volume["secret"] == {
        "secretName": "s3-creds",
        "items": [
            {"key": "AWS_ACCESS_KEY_ID", "path": "AWS_ACCESS_KEY_ID"},
            {"key": "AWS_SECRET_ACCESS_KEY", "path": "AWS_SECRET_ACCESS_KEY"},
        ],
        # owner root, group fsGroup: the step's uid 1000 reads through its group
        "defaultMode": 0o440,
    }
    (mount,) = [m for m in spec_["containers"][0]["volumeMounts"] if m["name"] == volume["name"]]
    assert mount == {
        "name": volume["name"], "mountPath": "/var/run/secrets/rtrl/storage", "readOnly": True
    }  # fmt: skip
    security = spec_["securityContext"]
    assert security["runAsUser"] == 1000 and security["fsGroup"] == 1000


def test_without_a_credentials_secret_nothing_is_mounted() -> None:
    for job in manifests(spec(credentialsSecret=None, serviceAccountName="rtrl-jobs")).values():
        spec_ = pod(job)
        assert not [v for v in spec_["volumes"] if "secret" in v]
        names = {e["name"] for e in spec_["containers"][0]["env"]}
        assert "RTRL_STORAGE_CREDENTIALS_DIR" not in names
        assert spec_["serviceAccountName"] == "rtrl-jobs"


def test_the_pod_and_the_store_agree_on_the_contract() -> None:
    assert CREDENTIALS_DIR_ENV == credentials.CREDENTIALS_DIR_ENV
    assert CREDENTIAL_KEYS == (credentials.ACCESS_KEY_FILE, credentials.SECRET_KEY_FILE)


@pytest.mark.parametrize("step", STEPS)
def test_storage_retries_reach_every_step_as_the_variables_the_store_reads(step: str) -> None:
    job = manifests(spec(retries={"mode": "adaptive", "maxAttempts": 20, "bodyAttempts": 7}))[step]
    (container,) = pod(job)["containers"]
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    settings = retry_settings(
        {"retry_mode": env[RETRY_MODE_ENV], "max_attempts": env[MAX_ATTEMPTS_ENV]}, env
    )
    assert settings == RetrySettings(mode="adaptive", max_attempts=20, body_attempts=7)
    # unset: the store's defaults, nothing in the pod's environment
    (plain,) = pod(manifests(spec())[step])["containers"]
    names = {e["name"] for e in plain["env"]}
    assert not names & {RETRY_MODE_ENV, MAX_ATTEMPTS_ENV, BODY_ATTEMPTS_ENV}


def test_storage_retries_are_bounded() -> None:
    with pytest.raises(ValueError, match=r"storage\.retries\.maxAttempts"):
        spec(retries={"maxAttempts": 1000})
