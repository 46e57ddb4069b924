"""Tools for multi-turn rollouts: JSON schemas, tool-call parsing, and guarded execution.

Three steps of a tool-calling turn, each usable on its own:

- **schemas**: python callables become the JSON schemas that
  ``tokenizer.apply_chat_template(..., tools=...)`` renders (`transformers.utils.get_json_schema`: type
  hints plus a Google-style docstring). An environment (TRL's ``environment_factory`` objects) exposes
  its public methods, other than ``reset`` and ``get_reward``, as tools.
- **parsing**: a generated assistant turn becomes a message ``{"role": "assistant", "content": ...,
  "tool_calls": [{"type": "function", "function": {"name": ..., "arguments": {...}}}]}``. A tokenizer
  with a ``response_template`` (transformers' response-parsing API) is parsed with
  ``tokenizer.parse_response``; otherwise the Hermes / Qwen2.5 format is read, any number of
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks. A malformed call is recorded as a
  parse error and not executed; it never raises.
- **execution**: each call runs with a timeout. Sync tools run on a daemon thread that is waited on
  for at most the timeout (a hung tool is abandoned, never joined, and does not block interpreter exit);
  coroutine tools run on one shared background event loop and are cancelled at the timeout. An unknown
  tool, arguments that do not fit the signature, an exception or a timeout become a tool message whose
  content is ``str({"error": ...})``, as TRL writes tool failures.

Calls of one message run one after the other, in order (a stateful environment sees them in the order
the model wrote them); callers may run different rows concurrently, so tools shared between rows
must be thread-safe.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import json
import logging
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_TOOL_TIMEOUT_S = 30.0
ENVIRONMENT_RESERVED_METHODS = ("reset", "get_reward")  # environment methods that are not tools

_TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_TOOL_CALL_OPEN, _TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"


# ---------------------------------------------------------------------------------------- schemas


def tool_name(tool: Callable | Mapping) -> str:
    """The name a model calls `tool` by: the function's `__name__`, or a schema's `function.name`."""
    if isinstance(tool, Mapping):
        return tool.get("function", tool)["name"]
    return getattr(tool, "__name__", None) or type(tool).__name__


def tool_schema(tool: Callable | Mapping) -> dict:
    """The JSON schema of one tool, as `apply_chat_template(tools=...)` takes it.

    Args:
        tool (`Callable` or `dict`): a function (sync or async) with type hints and a Google-style
            docstring describing every argument, or an already-built schema (returned unchanged).

    Returns:
        `dict`: `{"type": "function", "function": {"name", "description", "parameters", ...}}`.
    """
    if isinstance(tool, Mapping):
        return dict(tool)
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(tool)
    except Exception as err:  # transformers raises its own parsing exceptions
        raise ValueError(
            f"cannot build a JSON schema for tool {tool_name(tool)!r}: {err}. A tool needs type hints on every "
            "argument and a Google-style docstring with an `Args:` entry per argument."
        ) from err


def tool_schemas(tools: Sequence[Callable | Mapping]) -> list[dict]:
    """:func:`tool_schema` of every tool; raises on two tools with the same name."""
    names = [tool_name(t) for t in tools]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"several tools are named {duplicates}; tool names must be unique.")
    return [tool_schema(t) for t in tools]


def environment_tools(environment: Any) -> list[Callable]:
    """The tools of an environment object: its public methods, bound, except `reset` and `get_reward`.

    Methods are listed on the class (so properties are not evaluated), in name order.
    """
    return [
        getattr(environment, name)
        for name, _ in inspect.getmembers(type(environment), predicate=inspect.isfunction)
        if not name.startswith("_") and name not in ENVIRONMENT_RESERVED_METHODS
    ]


def supports_tool_calling(tokenizer: Any) -> bool:
    """Whether `tokenizer`'s chat template renders a whole tool exchange (user, assistant call, tool result).

    A template that raises on the `tool` role, or silently drops the call's name, its arguments or the
    tool's output, cannot be used for tool-calling rollouts.
    """
    if getattr(tokenizer, "chat_template", None) is None:
        return False
    marks = {"name": "fn_q7x", "key": "arg_k3z", "value": "val_v8w", "output": "out_r2m"}
    call = {"type": "function", "function": {"name": marks["name"], "arguments": {marks["key"]: marks["value"]}}}
    conversation = [{"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "", "tool_calls": [call]},
                    {"role": "tool", "name": marks["name"], "content": marks["output"]}]
    try:
        text = tokenizer.apply_chat_template(conversation, tokenize=False)
    except Exception:  # noqa: BLE001 - any template error (jinja2's or a raise in it) means no support
        return False
    return all(mark in text for mark in marks.values())


# ---------------------------------------------------------------------------------------- parsing


@dataclass
class ParsedTurn:
    """An assistant turn read from generated text.

    Args:
        message (`dict`): `{"role": "assistant", "content": str}` plus `"tool_calls"` when the turn
            holds at least one well-formed call.
        errors (`list[str]`): one entry per call that could not be read (not executed).
    """

    message: dict
    errors: list[str] = field(default_factory=list)

    @property
    def tool_calls(self) -> list[dict]:
        return self.message.get("tool_calls") or []


def _normalize_call(raw: Any) -> tuple[dict | None, str | None]:
    """`(call, None)` in the chat-template form `{"type": "function", "function": {...}}`, or `(None, error)`."""
    if not isinstance(raw, Mapping):
        return None, f"a tool call must be a JSON object, got {type(raw).__name__}"
    function = raw.get("function", raw)
    if not isinstance(function, Mapping):
        return None, "a tool call's 'function' must be an object"
    name = function.get("name")
    if not isinstance(name, str) or not name:
        return None, "a tool call needs a string 'name'"
    arguments = function.get("arguments", function.get("parameters"))
    if arguments is None:
        arguments = {}
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as err:
            return None, f"tool call {name!r}: arguments are not valid JSON ({err})"
    if not isinstance(arguments, Mapping):
        return None, f"tool call {name!r}: arguments must be an object, got {type(arguments).__name__}"
    return {"type": "function", "function": {"name": name, "arguments": dict(arguments)}}, None


def parse_tool_calls(text: str) -> ParsedTurn:
    """Read Hermes / Qwen2.5-style tool calls from an assistant turn's text.

    Every ``<tool_call>...</tool_call>`` block holding a JSON object with a `name` and `arguments` (an
    object, or a JSON string of one) is a call; the text outside the well-formed blocks is the content.

    Args:
        text (`str`): the generated assistant text (without the prompt).

    Returns:
        [`ParsedTurn`]: the assistant message and the parse errors (malformed JSON, a missing name, an
        unclosed `<tool_call>`); a malformed block stays in the content as written.

    Example:

    ```python
    >>> parse_tool_calls('<tool_call>\\n{"name": "add", "arguments": {"a": 1}}\\n</tool_call>').tool_calls
    [{'type': 'function', 'function': {'name': 'add', 'arguments': {'a': 1}}}]
    ```
    """
    calls, errors, kept, last = [], [], [], 0
    for match in _TOOL_CALL_RE.finditer(text):
        kept.append(text[last : match.start()])
        last = match.end()
        body = match.group(1).strip()
        try:
            call, error = _normalize_call(json.loads(body))
        except json.JSONDecodeError as err:
            call, error = None, f"tool call is not valid JSON ({err}): {body[:200]!r}"
        if call is None:
            errors.append(error)
            kept.append(match.group(0))
        else:
            calls.append(call)
    tail = text[last:]
    if _TOOL_CALL_OPEN in tail:
        errors.append(f"unclosed {_TOOL_CALL_OPEN}: {tail[tail.index(_TOOL_CALL_OPEN):][:200]!r}")
    kept.append(tail)
    message = {"role": "assistant", "content": "".join(kept).strip()}
    if calls:
        message["tool_calls"] = calls
    return ParsedTurn(message, errors)


def _strip_special(text: str, tokenizer: Any) -> str:
    """`text` without the tokenizer's special tokens (end of turn, padding), tool-call markers kept."""
    for token in sorted(set(getattr(tokenizer, "all_special_tokens", [])), key=len, reverse=True):
        if token and token not in (_TOOL_CALL_OPEN, _TOOL_CALL_CLOSE):
            text = text.replace(token, "")
    return text


