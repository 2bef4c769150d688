"""What the capture proxy records, read back from the events store (moto S3 over HTTP), for
requests the official ``openai`` client sends through it to a real vLLM: token ids and the
engine's own log-probs, the sampling parameters actually used, tool calls checked against the
request's schemas, the checkpoint and arm, the headers; and the failures, which are events
too."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI

from rtrl.core.events import served_at
from rtrl_localkube import tinymodel
from tests.rtrl_serving.capture.events_store import wait_for_events
from tests.rtrl_serving.capture.http import MESSAGES, WEATHER, post
from tests.rtrl_serving.capture.late_end import engine_that_ends_late
from tests.rtrl_serving.conftest import Capture, new_bucket, s3_env, start_capture
from tests.vllm_engine import VllmEngine

pytestmark = pytest.mark.timeout(1800)

HEADERS = {"X-Rtrl-User": "u-17", "X-Rtrl-Session": "s-3", "X-Rtrl-Org": "acme"}


def call(arguments: str, name: str = "get_weather") -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {arguments}}}</tool_call>'


@pytest.fixture(scope="module")
def moto(vllm_engine: VllmEngine) -> str:
    """The engine's S3 (moto over HTTP): the model it serves, and the events."""
    return vllm_engine.s3_endpoint


@pytest.fixture(scope="module")
def capture(
    vllm_engine: VllmEngine, moto: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Capture]:
    bucket = new_bucket(moto)
    spool: Path = tmp_path_factory.mktemp("events") / "spool"
    cap = start_capture(
        vllm_engine.root_url, f"s3://{bucket}/events/", spool, s3_env(moto),
        model_uri=vllm_engine.model_uri,
        extra=["--segment-age-s", "0.3", "--clock-header", "X-Rtrl-Sim-Time"],
    )  # fmt: skip
    yield cap
    assert cap.stop() == 0


@pytest.fixture(scope="module")
def client(capture: Capture) -> OpenAI:
    return OpenAI(base_url=f"{capture.url}/v1", api_key="unused", default_headers=HEADERS)


def one_event(moto: str, capture: Capture, interaction_id: str) -> dict[str, Any]:
    rows = wait_for_events(moto, capture.events, {interaction_id})[interaction_id]
    assert len(rows) == 1, rows
    return rows[0]


def test_a_completion_event_holds_the_engines_tokens_and_log_probs(
    vllm_engine: VllmEngine, capture: Capture, client: OpenAI, moto: str
) -> None:
    raw = client.completions.with_raw_response.create(
        model="tiny", prompt="def add(a, b):", max_tokens=20, seed=42, temperature=0.7
    )
    completion = raw.parse()
    [interaction_id] = raw.headers["x-rtrl-interaction-id"].split(",")
    # the same request asked of the engine directly, with what the proxy asks for
    direct = post(vllm_engine.root_url, "/v1/completions", {
        "model": "tiny", "prompt": "def add(a, b):", "max_tokens": 20, "seed": 42,
        "temperature": 0.7, "logprobs": 0, "return_token_ids": True,
    }).json()["choices"][0]  # fmt: skip
    event = one_event(moto, capture, interaction_id)
    assert event["prompt_ids"] == direct["prompt_token_ids"]
    assert event["completion_ids"] == direct["token_ids"]
    assert len(event["completion_ids"]) == completion.usage.completion_tokens
    assert event["completion_logprobs"] == pytest.approx(
        direct["logprobs"]["token_logprobs"], abs=1e-6
    )
    assert event["completion_mask"] == [True] * len(event["completion_ids"])
    assert event["finish_reason"] == completion.choices[0].finish_reason
    # temperature as asked; top_p and top_k the engine's defaults (the model's
    # generation_config.json names none: OpenAI's)
    assert (event["temperature"], event["top_p"], event["top_k"]) == (pytest.approx(0.7), 1.0, 0)
    assert event["logprobs_mode"] == "processed_logprobs"
    assert event["serving_dtype"] == "float32"
    assert event["checkpoint_id"] == "ckpt-1"
    assert event["checkpoint_verified"] is True
    assert event["engine_model"] == vllm_engine.model_uri
    assert (event["arm"], event["rlcycle"], event["pod"]) == (
        "stable",
        "demo",
        "serving-7f9c-abcde",
    )
    assert (event["user_id"], event["session_id"], event["org"]) == ("u-17", "s-3", "acme")
    assert (event["endpoint"], event["stream"], event["status"]) == ("completions", False, 200)
    assert event["choice_index"] == 0
    assert abs(served_at(interaction_id) - event["created_at"]) < timedelta(milliseconds=1)
    assert event["latency_ms"] > 0
    assert event["tool_calls"] is None  # completions: the client parses its own calls


