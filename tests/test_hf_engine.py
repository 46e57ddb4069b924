"""TransformersEngine: greedy exactness, log-prob convention, EOS / stop-string cuts, weight sync."""

import copy
import string

import pytest
import torch
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from hf_verl.rollout.base import SamplingParams
from hf_verl.rollout.hf_engine import TransformersEngine

PROMPTS = ["hello world", "ab", "the 42 cats"]


@pytest.fixture(scope="module")
def tokenizer():
    vocab = {"<pad>": 0, "<eos>": 1}
    for c in string.ascii_lowercase + string.digits + " ":
        vocab[c] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))  # no merges: one token per character
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def _model(tokenizer, seed=0):
    torch.manual_seed(seed)
    config = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2,
                         vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    model = Qwen2ForCausalLM(config).eval()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


@pytest.fixture()
def model(tokenizer):
    return _model(tokenizer)


def _prompt_ids(tokenizer):
    return [tokenizer(p)["input_ids"] for p in PROMPTS]


def _bias_hook(model, fn):
    """Add `fn(logits)` to the lm_head output (to force or forbid tokens)."""
    return model.lm_head.register_forward_hook(lambda m, i, out: out + fn(out))


def _manual_greedy(model, prompt, max_new_tokens, eos_id):
    ids = list(prompt)
    out = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1]
            tok = int(logits.argmax())
            out.append(tok)
            ids.append(tok)
            if tok == eos_id:
                break
    return out


def _fresh_logprobs(model, prompt, completion, temperature):
    with torch.no_grad():
        logits = model(torch.tensor([list(prompt) + list(completion)])).logits[0].float()
    lps = torch.log_softmax(logits / temperature, dim=-1)
    pos = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(completion))
    return lps[pos, torch.tensor(completion)]


def test_greedy_matches_manual_argmax_and_logprobs(model, tokenizer):
    engine = TransformersEngine(model, tokenizer)
    prompts = _prompt_ids(tokenizer)
    out = engine.generate(prompts, SamplingParams(max_new_tokens=8, temperature=0.0))
    assert out.weight_version == 0
    for p, ids, lps, reason in zip(prompts, out.completion_ids, out.logprobs, out.finish_reasons):
        assert ids == _manual_greedy(model, p, 8, tokenizer.eos_token_id)
        assert 1 <= len(ids) <= 8
        assert reason == ("stop" if ids[-1] == tokenizer.eos_token_id else "length")
        assert torch.allclose(torch.tensor(lps), _fresh_logprobs(model, p, ids, 1.0), atol=1e-4)


def test_batch_size_chunks_give_same_greedy_output(model, tokenizer):
    sp = SamplingParams(max_new_tokens=6, temperature=0.0)
    full = TransformersEngine(model, tokenizer).generate(_prompt_ids(tokenizer), sp)
    chunked = TransformersEngine(model, tokenizer, batch_size=1).generate(
        _prompt_ids(tokenizer), sp)
    assert full.completion_ids == chunked.completion_ids


def test_sampling_logprobs_use_temperature_and_seed_reproduces(model, tokenizer):
    engine = TransformersEngine(model, tokenizer)
    prompts = _prompt_ids(tokenizer)
    sp = SamplingParams(max_new_tokens=10, temperature=0.7, top_k=5, top_p=0.9, seed=123)
    out = engine.generate(prompts, sp)
    again = engine.generate(prompts, sp)
    assert out.completion_ids == again.completion_ids
    for p, ids, lps in zip(prompts, out.completion_ids, out.logprobs):
        assert 1 <= len(ids) <= 10
        assert torch.allclose(torch.tensor(lps), _fresh_logprobs(model, p, ids, 0.7), atol=1e-4)


@pytest.mark.parametrize("use_generate", [False, True])
def test_a_seeded_rollout_leaves_the_global_random_state_alone(model, tokenizer, use_generate):
    # the trainer's dropout / shuffling draws must not be reset by a seeded rollout (nor raced by one
    # running in a background thread)
    engine = TransformersEngine(model, tokenizer, use_generate=use_generate)
    sp = SamplingParams(max_new_tokens=6, temperature=1.0, seed=7)
    torch.manual_seed(0)
    expected_next = torch.rand(3)
    torch.manual_seed(0)
    first = engine.generate(_prompt_ids(tokenizer), sp)
    assert torch.equal(torch.rand(3), expected_next)
    assert engine.generate(_prompt_ids(tokenizer), sp).completion_ids == first.completion_ids


