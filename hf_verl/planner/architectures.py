"""What the planner knows of a model: its shape (:class:`Architecture`), from a module, a config, a Hub id / path
(the config only, offline) or a size string.

A size string ("7b", "70B", "0.5b") means one stated reference architecture from :data:`REFERENCE_ARCHITECTURES`
(public configs, quoted below); any other count ("20b", 3_000_000_000) is the nearest reference with its layer count
scaled to it, which the :attr:`Architecture.source` says. A Mixture-of-Experts size string names total and active
parameters ("30b-a3b", "235B-A22B"): a stated MoE reference (Qwen3-30B-A3B, Qwen3-235B-A22B, Mixtral-8x7B's "47b-a13b")
or the nearest one with its layer count scaled to the total.

Mixture-of-Experts configs are read from their fields: Qwen3-MoE / Qwen2-MoE (`num_experts`, `num_experts_per_tok`,
`moe_intermediate_size`, `decoder_sparse_step`, `mlp_only_layers`; Qwen2-MoE's shared expert
`shared_expert_intermediate_size` and its sigmoid gate), Mixtral (`num_local_experts`, `intermediate_size` per
expert) and DeepSeek-V3 (`n_routed_experts`, `n_shared_experts`, `first_k_dense_replace`; its multi-head latent
attention counted from `q_lora_rank` / `kv_lora_rank` / `qk_nope_head_dim` / `qk_rope_head_dim` / `v_head_dim`).
Total parameters hold every expert; active parameters (what a token's forward computes: FLOPs, activations) hold
`experts_per_token` routed experts per MoE layer.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Any

__all__ = ["Architecture", "REFERENCE_ARCHITECTURES", "resolve_architecture", "parse_size", "whole_numel"]


@dataclass(frozen=True)
class Architecture:
    """A decoder-only transformer's shape: what memory and step time depend on.

    Args:
        hidden (`int`): hidden size. layers (`int`): decoder layers. heads (`int`): query heads.
        kv_heads (`int`): key-value heads (GQA). intermediate (`int`): MLP width (gated: gate, up, down).
        vocab (`int`): vocabulary size. tied (`bool`): input and output embeddings shared.
        qkv_bias (`bool`): biases on q / k / v (Qwen2). head_dim (`int`, *optional*): default hidden // heads.
        source (`str`): where the shape came from, quoted in explanations.
        num_params (`int`, *optional*): the exact count when a module was given.
        qk_norm (`bool`): RMSNorms on q and k per head (Qwen3).
        experts (`int`): routed experts per MoE layer (0: a dense model). experts_per_token (`int`): routed experts
            a token goes to (top-k). expert_intermediate (`int`): one routed expert's MLP width (gated).
        shared_intermediate (`int`): the shared experts' MLP width, all together (Qwen2-MoE's
            `shared_expert_intermediate_size`, DeepSeek's `n_shared_experts x moe_intermediate_size`); 0: none.
        shared_gate (`bool`): a sigmoid gate on the shared expert (Qwen2-MoE). dense_layers (`int`): decoder layers
            with a dense MLP of width `intermediate` instead of experts (DeepSeek's `first_k_dense_replace`,
            Qwen's `mlp_only_layers` / `decoder_sparse_step`).
        attention_params (`int`, *optional*): one layer's attention parameters when they are not the q / k / v / o
            formula (DeepSeek's multi-head latent attention).
    """

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool = False
    qkv_bias: bool = False
    head_dim: int | None = None
    source: str = ""
    num_params: int | None = None
    qk_norm: bool = False
    experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0
    shared_intermediate: int = 0
    shared_gate: bool = False
    dense_layers: int = 0
    attention_params: int | None = None

    @property
    def dim_head(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.dim_head

    @property
    def q_dim(self) -> int:
        return self.heads * self.dim_head

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def moe_layers(self) -> int:
        """Decoder layers whose MLP is a mixture of experts."""
        return self.layers - self.dense_layers if self.is_moe else 0

    @property
    def attn_params(self) -> int:
        """One layer's attention parameters (with Qwen2's q / k / v biases and Qwen3's q / k norms)."""
        if self.attention_params is not None:
            return self.attention_params
        attn = self.hidden * (self.q_dim + 2 * self.kv_dim) + self.q_dim * self.hidden
        if self.qkv_bias:
            attn += self.q_dim + 2 * self.kv_dim
        return attn + (2 * self.dim_head if self.qk_norm else 0)

    @property
    def expert_params_per_layer(self) -> int:
        """One MoE layer's routed experts (each a gated MLP: gate, up, down)."""
        return self.experts * 3 * self.hidden * self.expert_intermediate

    @property
    def moe_layer_params(self) -> int:
        """One MoE layer: attention, router, routed and shared experts, two RMSNorms."""
        shared = 3 * self.hidden * self.shared_intermediate + (self.hidden if self.shared_gate else 0)
        return (self.attn_params + self.hidden * self.experts + self.expert_params_per_layer + shared
                + 2 * self.hidden)

    @property
    def dense_layer_params(self) -> int:
        """One dense decoder layer: attention, gated MLP, two RMSNorms."""
        return self.attn_params + 3 * self.hidden * self.intermediate + 2 * self.hidden

    @property
    def layer_params(self) -> int:
        """Parameters of the largest decoder layer (an MoE layer where there are any): what FSDP2 / ZeRO-3 gathers
        at once."""
        return self.moe_layer_params if self.is_moe else self.dense_layer_params

    @property
    def body_params(self) -> int:
        """Parameters of every decoder layer together."""
        return self.moe_layers * self.moe_layer_params + (self.layers - self.moe_layers) * self.dense_layer_params

    @property
    def embedding_params(self) -> int:
        """Input embedding plus the LM head (once when tied)."""
        return self.vocab * self.hidden * (1 if self.tied else 2)

    @property
    def params(self) -> int:
        """All parameters (the exact count of a given module, else the formula)."""
        if self.num_params is not None:
            return self.num_params
        return self.body_params + self.embedding_params + self.hidden

    @property
    def expert_params(self) -> int:
        """The routed experts' parameters over every layer: what expert parallelism divides."""
        return self.moe_layers * self.expert_params_per_layer

    @property
    def active_params(self) -> int:
        """Parameters one token's forward computes with: every parameter but the routed experts it is not sent to
        (a dense model: all of them)."""
        if not self.is_moe:
            return self.params
        idle = self.moe_layers * (self.experts - self.experts_per_token) * 3 * self.hidden * self.expert_intermediate
        return self.params - idle

    @property
    def mlp_width_per_token(self) -> int:
        """The gated-MLP width one token passes through in an MoE layer (its routed experts and the shared ones),
        or the dense MLP's width."""
        if not self.is_moe:
            return self.intermediate
        return self.experts_per_token * self.expert_intermediate + self.shared_intermediate


def _ref(hidden, layers, heads, kv, inter, vocab, tied, bias, source, **moe) -> Architecture:
    return Architecture(hidden, layers, heads, kv, inter, vocab, tied, bias, source=source, **moe)


# size string -> a public architecture (numbers from the models' config.json)
REFERENCE_ARCHITECTURES: dict[str, Architecture] = {
    "0.5b": _ref(896, 24, 14, 2, 4864, 151936, True, True, "Qwen2.5-0.5B's architecture"),
    "1.5b": _ref(1536, 28, 12, 2, 8960, 151936, True, True, "Qwen2.5-1.5B's architecture"),
    "3b": _ref(2048, 36, 16, 2, 11008, 151936, True, True, "Qwen2.5-3B's architecture"),
    "7b": _ref(4096, 32, 32, 32, 11008, 32000, False, False, "Llama-2-7B's architecture"),
    "8b": _ref(4096, 32, 32, 8, 14336, 128256, False, False, "Llama-3-8B's architecture"),
    "13b": _ref(5120, 40, 40, 40, 13824, 32000, False, False, "Llama-2-13B's architecture"),
    "32b": _ref(5120, 64, 40, 8, 27648, 152064, False, True, "Qwen2.5-32B's architecture"),
    "70b": _ref(8192, 80, 64, 8, 28672, 32000, False, False, "Llama-2-70B's architecture"),
    # Mixture-of-Experts: "<total>b-a<active>b"
    "30b-a3b": _ref(2048, 48, 32, 4, 6144, 151936, False, False, "Qwen3-30B-A3B's architecture", head_dim=128,
                    qk_norm=True, experts=128, experts_per_token=8, expert_intermediate=768),
    "235b-a22b": _ref(4096, 94, 64, 4, 12288, 151936, False, False, "Qwen3-235B-A22B's architecture", head_dim=128,
                      qk_norm=True, experts=128, experts_per_token=8, expert_intermediate=1536),
    "47b-a13b": _ref(4096, 32, 32, 8, 14336, 32000, False, False, "Mixtral-8x7B's architecture", experts=8,
                     experts_per_token=2, expert_intermediate=14336),
}

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMBT]?)\s*$", re.IGNORECASE)
_MOE_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMBT]?)\s*-\s*A\s*(\d+(?:\.\d+)?)\s*([KMBT]?)\s*$", re.IGNORECASE)
_SCALE = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}


