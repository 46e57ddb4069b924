"""GRPOTrainer with tools, environment_factory and rollout_func (TRL 1.16's arguments), on a tiny Llama.

The model is built in code with hand-set weights that make it a bigram model over a character-level
tokenizer with a Hermes chat template (tests.conftest): after the assistant header (a newline) it writes,
with even odds, either one token holding a whole `add(2, 3)` tool call or the token "5", then ends the
turn. Tool calls therefore happen in every round, each followed by an observation span.
"""

import dataclasses

import pytest
import torch
from datasets import Dataset

from hf_verl.trainers.grpo_config import GRPOConfig
from hf_verl.trainers.grpo_trainer import GRPOTrainer
from tests.conftest import build_char_tokenizer, build_hermes_tokenizer, call_text

ADD_2_3 = call_text("add", {"a": 2, "b": 3})


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first integer
        b: the second integer
    """
    return a + b


def _tokenizer():
    tok = build_hermes_tokenizer()
    tok.add_tokens([ADD_2_3])
    return tok


def _bigram_llama(tok, call_token=ADD_2_3):
    """A Llama whose LM head reads the last token one-hot (its attention block adds a small context-dependent
    term, its MLP block nothing): "\\n" -> the call token or "5" (even odds), either -> EOS."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    vocab = len(tok)
    config = LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    ids = tok.convert_tokens_to_ids
    call_id, newline, five, eos = ids(call_token), ids("\n"), ids("5"), tok.eos_token_id
    scale = 1 / 128 ** 0.5  # the final norm scales a one-hot row by sqrt(hidden)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.normal_(0.0, 0.03)
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.zero_()
        model.model.embed_tokens.weight[:, :vocab].copy_(torch.eye(vocab))
        model.lm_head.weight.zero_()
        model.lm_head.weight[eos, :vocab] = 20 * scale
        model.lm_head.weight[eos, newline] = 0.0
        model.lm_head.weight[call_id, newline] = 10 * scale
        model.lm_head.weight[five, newline] = 10 * scale
    return model


def _args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=2, logging_steps=1,
                per_device_train_batch_size=8, num_generations=4, max_completion_length=200, learning_rate=1e-4,
                gradient_checkpointing=False, save_strategy="no", max_tool_calling_iterations=1, seed=3)
    base.update(kw)
    return GRPOConfig(**base)


def _dataset(n=8, **columns):
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": "what is 2+3?"}]] * n, **columns})


def _observations(batch):
    return batch.completion_attention_mask.bool() & ~batch.completion_mask.bool()