def test_a_streamed_chat_event_holds_every_token(
    vllm_engine: VllmEngine, capture: Capture, client: OpenAI, moto: str
) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=30,
        seed=5,
        stream=True,  # type: ignore[arg-type]
    )
    [interaction_id] = raw.headers["x-rtrl-interaction-id"].split(",")
    text = "".join(chunk.choices[0].delta.content or "" for chunk in raw.parse() if chunk.choices)
    direct = post(vllm_engine.root_url, "/v1/chat/completions", {
        "model": "tiny", "messages": MESSAGES, "max_tokens": 30, "seed": 5,
        "logprobs": True, "return_token_ids": True,
    }).json()  # fmt: skip
    event = one_event(moto, capture, interaction_id)
    assert event["prompt_ids"] == direct["prompt_token_ids"]
    assert event["completion_ids"] == direct["choices"][0]["token_ids"]
    assert event["completion_logprobs"] == pytest.approx(
        [entry["logprob"] for entry in direct["choices"][0]["logprobs"]["content"]], abs=1e-6
    )
    assert (event["endpoint"], event["stream"]) == ("chat.completions", True)
    assert (event["tool_calls"], event["invalid_tool_calls"]) == (0, 0)
    assert text == direct["choices"][0]["message"]["content"]
    # none asked: the engine's defaults, which the proxy's probe confirmed
    assert (event["temperature"], event["top_p"], event["top_k"]) == (1.0, 1.0, 0)
    assert capture.metric("rtrl_capture_sampling_defaults_verified") == 1


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize(
    "case",
    [
        (call('{"city": "Paris"}'), 0, None),
        (call('{"city": 42}'), 1, "do not match its schema: 42 is not of type 'string'"),
        (call('{"town": "Paris"}'), 1, "do not match its schema"),
        (call("{}", name="delete_repo"), 1, "no such function"),
        ('<tool_call>{"name": "get_weather", "arguments": {"city": "Par</tool_call>', 1, None),
    ],
    ids=["valid", "wrong type", "wrong field", "unknown function", "malformed"],
)
def test_tool_calls_are_checked_against_the_requests_schemas(
    capture: Capture, client: OpenAI, moto: str, stream: bool, case: tuple[str, int, str | None]
) -> None:
    text, invalid, reason = case
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=MESSAGES, tools=[WEATHER], tool_choice="auto",  # type: ignore[list-item]
        max_tokens=120, seed=1, stream=stream,  # type: ignore[arg-type]
        extra_body={"structured_outputs": {"choice": [text]}},
    )  # fmt: skip
    parsed: Any = raw.parse()
    if not stream and invalid == 0:
        assert parsed.choices[0].message.tool_calls[0].function.name == "get_weather"
    elif stream:
        list(parsed)
    [interaction_id] = raw.headers["x-rtrl-interaction-id"].split(",")
    event = one_event(moto, capture, interaction_id)
    assert event["tool_calls"] >= 1
    assert event["invalid_tool_calls"] == (event["tool_calls"] if invalid else 0), event
    assert len(event["tool_call_errors"]) == event["invalid_tool_calls"]
    if reason is not None:
        assert reason in event["tool_call_errors"][0]
    assert event["completion_ids"], "an invalid call's tokens are kept: it must be penalised"


@pytest.mark.parametrize(
    "expected",
    [
        ("text", 0, 0, None),
        ("tool_call", 1, 0, None),
        ("tool_call_invalid_arguments", 1, 1, "7 is not of type 'string' at path"),
        ("tool_call_malformed", 1, 1, None),
    ],
    ids=lambda expected: expected[0],
)
def test_the_models_own_tool_calls_are_judged(
    capture: Capture, client: OpenAI, moto: str, expected: tuple[str, int, int, str | None]
) -> None:
    """The tiny model answers these prompts, greedily, with text, a valid call, a call that
    breaks the tool's schema and malformed call text (rtrl_localkube.tinymodel)."""
    case, calls, invalid, reason = expected
    spec = tinymodel.CASE[case]
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=list(spec.messages), temperature=0, max_tokens=120,  # type: ignore[arg-type]
        tools=tinymodel.TOOLS if spec.tools else None,  # type: ignore[arg-type]
    )  # fmt: skip
    raw.parse()
    event = one_event(moto, capture, raw.headers["x-rtrl-interaction-id"])
    assert (event["tool_calls"], event["invalid_tool_calls"]) == (calls, invalid), event
    if reason is not None:
        assert reason in event["tool_call_errors"][0]
    assert event["temperature"] == 0.0 and event["completion_ids"]