def parse_size(size: int | str) -> tuple[str | None, int]:
    """`("7b", 7_000_000_000)` for "7B"; the key is `None` when no reference architecture has that name. A
    Mixture-of-Experts string ("30b-a3b") gives its total count.

    Raises:
        `ValueError`: not a count or a string like "7b" / "500M" / "30b-a3b".
    """
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return None, size
    if isinstance(size, str) and _MOE_SIZE.match(size):
        total, _ = _parse_moe(size)
        key = _moe_key(size)
        return (key if key in REFERENCE_ARCHITECTURES else None), total
    match = _SIZE.match(size) if isinstance(size, str) else None
    if match is None:
        raise ValueError(f"model size {size!r} is not a parameter count: write e.g. '7b', '500M', 7_000_000_000 or, "
                         "for a Mixture-of-Experts model, total and active parameters as '30b-a3b'.")
    number, unit = match.groups()
    key = f"{float(number):g}{unit.lower()}"
    return (key if key in REFERENCE_ARCHITECTURES else None), int(float(number) * _SCALE[unit.lower()])


def _parse_moe(size: str) -> tuple[int, int]:
    """(total, active) parameters of "30b-a3b" (an active count without a unit takes the total's)."""
    n_total, u_total, n_active, u_active = _MOE_SIZE.match(size).groups()
    total = int(float(n_total) * _SCALE[u_total.lower()])
    active = int(float(n_active) * _SCALE[(u_active or u_total).lower()])
    if active > total:
        raise ValueError(f"model size {size!r}: the active parameters exceed the total ('30b-a3b' is 30B total, 3B "
                         "active).")
    return total, active


