"""The tool-calling, multi-turn rollout loop (hf_verl.pipeline.multi_turn).

Most tests drive the loop with `ScriptedEngine`, a real `RolloutEngine` whose *model output* is scripted
per prompt and turn, so that the loop's bookkeeping (masks, observation spans, budgets, iteration
limits, seeds) can be checked exactly. Two tests use `TransformersEngine` on tiny Llama models.
"""

import re
import threading

import pytest
import torch

from hf_verl.pipeline.generation import generate
from hf_verl.pipeline.multi_turn import (
    generate_with_tools,
    observation_ids,
    reset_environments,
    turn_seed,
)
from hf_verl.rollout.base import (
    FINISH_LENGTH,
    FINISH_STOP,
    GenerationOutput,
    RolloutEngine,
    SamplingParams,
)
from tests.conftest import build_hermes_tokenizer, call_text
from tests.test_tools import Counter, add, boom

ADD_2_3 = call_text("add", {"a": 2, "b": 3})
_USER_RE = re.compile(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", re.DOTALL)


class ScriptedEngine(RolloutEngine):
    """Answers each context with the scripted text for (first user message, turn), then EOS.

    `script[user_text]` is a list of turn texts (the last one repeats). Records every call.
    """

    def __init__(self, tokenizer, script):
        super().__init__()
        self.tokenizer, self.script, self.calls = tokenizer, script, []

    def generate(self, prompt_ids, sampling, row_seeds=None):
        self.calls.append({"prompt_ids": [list(p) for p in prompt_ids], "sampling": sampling, "row_seeds": row_seeds})
        ids, lps, reasons = [], [], []
        for context in prompt_ids:
            text = self.tokenizer.decode(context, skip_special_tokens=False)
            turns = self.script[_USER_RE.search(text).group(1)]
            turn = text.count("<|im_start|>assistant\n") - 1
            out = self.tokenizer(turns[min(turn, len(turns) - 1)], add_special_tokens=False)["input_ids"]
            out = out + [self.tokenizer.eos_token_id]
            reasons.append(FINISH_LENGTH if len(out) > sampling.max_new_tokens else FINISH_STOP)
            out = out[: sampling.max_new_tokens]
            ids.append(out)
            lps.append([-0.01 * (k + 1) - turn for k in range(len(out))])
        return GenerationOutput(ids, lps, reasons, weight_version=self.weight_version)

    def sync_weights(self, named_tensors):
        self._bump_version()


def user(text):
    return [{"role": "user", "content": text}]


def spans(mask_row):
    """(start, end) of each run of zeros in a 0/1 list."""
    out, start = [], None
    for k, m in enumerate(mask_row + [1]):
        if m == 0 and start is None:
            start = k
        elif m == 1 and start is not None:
            out.append((start, k))
            start = None
    return out


@pytest.fixture
def tok():
    return build_hermes_tokenizer()


def test_tool_round_trip(tok):
    engine = ScriptedEngine(tok, {"calc": [ADD_2_3, "the answer is 5"], "chat": ["hello"]})
    prompts = [user("calc"), user("chat")]
    batch = generate_with_tools(engine, prompts, tok, SamplingParams(max_new_tokens=400), tools=[add])

    n_call = len(tok(ADD_2_3, add_special_tokens=False)["input_ids"]) + 1
    n_answer = len("the answer is 5") + 1
    expected_obs = "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    n_obs = len(tok(expected_obs, add_special_tokens=False)["input_ids"])
    lengths = batch.completion_ids.ne(tok.pad_token_id).sum(1).tolist()
    assert lengths == [n_call + n_obs + n_answer, len("hello") + 1]

    # the mask is 0 exactly on the observation span, and the span decodes to the tool result
    mask = batch.completion_mask[0].tolist()
    assert spans(mask[: lengths[0]]) == [(n_call, n_call + n_obs)]
    obs_ids = batch.completion_ids[0, n_call : n_call + n_obs].tolist()
    assert tok.decode(obs_ids, skip_special_tokens=False) == expected_obs
    assert batch.completion_mask[1].tolist() == [1] * lengths[1] + [0] * (batch.completion_ids.shape[1] - lengths[1])

    # log-probs: the engine's on generated tokens, 0 on observations and padding
    lp = batch.sampling_logprobs[0].tolist()
    assert lp[:n_call] == pytest.approx([-0.01 * (k + 1) for k in range(n_call)])
    assert lp[n_call : n_call + n_obs] == [0.0] * n_obs
    assert lp[n_call + n_obs : lengths[0]] == pytest.approx([-0.01 * (k + 1) - 1 for k in range(n_answer)])

    # the messages reward functions receive, and the per-row counts
    assert batch.meta["completions"][0] == [
        {"role": "assistant", "content": "",
         "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
        {"role": "tool", "name": "add", "content": "5"},
        {"role": "assistant", "content": "the answer is 5"},
    ]
    assert batch.meta["completions"][1] == [{"role": "assistant", "content": "hello"}]
    assert batch.meta["tool_calls"] == [1, 0] and batch.meta["tool_failures"] == [0, 0]
    assert batch.is_truncated.tolist() == [False, False]

    # the row without a call stopped after one turn; the second call continued from the exact ids
    assert [len(c["prompt_ids"]) for c in engine.calls] == [2, 1]
    continued = batch.meta["prompt_ids"][0] + batch.completion_ids[0, : n_call + n_obs].tolist()
    assert engine.calls[1]["prompt_ids"][0] == continued
    assert engine.calls[1]["sampling"].max_new_tokens == 400 - n_call - n_obs

    # prompt + completion is exactly the chat template's rendering of the whole conversation
    full = tok.decode(batch.meta["prompt_ids"][0] + batch.meta["completion_ids"][0], skip_special_tokens=False)
    rendered = tok.apply_chat_template(prompts[0] + batch.meta["completions"][0], tools=[add], tokenize=False)
    assert full + "\n" == rendered
    assert '"name": "add"' in tok.decode(batch.meta["prompt_ids"][0])  # the prompt carries the tool schema


def test_observation_ids_group_several_tool_results(tok):
    conversation = user("x") + [{"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 1}}}] * 2}]
    results = [{"role": "tool", "name": "add", "content": "2"}, {"role": "tool", "name": "add", "content": "two"}]
    obs = observation_ids(tok, conversation, results)
    assert tok.decode(obs, skip_special_tokens=False) == (
        "\n<|im_start|>user\n<tool_response>\n2\n</tool_response>\n<tool_response>\ntwo\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("max_iterations, expected_turns", [(0, 1), (1, 2), (3, 4)])
def test_iterations_stop_at_max_iterations(tok, max_iterations, expected_turns):
    engine = ScriptedEngine(tok, {"loop": [ADD_2_3]})  # calls the tool on every turn
    batch = generate_with_tools(engine, [user("loop")], tok, SamplingParams(max_new_tokens=2000), tools=[add],
                                max_iterations=max_iterations)
    assert len(engine.calls) == expected_turns
    roles = [m["role"] for m in batch.meta["completions"][0]]
    assert roles == ["assistant", "tool"] * max_iterations + ["assistant"]
    assert batch.meta["completions"][0][-1]["tool_calls"]  # the last turn's call is not run
    assert batch.meta["tool_calls"] == [max_iterations]
    assert len(spans(batch.completion_mask[0].tolist()[: len(batch.meta["completion_ids"][0])])) == max_iterations
    assert batch.is_truncated.tolist() == [False]


def test_no_limit_runs_until_the_budget(tok):
    n_call, n_obs = _lengths(tok)
    engine = ScriptedEngine(tok, {"loop": [ADD_2_3]})
    budget = 3 * (n_call + n_obs) + 5  # three whole rounds, then a call cut after 5 tokens
    batch = generate_with_tools(engine, [user("loop")], tok, SamplingParams(max_new_tokens=budget), tools=[add],
                                max_iterations=None)
    assert batch.completion_ids.shape[1] == budget and batch.is_truncated.tolist() == [True]
    assert batch.meta["tool_calls"] == [3] and len(engine.calls) == 4
    assert batch.completion_mask[0].sum().item() == 3 * n_call + 5


def _lengths(tok):
    n_call = len(tok(ADD_2_3, add_special_tokens=False)["input_ids"]) + 1
    obs = "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    return n_call, len(tok(obs, add_special_tokens=False)["input_ids"])


def test_budget_cuts_the_last_turn(tok):
    n_call, n_obs = _lengths(tok)
    engine = ScriptedEngine(tok, {"calc": [ADD_2_3, "the answer is 5"], "chat": ["hi"]})
    budget = n_call + n_obs + 3
    batch = generate_with_tools(engine, [user("calc"), user("chat")], tok, SamplingParams(max_new_tokens=budget),
                                tools=[add])
    assert batch.completion_ids.shape[1] == budget
    assert batch.is_truncated.tolist() == [True, False]
    assert tok.decode(batch.completion_ids[0, -3:].tolist()) == "the"
    assert batch.completion_mask[0].sum().item() == n_call + 3
    assert batch.meta["completions"][0][-1] == {"role": "assistant", "content": "the"}


def test_tool_results_that_do_not_fit_are_dropped(tok):
    n_call, n_obs = _lengths(tok)
    engine = ScriptedEngine(tok, {"calc": [ADD_2_3, "the answer is 5"]})
    batch = generate_with_tools(engine, [user("calc")], tok, SamplingParams(max_new_tokens=n_call + n_obs),
                                tools=[add])
    assert len(engine.calls) == 1
    assert batch.meta["completion_ids"][0] == tok(ADD_2_3, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert batch.completion_mask.tolist() == [[1] * n_call]
    assert [m["role"] for m in batch.meta["completions"][0]] == ["assistant"]
    assert batch.meta["tool_calls"] == [1] and batch.is_truncated.tolist() == [True]
    # the same when the model's context, not the budget, has no room left
    engine = ScriptedEngine(tok, {"calc": [ADD_2_3, "the answer is 5"]})
    prompt_len = len(batch.meta["prompt_ids"][0])
    limited = generate_with_tools(engine, [user("calc")], tok, SamplingParams(max_new_tokens=1000), tools=[add],
                                  max_context_length=prompt_len + n_call + n_obs)
    assert limited.meta["completion_ids"] == batch.meta["completion_ids"] and limited.is_truncated.tolist() == [True]


def test_a_call_cut_by_the_budget_is_not_run(tok):
    engine = ScriptedEngine(tok, {"calc": [ADD_2_3, "done"]})
    batch = generate_with_tools(engine, [user("calc")], tok, SamplingParams(max_new_tokens=20), tools=[add])
    assert len(engine.calls) == 1 and batch.meta["tool_calls"] == [0]
    assert batch.is_truncated.tolist() == [True] and batch.completion_mask.tolist() == [[1] * 20]
    assert batch.meta["tool_parse_errors"] == [1]  # an unclosed <tool_call>


def test_failing_tools_become_observations(tok):
    release = threading.Event()

    def hang() -> str:
        """Waits until released."""
        release.wait(30)
        return "late"

    turn0 = (call_text("boom", {}) + call_text("nosuch", {}) + call_text("add", {"a": 1})
             + call_text("hang", {}) + '<tool_call>{"name": broken}</tool_call>')
    engine = ScriptedEngine(tok, {"bad": [turn0, "sorry"]})
    try:
        batch = generate_with_tools(engine, [user("bad")], tok, SamplingParams(max_new_tokens=2000),
                                    tools=[add, boom, hang], tool_timeout_s=0.3)
    finally:
        release.set()
    assert batch.meta["tool_calls"] == [4] and batch.meta["tool_failures"] == [4]
    assert batch.meta["tool_parse_errors"] == [1]
    tool_messages = [m for m in batch.meta["completions"][0] if m["role"] == "tool"]
    assert [m["name"] for m in tool_messages] == ["boom", "nosuch", "add", "hang"]
    assert tool_messages[0]["content"] == str({"error": "RuntimeError: kaboom"})
    assert "timed out" in tool_messages[3]["content"]
    (start, end), = spans(batch.completion_mask[0].tolist()[: len(batch.meta["completion_ids"][0])])
    observation = tok.decode(batch.completion_ids[0, start:end].tolist())
    assert "kaboom" in observation and "unknown tool 'nosuch'" in observation
    assert batch.meta["completions"][0][-1] == {"role": "assistant", "content": "sorry"}


def test_environments_one_instance_per_row(tok):
    envs = [Counter(), Counter()]
    prompts = reset_environments(envs, [user("count"), user("count")], [{"start": 1}, {"start": 2}])
    assert prompts == [user("count"), user("count")]  # Counter.reset returns None
    by = call_text("increment", {"by": 4})
    engine = ScriptedEngine(tok, {"count": [by, "done"]})
    batch = generate_with_tools(engine, prompts, tok, SamplingParams(max_new_tokens=2000), environments=envs,
                                max_iterations=1)
    # each row's call reached its own instance
    assert [e.total for e in envs] == [4, 4]
    assert [m["content"] for c in batch.meta["completions"] for m in c if m["role"] == "tool"] == ["4", "4"]
    prompt_text = tok.decode(batch.meta["prompt_ids"][0])
    assert '"name": "increment"' in prompt_text and "get_reward" not in prompt_text and "reset" not in prompt_text


def test_reset_observation_is_appended_to_the_last_message():
    class Greeter:
        def reset(self, name, **_):
            return f" (player: {name})"

    prompts = [[{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]]
    out = reset_environments([Greeter()], prompts, [{"name": "ada"}])
    assert out == [[{"role": "system", "content": "s"}, {"role": "user", "content": "hi (player: ada)"}]]
    assert prompts[0][1]["content"] == "hi"  # the input is left as is


def test_each_turn_samples_with_its_own_seed(tok):
    engine = ScriptedEngine(tok, {"calc": [ADD_2_3, "five"], "chat": ["hi"]})
    generate_with_tools(engine, [user("calc"), user("chat")], tok, SamplingParams(max_new_tokens=500, seed=3),
                        tools=[add], row_seeds=[11, 12])
    assert engine.calls[0]["row_seeds"] == [11, 12] and engine.calls[0]["sampling"].seed == 3
    assert engine.calls[1]["row_seeds"] == [turn_seed(11, 1)] and engine.calls[1]["sampling"].seed == turn_seed(3, 1)
    assert turn_seed(11, 1) not in (11, 12, turn_seed(12, 1), turn_seed(11, 2))
    assert turn_seed(11, 1) == turn_seed(11, 1) and 0 <= turn_seed(11, 1) < 2**63


def test_rejects_bad_inputs(tok):
    engine = ScriptedEngine(tok, {})
    with pytest.raises(ValueError, match="conversational"):
        generate_with_tools(engine, ["plain text"], tok, SamplingParams(max_new_tokens=5), tools=[add])
    with pytest.raises(ValueError, match="max_iterations"):
        generate_with_tools(engine, [user("x")], tok, SamplingParams(max_new_tokens=5), tools=[add], max_iterations=-1)
    with pytest.raises(ValueError, match="row_seeds"):
        generate_with_tools(engine, [user("x")], tok, SamplingParams(max_new_tokens=5), tools=[add], row_seeds=[1, 2])


# ------------------------------------------------------------------------------------------ real engine


def _tiny_llama(vocab_size, hidden_size=32, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                         tie_word_embeddings=False)
    return LlamaForCausalLM(config).eval()


def test_transformers_engine_without_calls_matches_plain_generation(tok):
    from hf_verl.rollout.hf_engine import TransformersEngine

    engine = TransformersEngine(_tiny_llama(len(tok)), tok)
    prompts = [user("what is 2+3?"), user("hi")]
    sampling = SamplingParams(max_new_tokens=16, temperature=1.0)
    batch = generate_with_tools(engine, prompts, tok, sampling, tools=[add], row_seeds=[7, 8])
    assert batch.meta["tool_calls"] == [0, 0] and all(len(c) == 1 for c in batch.meta["completions"])
    plain = generate(engine, batch.meta["prompt_ids"], prompts, sampling, tok, "cpu", row_seeds=[7, 8])
    assert torch.equal(batch.completion_ids, plain.completion_ids)
    assert torch.equal(batch.completion_mask, plain.completion_mask)
    assert torch.allclose(batch.sampling_logprobs, plain.sampling_logprobs)
    assert torch.equal(batch.is_truncated, plain.is_truncated)


def test_transformers_engine_tool_loop_logprobs_match_the_model(tok):
    """A Llama whose weights make it a bigram model: after a newline it writes one token holding a whole
    tool call, then EOS. Every turn therefore calls the tool; the sampling log-probs of every generated
    token must equal the model's own log-probs over the final sequence (observations in context)."""
    from hf_verl.rollout.hf_engine import TransformersEngine

    tok.add_tokens([ADD_2_3])
    call_id, newline, eos = tok.convert_tokens_to_ids(ADD_2_3), tok.convert_tokens_to_ids("\n"), tok.eos_token_id
    vocab = len(tok)
    model = _tiny_llama(vocab, hidden_size=128)
    with torch.no_grad():
        for layer in model.model.layers:  # each block adds nothing to the residual stream
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.zero_()
        model.model.embed_tokens.weight[:, :vocab].copy_(torch.eye(vocab))
        model.lm_head.weight.zero_()
        model.lm_head.weight[eos, :vocab] = 2.0  # by default: end the turn
        model.lm_head.weight[eos, newline] = 0.0
        model.lm_head.weight[call_id, newline] = 2.0  # after a newline: the tool call
        model.lm_head.weight[eos, call_id] = 2.0
    engine = TransformersEngine(model, tok)
    batch = generate_with_tools(engine, [user("calc"), user("more")], tok, SamplingParams(max_new_tokens=300,
                                temperature=0.0), tools=[add], max_iterations=2)

    obs = tok("\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
              add_special_tokens=False)["input_ids"]
    expected = [call_id, eos] + obs + [call_id, eos] + obs + [call_id, eos]
    assert batch.meta["completion_ids"] == [expected, expected]
    assert batch.completion_mask[0].tolist() == [1, 1] + [0] * len(obs) + [1, 1] + [0] * len(obs) + [1, 1]
    assert batch.meta["tool_calls"] == [2, 2] and batch.is_truncated.tolist() == [False, False]

    # recompute the log-probs of the whole sequence (every real token attended to)
    ids = batch.input_ids
    attention = torch.cat([batch.prompt_mask, batch.completion_ids.ne(tok.pad_token_id).long()], 1)
    assert torch.equal(batch.attention_mask, attention)  # observations attended (completion_attention_mask)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention).logits.float()
    P = batch.prompt_ids.shape[1]
    logp = torch.log_softmax(logits[:, P - 1 : -1], -1).gather(-1, batch.completion_ids[..., None])[..., 0]
    gen = batch.completion_mask.bool()
    assert torch.allclose(batch.sampling_logprobs[gen], logp[gen], atol=1e-5)
    assert (batch.sampling_logprobs[~gen] == 0).all()
