"""Decode steps computed straight from a Llama-family decoder's weights, into caches allocated ahead.

The transformers engine's decode loop runs one single-token forward per generated token. On a small model (and on
any model whose decode step costs more in Python than in matmuls) most of that forward is module dispatch, the
`DynamicCache` growing by concatenation every step, mask preparation and output objects, not arithmetic.
:class:`DirectDecoder` computes the same step from the same parameters with the same torch operations in the same
order as transformers' own modules (RMSNorm in float32, rotary embedding from the model's own `rotary_emb`, sdpa
attention with the key padding mask, key/value heads repeated as transformers repeats them when a mask is given, the
gated MLP with the model's activation), writing each step's keys and values into per-layer buffers allocated ahead.
The logits equal the model's forward bit for bit (`tests/test_direct_decode.py`: the families below in float32,
bfloat16 and bf16 autocast, with left padding, grouped and ungrouped key/value heads, biases, Qwen3's head norms,
LoRA adapters).

It reads the modules at every step, so weight updates that land between two steps (in-flight updates, the actor's
own tensors trained in place, an adapter sync that puts LoRA layers in place) are used from the next step on.
Projections that are not plain `nn.Linear` (LoRA, quantised layers) run their own forward.

Taken only where it reproduces the model exactly (:func:`unsupported_reason` says why not otherwise; the engine then
runs the model's forward): the exact classes `LlamaForCausalLM`, `MistralForCausalLM`, `Qwen2ForCausalLM`,
`Qwen3ForCausalLM`, bare or under PEFT LoRA adapters; sdpa attention (or hf_verl's sequence-parallel attention, which
is sdpa without a shard); no sliding-window layers; rotary embedding over the whole head; no sharded parameters; no
forward hooks; no attention dropout in training mode.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# class name -> whether its attention normalises queries and keys per head (Qwen3's q_norm / k_norm)
FAMILIES = {"LlamaForCausalLM": False, "MistralForCausalLM": False, "Qwen2ForCausalLM": False,
            "Qwen3ForCausalLM": True}


# transformers' own hooks that do not change a no-grad decode step, so they do not count as hooks here: its
# output-capturing hooks (installed on the first forward that asks for hidden states; they record only inside such a
# forward) and the hook gradient checkpointing puts on the input embeddings (TRL's default `gradient_checkpointing=True`;
# it marks the embeddings' output as requiring grad, which a forward without grad ignores)
_TRANSFORMERS_CAPTURE = "transformers.utils.output_capturing"
_INPUT_REQUIRES_GRAD = ("transformers.modeling_utils", "make_inputs_require_grads")


def _inert(hook) -> bool:
    module, name = getattr(hook, "__module__", None), getattr(hook, "__qualname__", "")
    return module == _TRANSFORMERS_CAPTURE or (module, name.rsplit(".", 1)[-1]) == _INPUT_REQUIRES_GRAD


def _has_hooks(model: nn.Module) -> bool:
    from torch.nn.modules import module as module_mod

    if module_mod._global_forward_hooks or module_mod._global_forward_pre_hooks:
        return True
    return any(not _inert(hook)
               for m in model.modules() for hooks in (m._forward_hooks, m._forward_pre_hooks) for hook in hooks.values())


def pad_left(t: torch.Tensor, width: int, dim: int, value: float = 0) -> torch.Tensor:
    """`t` left-padded with `value` along `dim` to `width` (unchanged when already that wide)."""
    missing = width - t.shape[dim]
    if missing <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_full(shape, value), t], dim=dim)


def _base(model: nn.Module) -> nn.Module:
    """The transformers model under a PEFT wrapper (its LoRA layers sit inside it), or `model`."""
    return model.get_base_model() if hasattr(model, "peft_config") and hasattr(model, "get_base_model") else model


def unsupported_reason(model: nn.Module) -> str | None:
    """Why :class:`DirectDecoder` cannot decode `model` exactly, or `None` when it can (see the module docstring)."""
    from hf_verl.parallel.ulysses import packing_unsupported

    if _has_hooks(model):  # the wrapper's too
        return "it has forward hooks"
    if hasattr(model, "peft_config"):
        kinds = {getattr(getattr(c, "peft_type", None), "value", str(getattr(c, "peft_type", None)))
                 for c in model.peft_config.values()}
        if kinds != {"LORA"}:
            return f"its PEFT adapters are {sorted(kinds)}; LoRA adapters only"
        model = _base(model)
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
    if len(model.model.layers) != config.num_hidden_layers:
        return "its layer list and config disagree"
    if any(type(p) is not nn.Parameter and type(p) is not torch.Tensor for p in model.parameters()):
        return "its parameters are sharded or wrapped tensors"
    return None


def _rms_norm(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """transformers' Llama RMSNorm, op for op."""
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * x.to(dtype)


