"""Every store path of every CLI (``rtrl shards validate``, ``rtrl-job stage|train|eval|
analyze|seal``, and the servers ``rtrl-capture`` and ``rtrl-feedback`` as they start), given
what a user may paste or a cluster may hold: a presigned https URL or a store URI with a
signed query or credentials as a URI, an endpoint with credentials or a query, a bucket
that does not exist, an endpoint that answers nothing. Whatever the path,
the command ends in one line naming the problem, exit 2 for usage (1 where a step's store
failed at run time, which a rerun may fix), and nothing secret is printed anywhere: no
presigned query value, no userinfo, no access key of the environment.

Found broken (issue 32): ``rtrl-job stage --shards 'https://user:pass@host/x?X-Amz-
Signature=...'`` echoed the URL whole (so did analyze, and ``rtrl shards validate
--checkpoint``); a store URI with a query given to stage or analyze, and an endpoint with
credentials given to ``rtrl shards validate`` (from the flag or $AWS_ENDPOINT_URL), ended in
a traceback. Later, with the servers: ``rtrl-capture`` given an endpoint with credentials in
$AWS_ENDPOINT_URL ended in a traceback, and ``rtrl-feedback --endpoint-url`` with a signed
query started serving (every write then failing)."""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import console_script

# Secret parts of the hostile values below: none may be printed.
SECRETS = ("SIGSECRET", "CREDSECRET", "pw-secret", "AKIATESTSECRET", "envsecretkey")
PRESIGNED = (
    "https://user:pw-secret@bucket.s3.example.com/x?X-Amz-Algorithm=AWS4-HMAC-SHA256"
    "&X-Amz-Credential=CREDSECRET&X-Amz-Signature=SIGSECRET"
)
QUERY = "s3://bucket-a/prefix/?X-Amz-Signature=SIGSECRET"
FILE_QUERY = "file:///tmp/x/?X-Amz-Signature=SIGSECRET"
USERINFO = "s3://AKIATESTSECRET:pw-secret@bucket-a/x/"
BAD_URIS = {"presigned": PRESIGNED, "query": QUERY, "file-query": FILE_QUERY, "userinfo": USERINFO}
BAD_ENDPOINTS = {
    "userinfo": "http://AKIATESTSECRET:pw-secret@127.0.0.1:9/",
    "query": "http://127.0.0.1:9/?X-Amz-Signature=SIGSECRET",
}


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """The environment of a pod whose keys are secret (they must never be printed)."""
    empty = tmp_path / "no-aws-config"
    environ = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    return environ | {
        "AWS_ACCESS_KEY_ID": "AKIATESTSECRET",
        "AWS_SECRET_ACCESS_KEY": "envsecretkey",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_CONFIG_FILE": str(empty),
        "AWS_SHARED_CREDENTIALS_FILE": str(empty),
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_MAX_ATTEMPTS": "1",
        "RTRL_S3_BODY_ATTEMPTS": "1",
    }


@pytest.fixture
def dirs(tmp_path: Path) -> dict[str, str]:
    out = {}
    for name in ("shards", "parent", "data", "heldout"):
        (tmp_path / name).mkdir()
        out[name] = (tmp_path / name).as_uri() + "/"
    for name in ("out", "out2", "out3"):
        out[name] = (tmp_path / name).as_uri() + "/"
    out["spool"] = str(tmp_path / "spool")
    (tmp_path / "token").write_text("a-feedback-token\n")
    out["token"] = str(tmp_path / "token")
    return out


NOW = ("--now", "2026-01-05T12:00:00Z")


