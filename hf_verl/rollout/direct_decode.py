"""Decode steps computed straight from a Llama-family decoder's weights, into caches allocated once.

The transformers engine's decode loop runs one single-token forward per generated token. On a small model (and on
any model whose decode step costs more in Python than in matmuls) most of that forward is module dispatch, the
`DynamicCache` growing by concatenation every step, mask preparation and output objects, not arithmetic.
:class:`DirectDecoder` computes the same step from the same parameter tensors with the same torch operations in the
same order as transformers' own modules (RMSNorm in float32, rotary embedding from the model's own `rotary_emb`,
sdpa attention with the key padding mask, key/value heads repeated as transformers repeats them when a mask is
given, the gated MLP with the model's activation), writing each step's keys and values into per-layer buffers sized
for the whole generation. The logits equal the model's forward (`tests/test_direct_decode.py`: exact on the
families below in float32 and bfloat16, with left padding, grouped key/value heads, biases and Qwen3's head norms).

It reads the parameters at every step, so weight updates that land between two steps (in-flight updates, the
actor's own tensors trained in place) are used from the next step on.

Taken only where it reproduces the model exactly (:func:`unsupported_reason` says why not otherwise; the engine then
runs the model's forward): the exact classes `LlamaForCausalLM`, `MistralForCausalLM`, `Qwen2ForCausalLM`,
`Qwen3ForCausalLM`; sdpa attention (or hf_verl's sequence-parallel attention, which is sdpa without a shard); no
sliding-window layers; rotary embedding over the whole head; plain `nn.Linear` projections (no LoRA, quantised or
sharded layers); no forward hooks; no attention dropout in training mode.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# class name -> whether its attention normalises queries and keys per head (Qwen3's q_norm / k_norm)
FAMILIES = {"LlamaForCausalLM": False, "MistralForCausalLM": False, "Qwen2ForCausalLM": False,
            "Qwen3ForCausalLM": True}


def _has_hooks(model: nn.Module) -> bool:
    from torch.nn.modules import module as module_mod

    if module_mod._global_forward_hooks or module_mod._global_forward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def unsupported_reason(model: nn.Module) -> str | None:
    """Why :class:`DirectDecoder` cannot decode `model` exactly, or `None` when it can (see the module docstring)."""
    from hf_verl.parallel.ulysses import packing_unsupported

    cls = type(model)
    if cls.__name__ not in FAMILIES or not cls.__module__.startswith("transformers.models."):
        return f"{cls.__name__} is not one of {sorted(FAMILIES)}"
    reason = packing_unsupported(model)  # sdpa attention, no sliding windows
    if reason:
        return reason
    config = model.config
    if getattr(config, "partial_rotary_factor", 1.0) not in (None, 1.0):
        return "its rotary embedding covers part of each head"
    if model.training and getattr(config, "attention_dropout", 0.0):
        return "it is in training mode with attention dropout"
    layers = model.model.layers
    if len(layers) != config.num_hidden_layers:
        return "its layer list and config disagree"
    linears = [model.lm_head] + [m for layer in layers for m in (
        layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
        layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj)]
    if any(type(m) is not nn.Linear for m in linears) or type(model.model.embed_tokens) is not nn.Embedding:
        return "some of its layers are not plain nn.Linear / nn.Embedding (LoRA, quantised or wrapped layers)"
    if any(not type(p) is nn.Parameter and not type(p) is torch.Tensor for p in model.parameters()):
        return "its parameters are sharded or wrapped tensors"
    if _has_hooks(model):
        return "it has forward hooks"
    return None


def _rms_norm(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """transformers' Llama RMSNorm, op for op."""
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * x.to(dtype)