def _linear(x: torch.Tensor, layer: nn.Module) -> torch.Tensor:
    """A projection: `F.linear` for a plain `nn.Linear`, the module itself otherwise (a LoRA or quantised layer,
    also one an adapter sync puts in place during a generation)."""
    return F.linear(x, layer.weight, layer.bias) if type(layer) is nn.Linear else layer(x)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class DirectDecoder:
    """Single-token decode steps for one batch of rows (see the module docstring).

    The rows share one key width, left-padded (the padding is masked): every step appends one column for every row.
    The buffers hold `max_new_tokens` columns beyond the prompt; with `grow=True` (the continuous decode loop, whose
    rows come and go) they grow when full instead, and rows can be selected, leading columns trimmed and two
    decoders merged.

    Args:
        model (`PreTrainedModel`): a model :func:`unsupported_reason` accepts.
        cache (`transformers.Cache`): the prompt's KV cache from the prefill, one row per completion.
        key_mask (`torch.Tensor`): `(B, W)` padding mask of the prompt (1 for real tokens).
        max_new_tokens (`int`): the steps the buffers are sized for.
        grow (`bool`, defaults to `False`): grow the buffers when full instead of refusing the step.
    """

    def __init__(self, model: nn.Module, cache, key_mask: torch.Tensor, max_new_tokens: int, *,
                 grow: bool = False) -> None:
        model = _base(model)
        config = model.config
        batch, width = key_mask.shape
        keys, values = [], []
        for layer in range(config.num_hidden_layers):
            k, v = cache.layers[layer].keys, cache.layers[layer].values
            if k.shape[0] != batch or k.shape[2] != width:
                raise ValueError(f"the prefill cache holds {tuple(k.shape)} keys for a {tuple(key_mask.shape)} mask")
            keys.append(k)
            values.append(v)
        self._set(model, keys, values, key_mask.bool(), max_new_tokens, grow)

    def _set(self, model, keys: list, values: list, mask: torch.Tensor, room: int, grow: bool) -> None:
        """Buffers `room` columns wider than the `(B, H, W, D)` `keys` / `values` and `(B, W)` boolean `mask`."""
        config = model.config
        self.model, self.grow = model, grow
        self.qk_norm = FAMILIES[type(model).__name__]
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        batch, width = mask.shape
        self.length = width
        self.keys, self.values = [], []
        for k, v in zip(keys, values):
            kb = k.new_empty((batch, k.shape[1], width + room, k.shape[3]))
            vb = v.new_empty((batch, v.shape[1], width + room, v.shape[3]))
            kb[:, :, :width] = k
            vb[:, :, :width] = v
            self.keys.append(kb)
            self.values.append(vb)
        self.mask = torch.zeros((batch, 1, 1, width + room), dtype=torch.bool, device=mask.device)
        self.mask[:, 0, 0, :width] = mask

    @property
    def key_mask(self) -> torch.Tensor:
        """`(B, W)` mask of the keys held so far."""
        return self.mask[:, 0, 0, : self.length]

    def _used(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[i][:, :, : self.length], self.values[i][:, :, : self.length]

    def select(self, index: torch.Tensor) -> None:
        """Keep the rows `index` (in that order)."""
        self.keys = [k[index] for k in self.keys]
        self.values = [v[index] for v in self.values]
        self.mask = self.mask[index]

    def trim(self, first: int) -> None:
        """Drop the first `first` key columns (padding for every row)."""
        self.keys = [k[:, :, first:] for k in self.keys]
        self.values = [v[:, :, first:] for v in self.values]
        self.mask = self.mask[..., first:]
        self.length -= first

    def merge(self, other: DirectDecoder) -> DirectDecoder:
        """A decoder over the rows of `self` then `other`, both left-padded to the wider key width."""
        width = max(self.length, other.length)
        room = max(self.mask.shape[-1] - self.length, other.mask.shape[-1] - other.length, 1)
        pairs = [(self._used(i), other._used(i)) for i in range(len(self.keys))]
        keys = [torch.cat([pad_left(a[0], width, 2), pad_left(b[0], width, 2)]) for a, b in pairs]
        values = [torch.cat([pad_left(a[1], width, 2), pad_left(b[1], width, 2)]) for a, b in pairs]
        mask = torch.cat([pad_left(self.key_mask, width, 1, False), pad_left(other.key_mask, width, 1, False)])
        merged = object.__new__(DirectDecoder)
        merged._set(self.model, keys, values, mask, room, self.grow or other.grow)
        return merged

    def to_cache(self):
        """The keys and values held so far as a transformers `DynamicCache` (for the model's own forward)."""
        from transformers import DynamicCache

        return DynamicCache(ddp_cache_data=[tuple(t.contiguous() for t in self._used(i)) for i in range(len(self.keys))])

    def _make_room(self) -> None:
        if not self.grow:
            raise RuntimeError(f"the decoder was sized for {self.mask.shape[-1]} positions")
        used = [self._used(i) for i in range(len(self.keys))]
        self._set(self.model, [k for k, _ in used], [v for _, v in used], self.key_mask.clone(),
                  max(16, self.length // 2), True)

    @torch.no_grad()
    def step(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """One token per row: `input_ids` `(B,)`, `position_ids` `(B, 1)`; returns the next logits `(B, V)` in float32."""
        if self.length >= self.mask.shape[-1]:
            self._make_room()
        model = self.model
        inner = model.model
        batch = input_ids.shape[0]
        c = self.length
        self.length += 1
        self.mask[:, 0, 0, c] = True
        mask = self.mask[..., : c + 1]
        embed = inner.embed_tokens
        ids = input_ids[:, None]
        hidden = F.embedding(ids, embed.weight) if type(embed) is nn.Embedding else embed(ids)
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
