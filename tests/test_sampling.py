"""Lean decode loop and sampling functions: parity with `generate`, transformers' processors, hand values."""

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from hf_verl.rollout.base import SamplingParams
from hf_verl.rollout.hf_engine import TransformersEngine
from hf_verl.rollout.sampling import (
    apply_repetition_penalty,
    draw_categorical,
    filter_min_p,
    filter_top_k,
    filter_top_p,
    invert_cdf,
    sample_next,
)
from tests.conftest import build_char_tokenizer

NEG = float("-inf")
PROMPTS = ["hello world", "ab", "what is 2+2?", "x"]


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def _llama(tok, seed=0):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    return model


@pytest.fixture()
def model(tok):
    return _llama(tok)


def _ids(tok):
    return [tok(p)["input_ids"] for p in PROMPTS]


def _bias_hook(model, fn):
    return model.lm_head.register_forward_hook(lambda m, i, out: out + fn(out))


def _teacher_forced(model, prompt, completion, temperature):
    with torch.no_grad():
        logits = model(torch.tensor([list(prompt) + list(completion)])).logits[0].float()
    lps = torch.log_softmax(logits / temperature, dim=-1)
    pos = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(completion))
    return lps[pos, torch.tensor(completion)]


# ------------------------------------------------------------------ engine parity


@pytest.mark.parametrize("penalty", [1.0, 1.3])
def test_fast_greedy_equals_generate(model, tok, penalty):
    sp = SamplingParams(max_new_tokens=12, temperature=0.0, repetition_penalty=penalty)
    fast = TransformersEngine(model, tok).generate(_ids(tok), sp)
    slow = TransformersEngine(model, tok, use_generate=True).generate(_ids(tok), sp)
    assert fast.completion_ids == slow.completion_ids
    assert fast.finish_reasons == slow.finish_reasons
    for a, b in zip(fast.logprobs, slow.logprobs):
        assert a == pytest.approx(b, abs=1e-4)


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.3])
def test_fast_logprobs_equal_teacher_forced(model, tok, temperature):
    sp = SamplingParams(max_new_tokens=10, temperature=temperature, top_k=8, top_p=0.9,
                        min_p=0.05, repetition_penalty=1.2, seed=3)
    prompts = _ids(tok)
    out = TransformersEngine(model, tok).generate(prompts, sp)
    t = 1.0 if temperature == 0.0 else temperature
    for p, ids, lps in zip(prompts, out.completion_ids, out.logprobs):
        assert 1 <= len(ids) <= 10
        assert torch.allclose(torch.tensor(lps), _teacher_forced(model, p, ids, t), atol=1e-4)


def test_fast_sampling_seed_reproducible(model, tok):
    engine = TransformersEngine(model, tok)
    sp = SamplingParams(max_new_tokens=10, temperature=1.0, top_k=10, seed=7)
    a, b = engine.generate(_ids(tok), sp), engine.generate(_ids(tok), sp)
    assert a.completion_ids == b.completion_ids and a.logprobs == b.logprobs
    c = engine.generate(_ids(tok), SamplingParams(max_new_tokens=10, temperature=1.0, seed=8))
    assert c.completion_ids != a.completion_ids


def test_fast_rows_finish_at_different_times(model, tok):
    eos = tok.eos_token_id
    calls = {"n": 0}

    def bias(logits):
        # forward k (0 = prefill) forces EOS on row k: row 0 ends after 1 token, row 1 after 2;
        # rows 2 and 3 never end
        b = torch.zeros_like(logits)
        b[..., eos] = -100.0
        k = calls["n"]
        if k < 2:
            b[k, ..., eos] = 100.0
        calls["n"] += 1
        return b

    handle = _bias_hook(model, bias)
    try:
        out = TransformersEngine(model, tok).generate(
            _ids(tok), SamplingParams(max_new_tokens=6, temperature=0.0))
    finally:
        handle.remove()
    assert out.completion_ids[0] == [eos]
    assert len(out.completion_ids[1]) == 2 and out.completion_ids[1][-1] == eos
    assert out.finish_reasons == ["stop", "stop", "length", "length"]
    assert [len(c) for c in out.completion_ids[2:]] == [6, 6]
    assert all(eos not in c for c in out.completion_ids[2:])
    assert all(len(i) == len(lp) for i, lp in zip(out.completion_ids, out.logprobs))


def test_fast_loop_stops_when_all_rows_end(model, tok):
    eos = tok.eos_token_id
    calls = {"n": 0}

    def bias(logits):
        calls["n"] += 1
        b = torch.zeros_like(logits)
        b[..., eos] = 100.0
        return b

    handle = _bias_hook(model, bias)
    try:
        out = TransformersEngine(model, tok).generate(
            _ids(tok), SamplingParams(max_new_tokens=8, temperature=0.0))
    finally:
        handle.remove()
    assert out.completion_ids == [[eos]] * len(PROMPTS)
    assert calls["n"] == 1  # the prefill only


# ------------------------------------------------------------------ pure functions


def test_filter_top_k_hand_values():
    x = torch.tensor([[1.0, 3.0, 2.0, 0.5], [0.0, 0.0, 1.0, 0.0]])
    assert torch.equal(filter_top_k(x, 2), torch.tensor([[NEG, 3.0, 2.0, NEG],
                                                        [0.0, 0.0, 1.0, 0.0]]))  # ties kept
    assert torch.equal(filter_top_k(x, 0), x)
    assert torch.equal(filter_top_k(x, 10), x)
    assert torch.equal(filter_top_k(x, 2), TopKLogitsWarper(2)(None, x.clone()))


