"""hf_verl's prefix-preserving Qwen3 training template (hf_verl.data.chat_templates) and its use in tool rollouts.

Qwen3's own template is read from the installed trl's `chat_templates/qwen3.jinja`, the file the TRL-suite
fixtures (tests/trl_suite/hub_fixtures.py) give their Qwen3 tokenizers; the tokenizer is the character-level
one of tests.conftest, so every rendered text round-trips through ids exactly.
"""

import logging
from pathlib import Path

import pytest

from hf_verl.data.chat_templates import (
    QWEN3_TRAINING_CHAT_TEMPLATE,
    is_prefix_preserving,
    is_qwen3_chat_template,
    training_chat_template,
)
from hf_verl.pipeline import multi_turn
from hf_verl.pipeline.multi_turn import observation_ids, rollout_chat_template_kwargs
from hf_verl.pipeline.tool_rollout import ToolRollout
from hf_verl.rollout.base import SamplingParams
from hf_verl.rollout.tools import tool_schemas
from tests.conftest import HERMES_TEMPLATE, build_hermes_tokenizer, call_text
from tests.test_multi_turn import ScriptedEngine, spans
from tests.test_tools import add

ADD = {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
ADD_STR = {"type": "function", "function": {"name": "add", "arguments": '{"a": 5, "b": 1}'}}
TOOLS = tool_schemas([add])
# a Hermes template whose earlier assistant turns are marked "[past]": renders tools, is not prefix-preserving
# (a template that rewrites history, unrelated to Qwen3)
PAST_MARKING_TEMPLATE = HERMES_TEMPLATE.replace(
    "{{- '<|im_start|>assistant\\n' + m.content }}",
    "{{- '<|im_start|>assistant\\n' + ('' if loop.last else '[past]') + m.content }}")


@pytest.fixture(scope="module")
def qwen3_template():
    trl = pytest.importorskip("trl")
    return (Path(trl.__file__).parent / "chat_templates" / "qwen3.jinja").read_text(encoding="utf-8")


@pytest.fixture
def qwen3_tok(qwen3_template):
    tok = build_hermes_tokenizer()
    tok.chat_template = qwen3_template
    return tok


def render(tok, messages, template=None, **kwargs):
    return tok.apply_chat_template(messages, tokenize=False, chat_template=template, **kwargs)


def cut_after_last_eos(text, eos="<|im_end|>"):
    return text[: text.rindex(eos) + len(eos)]


# a multi-turn tool exchange in which every assistant turn carries reasoning (a reasoning_content field, or a
# <think> block in its content) except the final answer
EXCHANGE = [
    {"role": "system", "content": "You add numbers."},
    {"role": "user", "content": "What is 2 + 3, plus 1?"},
    {"role": "assistant", "reasoning_content": "Add 2 and 3 first.", "content": "", "tool_calls": [ADD]},
    {"role": "tool", "name": "add", "content": "5"},
    {"role": "assistant", "content": "<think>\nNow add 1, twice to be sure.\n</think>\n\nChecking.",
     "tool_calls": [ADD_STR, ADD_STR]},
    {"role": "tool", "name": "add", "content": "6"},
    {"role": "tool", "name": "add", "content": "6"},
    {"role": "assistant", "content": "It is 6."},
]


# ------------------------------------------------------------------------------------ the template itself


def test_qwen3_is_not_prefix_preserving_and_the_training_template_is(qwen3_tok, qwen3_template):
    assert not is_prefix_preserving(qwen3_tok)
    assert not is_prefix_preserving(qwen3_tok, qwen3_template)
    assert is_prefix_preserving(qwen3_tok, QWEN3_TRAINING_CHAT_TEMPLATE)
    assert is_prefix_preserving(qwen3_tok, QWEN3_TRAINING_CHAT_TEMPLATE, {"enable_thinking": False})


@pytest.mark.parametrize("extra", [{}, {"enable_thinking": False}], ids=["thinking", "no_thinking"])
def test_earlier_turns_render_identically_whatever_follows(qwen3_tok, extra):
    conversation = EXCHANGE + [{"role": "user", "content": "And 6 + 1?"},
                               {"role": "assistant", "content": "", "tool_calls": [ADD]},
                               {"role": "tool", "name": "add", "content": "7"},
                               {"role": "assistant", "content": "7."}]
    full = render(qwen3_tok, conversation, QWEN3_TRAINING_CHAT_TEMPLATE, tools=TOOLS, **extra)
    ends = [k for k in range(2, len(conversation) + 1) if conversation[k - 1]["role"] == "assistant"]
    assert len(ends) == 5
    for k in ends:  # every conversation ending with an assistant turn starts every longer one
        head = cut_after_last_eos(render(qwen3_tok, conversation[:k], QWEN3_TRAINING_CHAT_TEMPLATE, tools=TOOLS,
                                         **extra))
        assert full.startswith(head), k
        for j in range(k + 1, len(conversation) + 1):
            longer = render(qwen3_tok, conversation[:j], QWEN3_TRAINING_CHAT_TEMPLATE, tools=TOOLS,
                            add_generation_prompt=conversation[j - 1]["role"] != "assistant", **extra)
            assert longer.startswith(head), (k, j)
    # Qwen3's own template rewrites the turn before the second user query (it drops its <think> block)
    qwen3_head = cut_after_last_eos(render(qwen3_tok, conversation[:8], tools=TOOLS, **extra))
    assert not render(qwen3_tok, conversation, tools=TOOLS, **extra).startswith(qwen3_head)


@pytest.mark.parametrize("extra", [{}, {"enable_thinking": False}], ids=["thinking", "no_thinking"])
@pytest.mark.parametrize("tools", [TOOLS, None], ids=["tools", "no_tools"])
def test_last_turn_and_generation_prompt_match_qwen3(qwen3_tok, extra, tools):
    # every assistant turn here either is the last or carries reasoning, so Qwen3 renders each as it renders a
    # last turn: both templates agree on every prefix, with the generation prompt after a user or tool message
    for k in range(2, len(EXCHANGE) + 1):
        gen = EXCHANGE[k - 1]["role"] != "assistant"
        ours = render(qwen3_tok, EXCHANGE[:k], QWEN3_TRAINING_CHAT_TEMPLATE, tools=tools,
                      add_generation_prompt=gen, **extra)
        assert ours == render(qwen3_tok, EXCHANGE[:k], tools=tools, add_generation_prompt=gen, **extra), k
    prompt = render(qwen3_tok, EXCHANGE[:2], QWEN3_TRAINING_CHAT_TEMPLATE, tools=tools, add_generation_prompt=True,
                    **extra)
    assert prompt.endswith("<|im_start|>assistant\n" + ("<think>\n\n</think>\n\n" if extra else ""))
    last = render(qwen3_tok, EXCHANGE, QWEN3_TRAINING_CHAT_TEMPLATE, tools=tools, **extra)
    assert last.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nIt is 6.<|im_end|>\n")


def test_history_turns_keep_their_think_block(qwen3_tok):
    # the one departure from Qwen3: a turn before a later user query keeps its (here empty) <think> block
    history = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."},
               {"role": "user", "content": "Bye."}]
    ours = render(qwen3_tok, history, QWEN3_TRAINING_CHAT_TEMPLATE, add_generation_prompt=True)
    theirs = render(qwen3_tok, history, add_generation_prompt=True)
    assert "<|im_start|>assistant\n<think>\n\n</think>\n\nHello.<|im_end|>" in ours
    assert "<|im_start|>assistant\nHello.<|im_end|>" in theirs
    assert ours.startswith(render(qwen3_tok, history[:2], QWEN3_TRAINING_CHAT_TEMPLATE))