def _parse_response_takes_tools(tokenizer: Any) -> bool:
    # transformers' `parse_response(..., prefix=, tools=)` (5.15+) is the one public response-parsing API;
    # earlier 5.x releases lack `tools=`. Checked on the signature, here only.
    return "tools" in inspect.signature(type(tokenizer).parse_response).parameters


def parse_assistant_turn(tokenizer: Any, completion_ids: Sequence[int], *, prefix_ids: Sequence[int] | None = None,
                         tools: Sequence[Callable | Mapping] | None = None) -> ParsedTurn:
    """Read one generated assistant turn (token ids) into a message with its tool calls.

    With a `response_template` on the tokenizer, transformers' `tokenizer.parse_response` reads the turn
    (it sees `prefix_ids`, the prompt the turn continues, and types arguments from `tools`' schemas);
    otherwise the text is read as Hermes / Qwen2.5 tool calls (:func:`parse_tool_calls`) after special
    tokens are dropped.

    Args:
        tokenizer (`PreTrainedTokenizerBase`): the policy's tokenizer.
        completion_ids (`Sequence[int]`): the turn's generated token ids.
        prefix_ids (`Sequence[int]`, *optional*): the token ids the turn was generated after.
        tools (`Sequence[Callable | dict]`, *optional*): the tools the prompt was rendered with.

    Returns:
        [`ParsedTurn`]: never raises on malformed output; a failure is recorded in `errors`.
    """
    ids = [int(t) for t in completion_ids]
    if getattr(tokenizer, "response_template", None) is None:
        return parse_tool_calls(_strip_special(tokenizer.decode(ids, skip_special_tokens=False), tokenizer))
    kwargs = {"prefix": [int(t) for t in prefix_ids or []]}
    if tools and _parse_response_takes_tools(tokenizer):
        kwargs["tools"] = tool_schemas(tools)
    errors: list[str] = []
    try:
        parsed = dict(tokenizer.parse_response(ids, **kwargs) or {})
    except Exception as err:  # noqa: BLE001 - the parser raises various errors on output that does not fit
        parsed = {"content": tokenizer.decode(ids, skip_special_tokens=True)}
        errors.append(f"response could not be parsed: {err}")
    content = parsed.get("content") or ""
    if isinstance(content, str) and tokenizer.eos_token:
        content = content.removesuffix(tokenizer.eos_token)
    message = {**parsed, "role": "assistant", "content": content}
    message.pop("tool_calls", None)
    calls = []
    for raw in parsed.get("tool_calls") or []:
        call, error = _normalize_call(raw)
        if call is None:
            errors.append(error)
        else:
            calls.append(call)
    if calls:
        message["tool_calls"] = calls
    return ParsedTurn(message, errors)