def test_each_choice_is_an_event_under_the_id_the_client_got(
    capture: Capture, client: OpenAI, moto: str
) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=8,
        seed=9,
        n=3,  # type: ignore[arg-type]
    )
    ids = raw.headers["x-rtrl-interaction-id"].split(",")
    assert len(set(ids)) == 3
    events = wait_for_events(moto, capture.events, set(ids))
    completion = raw.parse()
    for index, interaction_id in enumerate(ids):
        [event] = events[interaction_id]
        assert event["choice_index"] == index
        assert len(event["completion_ids"]) > 0
    assert {c.index for c in completion.choices} == {0, 1, 2}


def test_an_engine_error_is_an_event_without_tokens(capture: Capture, moto: str) -> None:
    reply = post(capture.url, "/v1/chat/completions",
                 {"model": "tiny", "messages": MESSAGES, "temperature": 9}, HEADERS)  # fmt: skip
    assert reply.status == 400
    event = one_event(moto, capture, reply.ids[0])
    assert event["status"] == 400
    assert event["completion_ids"] is None and event["prompt_ids"] is None
    assert event["user_id"] == "u-17"
    assert capture.metric("rtrl_capture_requests_total", arm="stable", endpoint="chat.completions",
                          status="400") >= 1  # fmt: skip


def test_a_request_the_proxy_cannot_capture_is_counted(capture: Capture, moto: str) -> None:
    reply = post(capture.url, "/v1/completions",
                 {"model": "tiny", "prompt": "x", "max_tokens": 3, "echo": True})  # fmt: skip
    assert reply.status == 200
    event = one_event(moto, capture, reply.ids[0])
    assert event["status"] == 200 and event["completion_ids"] is None
    assert capture.metric("rtrl_capture_uncaptured_total", reason="echo") >= 1


def test_a_client_that_leaves_mid_stream_is_an_event(capture: Capture, moto: str) -> None:
    host, port = capture.url.removeprefix("http://").split(":")
    body = (b'{"model": "tiny", "prompt": "x", "max_tokens": 400, "ignore_eos": true, '
            b'"stream": true}')  # fmt: skip
    # On loaded cores the engine can finish all 400 tokens, and the proxy write them into the
    # sockets' buffers, before this client is scheduled to leave: then the proxy did serve the
    # whole stream (status 200, all tokens), which is no failure of the proxy. A small receive
    # buffer makes that rare; such a run is tried again, at most three times in all.
    for _ in range(3):
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect((host, int(port)))
            head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                    b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body))  # fmt: skip
            sock.sendall(head + body)
            head = sock.recv(65536)
            while b"data: " not in head:
                head += sock.recv(65536)
        line = next(h for h in head.split(b"\r\n")
                    if h.lower().startswith(b"x-rtrl-interaction-id"))  # fmt: skip
        interaction_id = line.split(b":", 1)[1].strip().decode()
        event = one_event(moto, capture, interaction_id)
        served_whole = event["status"] == 200 and len(event["completion_ids"] or []) == 400
        if not served_whole:
            break
    assert event["status"] == 499
    assert event["completion_ids"] is None
    started = time.monotonic()
    while capture.metric("rtrl_capture_requests_total", arm="stable", endpoint="completions",
                         status="499") < 1:  # fmt: skip
        assert time.monotonic() - started < 10
        time.sleep(0.2)