def test_grpo_trains_with_tools(tmp_path):
    tok = _tokenizer()
    model = _bigram_llama(tok)
    seen = []

    def used_tool(prompts, completions, **kwargs):
        seen.append(completions)
        return [float(any(m["role"] == "tool" for m in c)) for c in completions]

    trainer = GRPOTrainer(model=model, reward_funcs=used_tool, args=_args(tmp_path), train_dataset=_dataset(),
                          processing_class=tok, tools=[add])

    # one rollout before training: tool calls happen, observations are attended but not selected
    rows = [trainer.train_dataset[i] for i in range(8)]
    batch = trainer._collect(rows, trainer.engine).batch
    obs = _observations(batch)
    assert obs.any() and sum(batch.meta["tool_calls"]) > 0
    assert all(isinstance(c, list) and c[0]["role"] == "assistant" for c in seen[-1])
    assert any(m["role"] == "tool" and m["content"] == "5" for c in seen[-1] for m in c)
    with torch.no_grad():
        logp, _ = trainer.actor.logprobs(batch)
    gen = batch.completion_mask.bool()
    assert (logp[obs] == 0).all()
    # the trainer scores each model token with the observations in its context, as the engine sampled it (with
    # the observations left out of the attention, the log-probs of later turns would differ)
    torch.testing.assert_close(logp[gen], batch.sampling_logprobs[gen], atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        blind, _ = trainer.actor.logprobs(dataclasses.replace(batch, completion_attention_mask=None))
    assert (blind[gen] - batch.sampling_logprobs[gen]).abs().max() > 1e-3

    # the loss ignores the observation tokens: perturbing their log-probs (current and old) changes nothing
    batch.advantages = torch.tensor([1.0, -1.0] * 4)
    batch.old_logprobs = logp.detach() - 0.05 * gen
    out = trainer.actor.infer(batch, trainer.algorithm.forward_request())
    reference = trainer.algorithm.policy_loss(out, batch)[0]
    perturbed = dataclasses.replace(out, logp=out.logp + 3.0 * _observations(batch))
    batch.old_logprobs = batch.old_logprobs - 2.0 * obs
    assert torch.equal(trainer.algorithm.policy_loss(perturbed, batch)[0], reference)

    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2
    assert all(h["tools/call_frequency"] > 0 for h in logs)
    assert all(h["tools/failure_frequency"] == 0 for h in logs)
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert "lm_head.weight" in changed and any("o_proj" in n for n in changed)


class AddEnv:
    """One instance per row: `add` is its tool; the reward is whether the row's target was reached."""

    instances = 0

    def __init__(self):
        type(self).instances += 1
        self.target, self.results = None, []

    def reset(self, target, **row):
        self.target, self.results = target, []
        return " (use the add tool)"

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: the first integer
            b: the second integer
        """
        self.results.append(a + b)
        return a + b

    def get_reward(self) -> float:
        return float(self.target in self.results)


def test_grpo_trains_with_environment_factory(tmp_path):
    tok = _tokenizer()
    model = _bigram_llama(tok)
    seen = {}

    def sees_environments(prompts, completions, environments, target, **kwargs):
        assert [e.target for e in environments] == target  # each reset with its own row
        seen.update(prompts=prompts, environments=environments)
        return [0.0] * len(completions)

    AddEnv.instances = 0
    trainer = GRPOTrainer(model=model, reward_funcs=sees_environments, args=_args(tmp_path),
                          train_dataset=_dataset(target=[5, 6] * 4), processing_class=tok,
                          environment_factory=AddEnv)
    assert trainer.reward_names == ["sees_environments", "AddEnv"]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer.train()
    envs = seen["environments"]
    assert len(envs) == 8 and len({id(e) for e in envs}) == 8 and all(isinstance(e, AddEnv) for e in envs)
    assert AddEnv.instances == 8  # made once (the probe seeds the pool), reset for every rollout
    assert any(e.results == [5] for e in envs)
    assert seen["prompts"][0][-1]["content"] == "what is 2+3? (use the add tool)"  # reset's string appended
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert all(h["tools/call_frequency"] > 0 for h in logs)
    assert "rewards/AddEnv/mean" in logs[0] and 0 < logs[0]["rewards/AddEnv/mean"] < 1
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_tools_with_async_rollout(tmp_path):
    tok = _tokenizer()

    def used_tool(completions, **kwargs):
        return [float(any(m["role"] == "tool" for m in c)) for c in completions]

    trainer = GRPOTrainer(model=_bigram_llama(tok), reward_funcs=used_tool,
                          args=_args(tmp_path, use_async_rollout=True, max_steps=3), train_dataset=_dataset(),
                          processing_class=tok, tools=[add])
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 3 and all(h["tools/call_frequency"] > 0 for h in logs)


def test_rollout_func_contract(tmp_path):
    """TRL's rollout_func: prompts and the trainer in; prompt_ids / completion_ids / logprobs out, `env_mask`
    masking the loss, every other field a reward column."""
    from hf_verl.rollout.base import SamplingParams

    tok = _tokenizer()
    calls = []

    def rollout_func(prompts, trainer):
        calls.append(prompts)
        ids = [tok.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=False)
               for p in prompts]
        out = trainer.engine.generate(ids, SamplingParams(max_new_tokens=8))
        return {"prompt_ids": ids, "completion_ids": out.completion_ids, "logprobs": out.logprobs,
                "env_mask": [[1] * (len(c) - 1) + [0] for c in out.completion_ids],
                "lengths": [len(c) for c in out.completion_ids]}

    def longer(completions, lengths, **kwargs):
        assert isinstance(completions[0], list)
        return [float(n) for n in lengths]

    trainer = GRPOTrainer(model=_bigram_llama(tok), reward_funcs=longer, args=_args(tmp_path, max_steps=1),
                          train_dataset=_dataset(), processing_class=tok, rollout_func=rollout_func)
    rows = [trainer.train_dataset[i] for i in range(8)]
    batch = trainer._collect(rows, trainer.engine).batch
    assert len(calls[-1]) == 8 and calls[-1][0] == rows[0]["prompt"]
    lengths = batch.completion_attention_mask.sum(1)
    assert torch.equal(batch.completion_mask.sum(1), lengths - 1)  # the last token of each row masked out
    trainer.train()
    assert [h for h in trainer.state.log_history if "loss" in h]


def test_rejections_name_what_to_change(tmp_path):
    tok = _tokenizer()
    model = _bigram_llama(tok)

    def reward(completions, **kwargs):
        return [0.0] * len(completions)

    with pytest.raises(ValueError, match="cannot render tool calls"):
        GRPOTrainer(model=model, reward_funcs=reward, args=_args(tmp_path), train_dataset=_dataset(),
                    processing_class=build_char_tokenizer(), tools=[add])
    with pytest.raises(ValueError, match="conversational prompts"):
        GRPOTrainer(model=model, reward_funcs=reward, args=_args(tmp_path), processing_class=tok, tools=[add],
                    train_dataset=Dataset.from_dict({"prompt": ["what is 2+3?"] * 8}))
    with pytest.raises(ValueError, match="rollout_func cannot be combined with tools"):
        GRPOTrainer(model=model, reward_funcs=reward, args=_args(tmp_path), train_dataset=_dataset(),
                    processing_class=tok, tools=[add], rollout_func=lambda prompts, trainer: {})
    with pytest.raises(ValueError, match="use_async_rollout=False"):
        GRPOTrainer(model=model, reward_funcs=reward, args=_args(tmp_path, use_async_rollout=True),
                    train_dataset=_dataset(), processing_class=tok, rollout_func=lambda prompts, trainer: {})
    with pytest.raises(ValueError, match="No reward source provided"):
        GRPOTrainer(model=model, args=_args(tmp_path), train_dataset=_dataset(), processing_class=tok, tools=[add])


class RoutedEnv:
    """Owns its data: `reset` writes the prompt's only content; records what it was reset with."""

    resets: list = []

    def reset(self, **row):
        type(self).resets.append(row)
        return "add 2 and 3"

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: the first integer
            b: the second integer
        """
        return a + b

    def get_reward(self) -> float:
        return 1.0


def test_rows_without_prompt_route_to_environments_that_own_the_data(tmp_path):
    # TRL: a dict environment_factory may be fed rows with only an `environment` column; each row's prompt is an
    # empty user message that reset() fills, and reset() receives neither that placeholder nor the routing column
    tok = _tokenizer()
    model = _bigram_llama(tok)
    seen = {}

    def sees_prompts(prompts, completions, **kwargs):
        seen.setdefault("prompts", []).extend(prompts)
        return [0.0] * len(completions)

    RoutedEnv.resets = []
    ds = Dataset.from_dict({"environment": ["a", "b"] * 4, "level": [1, 2] * 4})
    trainer = GRPOTrainer(model=model, reward_funcs=sees_prompts, args=_args(tmp_path, max_steps=1),
                          train_dataset=ds, processing_class=tok,
                          environment_factory={"a": RoutedEnv, "b": RoutedEnv})
    trainer.train()
    resets = [r for r in RoutedEnv.resets if r]  # the constructor's probe resets with no row
    assert resets and all(set(r) == {"level"} for r in resets)
    assert seen["prompts"] and all(p[-1]["role"] == "user" and p[-1]["content"].endswith("add 2 and 3")
                                   for p in seen["prompts"])
    assert len([h for h in trainer.state.log_history if "loss" in h]) == 1
