"""The stream comparison of test_same_bytes when vLLM cut two runs differently: the same
stream cut elsewhere compares equal; a changed, lost or reordered byte does not. The chunks
are those of a loaded run in which every try was cut differently (CI, 2026-12-04)."""

from __future__ import annotations

import json

from tests.rtrl_serving.capture.http import chunk_shape, merged_steps

HEAD = b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":17,"model":"tiny",'
ROLE = HEAD + (b'"choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,'
               b'"finish_reason":null}],"prompt_token_ids":null,"prompt_text":null}')  # fmt: skip
END = HEAD + (b'"choices":[{"index":0,"delta":{},"logprobs":null,"finish_reason":"stop",'
              b'"stop_reason":null,"token_ids":null}],"system_fingerprint":"v"}')  # fmt: skip


def step(text: str, logprobs: list[float] | None = None) -> bytes:
    lp = b"null"
    if logprobs is not None:
        entries = [{"token": t, "logprob": x, "bytes": list(t.encode()), "top_logprobs": []}
                   for t, x in zip(text, logprobs, strict=True)]  # fmt: skip
        lp = json.dumps({"content": entries}, separators=(",", ":")).encode()
    content = json.dumps(text).encode()
    return HEAD + (b'"choices":[{"index":0,"delta":{"content":' + content + b'},"logprobs":'
                   + lp + b',"finish_reason":null,"token_ids":null}]}')  # fmt: skip


def stream(*texts: str) -> list[bytes]:
    return [ROLE, *(step(t) for t in texts), END]


def same(a: list[bytes], b: list[bytes]) -> bool:
    return merged_steps(a) == merged_steps(b) and {chunk_shape(e) for e in a} <= {
        chunk_shape(e) for e in b
    }


def test_the_same_stream_cut_elsewhere_is_the_same() -> None:
    direct = stream("d", "e", '"', "nr", "n", " ", "7", "}")
    proxied = stream("d", 'e"n', "r", "n", " 7}")
    assert direct != proxied and same(proxied, direct)


def test_the_last_step_in_the_finishing_chunk_is_the_same() -> None:
    direct = stream("d", "e", "n")
    last = END.replace(b'"delta":{}', b'"delta":{"content":"n"}')
    assert same([ROLE, step("d"), step("e"), last], direct)
    assert not same([ROLE, step("d"), step("e"), last.replace(b'"n"', b'"m"')], direct)


def test_log_probs_joined_with_their_steps_are_the_same() -> None:
    direct = [ROLE, step("a", [-0.5]), step("b", [-1.25]), step("c", [-2.0]), END]
    proxied = [ROLE, step("ab", [-0.5, -1.25]), step("c", [-2.0]), END]
    assert same(proxied, direct)


def test_a_changed_text_token_or_field_is_not() -> None:
    direct = stream("d", "e", "n")
    assert not same(stream("d", "en", "m"), direct)  # a character
    assert not same(stream("d", "e"), direct)  # a step lost
    assert not same([ROLE, step("a", [-0.5]), END], [ROLE, step("a", [-0.75]), END])
    dropped = [e.replace(b',"token_ids":null', b"") for e in stream("d", "en")]
    assert not same(dropped, direct)  # a field the client did not ask for, stripped
    reordered = [e.replace(b'"logprobs":null,"finish_reason":null', b'"finish_reason":null,'
                           b'"logprobs":null') for e in stream("de", "n")]  # fmt: skip
    assert not same(reordered, direct)  # the same JSON, not the same bytes
    assert not same(stream("d", "e", "n")[:-1], direct)  # no finish chunk
