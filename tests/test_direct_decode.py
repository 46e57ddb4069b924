"""`DirectDecoder` (hf_verl/rollout/direct_decode.py): its decode steps equal the model's own forward with a KV cache,
and it declines every model it cannot reproduce exactly."""

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from hf_verl.rollout.direct_decode import DirectDecoder, unsupported_reason

SMALL = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)


def build(family: str, **overrides):
    torch.manual_seed(0)
    kw = {**SMALL, **overrides}
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**kw))
    elif family == "llama-bias-headdim-rope":  # biases everywhere, head_dim != hidden / heads, llama3 rope scaling
        model = LlamaForCausalLM(LlamaConfig(**{**kw, "attention_bias": True, "mlp_bias": True, "head_dim": 24,
                                                "num_key_value_heads": 1, "rope_parameters": {
                                                    "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                    "original_max_position_embeddings": 32}}))
    elif family == "mistral":
        model = MistralForCausalLM(MistralConfig(**kw, sliding_window=None))
    elif family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**kw, tie_word_embeddings=True))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**kw, head_dim=16))
    model.config._attn_implementation = "sdpa"
    with torch.no_grad():  # non-trivial norm weights, so a missed or misplaced norm shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.rand_like(p) * 0.5)
    return model.eval()


def decode_both(model, dtype, steps=7):
    """Greedy decode of a left-padded batch: the model's forward with its cache, and the direct decoder; returns
    both logits sequences `(B, steps, V)`. `dtype="autocast"`: fp32 weights under bf16 autocast."""
    if dtype == "autocast":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return decode_both(model, torch.float32, steps)
    model = model.to(dtype)
    gen = torch.Generator().manual_seed(1)
    lengths = [5, 3, 7, 1]
    width = max(lengths)
    ids = torch.zeros((len(lengths), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, width - n:] = torch.randint(1, 97, (n,), generator=gen)
        mask[i, width - n:] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    results = []
    for direct in (False, True):
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1)
        cache, logits = out.past_key_values, out.logits[:, -1].float()
        decoder = DirectDecoder(model, cache, mask, steps) if direct else None
        m, p, seq = mask, pos[:, -1:], []
        for _ in range(steps):
            nxt = logits.argmax(-1)
            m = torch.cat([m, m.new_ones((len(lengths), 1))], dim=-1)
            p = p + 1
            if direct:
                logits = decoder.step(nxt, p)
            else:
                with torch.no_grad():
                    out = model(input_ids=nxt[:, None], attention_mask=m.bool()[:, None, None, :], position_ids=p,
                                past_key_values=cache, use_cache=True, logits_to_keep=1)
                logits, cache = out.logits[:, -1].float(), out.past_key_values
            seq.append(logits)
        results.append(torch.stack(seq, 1))
    return results


@pytest.mark.parametrize("family", ["llama", "llama-bias-headdim-rope", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, "autocast"])
def test_direct_steps_equal_the_models_forward(family, dtype):
    model = build(family)
    assert unsupported_reason(model) is None
    reference, direct = decode_both(model, dtype)
    assert reference.shape == direct.shape == (4, 7, 97)
    assert torch.equal(reference.argmax(-1), direct.argmax(-1))
    assert torch.equal(reference, direct)  # the same ops in the same order: bit for bit


def test_direct_decoder_reads_weights_changed_between_steps():
    model = build("llama")
    ids = torch.tensor([[3, 4, 5]])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, use_cache=True, logits_to_keep=1)
    decoder = DirectDecoder(model, out.past_key_values, mask, 2)
    first = decoder.step(torch.tensor([6]), torch.tensor([[3]]))
    with torch.no_grad():
        model.lm_head.weight.mul_(2.0)  # an in-place update, as an in-flight sync or the optimizer makes
    second = decoder.step(torch.tensor([7]), torch.tensor([[4]]))
    with torch.no_grad():
        full = model(input_ids=torch.tensor([[3, 4, 5, 6, 7]])).logits[:, -1]
    assert not torch.allclose(first, second)
    # keys/values of earlier positions came from the old weights only where the update touched them (the head
    # changes no keys), so the direct step equals a fresh forward on the new weights
    torch.testing.assert_close(second, full, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="sized for 5 positions"):
        decoder.step(torch.tensor([8]), torch.tensor([[5]]))


def test_models_it_cannot_reproduce_are_declined_with_the_reason():
    from peft import LoraConfig, get_peft_model

    assert "sliding-window" in unsupported_reason(MistralForCausalLM(MistralConfig(**SMALL, sliding_window=16)))
    eager = build("llama")
    eager.config._attn_implementation = "eager"
    assert "'eager'" in unsupported_reason(eager)
    lora = get_peft_model(build("llama"), LoraConfig(r=2, target_modules=["q_proj"]))
    assert "PeftModel" in unsupported_reason(lora)
    assert "plain nn.Linear" in unsupported_reason(lora.get_base_model())
    hooked = build("llama")
    hooked.model.layers[0].mlp.register_forward_hook(lambda *a: None)
    assert "hooks" in unsupported_reason(hooked)
    training = LlamaForCausalLM(LlamaConfig(**SMALL, attention_dropout=0.1))
    training.config._attn_implementation = "sdpa"
    assert "dropout" in unsupported_reason(training.train())
    assert unsupported_reason(training.eval()) is None