def test_filter_top_p_hand_values():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    x = probs.log()
    # keep the smallest top set with mass >= 0.8: {0.5, 0.3}
    assert torch.isinf(filter_top_p(x, 0.8)[0, 2:]).all()
    assert torch.isfinite(filter_top_p(x, 0.8)[0, :2]).all()
    # top_p below the top probability still keeps the top token
    kept = torch.isfinite(filter_top_p(x, 0.1))
    assert kept.tolist() == [[True, False, False, False]]
    assert torch.equal(filter_top_p(x, 1.0), x)
    y = torch.randn(3, 50)
    for p in (0.3, 0.9):
        assert torch.equal(filter_top_p(y, p), TopPLogitsWarper(p)(None, y.clone()))


def test_filter_min_p_hand_values():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    x = probs.log()
    # threshold 0.4 * 0.5 = 0.2: keep 0.5 and 0.3
    assert torch.isfinite(filter_min_p(x, 0.4)).tolist() == [[True, True, False, False]]
    assert torch.isfinite(filter_min_p(x, 1.0)).tolist() == [[True, False, False, False]]
    assert torch.equal(filter_min_p(x, None), x)
    y = torch.randn(3, 50)
    assert torch.equal(filter_min_p(y, 0.1), MinPLogitsWarper(0.1)(None, y.clone()))


def test_repetition_penalty_matches_transformers():
    torch.manual_seed(0)
    logits = torch.randn(3, 20)
    prev = torch.randint(0, 20, (3, 7))
    ours = apply_repetition_penalty(logits, prev, 1.5)
    ref = RepetitionPenaltyLogitsProcessor(penalty=1.5)(prev, logits.clone())
    assert torch.allclose(ours, ref)
    # hand values: positive divided, negative multiplied, unseen untouched
    x = torch.tensor([[2.0, -1.0, 3.0]])
    assert apply_repetition_penalty(x, torch.tensor([[0, 1, 1]]), 2.0).tolist() == [[1.0, -2.0, 3.0]]
    # masked (padding) positions are not counted
    masked = apply_repetition_penalty(x, torch.tensor([[2, 0, 1]]), 2.0,
                                      prev_mask=torch.tensor([[0, 1, 1]]))
    assert masked.tolist() == [[1.0, -2.0, 3.0]]
    assert apply_repetition_penalty(x, torch.tensor([[0]]), 1.0) is x


def test_sample_next_logprobs_before_filters_and_generator_reproducible():
    torch.manual_seed(0)
    logits = torch.randn(5, 30)
    prev = torch.randint(0, 30, (5, 4))
    sp = SamplingParams(max_new_tokens=1, temperature=0.8, top_k=5, top_p=0.7, min_p=0.1,
                        repetition_penalty=1.4)
    ids, lps = sample_next(logits, sp, torch.Generator().manual_seed(1), prev_ids=prev)
    ids2, lps2 = sample_next(logits, sp, torch.Generator().manual_seed(1), prev_ids=prev)
    assert torch.equal(ids, ids2) and torch.equal(lps, lps2)
    expected = torch.log_softmax(logits / 0.8, dim=-1).gather(-1, ids[:, None]).squeeze(-1)
    assert torch.allclose(lps, expected)
    # every draw is inside the filtered support (penalty, temperature, top-k, top-p, min-p)
    scores = apply_repetition_penalty(logits, prev, 1.4) / 0.8
    scores = filter_min_p(filter_top_p(filter_top_k(scores, 5), 0.7), 0.1)
    assert torch.isfinite(scores.gather(-1, ids[:, None])).all()


def test_sample_next_greedy_uses_penalised_argmax_and_unit_temperature():
    logits = torch.tensor([[2.0, 1.9, -5.0]])
    sp = SamplingParams(max_new_tokens=1, temperature=0.0, repetition_penalty=2.0)
    ids, lps = sample_next(logits, sp, prev_ids=torch.tensor([[0]]))
    assert ids.tolist() == [1]
    assert lps.item() == pytest.approx(torch.log_softmax(logits, -1)[0, 1].item())
    with pytest.raises(ValueError, match="prev_ids"):
        sample_next(logits, sp)
    assert math.isfinite(lps.item())


def test_draw_categorical_follows_the_distribution_and_never_draws_zero_mass():
    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3, 0.0], [0.0, 0.0, 0.0, 0.0, 2.0], [5.0, 0.0, 0.0, 0.0, 5.0]])
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([draw_categorical(probs, g) for _ in range(20000)])  # (20000, 3)
    freq = torch.nn.functional.one_hot(draws, 5).float().mean(0)  # (3, 5)
    expected = probs / probs.sum(-1, keepdim=True)
    assert torch.allclose(freq, expected, atol=0.015)  # 20000 draws: standard error <= 0.0035
    assert (freq[expected == 0] == 0).all()
    # the same seed gives the same draws; one generator per row ignores the rest of the batch
    a = draw_categorical(probs, [torch.Generator().manual_seed(i) for i in range(3)])
    b = draw_categorical(probs[1:], [torch.Generator().manual_seed(i) for i in range(1, 3)])
    assert a[1:].tolist() == b.tolist()
    assert draw_categorical(probs, torch.Generator().manual_seed(7)).tolist() == \
        draw_categorical(probs, torch.Generator().manual_seed(7)).tolist()


def test_invert_cdf_maps_uniforms_to_intervals_and_clamps_the_top():
    probs = torch.tensor([[0.5, 0.5, 0.0]] * 4 + [[0.0, 0.25, 0.75]] * 3)
    u = torch.tensor([0.0, 0.49, 0.5, 1.0, 0.0, 0.2499, 0.25], dtype=torch.float64)
    assert invert_cdf(probs, u).tolist() == [0, 0, 1, 1, 1, 1, 2]  # never the zero-mass entries 2 (rows 0-3) or 0
