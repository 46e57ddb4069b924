"""Degenerate rounds train on: a micro-batch whose completions are all empty, all truncated (and masked) or
all rewarded None gives a zero loss that is logged, and the run goes on (issue 12, deliverable 5)."""

import math

import pytest
import torch
from datasets import Dataset

from hf_verl.trainers.grpo_trainer import GRPOTrainer
from tests.conftest import build_char_tokenizer
from tests.test_grpo_trainer import _args as grpo_args
from tests.test_grpo_trainer import _model


def _args(tmp_path, **kw):
    return grpo_args(tmp_path, **{"max_steps": 2, "max_completion_length": 4, **kw})


def _losses(trainer):
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == trainer.args.max_steps
    return [h["loss"] for h in logs], logs


def length(completions, **kwargs):
    return [float(len(c)) for c in completions]


def test_all_empty_completions_train_on_with_zero_loss(tmp_path):
    tok = build_char_tokenizer()
    ds = Dataset.from_dict({"prompt": ["abc", "xy"] * 4})

    def empty_rollout(prompts, trainer):
        ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
        return {"prompt_ids": ids, "completion_ids": [[] for _ in prompts], "logprobs": [[] for _ in prompts]}

    trainer = GRPOTrainer(model=_model(tok), reward_funcs=length, args=_args(tmp_path, beta=0.1),
                          train_dataset=ds, processing_class=tok, rollout_func=empty_rollout)
    trainer.train()
    losses, logs = _losses(trainer)
    assert losses == [0.0, 0.0]
    assert logs[0]["completions/mean_length"] == 0.0


@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_all_truncated_and_masked_trains_on_with_zero_loss(tmp_path, beta):
    tok = build_char_tokenizer()
    ds = Dataset.from_dict({"prompt": ["abc", "xy"] * 4})
    body = tok("ab", add_special_tokens=False)["input_ids"]

    def never_ending(prompts, trainer):  # no completion ends with EOS: all hit the limit
        ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
        return {"prompt_ids": ids, "completion_ids": [list(body) for _ in prompts], "logprobs": None}

    model = _model(tok)
    trainer = GRPOTrainer(model=model, reward_funcs=length,
                          args=_args(tmp_path, beta=beta, mask_truncated_completions=True, weight_decay=0.0),
                          train_dataset=ds, processing_class=tok, rollout_func=never_ending)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    losses, logs = _losses(trainer)
    assert losses == [0.0, 0.0]
    assert logs[0]["completions/clipped_ratio"] == 1.0
    # nothing to learn from: no gradient reaches the weights
    assert all(torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())


def test_all_rewards_none_trains_on(tmp_path):
    tok = build_char_tokenizer()

    def abstain(completions, **kwargs):
        return [None] * len(completions)

    ds = Dataset.from_dict({"prompt": ["abc", "xy"] * 4})
    trainer = GRPOTrainer(model=_model(tok), reward_funcs=abstain, args=_args(tmp_path),
                          train_dataset=ds, processing_class=tok)
    trainer.train()
    losses, logs = _losses(trainer)
    assert all(math.isfinite(x) for x in losses)
    assert losses == [0.0, 0.0]  # every advantage is 0
    assert logs[0]["reward"] == 0.0


@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_a_micro_batch_of_empty_completions_beside_a_full_one(tmp_path, beta):
    """Two micro-batches per round (one per prompt group): the one whose completions are all empty contributes a
    zero loss, the other trains the model."""
    tok = build_char_tokenizer()
    ds = Dataset.from_dict({"prompt": ["abc", "xy"] * 4})
    eos = tok.eos_token_id
    body = tok("ab", add_special_tokens=False)["input_ids"]

    def half_empty(prompts, trainer):
        ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
        comps = [[] if p == "xy" else body[: 1 + i % 2] + [eos] for i, p in enumerate(prompts)]
        return {"prompt_ids": ids, "completion_ids": comps, "logprobs": None}

    model = _model(tok)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = GRPOTrainer(model=model, reward_funcs=length,
                          args=_args(tmp_path, beta=beta, steps_per_generation=2, shuffle_dataset=False),
                          train_dataset=ds, processing_class=tok, rollout_func=half_empty)
    trainer.train()
    losses, _ = _losses(trainer)
    assert all(math.isfinite(x) for x in losses)
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())


@pytest.mark.parametrize("critic", [False, True])
def test_facade_step_on_a_mini_batch_without_completion_tokens(critic):
    """The facade's loop on a mini-batch whose completion tokens are all masked out (all truncated and masked,
    or all empty): compute_loss gives 0 (the engines ran its backward), step() runs and changes nothing."""
    from tests.test_facade import PROMPTS, make_trainer, snapshot

    trainer = make_trainer(critic=critic)
    rollout = trainer.rollout(PROMPTS)
    rollout.completion_mask = torch.zeros_like(rollout.completion_mask)
    before = snapshot(trainer.model)
    loss = trainer.compute_loss(rollout)
    assert loss.item() == 0.0 and not loss.requires_grad
    metrics = trainer.step(loss)
    assert metrics["grad_norm/actor"] == 0.0
    assert all(torch.equal(p, before[n]) for n, p in trainer.model.named_parameters() if n in before)