def test_observation_ids_are_qwen3s_tool_turn_and_generation_prompt(qwen3_tok):
    conversation = [{"role": "user", "content": "What is 2 + 3?"},
                    {"role": "assistant", "content": "", "tool_calls": [ADD]}]
    results = [{"role": "tool", "name": "add", "content": "5"}]
    with pytest.raises(ValueError, match="not prefix-preserving"):
        observation_ids(qwen3_tok, conversation, results, tools=TOOLS)  # Qwen3's own template
    obs = observation_ids(qwen3_tok, conversation, results, tools=TOOLS,
                          chat_template_kwargs=rollout_chat_template_kwargs(qwen3_tok))
    expected = "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert qwen3_tok.decode(obs, skip_special_tokens=False) == expected
    # ... which is how Qwen3 itself writes the tool result and the next generation prompt
    assert render(qwen3_tok, conversation + results, tools=TOOLS, add_generation_prompt=True).endswith(expected)


# ------------------------------------------------------------------------------------ recognition


def test_recognises_qwen3_only(qwen3_tok):
    assert is_qwen3_chat_template(qwen3_tok)
    assert training_chat_template(qwen3_tok) == QWEN3_TRAINING_CHAT_TEMPLATE
    others = {"hermes (prefix-preserving)": HERMES_TEMPLATE, "ours": QWEN3_TRAINING_CHAT_TEMPLATE,
              "past-marking (not prefix-preserving)": PAST_MARKING_TEMPLATE,
              # Qwen3's template with its tool header reworded: renders the probes differently
              "qwen3 variant": qwen3_tok.chat_template.replace("# Tools", "# Functions")}
    for name, template in others.items():
        tok = build_hermes_tokenizer()
        tok.chat_template = template
        assert training_chat_template(tok) is None, name
    tok = build_hermes_tokenizer()
    tok.chat_template = None
    assert training_chat_template(tok) is None


