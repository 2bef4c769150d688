"""Tool calls against the request's schemas: every invalid one counted, with its reason."""

from __future__ import annotations

from rtrl_serving.capture.toolcheck import ToolCall, check_tool_calls, request_tools

TOOLS = request_tools({"tools": [
    {"type": "function", "function": {"name": "edit", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}, "line": {"type": "integer"}},
        "required": ["path"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "ls"}},
]})  # fmt: skip
MARKERS = ("<tool_call>",)


def test_valid_calls_count_and_none_is_invalid() -> None:
    verdict = check_tool_calls(
        [ToolCall("edit", '{"path": "a.py", "line": 3}'), ToolCall("ls", '{"anything": 1}')],
        "I will edit a.py", TOOLS, MARKERS,
    )  # fmt: skip
    assert (verdict.calls, verdict.invalid, verdict.errors) == (2, 0, [])


def test_each_invalid_call_is_counted_with_its_reason() -> None:
    verdict = check_tool_calls(
        [
            ToolCall("edit", '{"path": 7}'),
            ToolCall("edit", '{"line": 1}'),
            ToolCall("edit", '{"path": "a", "extra": 1}'),
            ToolCall("rm", "{}"),
            ToolCall("edit", '{"path": "a"'),
            ToolCall(None, "{}"),
        ],
        'text <tool_call>{"name": "edit"} and again <tool_call>', TOOLS, MARKERS,
    )  # fmt: skip
    assert (verdict.calls, verdict.invalid) == (8, 8)
    reasons = verdict.errors
    assert "7 is not of type 'string' at path" in reasons[0]
    assert "'path' is a required property" in reasons[1]
    assert "Additional properties are not allowed" in reasons[2]
    assert "no such function in the request's tools (edit, ls)" in reasons[3]
    assert "arguments are not JSON" in reasons[4]
    assert "no such function" in reasons[5]
    assert reasons[6:] == ["unparsed tool call: '<tool_call>' in the reply's content"] * 2


def test_a_call_without_declared_tools_is_invalid_and_a_broken_schema_not_the_models_fault() -> (
    None
):
    assert check_tool_calls([ToolCall("edit", "{}")], None, None, MARKERS).invalid == 1
    broken = request_tools({"tools": [{"function": {"name": "f", "parameters": {"type": 12}}}]})
    assert check_tool_calls([ToolCall("f", "{}")], None, broken, MARKERS).invalid == 0
