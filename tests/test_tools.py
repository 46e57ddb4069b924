"""Tool schemas, tool-call parsing and guarded tool execution (hf_verl.rollout.tools)."""

import asyncio
import threading
import time

import pytest

from hf_verl.rollout.tools import (
    ParsedTurn,
    environment_tools,
    parse_assistant_turn,
    parse_tool_calls,
    run_tool_call,
    run_tool_calls,
    supports_tool_calling,
    tool_schema,
    tool_schemas,
)
from tests.conftest import build_char_tokenizer, build_hermes_tokenizer, call_text

# transformers' declarative response template for the Hermes format of tests.conftest.HERMES_TEMPLATE
HERMES_RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {"open": "<tool_call>", "close_pattern": r"</tool_call>\s*", "repeats": True,
                       "content": "json", "transform": {"type": "function", "function": "{content}"}},
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first integer
        b: the second integer
    """
    return a + b


async def async_mul(a: int, b: int) -> int:
    """Multiply two integers, asynchronously.

    Args:
        a: the first integer
        b: the second integer
    """
    await asyncio.sleep(0.01)
    return a * b


def boom() -> str:
    """Always fails."""
    raise RuntimeError("kaboom")


class Counter:
    """An environment: `increment` is its tool; `reset`, `get_reward` and `_helper` are not."""

    def __init__(self):
        self.total = 0

    def reset(self, **row):
        self.total = 0

    def increment(self, by: int) -> int:
        """Add to the counter.

        Args:
            by: the amount to add
        """
        self.total += by
        return self.total

    def get_reward(self) -> float:
        return float(self.total)

    def _helper(self):
        return None

    @property
    def doubled(self):
        raise AssertionError("properties must not be evaluated")


# ------------------------------------------------------------------------------------------ schemas


def test_tool_schema_from_type_hints_and_docstring():
    schema = tool_schema(add)
    assert schema["type"] == "function"
    fn = schema["function"]
    assert fn["name"] == "add" and fn["description"] == "Add two integers."
    assert fn["parameters"] == {
        "type": "object",
        "properties": {"a": {"type": "integer", "description": "the first integer"},
                       "b": {"type": "integer", "description": "the second integer"}},
        "required": ["a", "b"],
    }
    assert tool_schema(async_mul)["function"]["name"] == "async_mul"
    assert tool_schema(schema) == schema  # a ready schema passes through


def test_tool_schemas_reject_undocumented_and_duplicate_tools():
    def undocumented(x: int) -> int:
        return x

    with pytest.raises(ValueError, match="undocumented"):
        tool_schema(undocumented)
    with pytest.raises(ValueError, match="unique"):
        tool_schemas([add, add])


def test_environment_tools_are_public_methods_except_reset_and_get_reward():
    env = Counter()
    tools = environment_tools(env)
    assert [t.__name__ for t in tools] == ["increment"]
    assert tools[0](by=3) == 3 and env.total == 3  # bound to this instance
    schema = tool_schema(tools[0])["function"]
    assert schema["name"] == "increment" and list(schema["parameters"]["properties"]) == ["by"]


def test_supports_tool_calling():
    assert supports_tool_calling(build_hermes_tokenizer())
    assert not supports_tool_calling(build_char_tokenizer())  # its template drops tool calls


# ------------------------------------------------------------------------------------------ parsing


def test_parse_single_call():
    turn = parse_tool_calls(call_text("add", {"a": 2, "b": 3}))
    assert turn.tool_calls == [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]
    assert turn.message["content"] == "" and turn.errors == []


def test_parse_several_calls_with_text():
    text = "Let me compute. " + call_text("add", {"a": 1, "b": 2}) + "\n" + call_text("async_mul", {"a": 3, "b": 4})
    turn = parse_tool_calls(text)
    assert [c["function"]["name"] for c in turn.tool_calls] == ["add", "async_mul"]
    assert turn.tool_calls[1]["function"]["arguments"] == {"a": 3, "b": 4}
    assert turn.message["content"] == "Let me compute."


def test_parse_no_call_is_plain_content():
    turn = parse_tool_calls("The answer is 5.")
    assert turn.message == {"role": "assistant", "content": "The answer is 5."} and turn.errors == []


def test_parse_malformed_calls_are_errors_not_exceptions():
    good = call_text("add", {"a": 1, "b": 2})
    bad_json = '<tool_call>\n{"name": "add", "arguments": {"a": 1,}\n</tool_call>'
    text = good + bad_json + '<tool_call>{"arguments": {}}</tool_call>'
    turn = parse_tool_calls(text)
    assert len(turn.tool_calls) == 1 and turn.tool_calls[0]["function"]["arguments"] == {"a": 1, "b": 2}
    assert len(turn.errors) == 2
    assert "not valid JSON" in turn.errors[0] and "name" in turn.errors[1]
    assert '{"a": 1,}' in turn.message["content"]  # a malformed block stays in the content as written
    unclosed = parse_tool_calls('<tool_call>\n{"name": "add", "argu')
    assert unclosed.tool_calls == [] and len(unclosed.errors) == 1 and "unclosed" in unclosed.errors[0]


def test_parse_arguments_given_as_json_string_and_missing():
    turn = parse_tool_calls('<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>'
                            '<tool_call>{"name": "boom"}</tool_call>')
    assert [c["function"]["arguments"] for c in turn.tool_calls] == [{"a": 1, "b": 2}, {}]


def test_parse_assistant_turn_drops_special_tokens():
    tok = build_hermes_tokenizer()
    ids = tok("ok " + call_text("add", {"a": 1, "b": 2}) + "<|im_end|>", add_special_tokens=False)["input_ids"]
    assert ids[-1] == tok.eos_token_id
    turn = parse_assistant_turn(tok, ids)
    assert turn.message == {"role": "assistant", "content": "ok", "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]}


def test_parse_assistant_turn_uses_the_tokenizers_response_template():
    tok = build_hermes_tokenizer()
    tok.response_template = HERMES_RESPONSE_TEMPLATE
    prefix = tok.apply_chat_template([{"role": "user", "content": "hi"}], tools=[add], add_generation_prompt=True,
                                     tokenize=False)
    prefix_ids = tok(prefix, add_special_tokens=False)["input_ids"]
    text = "sure" + call_text("add", {"a": "7", "b": 1}) + call_text("add", {"a": 2, "b": 2}) + "<|im_end|>"
    turn = parse_assistant_turn(tok, tok(text, add_special_tokens=False)["input_ids"], prefix_ids=prefix_ids,
                                tools=[add])
    assert turn.errors == []
    assert turn.message["content"] == "sure"
    # the parser types arguments from the tool's schema: "7" becomes 7 for an integer parameter
    assert [c["function"]["arguments"] for c in turn.tool_calls] == [{"a": 7, "b": 1}, {"a": 2, "b": 2}]
    bad_ids = tok("<tool_call>{oops</tool_call><|im_end|>", add_special_tokens=False)["input_ids"]
    bad = parse_assistant_turn(tok, bad_ids, prefix_ids=prefix_ids)
    assert bad.tool_calls == [] and len(bad.errors) == 1 and "oops" in bad.message["content"]


def test_hermes_parsing_matches_trl_parse_response():
    pytest.importorskip("trl")
    from trl.chat_template_utils import parse_response, qwen3_template

    tok = build_hermes_tokenizer()
    text = "thinking aloud" + call_text("add", {"a": 1, "b": 2}) + call_text("boom", {}) + "<|im_end|>"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    ours = parse_assistant_turn(tok, ids)
    tok.response_template = qwen3_template
    theirs = parse_response(tok, ids, prefix=[])
    assert ours.message == theirs


# ------------------------------------------------------------------------------------------ execution


def test_run_sync_and_async_tools_in_order():
    calls = [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}},
             {"type": "function", "function": {"name": "async_mul", "arguments": {"a": 4, "b": 5}}},
             {"name": "add", "arguments": {"a": 1, "b": 1}}]  # the flat form is accepted too
    results = run_tool_calls(calls, [add, async_mul], timeout_s=5)
    assert [r.message for r in results] == [{"role": "tool", "name": "add", "content": "5"},
                                            {"role": "tool", "name": "async_mul", "content": "20"},
                                            {"role": "tool", "name": "add", "content": "2"}]
    assert not any(r.failed for r in results)


def test_raising_tool_becomes_an_error_message():
    result = run_tool_call({"type": "function", "function": {"name": "boom", "arguments": {}}}, {"boom": boom})
    assert result.failed and result.error == "RuntimeError: kaboom"
    assert result.message == {"role": "tool", "name": "boom", "content": str({"error": "RuntimeError: kaboom"})}


def test_unknown_tool_and_bad_arguments():
    tools = {"add": add}
    unknown = run_tool_call({"type": "function", "function": {"name": "sub", "arguments": {}}}, tools)
    assert unknown.failed and unknown.message["name"] == "sub" and "unknown tool 'sub'" in unknown.message["content"]
    missing = run_tool_call({"type": "function", "function": {"name": "add", "arguments": {"a": 1}}}, tools)
    extra = run_tool_call({"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2, "c": 3}}},
                          tools)
    not_object = run_tool_call({"type": "function", "function": {"name": "add", "arguments": [1, 2]}}, tools)
    for result in (missing, extra, not_object):
        assert result.failed and result.message["role"] == "tool" and "error" in result.message["content"]
    assert "bad arguments" in missing.error and "'b'" in missing.error
    assert "bad arguments" in extra.error and "'c'" in extra.error
    assert "must be an object" in not_object.error
    other = run_tool_call({"type": "retrieval", "name": "x"}, tools)
    assert other.failed and "unsupported tool call type" in other.error


def test_hanging_sync_tool_times_out():
    release = threading.Event()

    def hang() -> str:
        """Waits until released."""
        release.wait(30)
        return "late"

    try:
        start = time.monotonic()
        result = run_tool_call({"type": "function", "function": {"name": "hang", "arguments": {}}}, {"hang": hang},
                               timeout_s=0.5)
        elapsed = time.monotonic() - start
    finally:
        release.set()
    assert result.failed and "timed out after 0.5 s" in result.error
    assert 0.45 <= elapsed < 2.0


def test_hanging_async_tool_is_cancelled_at_the_timeout():
    cancelled = threading.Event()

    async def sleepy() -> str:
        """Sleeps for a long time."""
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return "late"

    start = time.monotonic()
    result = run_tool_call({"type": "function", "function": {"name": "sleepy", "arguments": {}}},
                           {"sleepy": sleepy}, timeout_s=0.5)
    assert result.failed and "timed out" in result.error
    assert time.monotonic() - start < 2.0
    assert cancelled.wait(2.0)
    # the shared loop still serves later calls
    assert run_tool_call({"name": "async_mul", "arguments": {"a": 2, "b": 3}}, {"async_mul": async_mul},
                         timeout_s=5).message["content"] == "6"


def test_parsed_turn_default_has_no_calls():
    assert ParsedTurn({"role": "assistant", "content": "x"}).tool_calls == []