def commands(d: dict[str, str], uri: str) -> Iterator[tuple[str, list[str]]]:
    """(name, argv) of each store-taking flag of each CLI, given ``uri``."""
    rtrl, job = console_script("rtrl"), console_script("rtrl-job")
    yield "shards validate URI", [rtrl, "shards", "validate", uri]
    yield "shards validate --checkpoint", [rtrl, "shards", "validate", d["shards"],
                                           "--checkpoint", uri]  # fmt: skip
    stage = [job, "stage", "--checkpoint", "c", *NOW]
    yield "stage --shards", [*stage, "--shards", uri, "--out", d["out"]]
    yield "stage --out", [*stage, "--shards", d["shards"], "--out", uri]
    yield "stage --parent", [*stage, "--shards", d["shards"], "--out", d["out"], "--parent", uri]
    analyze = [job, "analyze", "--baseline", "a", "--canary", "b", *NOW]
    yield "analyze --shards", [*analyze, "--shards", uri, "--out", d["out"]]
    yield "analyze --out", [*analyze, "--shards", d["shards"], "--out", uri]
    seal = [job, "seal", *NOW]
    yield "seal --events", [*seal, "--events", uri, "--shards", d["out"]]
    yield "seal --feedback-events", [*seal, "--events", d["shards"], "--feedback-events", uri,
                                     "--shards", d["out"]]  # fmt: skip
    yield "seal --shards", [*seal, "--events", d["shards"], "--shards", uri]


def free_listen() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def server_commands(d: dict[str, str], uri: str) -> Iterator[tuple[str, list[str]]]:
    """The servers' store: the events root they write to, checked as they start (a store
    that fails later is retried, never a reason to exit: docs/serving.md)."""
    spool, token = d["spool"], d["token"]
    yield "rtrl-capture --events", [console_script("rtrl-capture"), "--events", uri, "--spool",
                                    spool, "--listen", free_listen()]  # fmt: skip
    yield "rtrl-feedback --events", [console_script("rtrl-feedback"), "--events", uri,
                                     "--token-file", token, "--listen", free_listen()]  # fmt: skip


def slow_commands(d: dict[str, str], uri: str) -> Iterator[tuple[str, list[str]]]:
    """The steps that import torch (seconds each): one run per flag."""
    job = console_script("rtrl-job")
    yield "train --parent", [job, "train", "--parent", uri, "--data", d["data"], "--out", d["out"]]
    yield "train --data", [job, "train", "--parent", d["parent"], "--data", uri, "--out", d["out"]]
    yield "train --out", [job, "train", "--parent", d["parent"], "--data", d["data"], "--out", uri]
    flags = {"--candidate": d["parent"], "--parent": d["parent"], "--heldout": d["heldout"],
             "--out": d["out"]}  # fmt: skip
    for flag in flags:
        given = {**flags, flag: uri}
        yield f"eval {flag}", [job, "eval", *(a for kv in given.items() for a in kv)]


