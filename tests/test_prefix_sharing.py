"""Shared-prompt layout: the completions of one prompt scored with the prompt laid out once (a GRPO group, a DPO
pair), with the padded path's log-probs, entropy and gradients to float rounding (issue 14: the prompt's repeats
are work TRL does and hf_verl need not)."""

import random

import pytest
import torch
from datasets import Dataset

from hf_verl.data.batch import RolloutBatch
from hf_verl.data.prefix_sharing import (
    packed_cost,
    padded_cost,
    share_prefixes,
    sharing_cost,
)
from tests.conftest import build_char_tokenizer
from tests.test_grpo_trainer import _args, _model
from tests.test_parallel_layout import _engine
from tests.test_rollout_packing import InputShapes


def _group_batch(tok, prompts=3, group=4, seed=0, prompt=(2, 30), completion=(1, 12)):
    """`prompts` distinct prompts, each repeated `group` times with its own completion (a GRPO round)."""
    rng = random.Random(seed)
    distinct = [[rng.randrange(3, 30) for _ in range(rng.randint(*prompt))] for _ in range(prompts)]
    rows = [p for p in distinct for _ in range(group)]
    completions = [[rng.randrange(3, 30) for _ in range(rng.randint(*completion))] for _ in rows]
    return RolloutBatch.from_lists(rows, completions, tok.pad_token_id)


def _llama(tok):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    return LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=1, vocab_size=len(tok),
                                        pad_token_id=tok.pad_token_id))


# ------------------------------------------------------------------ the layout
def test_layout_lays_each_prompt_out_once_and_indexes_every_completion_token():
    prompts = [[5, 6, 7], [9], [5, 6, 7]]
    completions = [[10, 11], [12, 13, 14], [15]]
    layout = share_prefixes(prompts, completions, pad_token_id=0)
    assert layout.input_ids.tolist() == [[5, 6, 7, 10, 11, 15], [9, 12, 13, 14, 0, 0]]
    assert layout.position_ids.tolist() == [[0, 1, 2, 3, 4, 3], [0, 1, 2, 3, 0, 0]]
    assert layout.tokens == 10 and layout.num_rows == 3
    W = 6
    # row 0's tokens from 2 (predicting 10), 3 (11); row 1's from 6 + 0 (12), 6 + 1, 6 + 2; row 2's from 2 (15)
    assert layout.index.tolist() == [2, 3, W + 0, W + 1, W + 2, 2]
    assert layout.targets.tolist() == [10, 11, 12, 13, 14, 15]
    assert layout.row_of.tolist() == [0, 0, 1, 1, 1, 2]
    mask = layout.attention_mask[0, 0]
    assert mask[5].tolist() == [True, True, True, False, False, True]  # completion 2 sees the prompt and itself
    assert mask[4].tolist() == [True, True, True, True, True, False]
    assert mask[2].tolist() == [True, True, True, False, False, False]  # the prompt is causal
    pad = layout.attention_mask[1, 0]
    assert pad[4].tolist() == [False, False, False, False, True, False]  # padding attends to itself only


def test_layout_declines_what_it_cannot_gain_on_or_reproduce():
    assert share_prefixes([[1, 2], [3]], [[4], [5]]) is None  # no shared prompt
    assert share_prefixes([[], []], [[4], [5]]) is None  # an empty prompt has no position predicting token 1
    with pytest.raises(ValueError, match="2 prompts but 1 completions"):
        share_prefixes([[1], [1]], [[2]])
    layout = share_prefixes([[1, 2], [1, 2]], [[], [3]])  # an empty completion is laid out as nothing
    assert layout.input_ids.tolist() == [[1, 2, 3]] and layout.index.tolist() == [1]


def test_cost_model_prefers_sharing_for_long_prompts_and_large_groups_only():
    model = {"hidden_size": 896, "intermediate_size": 4864, "kv_fraction": 1 / 7}
    long_prompt = share_prefixes([[1] * 200] * 8, [[2] * 40] * 8)
    assert sharing_cost(long_prompt, **model) < 0.5 * padded_cost(8, 240, **model)
    short_prompt = share_prefixes([[1] * 4] * 8, [[2] * 200] * 8)  # sharing saves 28 tokens, attends 8x wider
    assert sharing_cost(short_prompt, **model) > padded_cost(8, 204, **model)
    assert packed_cost([10, 20], **model) < padded_cost(2, 20, **model)


# ------------------------------------------------------------------ the engine
@pytest.mark.parametrize("build", [_model, _llama], ids=["qwen2-gqa", "llama-1kv"])
def test_shared_equals_padded_logprobs_entropy_and_gradients(build):
    tok = build_char_tokenizer()
    model = build(tok)
    batch = _group_batch(tok)
    padded_lp, padded_ent = _engine(model, shared_prefix=False, padding_free=False).logprobs(
        batch, temperature=0.7, with_entropy=True)
    (padded_lp * torch.linspace(0.5, 1.5, padded_lp.numel()).view_as(padded_lp)).sum().backward()
    padded_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    shapes = InputShapes(model)
    shared_lp, shared_ent = _engine(model, shared_prefix=True).logprobs(batch, temperature=0.7, with_entropy=True)
    assert len(shapes.shapes) == 1 and shapes.shapes[0][0] == 3  # one row per distinct prompt
    torch.testing.assert_close(shared_lp, padded_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(shared_ent, padded_ent, rtol=1e-5, atol=1e-5)
    assert (shared_lp[batch.completion_mask == 0] == 0).all()
    (shared_lp * torch.linspace(0.5, 1.5, shared_lp.numel()).view_as(shared_lp)).sum().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, padded_grads[n], rtol=1e-4, atol=1e-5, msg=n)


