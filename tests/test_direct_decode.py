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

SMALL = {"vocab_size": 97, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128}


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
        model = MistralForCausalLM(MistralConfig(**{**kw, "num_key_value_heads": 4}, sliding_window=None))  # no groups
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
    # a forward asking for hidden states (as the trainers' log-prob forwards do) makes transformers install its
    # output-capturing hooks, inactive outside such forwards: they do not count
    model(input_ids=torch.tensor([[1, 2]]), output_hidden_states=True)
    model.enable_input_require_grads()  # as gradient checkpointing does (TRL's default): inert without grad
    assert any(m._forward_hooks for m in model.modules())
    assert unsupported_reason(model) is None
    reference, direct = decode_both(model, dtype)
    assert reference.shape == direct.shape == (4, 7, 97)
    assert torch.equal(reference.argmax(-1), direct.argmax(-1))
    assert torch.equal(reference, direct)  # the same ops in the same order: bit for bit


def test_lora_adapters_run_inside_direct_steps():
    """A PEFT LoRA model (adapters on attention, MLP and head, non-zero B): the direct steps call the LoRA layers."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(build("qwen2"), LoraConfig(r=4, lora_alpha=8, target_modules=[
        "q_proj", "v_proj", "gate_proj", "down_proj", "lm_head"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    assert unsupported_reason(model) is None
    reference, direct = decode_both(model, torch.float32)
    assert torch.equal(reference, direct)
    with model.disable_adapter():  # the adapters matter: without them the logits differ
        plain, _ = decode_both(model, torch.float32)
    assert not torch.allclose(plain, reference)


def test_rows_selected_trimmed_merged_and_grown_equal_the_models_forward():
    """The continuous loop's operations: after keeping some rows, dropping all-padding columns, merging another
    batch and growing the buffers, a step equals the model's forward over each row's whole sequence."""
    model = build("llama")
    rows = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]

    def prefill(prompts):
        width = max(map(len, prompts))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                        use_cache=True)
        return DirectDecoder(model, out.past_key_values, mask, 1, grow=True)

    first = prefill(rows)
    first.step(torch.tensor([20, 21, 22]), torch.tensor([[4], [2], [3]]))
    rows = [r + [t] for r, t in zip(rows, [20, 21, 22])]
    first.select(torch.tensor([1, 2]))  # the longest row leaves: the leading column is padding for both others
    rows = rows[1:]
    first.trim(1)
    second = prefill([[30, 31, 32, 33, 34, 35]])
    merged = first.merge(second)
    rows.append([30, 31, 32, 33, 34, 35])
    logits = None
    for t in range(20):  # past the merged buffers' room: they grow
        nxt = torch.tensor([40 + t] * 3)
        logits = merged.step(nxt, torch.tensor([[len(r)] for r in rows]))
        rows = [r + [40 + t] for r in rows]
    assert merged.length == max(map(len, rows))
    for i, row in enumerate(rows):
        with torch.no_grad():
            alone = model(input_ids=torch.tensor([row])).logits[0, -1]
        torch.testing.assert_close(logits[i], alone, rtol=1e-5, atol=1e-5)
    cache = merged.to_cache()
    assert cache.layers[0].keys.shape == (3, 2, merged.length, 16)


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
    from peft import get_peft_model

    assert "sliding-window" in unsupported_reason(MistralForCausalLM(MistralConfig(**SMALL, sliding_window=16)))
    eager = build("llama")
    eager.config._attn_implementation = "eager"
    assert "'eager'" in unsupported_reason(eager)
    from peft import LoraConfig, PromptTuningConfig

    prompt_tuning = get_peft_model(build("llama"), PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=2))
    assert "LoRA adapters only" in unsupported_reason(prompt_tuning)
    lora = get_peft_model(build("llama"), LoraConfig(r=2, target_modules=["q_proj"]))
    assert unsupported_reason(lora) is None
    lora.register_forward_pre_hook(lambda *a: None)  # on the PEFT wrapper: counts too
    assert "hooks" in unsupported_reason(lora)
    hooked = build("llama")
    hooked.model.layers[0].mlp.register_forward_hook(lambda *a: None)
    assert "hooks" in unsupported_reason(hooked)
    training = LlamaForCausalLM(LlamaConfig(**SMALL, attention_dropout=0.1))
    training.config._attn_implementation = "sdpa"
    assert "dropout" in unsupported_reason(training.train())
    assert unsupported_reason(training.eval()) is None