def test_a_streams_end_reaches_the_client_with_its_last_event(
    vllm_engine: VllmEngine, moto: str, tmp_path: Path
) -> None:
    """A closed loop's client sends its next request once it has the response's end: the
    proxy ends the response with the stream's last event, not when the engine's own end
    comes (held back here by a relay), and records it served whole, its latency up to that
    last event."""
    hold = 3.0
    body = (b'{"model": "tiny", "prompt": "x", "max_tokens": 8, "ignore_eos": true, '
            b'"stream": true}')  # fmt: skip
    with engine_that_ends_late(vllm_engine.root_url, hold=hold) as engine:
        cap = start_capture(
            engine, f"s3://{new_bucket(moto)}/events/", tmp_path / "spool", s3_env(moto),
            model_uri=vllm_engine.model_uri, extra=["--segment-age-s", "0.3"],
        )  # fmt: skip
        try:
            host, port = cap.url.removeprefix("http://").split(":")
            with socket.create_connection((host, int(port)), timeout=60) as sock:
                head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                        b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body))  # fmt: skip
                sock.sendall(head + body)
                got = b""
                while b"data: [DONE]" not in got:
                    got += sock.recv(65536)
                last_event = time.monotonic()
                while not got.endswith(b"\r\n0\r\n\r\n"):
                    got += sock.recv(65536)
                waited = time.monotonic() - last_event
            line = next(h for h in got.split(b"\r\n")
                        if h.lower().startswith(b"x-rtrl-interaction-id"))  # fmt: skip
            event = one_event(moto, cap, line.split(b":", 1)[1].strip().decode())
        finally:
            assert cap.stop() == 0
    assert waited < hold / 2, f"the end came {waited:.2f} s after the last event"
    assert event["status"] == 200
    assert len(event["completion_ids"]) == 8
    assert len(event["completion_logprobs"]) == 8
    assert event["latency_ms"] < 1000 * hold


def test_a_checkpoint_mismatch_is_recorded_unverified_and_counted(
    vllm_engine: VllmEngine, moto: str, tmp_path: Path
) -> None:
    bucket = new_bucket(moto)
    cap = start_capture(vllm_engine.root_url, f"s3://{bucket}/events/", tmp_path / "spool",
                        s3_env(moto), model_uri="s3://models/checkpoints/ckpt-9/",
                        extra=["--segment-age-s", "0.3"])  # fmt: skip
    try:
        reply = post(cap.url, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 3})
        assert reply.status == 200
        event = one_event(moto, cap, reply.ids[0])
        assert event["checkpoint_verified"] is False
        assert event["engine_model"] == vllm_engine.model_uri
        assert event["model_uri"] == "s3://models/checkpoints/ckpt-9/"
        assert cap.metric("rtrl_capture_checkpoint_mismatches_total") >= 1
        assert cap.metric("rtrl_capture_checkpoint_verified") == 0
    finally:
        assert cap.stop() == 0


def test_a_simulation_sets_the_serving_time_by_header(capture: Capture, moto: str) -> None:
    body = {"model": "tiny", "prompt": "x", "max_tokens": 2}
    then = datetime(2026, 1, 5, 3, 10, 7, 250000, tzinfo=UTC)
    reply = post(capture.url, "/v1/completions", body, {"X-Rtrl-Sim-Time": then.isoformat()})
    event = one_event(moto, capture, reply.ids[0])
    assert event["created_at"] == then
    assert "/generations/date=2026-01-05/hour=03/" in event["_key"]
    assert served_at(reply.ids[0]) == then
    unix = post(capture.url, "/v1/completions", body, {"X-Rtrl-Sim-Time": "1767582000"})
    assert one_event(moto, capture, unix.ids[0])["created_at"] == datetime(
        2026, 1, 5, 3, 0, tzinfo=UTC)  # fmt: skip
    bad = post(capture.url, "/v1/completions", body, {"X-Rtrl-Sim-Time": "yesterday"})
    assert bad.status == 400 and b"X-Rtrl-Sim-Time" in bad.body


def test_the_probe_tells_when_the_proxy_misreads_the_engines_defaults(
    vllm_engine: VllmEngine, moto: str, tmp_path: Path
) -> None:
    """A proxy told of a generation config the engine does not use (here: temperature 0.5)
    finds out from the engine itself: the gauge says so, and the log says what to do."""
    config = tmp_path / "generation"
    config.mkdir()
    (config / "generation_config.json").write_text('{"temperature": 0.5, "top_k": 7}')
    wrong = start_capture(
        vllm_engine.root_url, f"s3://{new_bucket(moto)}/events/", tmp_path / "spool",
        s3_env(moto), model_uri=vllm_engine.model_uri,
        extra=["--generation-config", str(config)],
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while wrong.metric("rtrl_capture_sampling_defaults_verified") == -1:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert wrong.metric("rtrl_capture_sampling_defaults_verified") == 0
        assert "does not sample with the defaults the proxy read" in wrong.log.read_text()
    finally:
        assert wrong.stop() == 0