def test_rollout_kwargs_swap_the_template_and_keep_the_tokenizer(qwen3_tok, monkeypatch, caplog):
    monkeypatch.setattr(multi_turn, "_announced", set())
    original = qwen3_tok.chat_template
    with caplog.at_level(logging.INFO, logger="hf_verl.pipeline.multi_turn"):
        kwargs = rollout_chat_template_kwargs(qwen3_tok, {"enable_thinking": False})
        assert rollout_chat_template_kwargs(qwen3_tok) == {"chat_template": QWEN3_TRAINING_CHAT_TEMPLATE}
    assert kwargs == {"enable_thinking": False, "chat_template": QWEN3_TRAINING_CHAT_TEMPLATE}
    assert qwen3_tok.chat_template == original
    logged = [r for r in caplog.records if "Qwen3 training template" in r.getMessage()]
    assert len(logged) == 1 and logged[0].levelno == logging.INFO
    # a chat_template given by the caller is used as is; other tokenizers get nothing added
    assert rollout_chat_template_kwargs(qwen3_tok, {"chat_template": "x"}) == {"chat_template": "x"}
    assert rollout_chat_template_kwargs(build_hermes_tokenizer(), {"enable_thinking": False}) == {
        "enable_thinking": False}


def test_check_tokenizer_accepts_qwen3_and_refuses_other_rewriting_templates(qwen3_tok):
    rollout = ToolRollout([add])
    original = qwen3_tok.chat_template
    rollout.check_tokenizer(qwen3_tok)
    assert qwen3_tok.chat_template == original
    tok = build_hermes_tokenizer()
    tok.chat_template = PAST_MARKING_TEMPLATE
    with pytest.raises(ValueError, match="tool-calling rollouts cannot use this tokenizer's chat template: the chat "
                                         "template is not prefix-preserving"):
        rollout.check_tokenizer(tok)


# ------------------------------------------------------------------------------------ a whole rollout

THINK_CALL = "<think>\nAdd them.\n</think>\n\n" + call_text("add", {"a": 2, "b": 3})
THINK_ANSWER = "<think>\nIt said 5.\n</think>\n\nThe answer is 5."