def test_shared_layout_falls_back_where_it_does_not_apply():
    tok = build_char_tokenizer()
    model = _model(tok)
    shapes = InputShapes(model)
    engine = _engine(model, shared_prefix=True, padding_free=False)
    distinct = RolloutBatch.from_lists([[3, 4], [5, 6]], [[7], [8, 9]], tok.pad_token_id)
    engine.logprobs(distinct)
    assert shapes.shapes[-1] == (2, 4)  # padded: no prompt to share
    group = _group_batch(tok, prompts=1, group=3)
    tool = group.completion_mask.clone()
    group.completion_attention_mask = tool  # a multi-turn round: observations attended, not scored
    engine.logprobs(group)
    assert shapes.shapes[-1][0] == 3  # padded rows
    gap = _group_batch(tok, prompts=1, group=3, completion=(4, 6))
    gap.completion_mask[0, 1] = 0  # a scored token after an unscored one: not a plain completion
    engine.logprobs(gap)
    assert shapes.shapes[-1][0] == 3
    assert _engine(model, shared_prefix=False).shared_layout([[1], [1]], [[2], [3]], rows=2, width=2) is None


def test_shared_prefix_true_refuses_a_model_that_cannot_take_the_layout():
    tok = build_char_tokenizer()
    model = _model(tok)
    model.set_attn_implementation("eager")
    with pytest.raises(ValueError, match="shared_prefix=True cannot lay out the actor's rows by prompt"):
        _engine(model, shared_prefix=True).logprobs(_group_batch(tok))
    lp, _ = _engine(model).logprobs(_group_batch(tok))  # None: the padded path, silently
    assert lp.shape[0] == 12


def test_auto_shares_long_prompts_and_keeps_short_ones_padded():
    tok = build_char_tokenizer()
    model = _model(tok)  # hidden 32: a token costs about 144 attended pairs
    shapes = InputShapes(model)
    engine = _engine(model, padding_free=False)
    engine.logprobs(_group_batch(tok, prompts=2, group=4, prompt=(60, 60), completion=(4, 6)))
    assert shapes.shapes[-1][0] == 2
    engine.logprobs(_group_batch(tok, prompts=2, group=8, prompt=(2, 2), completion=(40, 60)))
    assert shapes.shapes[-1][0] == 16


# ------------------------------------------------------------------ the trainers
def _grpo_losses(tmp_path, shared_prefix):
    from hf_verl import GRPOTrainer

    tok = build_char_tokenizer()
    model = _model(tok)
    prompts = ["abcabcabc", "xyzxyz", "hello there", "ab"] * 2
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [float(c.count("a")) for c in completions],
                          args=_args(tmp_path, shared_prefix=shared_prefix, padding_free=False, seed=3, beta=0.1,
                                     max_steps=2),
                          train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=tok)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_grpo_with_shared_prompts_equals_padded(tmp_path):
    padded, padded_weights = _grpo_losses(tmp_path / "a", False)
    shared, shared_weights = _grpo_losses(tmp_path / "b", True)
    assert len(padded) == 2
    assert shared == pytest.approx(padded, rel=1e-4, abs=1e-6)
    for n, w in padded_weights.items():
        torch.testing.assert_close(shared_weights[n], w, rtol=1e-4, atol=1e-5, msg=n)


def _dpo_losses(tmp_path, shared_prefix, **kw):
    from hf_verl import DPOConfig, DPOTrainer

    tok = build_char_tokenizer()
    model = _model(tok)
    data = Dataset.from_dict({"prompt": ["abcabc", "hello", "xy", "the quick"] * 2,
                              "chosen": ["aa", "bbb", "c", "dd"] * 2, "rejected": ["x", "yyyy", "zz", "w"] * 2})
    args = DPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=2, logging_steps=1,
                     per_device_train_batch_size=4, learning_rate=1e-2, save_strategy="no", seed=3,
                     shared_prefix=shared_prefix, **kw)
    shapes = InputShapes(model)
    trainer = DPOTrainer(model=model, args=args, train_dataset=data, processing_class=tok)
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], shapes.shapes


@pytest.mark.parametrize("extra", [{}, {"ld_alpha": 0.5, "use_weighting": True}], ids=["sigmoid", "ld-wpo"])
def test_dpo_with_shared_prompts_equals_padded(tmp_path, extra):
    padded, padded_shapes = _dpo_losses(tmp_path / "a", False, **extra)
    shared, shared_shapes = _dpo_losses(tmp_path / "b", True, **extra)
    assert all(rows == 8 for rows, _ in padded_shapes)  # 4 pairs: 8 padded rows
    assert all(rows == 4 for rows, _ in shared_shapes)  # one row per prompt
    assert len(padded) == 2
    assert shared == pytest.approx(padded, rel=1e-4, abs=1e-6)