def _linear(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    return F.linear(x, layer.weight, layer.bias)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class DirectDecoder:
    """Single-token decode steps for one generation (see the module docstring).

    Args:
        model (`PreTrainedModel`): a model :func:`unsupported_reason` accepts.
        cache (`transformers.Cache`): the prompt's KV cache from the prefill, one row per completion.
        key_mask (`torch.Tensor`): `(B, W)` padding mask of the prompt (1 for real tokens).
        max_new_tokens (`int`): the most steps this generation takes (the buffers' extra width).
    """

    def __init__(self, model: nn.Module, cache, key_mask: torch.Tensor, max_new_tokens: int) -> None:
        config = model.config
        self.model = model
        self.qk_norm = FAMILIES[type(model).__name__]
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        batch, width = key_mask.shape
        self.length = width
        total = width + max_new_tokens
        self.keys, self.values = [], []
        for layer in range(config.num_hidden_layers):
            k, v = cache.layers[layer].keys, cache.layers[layer].values
            if k.shape[0] != batch or k.shape[2] != width:
                raise ValueError(f"the prefill cache holds {tuple(k.shape)} keys for a {tuple(key_mask.shape)} mask")
            kb = k.new_empty((batch, k.shape[1], total, k.shape[3]))
            vb = v.new_empty((batch, v.shape[1], total, v.shape[3]))
            kb[:, :, :width] = k
            vb[:, :, :width] = v
            self.keys.append(kb)
            self.values.append(vb)
        self.mask = torch.zeros((batch, 1, 1, total), dtype=torch.bool, device=key_mask.device)
        self.mask[:, 0, 0, :width] = key_mask.bool()

    @torch.no_grad()
    def step(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """One token per row: `input_ids` `(B,)`, `position_ids` `(B, 1)`; returns the next logits `(B, V)` in float32."""
        if self.length >= self.mask.shape[-1]:
            raise RuntimeError(f"the decoder was sized for {self.mask.shape[-1]} positions")
        model = self.model
        inner = model.model
        batch = input_ids.shape[0]
        c = self.length
        self.length += 1
        self.mask[:, 0, 0, c] = True
        mask = self.mask[..., : c + 1]
        hidden = F.embedding(input_ids[:, None], inner.embed_tokens.weight)
        cos, sin = inner.rotary_emb(hidden, position_ids=position_ids)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        groups = self.heads // self.kv_heads
        for i, layer in enumerate(inner.layers):
            attn = layer.self_attn
            h = _rms_norm(hidden, layer.input_layernorm)
            q = _linear(h, attn.q_proj).view(batch, 1, -1, self.head_dim)
            k = _linear(h, attn.k_proj).view(batch, 1, -1, self.head_dim)
            if self.qk_norm:
                q, k = _rms_norm(q, attn.q_norm), _rms_norm(k, attn.k_norm)
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            v = _linear(h, attn.v_proj).view(batch, 1, -1, self.head_dim).transpose(1, 2)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            self.keys[i][:, :, c : c + 1] = k
            self.values[i][:, :, c : c + 1] = v
            keys, values = self.keys[i][:, :, : c + 1], self.values[i][:, :, : c + 1]
            if groups > 1:  # as transformers' sdpa path does when a mask is given
                keys = keys[:, :, None].expand(batch, self.kv_heads, groups, c + 1, self.head_dim).reshape(
                    batch, self.heads, c + 1, self.head_dim)
                values = values[:, :, None].expand(batch, self.kv_heads, groups, c + 1, self.head_dim).reshape(
                    batch, self.heads, c + 1, self.head_dim)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, dropout_p=0.0, scale=attn.scaling)
            out = out.transpose(1, 2).contiguous().reshape(batch, 1, -1).contiguous()
            hidden = hidden + _linear(out, attn.o_proj)
            h = _rms_norm(hidden, layer.post_attention_layernorm)
            mlp = layer.mlp
            hidden = hidden + _linear(mlp.act_fn(_linear(h, mlp.gate_proj)) * _linear(h, mlp.up_proj), mlp.down_proj)
        return _linear(_rms_norm(hidden, inner.norm), model.lm_head)[:, -1].float()