@pytest.mark.parametrize("thinking", [True, False], ids=["thinking", "no_thinking"])
def test_tool_rollout_with_qwen3_template(qwen3_tok, thinking):
    script = [THINK_CALL, THINK_ANSWER] if thinking else [call_text("add", {"a": 2, "b": 3}), "The answer is 5."]
    engine = ScriptedEngine(qwen3_tok, {"calc": script})
    extra = {} if thinking else {"enable_thinking": False}
    original = qwen3_tok.chat_template
    rows = [{"prompt": [{"role": "user", "content": "calc"}]}]
    result = ToolRollout([add]).generate_and_score(
        engine, rows, qwen3_tok, SamplingParams(max_new_tokens=600), [lambda completions, **_: [1.0]], {},
        device="cpu", chat_template_kwargs=extra)
    batch = result.batch
    assert qwen3_tok.chat_template == original
    assert batch.meta["tool_calls"] == [1] and batch.is_truncated.tolist() == [False]
    messages = rows[0]["prompt"] + batch.meta["completions"][0]
    # the prompt and the observation are what Qwen3 itself writes before a generated turn
    prompt = qwen3_tok.decode(batch.meta["prompt_ids"][0], skip_special_tokens=False)
    assert prompt == render(qwen3_tok, messages[:1], tools=TOOLS, add_generation_prompt=True, **extra)
    ids = batch.meta["completion_ids"][0]
    mask = batch.completion_mask[0].tolist()[: len(ids)]
    ((start, end),) = spans(mask)
    observation = qwen3_tok.decode(ids[start:end], skip_special_tokens=False)
    assert render(qwen3_tok, messages[:3], tools=TOOLS, add_generation_prompt=True, **extra).endswith(
        "<|im_end|>" + observation)
    assert observation.startswith("\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n")
    # prompt + completion is the training template's rendering of the whole conversation; with thinking, every
    # turn carries its reasoning and this is also Qwen3's own rendering (what the model would generate)
    full = qwen3_tok.decode(batch.meta["prompt_ids"][0] + ids, skip_special_tokens=False) + "\n"
    assert full == render(qwen3_tok, messages, QWEN3_TRAINING_CHAT_TEMPLATE, tools=TOOLS, **extra)
    assert (full == render(qwen3_tok, messages, tools=TOOLS, **extra)) is thinking


def test_tool_rollout_renders_a_prompt_with_history_by_the_training_template(qwen3_tok):
    # the prompt, the observations and the generation prompts all come from one template: the prompt's earlier
    # assistant turn keeps its <think> block, as it will in every later rendering of the conversation
    # the scripted engine counts turns by assistant headers: the prompt's own is turn 0
    engine = ScriptedEngine(qwen3_tok, {"calc": ["(not generated)", THINK_CALL, THINK_ANSWER]})
    prompt = [{"role": "user", "content": "calc"}, {"role": "assistant", "content": "Which numbers?"},
              {"role": "user", "content": "2 and 3."}]
    result = ToolRollout([add]).generate_and_score(
        engine, [{"prompt": prompt}], qwen3_tok, SamplingParams(max_new_tokens=600), [lambda completions, **_: [1.0]],
        {}, device="cpu")
    batch = result.batch
    assert batch.meta["tool_calls"] == [1]
    prompt_text = qwen3_tok.decode(batch.meta["prompt_ids"][0], skip_special_tokens=False)
    assert "<|im_start|>assistant\n<think>\n\n</think>\n\nWhich numbers?<|im_end|>" in prompt_text
    messages = prompt + batch.meta["completions"][0]
    full = qwen3_tok.decode(batch.meta["prompt_ids"][0] + batch.meta["completion_ids"][0], skip_special_tokens=False)
    assert full + "\n" == render(qwen3_tok, messages, QWEN3_TRAINING_CHAT_TEMPLATE, tools=TOOLS)


def test_generate_with_tools_called_directly_swaps_the_template(qwen3_tok):
    # a turn without reasoning is what Qwen3 rewrites once a tool result follows: without the swap the
    # observation could not be computed
    engine = ScriptedEngine(qwen3_tok, {"calc": [call_text("add", {"a": 2, "b": 3}), "5."]})
    batch = multi_turn.generate_with_tools(engine, [[{"role": "user", "content": "calc"}]], qwen3_tok,
                                           SamplingParams(max_new_tokens=600), tools=[add],
                                           chat_template_kwargs={"enable_thinking": False})
    ids = batch.meta["completion_ids"][0]
    ((start, end),) = spans(batch.completion_mask[0].tolist()[: len(ids)])
    assert qwen3_tok.decode(ids[start:end], skip_special_tokens=False) == (
        "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
        "<think>\n\n</think>\n\n")