def _moe_key(size: str) -> str:
    n_total, u_total, n_active, u_active = _MOE_SIZE.match(size).groups()
    return f"{float(n_total):g}{u_total.lower()}-a{float(n_active):g}{(u_active or u_total).lower()}"


def _scaled(base: Architecture, count: int, size: Any) -> Architecture:
    """`base` deepened / made shallower to `count` parameters (its heads stay valid), saying so."""
    per_layer = base.body_params / base.layers
    layers = max(1, round((count - base.embedding_params) / per_layer))
    arch = replace(base, layers=layers)
    what = f"{arch.params / 1e9:.2f}B parameters"
    if arch.is_moe:
        what += f", {arch.active_params / 1e9:.2f}B active"
    return replace(arch, source=f"{size} parameters: {base.source} with {layers} layers ({what})")


def _from_size(size: int | str) -> Architecture:
    key, count = parse_size(size)
    if key is not None:
        return REFERENCE_ARCHITECTURES[key]
    moe = isinstance(size, str) and _MOE_SIZE.match(size) is not None
    # the reference (dense, or MoE for an MoE string) with the nearest count, scaled to the asked count
    pool = [a for a in REFERENCE_ARCHITECTURES.values() if a.is_moe == moe]
    if moe:
        total, active = _parse_moe(size)
        # the nearest active share (experts per token over experts), then its layers scaled to the total
        base = min(pool, key=lambda a: (abs(math.log(a.active_params / a.params * total / active)),
                                        abs(math.log(a.params / total))))
    else:
        base = min(pool, key=lambda a: abs(math.log(a.params / count)))
    return _scaled(base, count, size)


