"""What the proxy adds to a request, and where it must not (vLLM would answer differently)."""

from __future__ import annotations

import json

from rtrl_serving.capture.rewrite import CHAT, COMPLETIONS, rewrite


def sent(endpoint: str, body: object) -> dict[str, object]:
    return json.loads(rewrite(endpoint, json.dumps(body).encode()).body)  # type: ignore[no-any-return]


def test_token_ids_and_log_probs_are_asked_for_when_the_client_did_not() -> None:
    assert sent(CHAT, {"messages": []}) == {
        "messages": [],
        "logprobs": True,
        "return_token_ids": True,
    }
    assert sent(COMPLETIONS, {"prompt": "x"}) == {
        "prompt": "x",
        "logprobs": 0,
        "return_token_ids": True,
    }
    rw = rewrite(CHAT, b'{"messages": [], "logprobs": false, "return_token_ids": null}')
    assert (rw.added_logprobs, rw.added_token_ids) == (True, True)
    assert json.loads(rw.body)["logprobs"] is True  # the last duplicate key wins


def test_the_clients_bytes_are_kept_and_its_own_values_never_overridden() -> None:
    raw = b'{"prompt": "caf\xc3\xa9",  "temperature": 0.70000000000000001, "logprobs": 3}  \n'
    rw = rewrite(COMPLETIONS, raw)
    assert rw.body.startswith(b'{"prompt": "caf\xc3\xa9",  "temperature": 0.70000000000000001')
    assert json.loads(rw.body)["logprobs"] == 3 and not rw.added_logprobs
    assert sent(CHAT, {"messages": [], "logprobs": True, "top_logprobs": 4})["top_logprobs"] == 4
    assert rewrite(CHAT, b"{}").body == b'{"logprobs":true,"return_token_ids":true}'


def test_requests_vllm_would_refuse_or_answer_differently_pass_unchanged() -> None:
    for endpoint, body in [
        (CHAT, {"messages": [], "top_logprobs": 2}),  # 400 without logprobs: must stay one
        (CHAT, {"messages": [], "logprob_token_ids": [1]}),
        (COMPLETIONS, {"prompt": "x", "logprob_token_ids": [1]}),
    ]:
        rw = rewrite(endpoint, json.dumps(body).encode())
        assert "logprobs" not in json.loads(rw.body) and rw.uncapturable == "cannot_request"
    for endpoint, body, reason in [
        (COMPLETIONS, {"prompt": "x", "echo": True}, "echo"),  # token ids blank the echo
        (CHAT, {"messages": [], "use_beam_search": True}, "beam_search"),
    ]:
        raw = json.dumps(body).encode()
        rw = rewrite(endpoint, raw)
        assert (rw.body, rw.uncapturable) == (raw, reason)
    for raw in (b"{not json", b"[1, 2]", b"\xff"):
        assert rewrite(CHAT, raw).body == raw and rewrite(CHAT, raw).uncapturable == "not_json"


def test_the_number_of_ids_is_every_choice_of_every_prompt() -> None:
    assert rewrite(CHAT, b'{"n": 3}').choices == 3
    assert rewrite(COMPLETIONS, b'{"prompt": ["a", "b"], "n": 2}').choices == 4
    assert rewrite(COMPLETIONS, b'{"prompt": [[1, 2], [3]]}').choices == 2
    assert rewrite(COMPLETIONS, b'{"prompt": [1, 2, 3]}').choices == 1
    assert rewrite(COMPLETIONS, b'{"prompt": "x", "n": "bad"}').choices == 1
