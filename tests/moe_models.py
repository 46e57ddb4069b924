"""Tiny Mixture-of-Experts causal LMs built in code for the MoE tests (no Hub): Qwen3-MoE, Qwen2-MoE (with a
shared expert) and Mixtral, 2 layers, 4 experts, top-2 routing, over a given tokenizer's vocabulary.

`tiny_moe(family, tok, hidden=64)` gives the model; `hidden=128` (head_dim 32) is the smallest vLLM's CPU
attention accepts.
"""

import torch

FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral")


def tiny_moe(family: str, tok, *, seed: int = 0, hidden: int = 64, router_aux_loss_coef: float = 0.05):
    """A 2-layer `family` model (4 experts, 2 per token) with fp32 weights drawn from `seed`."""
    import transformers

    heads = 4
    common = dict(hidden_size=hidden, num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=2,
                  vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                  tie_word_embeddings=False, max_position_embeddings=256, num_experts_per_tok=2,
                  router_aux_loss_coef=router_aux_loss_coef)
    if family == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(intermediate_size=2 * hidden, moe_intermediate_size=hidden // 2,
                                          num_experts=4, head_dim=hidden // heads, **common)
        cls = transformers.Qwen3MoeForCausalLM
    elif family == "qwen2_moe":
        cfg = transformers.Qwen2MoeConfig(intermediate_size=2 * hidden, moe_intermediate_size=hidden // 2,
                                          shared_expert_intermediate_size=hidden // 2, num_experts=4, **common)
        cls = transformers.Qwen2MoeForCausalLM
    elif family == "mixtral":
        cfg = transformers.MixtralConfig(intermediate_size=hidden // 2, num_local_experts=4, **common)
        cls = transformers.MixtralForCausalLM
    else:
        raise ValueError(f"unknown MoE family {family!r}; one of {FAMILIES}")
    torch.manual_seed(seed)
    return cls(cfg)