def test_eos_cut_padding_dropped_and_finish_reasons(model, tokenizer):
    eos = tokenizer.eos_token_id

    def bias(logits):
        b = torch.zeros_like(logits)
        b[0, ..., eos] = 100.0  # row 0 ends at once
        b[1:, ..., eos] = -100.0  # other rows never end
        return b

    handle = _bias_hook(model, bias)
    try:
        out = TransformersEngine(model, tokenizer).generate(
            _prompt_ids(tokenizer)[:2], SamplingParams(max_new_tokens=5, temperature=0.0))
    finally:
        handle.remove()
    assert out.completion_ids[0] == [eos]
    assert out.finish_reasons == ["stop", "length"]
    assert len(out.completion_ids[1]) == 5 and eos not in out.completion_ids[1]
    assert out.logprobs[0][0] == pytest.approx(0.0, abs=1e-4)


def test_stop_string_truncates(model, tokenizer):
    special = [tokenizer.eos_token_id, tokenizer.pad_token_id]

    def bias(logits):
        b = torch.zeros_like(logits)
        b[..., special] = -100.0
        return b

    handle = _bias_hook(model, bias)
    try:
        engine = TransformersEngine(model, tokenizer)
        prompt = _prompt_ids(tokenizer)[:1]
        plain = engine.generate(prompt, SamplingParams(max_new_tokens=10, temperature=0.0))
        ids = plain.completion_ids[0]
        text = tokenizer.decode(ids)
        assert plain.finish_reasons == ["length"] and len(text) == 10  # one char per token
        stop = text[2:4]
        cut = text.index(stop) + len(stop)
        out = engine.generate(prompt, SamplingParams(max_new_tokens=10, temperature=0.0,
                                                     stop=(stop,)))
    finally:
        handle.remove()
    assert out.finish_reasons == ["stop"]
    assert out.completion_ids[0] == ids[:cut]
    assert tokenizer.decode(out.completion_ids[0]).endswith(stop)
    assert out.logprobs[0] == pytest.approx(plain.logprobs[0][:cut], abs=1e-5)


def test_training_mode_restored(model, tokenizer):
    model.train()
    TransformersEngine(model, tokenizer).generate(_prompt_ids(tokenizer)[:1],
                                                  SamplingParams(max_new_tokens=2))
    assert model.training


def test_sync_weights_updates_copy_and_bumps_version(tokenizer):
    trainer = _model(tokenizer)
    engine = TransformersEngine(copy.deepcopy(trainer), tokenizer)
    prompts = _prompt_ids(tokenizer)
    sp = SamplingParams(max_new_tokens=8, temperature=0.0)
    before = engine.generate(prompts, sp).completion_ids
    torch.manual_seed(1)
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    engine.sync_weights(trainer.named_parameters())
    assert engine.weight_version == 1
    out = engine.generate(prompts, sp)
    assert out.weight_version == 1
    expected = [_manual_greedy(trainer, p, 8, tokenizer.eos_token_id) for p in prompts]
    assert out.completion_ids == expected
    assert out.completion_ids != before


def test_sync_weights_shared_model_is_version_bump(model, tokenizer):
    engine = TransformersEngine(model, tokenizer)
    ref = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine.sync_weights(model.named_parameters())
    assert engine.weight_version == 1
    assert all(torch.equal(p, ref[n]) for n, p in model.named_parameters())


def test_sync_weights_unknown_name_raises(model, tokenizer):
    engine = TransformersEngine(model, tokenizer)
    with pytest.raises(ValueError, match="unknown parameter name"):
        engine.sync_weights([("not.a.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="shape mismatch"):
        engine.sync_weights([("lm_head.weight", torch.zeros(1))])
    assert engine.weight_version == 0
