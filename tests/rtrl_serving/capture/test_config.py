"""The sidecar's settings: flags over environment over defaults; a bad value names its flag."""

from __future__ import annotations

import pytest

from rtrl_serving.capture.config import ConfigError, parse_args

BASE = {"RTRL_CAPTURE_EVENTS": "s3://bucket/events/"}


def test_the_environment_sets_what_the_flags_do_not() -> None:
    env = {**BASE, "RTRL_CAPTURE_LISTEN": "127.0.0.1:9000", "RTRL_CAPTURE_COMMIT_MS": "20",
           "RTRL_CHECKPOINT_ID": "ck", "RTRL_MODEL_URI": "s3://m/ck/", "RTRL_ARM": "canary",
           "POD_NAME": "serving-1", "RTRL_CAPTURE_USER_HEADER": "X-User"}  # fmt: skip
    config = parse_args(["--commit-ms", "5"], env)
    assert (config.listen_host, config.listen_port, config.commit_ms) == ("127.0.0.1", 9000, 5.0)
    assert (config.checkpoint_id, config.model_uri, config.arm, config.pod) == (
        "ck", "s3://m/ck/", "canary", "serving-1")  # fmt: skip
    assert config.user_header == "X-User" and config.session_header == "X-Rtrl-Session"
    assert config.engine == "http://127.0.0.1:8000" and config.clock_header is None


@pytest.mark.parametrize(
    ("argv", "env", "named"),
    [
        ([], {}, "--events (env RTRL_CAPTURE_EVENTS)"),
        (["--events", "ftp://x/"], {}, "--events (env RTRL_CAPTURE_EVENTS)"),
        (["--listen", "nope"], BASE, "--listen (env RTRL_CAPTURE_LISTEN)"),
        (["--engine", "127.0.0.1:8000"], BASE, "--engine (env RTRL_CAPTURE_ENGINE)"),
        (["--commit-ms", "-1"], BASE, "--commit-ms (env RTRL_CAPTURE_COMMIT_MS)"),
        (["--logprobs-mode", "raw"], BASE, "--logprobs-mode"),
        (["--override-generation-config", "[1]"], BASE, "--override-generation-config"),
        ([], {**BASE, "RTRL_ARM": "blue"}, "RTRL_ARM"),
        (["--adapters-configmap", "composer-adapters"], BASE, "--adapters-configmap: needs"),
    ],
)
def test_a_bad_setting_is_refused_naming_it(
    argv: list[str], env: dict[str, str], named: str
) -> None:
    with pytest.raises(ConfigError, match=named.replace("(", r"\(").replace(")", r"\)")):
        parse_args(argv, env)