def check(
    argv: list[str], env: dict[str, str], codes: tuple[int, ...], timeout: float = 300
) -> str:
    """Run ``argv``: its exit code one of ``codes``, one line of error, no traceback, no
    secret in anything it printed; the error line. A server that is still running after
    ``timeout`` took what it was given."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"{argv[0]} started with it: {exc.stderr!r}") from None
    printed = done.stdout + done.stderr
    assert "Traceback" not in printed, printed[-3000:]
    leaked = [s for s in SECRETS if s in printed]
    assert not leaked, f"{leaked} printed: {printed[-2000:]}"
    assert done.returncode in codes, (done.returncode, printed[-2000:])
    # The error is one line of the command's own (argparse puts its usage synopsis before
    # a usage error; train's DeepSpeed notes that it loaded its CPU op).
    script = Path(argv[0]).name
    if script == "rtrl":
        prefixes: tuple[str, ...] = ("rtrl shards validate:",)
    elif script == "rtrl-job":
        prefixes = (f"rtrl-job {argv[1]}:", f"{argv[1]}:")
    else:
        prefixes = (f"{script}:",)
    ours = [line for line in done.stderr.splitlines() if line.startswith(prefixes)]
    assert len(ours) == 1, done.stderr
    return ours[0]


@pytest.mark.parametrize("kind", list(BAD_URIS))
def test_a_uri_with_a_secret_is_a_one_line_usage_error_that_hides_it(
    kind: str, env: dict[str, str], dirs: dict[str, str]
) -> None:
    for name, argv in commands(dirs, BAD_URIS[kind]):
        line = check(argv, env, (2,))
        assert "***" in line or "must be an object-store URI" in line, (name, line)


@pytest.mark.parametrize("kind", list(BAD_ENDPOINTS))
def test_an_endpoint_with_a_secret_is_a_usage_error_that_hides_it(
    kind: str, env: dict[str, str], dirs: dict[str, str]
) -> None:
    """Given as --endpoint-url: refused by argparse, exit 2."""
    for name, argv in commands(dirs, "s3://bucket-a/prefix/"):
        line = check([*argv, "--endpoint-url", BAD_ENDPOINTS[kind]], env, (2,))
        assert "--endpoint-url" in line, (name, line)


def test_an_endpoint_with_credentials_in_the_environment_is_one_line(
    env: dict[str, str], dirs: dict[str, str]
) -> None:
    """From $AWS_ENDPOINT_URL (a pod's env): the store refuses to be built; rtrl shards
    validate said so in a traceback."""
    env = env | {"AWS_ENDPOINT_URL": BAD_ENDPOINTS["userinfo"]}
    for name, argv in commands(dirs, "s3://bucket-a/prefix/"):
        line = check(argv, env, (1, 2))
        assert "has credentials in it" in line, (name, line)


SERVER_START = 60.0  # seconds: a server still up by then started with what it was given


@pytest.mark.parametrize("kind", list(BAD_URIS))
def test_the_servers_refuse_a_uri_with_a_secret_in_one_line_that_hides_it(
    kind: str, env: dict[str, str], dirs: dict[str, str]
) -> None:
    for name, argv in server_commands(dirs, BAD_URIS[kind]):
        line = check(argv, env, (2,), timeout=SERVER_START)
        assert "***" in line or "must be an object-store URI" in line, (name, line)


@pytest.mark.parametrize("kind", list(BAD_ENDPOINTS))
def test_the_servers_refuse_an_endpoint_with_a_secret_in_one_line(
    kind: str, env: dict[str, str], dirs: dict[str, str]
) -> None:
    """From the environment (the operator sets AWS_ENDPOINT_URL in the sidecar) and, for
    rtrl-feedback, --endpoint-url."""
    endpoint = BAD_ENDPOINTS[kind]
    for name, argv in server_commands(dirs, "s3://bucket-a/events/"):
        line = check(argv, env | {"AWS_ENDPOINT_URL": endpoint}, (2,), timeout=SERVER_START)
        assert "endpoint" in line.lower(), (name, line)
        if "feedback" in name:
            line = check([*argv, "--endpoint-url", endpoint], env, (2,), timeout=SERVER_START)
            assert "endpoint URL" in line, (name, line)


# A seal with no generation events (--events is empty here) has no hour to join, so it
# never reads the feedback root: only its URI is checked (the tests above).
NEEDS_EVENTS = ("seal --feedback-events",)


def test_a_bucket_that_does_not_exist_is_one_line(
    env: dict[str, str], dirs: dict[str, str], moto_endpoint: str
) -> None:
    env = env | {"AWS_ENDPOINT_URL": moto_endpoint}
    for name, argv in commands(dirs, "s3://no-such-bucket-32/prefix/"):
        if name in NEEDS_EVENTS:
            continue
        line = check(argv, env, (1, 2))
        assert "NoSuchBucket" in line, (name, line)


def test_an_endpoint_that_answers_nothing_is_one_line(
    env: dict[str, str], dirs: dict[str, str]
) -> None:
    env = env | {"AWS_ENDPOINT_URL": "http://127.0.0.1:9"}
    for name, argv in commands(dirs, "s3://bucket-a/prefix/"):
        if name in NEEDS_EVENTS:
            continue
        line = check(argv, env, (1, 2))
        assert "Could not connect to the endpoint URL" in line, (name, line)


@pytest.mark.parametrize("kind", ["presigned", "userinfo"])
def test_the_torch_steps_hide_a_uri_secret_too(
    kind: str, env: dict[str, str], dirs: dict[str, str]
) -> None:
    for name, argv in slow_commands(dirs, BAD_URIS[kind]):
        line = check(argv, env, (2,))
        assert "***" in line, (name, line)


def test_the_torch_steps_take_the_endpoint_flag_as_the_others(
    env: dict[str, str], dirs: dict[str, str]
) -> None:
    argv = next(iter(slow_commands(dirs, "s3://bucket-a/prefix/")))[1]
    line = check([*argv, "--endpoint-url", BAD_ENDPOINTS["userinfo"]], env, (2,))
    assert "--endpoint-url: must not hold credentials" in line
