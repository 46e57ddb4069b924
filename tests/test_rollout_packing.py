"""Padding-free rollouts on one process: the engine packs a round's rows into one sequence (per-row causal
attention) when its padding share makes it pay, with the padded path's log-probs, entropy, values and
gradients to float rounding (issue 14: padding is work TRL does and hf_verl need not)."""

import random

import pytest
import torch
from datasets import Dataset

from hf_verl.data.batch import RolloutBatch
from hf_verl.engine.hf_layouts import packing_pays
from hf_verl.parallel.ulysses import packing_unsupported
from tests.conftest import build_char_tokenizer
from tests.test_grpo_trainer import _args, _model
from tests.test_parallel_layout import _engine


def _spread_batch(tok, rows=8, seed=0, prompt=(2, 40), completion=(1, 20)):
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 30) for _ in range(rng.randint(*prompt))] for _ in range(rows)]
    completions = [[rng.randrange(3, 30) for _ in range(rng.randint(*completion))] for _ in range(rows)]
    return RolloutBatch.from_lists(prompts, completions, tok.pad_token_id)


class InputShapes:
    def __init__(self, model):
        self.shapes = []
        model.register_forward_pre_hook(lambda _m, _a, kw: self.shapes.append(tuple(kw["input_ids"].shape)),
                                        with_kwargs=True)


def test_packed_equals_padded_logprobs_entropy_and_gradients():
    tok = build_char_tokenizer()
    model = _model(tok)  # Qwen2 with grouped KV heads
    batch = _spread_batch(tok)
    padded_lp, padded_ent = _engine(model, padding_free=False).logprobs(batch, temperature=0.7, with_entropy=True)
    padded_lp.sum().backward()
    padded_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    shapes = InputShapes(model)
    packed_lp, packed_ent = _engine(model, padding_free=True).logprobs(batch, temperature=0.7, with_entropy=True)
    assert shapes.shapes == [(1, int(batch.attention_mask.sum()))]  # one sequence, no padding
    torch.testing.assert_close(packed_lp, padded_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed_ent, padded_ent, rtol=1e-5, atol=1e-5)
    assert (packed_lp[batch.completion_mask == 0] == 0).all()
    packed_lp.sum().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, padded_grads[n], rtol=1e-4, atol=1e-5, msg=n)


def test_packed_equals_padded_critic_values():
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    tok = build_char_tokenizer()
    torch.manual_seed(0)
    critic = Qwen2ForSequenceClassification(Qwen2Config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=len(tok), pad_token_id=tok.pad_token_id, num_labels=1))
    batch = _spread_batch(tok, seed=1)
    padded = _engine(critic, role="critic", padding_free=False).values(batch)
    packed = _engine(critic, role="critic", padding_free=True).values(batch)
    torch.testing.assert_close(packed, padded, rtol=1e-5, atol=1e-5)


def test_packing_pays_when_padding_per_row_exceeds_a_row_call():
    mask = torch.ones(4, 100)
    mask[:, :30] = 0  # 30 padded tokens per row
    assert packing_pays(mask, hidden_size=128)  # a row call costs 20 tokens of a hidden-128 model
    assert not packing_pays(mask, hidden_size=64)  # 40 tokens at hidden 64
    assert packing_pays(mask, hidden_size=4096)
    mask[:, :25] = 1  # 5 padded tokens per row: below the floor of 8 at any width
    assert not packing_pays(mask, hidden_size=4096)
    assert not packing_pays(torch.ones(0, 5), hidden_size=128)


def test_auto_packs_only_where_padding_pays():
    tok = build_char_tokenizer()
    model = _model(tok)  # hidden 32: a row call costs 80 tokens
    shapes = InputShapes(model)
    engine = _engine(model)  # padding_free=None
    spread = _spread_batch(tok, prompt=(2, 200), completion=(1, 20))
    assert packing_pays(spread.attention_mask, 32)
    engine.logprobs(spread)
    even = _spread_batch(tok, prompt=(10, 10), completion=(6, 6))
    engine.logprobs(even)
    assert shapes.shapes == [(1, int(spread.attention_mask.sum())), tuple(even.input_ids.shape)]


def test_models_that_cannot_pack_pad_or_fail_clearly():
    from transformers import MistralConfig, MistralForCausalLM

    tok = build_char_tokenizer()
    assert packing_unsupported(_model(tok)) is None
    eager = _model(tok)
    eager.set_attn_implementation("eager")
    assert "'eager'" in packing_unsupported(eager)
    windowed = MistralForCausalLM(MistralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                num_attention_heads=4, num_key_value_heads=2, vocab_size=len(tok),
                                                sliding_window=16, attn_implementation="sdpa"))
    assert "sliding-window" in packing_unsupported(windowed)
    batch = _spread_batch(tok)
    shapes = InputShapes(eager)
    _engine(eager).logprobs(batch)  # auto: pads
    assert shapes.shapes == [tuple(batch.input_ids.shape)]
    with pytest.raises(ValueError, match="padding_free=True cannot pack the actor's rows: it attends with 'eager'"):
        _engine(eager, padding_free=True).logprobs(batch)


def test_grpo_losses_equal_packed_and_padded(tmp_path):
    from hf_verl.trainers.grpo_trainer import GRPOTrainer

    tok = build_char_tokenizer()
    prompts = ["a", "hello there", "xy", "the quick brown fox jumps"] * 2
    losses = {}
    for padding_free in (False, True):
        trainer = GRPOTrainer(
            model=_model(tok), reward_funcs=lambda completions, **kw: [float(c.count("a")) for c in completions],
            args=_args(tmp_path / str(padding_free), max_steps=2, beta=0.1, padding_free=padding_free,
                       num_iterations=2),
            train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=tok)
        assert trainer.actor.padding_free is padding_free and trainer.reference.padding_free is padding_free
        trainer.train()
        losses[padding_free] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses[True]) == 2
    assert losses[True] == pytest.approx(losses[False], rel=1e-4, abs=1e-6)