def from_config(config: Any, source: str = "", num_params: int | None = None) -> Architecture:
    """The :class:`Architecture` of a transformers `PretrainedConfig` (decoder-only LMs; a composite config's text
    part is used).

    Raises:
        `ValueError`: the config lacks a decoder's shape fields.
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    try:
        hidden, layers, heads = text.hidden_size, text.num_hidden_layers, text.num_attention_heads
    except AttributeError as err:
        raise ValueError(f"{type(config).__name__} has no decoder shape (hidden_size, num_hidden_layers, "
                         "num_attention_heads): pass a causal-LM config, a model, or a size string like '7b'.") from err
    kv = getattr(text, "num_key_value_heads", None) or heads
    inter = getattr(text, "intermediate_size", None) or 4 * hidden
    model_type = str(getattr(text, "model_type", ""))
    moe = _moe_fields(text, layers, inter)
    return Architecture(hidden, layers, heads, kv, moe.pop("dense_intermediate", inter), text.vocab_size,
                        tied=bool(getattr(text, "tie_word_embeddings", False)),
                        qkv_bias=bool(getattr(text, "attention_bias", False) or model_type in ("qwen2", "qwen2_moe")),
                        head_dim=getattr(text, "head_dim", None), source=source or f"{type(config).__name__}",
                        num_params=num_params, qk_norm=model_type.startswith("qwen3"), **moe)


def _moe_fields(text: Any, layers: int, inter: int) -> dict[str, Any]:
    """The Mixture-of-Experts fields of a config (empty for a dense one): Qwen2/3-MoE, Mixtral, DeepSeek-V3."""
    routed = (getattr(text, "n_routed_experts", None) or getattr(text, "num_experts", None)
              or getattr(text, "num_local_experts", None))
    if not routed:
        return {}
    top_k = getattr(text, "num_experts_per_tok", None) or 2
    out: dict[str, Any] = {"experts": int(routed), "experts_per_token": int(top_k)}
    if not getattr(text, "moe_intermediate_size", None):  # Mixtral: every layer sparse, intermediate_size an expert's
        out["expert_intermediate"] = inter
        return out
    expert = getattr(text, "moe_intermediate_size", None) or inter
    out["expert_intermediate"] = int(expert)
    shared = getattr(text, "shared_expert_intermediate_size", None)
    if shared:  # Qwen2-MoE: one shared expert with a sigmoid gate
        out.update(shared_intermediate=int(shared), shared_gate=True)
    elif getattr(text, "n_shared_experts", None):  # DeepSeek: n shared experts of the routed width
        out["shared_intermediate"] = int(text.n_shared_experts) * int(expert)
    if getattr(text, "first_k_dense_replace", None) is not None:  # DeepSeek
        out["dense_layers"] = int(text.first_k_dense_replace)
    else:  # Qwen: mlp_only_layers, and every decoder_sparse_step-th layer sparse
        step = getattr(text, "decoder_sparse_step", 1) or 1
        only = set(getattr(text, "mlp_only_layers", None) or ())
        out["dense_layers"] = sum(1 for i in range(layers) if i in only or (i + 1) % step)
    if getattr(text, "kv_lora_rank", None):  # DeepSeek's multi-head latent attention
        out["attention_params"] = _mla_params(text)
    return out


def _mla_params(text: Any) -> int:
    """One layer of DeepSeek-V3's multi-head latent attention: q down / up projections (or one q projection), the
    joint kv down projection with the rope key, kv up projection, o_proj, and the two latent RMSNorms."""
    h, heads = text.hidden_size, text.num_attention_heads
    nope, rope, v = text.qk_nope_head_dim, text.qk_rope_head_dim, text.v_head_dim
    q_rank, kv_rank = getattr(text, "q_lora_rank", None), text.kv_lora_rank
    q = h * q_rank + q_rank + q_rank * heads * (nope + rope) if q_rank else h * heads * (nope + rope)
    kv = h * (kv_rank + rope) + kv_rank + kv_rank * heads * (nope + v)
    return q + kv + heads * v * h


def whole_numel(p: Any) -> int:
    """A parameter's whole element count: a ZeRO-3 partitioned parameter is empty on every rank (`ds_numel` keeps
    its count); FSDP2's DTensor and a meta parameter count as a whole one already."""
    return int(getattr(p, "ds_numel", None) or p.numel())


def resolve_architecture(model: Any) -> Architecture:
    """An :class:`Architecture` from a module, a config, a Hub id / local path (its config only, never the
    weights, offline: the local Hub cache) or a size string / parameter count.

    Raises:
        `ValueError`: a string that is neither a size nor a resolvable config, naming both readings.
    """
    if isinstance(model, Architecture):
        return model
    if hasattr(model, "parameters") and hasattr(model, "config"):
        count = sum(whole_numel(p) for p in model.parameters())
        base = getattr(model, "base_model", model)
        config = getattr(getattr(base, "model", base), "config", model.config)
        return from_config(config, source=f"the given {type(model).__name__} ({count / 1e6:.1f}M parameters)",
                           num_params=count)
    if hasattr(model, "to_dict") and hasattr(model, "model_type"):
        return from_config(model, source=f"the given {type(model).__name__}")
    if isinstance(model, int) or (isinstance(model, str) and (_SIZE.match(model) or _MOE_SIZE.match(model))):
        return _from_size(model)
    if isinstance(model, str):
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(model, local_files_only=True)
        except (OSError, ValueError) as err:
            raise ValueError(f"cannot read a config for {model!r} offline ({err}); pass a size string such as '7b', "
                             "a PretrainedConfig, or a local model directory.") from err
        return from_config(config, source=f"{model}'s config")
    raise ValueError(f"cannot tell a model's shape from a {type(model).__name__}: pass an nn.Module, a "
                     "PretrainedConfig, a Hub id / path, or a size string like '7b'.")
