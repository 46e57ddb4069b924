"""Core attention for Megatron-Core's local layer spec through `torch.nn.functional.scaled_dot_product_attention`.

Megatron-Core's local spec (no Transformer Engine) computes attention unfused: the `(b, heads, s, s)` scores, the
masked softmax and its saved activations per layer, in fp32, which costs several times the memory and time of
PyTorch's SDPA kernels that the HF models run with. :class:`SDPAttention` takes the place of
`DotProductAttention` in the spec (same constructor, so its heads-per-partition and softmax scale are Megatron's)
and computes the same attention with SDPA. Megatron's boolean mask (True = not attended) is inverted for SDPA;
a row that attends nothing (a padding query) attends to itself instead, so that it stays finite (its output is
never read: it is masked out as a key everywhere else).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention


class SDPAttention(DotProductAttention):
    """`DotProductAttention` with the arithmetic of `scaled_dot_product_attention` (see the module docstring)."""

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("packed sequences and attention biases are not supported by hf_verl's SDPA attention.")
        # [s, b, heads, d] -> [b, heads, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if k.shape[1] != q.shape[1]:  # grouped-query attention: each key-value head serves a group of query heads
            repeat = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        if attention_mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale)
        else:
            allowed = ~attention_mask
            sq, sk = allowed.shape[-2:]
            allowed = allowed | torch.eye(sq, sk, dtype=torch.bool, device=allowed.device)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=self.softmax_scale)
        b, heads, s, d = out.shape
        return out.permute(2, 0, 1, 3).reshape(s, b, heads * d)