# ---------------------------------------------------------------------------------------- execution


@dataclass
class ToolResult:
    """The outcome of one tool call.

    Args:
        message (`dict`): `{"role": "tool", "name": ..., "content": str}`, ready for the chat template.
        error (`str`, *optional*): why the call failed (unknown tool, bad arguments, an exception, a
            timeout); `None` when it returned.
    """

    message: dict
    error: str | None = None

    @property
    def failed(self) -> bool:
        return self.error is not None


class _BackgroundLoop:
    """One event loop on a daemon thread for coroutine tools (long-lived, as async clients expect)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="hf-verl-tools-loop", daemon=True)
        self.thread.start()

    def responsive(self, within_s: float = 0.05) -> bool:
        future = asyncio.run_coroutine_threadsafe(asyncio.sleep(0), self.loop)
        try:
            future.result(timeout=within_s)
            return True
        except concurrent.futures.TimeoutError:
            return False


_loop_lock = threading.Lock()
_loop: _BackgroundLoop | None = None


def _background_loop() -> _BackgroundLoop:
    global _loop
    with _loop_lock:
        if _loop is None:
            _loop = _BackgroundLoop()
        return _loop


def _await_with_timeout(awaitable: Any, timeout_s: float) -> Any:
    """Run `awaitable` on the background loop; raise `TimeoutError` after `timeout_s` (the task is cancelled)."""
    global _loop
    background = _background_loop()
    future = asyncio.run_coroutine_threadsafe(_as_coroutine(awaitable), background.loop)
    try:
        return future.result(timeout=max(timeout_s, 0.0))
    except concurrent.futures.TimeoutError:
        future.cancel()
        if not background.responsive():  # a coroutine blocked the loop itself: use a fresh one from now on
            logger.warning("a coroutine tool blocked the tools event loop; starting a new loop")
            with _loop_lock:
                if _loop is background:
                    _loop = None
        raise TimeoutError from None


async def _as_coroutine(awaitable: Any) -> Any:
    return await awaitable


def _call_on_thread(fn: Callable, arguments: dict, timeout_s: float) -> Any:
    """`fn(**arguments)` on a daemon thread; raise `TimeoutError` if it has not returned after `timeout_s`."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = fn(**arguments)
        except BaseException as err:  # noqa: BLE001 - reported as the tool's error
            box["error"] = err

    thread = threading.Thread(target=target, name=f"hf-verl-tool-{tool_name(fn)}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError
    if "error" in box:
        raise box["error"]
    return box["result"]


def _is_async(fn: Callable) -> bool:
    """A coroutine function, or an object whose `__call__` is one."""
    return inspect.iscoroutinefunction(fn) or (
        not inspect.isroutine(fn) and inspect.iscoroutinefunction(type(fn).__call__))


def _error_message(name: str, error: str) -> ToolResult:
    return ToolResult({"role": "tool", "name": name, "content": str({"error": error})}, error)


def run_tool_call(call: Mapping, tools: Mapping[str, Callable], *,
                  timeout_s: float = DEFAULT_TOOL_TIMEOUT_S) -> ToolResult:
    """Run one tool call and turn its outcome into a tool message; never raises, never waits past the timeout.

    Args:
        call (`dict`): `{"type": "function", "function": {"name": ..., "arguments": {...}}}` (or the flat
            `{"name": ..., "arguments": ...}`).
        tools (`Mapping[str, Callable]`): the tools this call may use, by name (sync or async).
        timeout_s (`float`, defaults to `30.0`): seconds the call may take.

    Returns:
        [`ToolResult`]: content `str(result)` on success, `str({"error": ...})` on any failure.
    """
    if not isinstance(call, Mapping):
        return _error_message("unknown", f"a tool call must be an object, got {type(call).__name__}")
    if call.get("type", "function") != "function":
        return _error_message(str(call.get("name", "unknown")), f"unsupported tool call type {call.get('type')!r}")
    normalized, error = _normalize_call(call)
    if normalized is None:
        raw = call.get("function", call)
        return _error_message(str(raw.get("name", "unknown")) if isinstance(raw, Mapping) else "unknown", error)
    name, arguments = normalized["function"]["name"], normalized["function"]["arguments"]
    fn = tools.get(name)
    if fn is None:
        return _error_message(name, f"unknown tool {name!r}; available tools: {sorted(tools)}")
    try:
        inspect.signature(fn).bind(**arguments)
    except TypeError as err:
        return _error_message(name, f"bad arguments for tool {name!r}: {err}")
    except ValueError:  # no signature (some builtins): let the call itself decide
        pass
    start = time.monotonic()
    try:
        if _is_async(fn):
            result = _await_with_timeout(fn(**arguments), timeout_s)
        else:
            result = _call_on_thread(fn, arguments, timeout_s)
            if inspect.isawaitable(result):  # e.g. a partial of a coroutine function
                result = _await_with_timeout(result, timeout_s - (time.monotonic() - start))
    except TimeoutError:
        return _error_message(name, f"tool {name!r} timed out after {timeout_s:g} s")
    except Exception as err:  # noqa: BLE001 - any failure of a tool is reported to the model
        return _error_message(name, f"{type(err).__name__}: {err}")
    return ToolResult({"role": "tool", "name": name, "content": str(result)})


def run_tool_calls(calls: Sequence[Mapping], tools: Mapping[str, Callable] | Sequence[Callable], *,
                   timeout_s: float = DEFAULT_TOOL_TIMEOUT_S) -> list[ToolResult]:
    """Run the tool calls of one assistant message, in order (see :func:`run_tool_call`).

    Args:
        calls (`Sequence[dict]`): the message's `tool_calls`.
        tools (`Mapping[str, Callable]` or `Sequence[Callable]`): the available tools.
        timeout_s (`float`, defaults to `30.0`): seconds each call may take.

    Returns:
        `list[ToolResult]`: one result per call, in the same order.
    """
    by_name = tools if isinstance(tools, Mapping) else {tool_name(t): t for t in tools}
    return [run_tool_call(call, by_name, timeout_s=timeout_s) for call in calls]
