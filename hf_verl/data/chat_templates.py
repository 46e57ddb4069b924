"""Chat templates for training: a prefix-preserving stand-in for Qwen3's template.

Tool-calling rollouts (:mod:`hf_verl.pipeline.multi_turn`) never re-tokenise what the model generated: after
each tool round they append the *observation*, the tokens the chat template adds between the assistant turn
and the next one, found by rendering the conversation without and with the tool results. That only works
with a *prefix-preserving* template, one that renders earlier messages identically whatever follows them.

Qwen3's template is not: it writes an assistant turn's `<think>` block only while that turn is the last one
(or, after the last user query, when the turn carries reasoning), so appending a tool result rewrites the
turn that called the tool. :data:`QWEN3_TRAINING_CHAT_TEMPLATE` is hf_verl's own Jinja template for the same
format in which every assistant turn is written the way Qwen3 writes the final one: the `<think>` block
(empty when the turn has no reasoning), the answer, its `<tool_call>` blocks, `<|im_end|>`. Everything else
(system turn and tool list, user turns, grouped `<tool_response>` turns, the generation prompt with or
without `enable_thinking=False`) is rendered as Qwen3 renders it, so a rollout's prompt, observations and
next generation prompt are the text Qwen3's own template gives for the last turn. The one difference: an
assistant turn of the history (before the last user message, or without reasoning and followed by other
messages) keeps its `<think>` block, where Qwen3 drops it.

:func:`training_chat_template` recognises a tokenizer whose template is Qwen3's (by behaviour: it renders a
set of probe conversations exactly as this template does where Qwen3's rendering is position-independent,
and it is not prefix-preserving) and returns the template to render tool rollouts with; the tokenizer
itself is left as it is (pass the result as `apply_chat_template(..., chat_template=...)`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

logger = logging.getLogger(__name__)

# Written for hf_verl. Jinja string literals below keep their backslash escapes (`\n`): this is a raw string.
QWEN3_TRAINING_CHAT_TEMPLATE = r"""
{#- hf_verl's prefix-preserving Qwen3 training template: every assistant turn keeps its <think> block. -#}
{%- set lead = messages[0] if messages else none -%}
{%- set lead_is_system = lead is not none and lead.role == 'system' -%}
{%- if tools -%}
    {{- '<|im_start|>system\n' -}}
    {%- if lead_is_system -%}{{- lead.content + '\n\n' -}}{%- endif -%}
    {{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' -}}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' -}}
    {%- for schema in tools -%}{{- '\n' ~ (schema | tojson) -}}{%- endfor -%}
    {{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within ' -}}
    {{- '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": ' -}}
    {{- '<args-json-object>}\n</tool_call><|im_end|>\n' -}}
{%- elif lead_is_system -%}
    {{- '<|im_start|>system\n' + lead.content + '<|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages -%}
    {%- set text = message.content if message.content is string else '' -%}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) -%}
        {{- '<|im_start|>' + message.role + '\n' + text + '<|im_end|>\n' -}}
    {%- elif message.role == 'assistant' -%}
        {%- set turn = namespace(thought='', answer=text) -%}
        {%- if message.reasoning_content is string -%}
            {%- set turn.thought = message.reasoning_content -%}
        {%- elif '</think>' in text -%}
            {%- set turn.thought = text.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') -%}
            {%- set turn.answer = text.split('</think>')[-1].lstrip('\n') -%}
        {%- endif -%}
        {{- '<|im_start|>assistant\n<think>\n' + turn.thought.strip('\n') + '\n</think>\n\n' -}}
        {{- turn.answer.lstrip('\n') -}}
        {%- for call in message.tool_calls or [] -%}
            {%- set fn = call.function if call.function else call -%}
            {%- if turn.answer or not loop.first -%}{{- '\n' -}}{%- endif -%}
            {{- '<tool_call>\n{"name": "' ~ fn.name ~ '", "arguments": ' -}}
            {{- fn.arguments if fn.arguments is string else fn.arguments | tojson -}}
            {{- '}\n</tool_call>' -}}
        {%- endfor -%}
        {{- '<|im_end|>\n' -}}
    {%- elif message.role == 'tool' -%}
        {%- if loop.first or loop.previtem.role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
        {{- '\n<tool_response>\n' + text + '\n</tool_response>' -}}
        {%- if loop.last or loop.nextitem.role != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
    {%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\n\n</think>\n\n' -}}{%- endif -%}
{%- endif -%}
""".strip()

# --------------------------------------------------------------------------------------- recognition
_PROBE_TOOL = {"type": "function", "function": {
    "name": "lookup", "description": "Look a word up.",
    "parameters": {"type": "object", "properties": {"word": {"type": "string", "description": "The word."}},
                   "required": ["word"]}}}
_CALL = {"type": "function", "function": {"name": "lookup", "arguments": {"word": "zen"}}}
_CALL_STR = {"type": "function", "function": {"name": "lookup", "arguments": '{"word": "ugly"}'}}
# (messages, tools, add_generation_prompt, extra kwargs): conversations whose rendering by Qwen3's template does
# not depend on where its assistant turns stand (each is the last, or follows the last user query and carries
# reasoning), so a Qwen3 template renders them exactly as the training template does
_PROBES: list[tuple[list[dict], list[dict] | None, bool, dict]] = [
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi."}], None, True, {}),
    ([{"role": "user", "content": "Hi."}], [_PROBE_TOOL], True, {"enable_thinking": False}),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Define zen."},
      {"role": "assistant", "content": "<think>\nLook it up.\n</think>\n\nLooking.",
       "tool_calls": [_CALL, _CALL_STR]}],
     [_PROBE_TOOL], False, {}),
    ([{"role": "user", "content": "Define zen."},
      {"role": "assistant", "reasoning_content": "Look it up.", "content": "", "tool_calls": [_CALL]},
      {"role": "tool", "name": "lookup", "content": "calm"}, {"role": "tool", "name": "lookup", "content": "still"}],
     [_PROBE_TOOL], True, {}),
    ([{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}], None, False, {}),
]

_lock = threading.Lock()
_recognised: dict[tuple[str, str | None], bool] = {}  # (template text, eos token) -> recognised


def _render(tokenizer: Any, messages: Sequence[Mapping], *, chat_template: str | None = None,
            **kwargs: Any) -> str:
    return tokenizer.apply_chat_template(list(messages), tokenize=False, chat_template=chat_template, **kwargs)


def is_prefix_preserving(tokenizer: Any, chat_template: str | None = None,
                         chat_template_kwargs: Mapping[str, Any] | None = None) -> bool:
    """Whether a tool exchange renders the conversation before it unchanged.

    Renders `[user, assistant with a tool call]` and the same plus a tool result (with the generation prompt),
    and checks that the first text, up to its last end-of-sequence token, starts the second.

    Args:
        tokenizer (`PreTrainedTokenizerBase`): tokenizer with a tool-calling chat template.
        chat_template (`str`, *optional*): the template to check instead of the tokenizer's own.
        chat_template_kwargs (`dict`, *optional*): extra arguments of `apply_chat_template`.

    Returns:
        `bool`: `False` also when the template cannot render the exchange.
    """
    conversation = [{"role": "user", "content": "Define zen."},
                    {"role": "assistant", "content": "", "tool_calls": [_CALL]}]
    kwargs = dict(chat_template_kwargs or {})
    try:
        before = _render(tokenizer, conversation, chat_template=chat_template, **kwargs)
        after = _render(tokenizer, conversation + [{"role": "tool", "name": "lookup", "content": "calm"}],
                        chat_template=chat_template, add_generation_prompt=True, **kwargs)
    except Exception:  # noqa: BLE001 - any template error means the exchange cannot be rendered
        return False
    eos = getattr(tokenizer, "eos_token", None)
    if eos and eos in before:
        before = before[: before.rindex(eos) + len(eos)]
    return after.startswith(before)


def _renders_like_training_template(tokenizer: Any, template: str) -> bool:
    try:
        return all(
            _render(tokenizer, messages, chat_template=template, tools=tools, add_generation_prompt=gen, **extra)
            == _render(tokenizer, messages, chat_template=QWEN3_TRAINING_CHAT_TEMPLATE, tools=tools,
                       add_generation_prompt=gen, **extra)
            for messages, tools, gen, extra in _PROBES)
    except Exception:  # noqa: BLE001 - a template that fails on a probe is not Qwen3's
        return False


def is_qwen3_chat_template(tokenizer: Any) -> bool:
    """Whether `tokenizer` carries Qwen3's chat template: one that renders the probe conversations as
    :data:`QWEN3_TRAINING_CHAT_TEMPLATE` does and is not prefix-preserving. Cached per template text."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or template == QWEN3_TRAINING_CHAT_TEMPLATE:
        return False
    if not all(mark in template for mark in ("<|im_start|>", "<think>", "<tool_response>")):
        return False  # cheap filter before rendering anything
    key = (template, getattr(tokenizer, "eos_token", None))
    with _lock:
        known = _recognised.get(key)
    if known is None:
        known = _renders_like_training_template(tokenizer, template) and not is_prefix_preserving(tokenizer)
        with _lock:
            _recognised[key] = known
    return known


def training_chat_template(tokenizer: Any) -> str | None:
    """The chat template to render tool-calling rollouts with, when the tokenizer's own cannot be used as is.

    Args:
        tokenizer (`PreTrainedTokenizerBase`): the policy's tokenizer; not modified.

    Returns:
        `str` or `None`: :data:`QWEN3_TRAINING_CHAT_TEMPLATE` for a tokenizer carrying Qwen3's
        (non-prefix-preserving) template, `None` for any other (use the tokenizer's own).

    Example:

    ```python
    >>> template = training_chat_template(tokenizer)  # a Qwen3 tokenizer
    >>> tokenizer.apply_chat_template(messages, tokenize=False, chat_template=template)
    ```
    """
    return QWEN3_TRAINING_CHAT_TEMPLATE if is_qwen3_chat_template(tokenizer) else None
