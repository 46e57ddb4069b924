"""Model families of the Megatron bridge: data only (mapping tables and architecture flags).

A family is a :class:`Family`: the HF `model_type`s it covers, its mapping :class:`~.bridge.Table` (Megatron
parameter -> HF tensors, through the mechanism of :mod:`hf_verl.parallel.megatron.bridge`) and the flags that
turn an HF config into Megatron's (`qkv_bias`, `qk_norm`). Adding a family is adding an entry here: see
`docs/megatron.md` ("Adding a family"), where Mistral, the fourth family, is the worked example.

Mixture-of-Experts families (Qwen3-MoE, Qwen2-MoE with its gated shared expert, Mixtral) replace the dense MLP
entries with the router, the routed experts (:class:`~.bridge.Experts` over HF's fused 3-D `gate_up_proj` /
`down_proj`) and, for Qwen2-MoE, the shared expert and its sigmoid gate; their :class:`MoESpec` names the config
fields that give the expert count, sizes and routing (read by :func:`~hf_verl.parallel.megatron.model.architecture`).

Heads are per role: a causal LM's `lm_head` (or, tied, the embedding itself) and a critic's `score` (the value
head of `AutoModelForSequenceClassification`, one label), so every family serves the actor, the reference and
the critic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hf_verl.parallel.megatron.bridge import (Experts, FusedGatedFC1, FusedQKV, GatedFC1, Mapping, Replicated, Row,
                                              Table, VocabColumn)

_L = "model.layers.{layer}."

# the decoder layer every family here shares (Llama's): pre-norm attention with fused QKV, gated MLP
LLAMA_TABLE = Table(
    layer={
        "input_layernorm.weight": Replicated((_L + "input_layernorm.weight",)),
        "self_attention.linear_qkv.weight": FusedQKV(
            (_L + "self_attn.q_proj.weight", _L + "self_attn.k_proj.weight", _L + "self_attn.v_proj.weight")),
        "self_attention.linear_proj.weight": Row((_L + "self_attn.o_proj.weight",)),
        "pre_mlp_layernorm.weight": Replicated((_L + "post_attention_layernorm.weight",)),
        "mlp.linear_fc1.weight": GatedFC1((_L + "mlp.gate_proj.weight", _L + "mlp.up_proj.weight")),
        "mlp.linear_fc2.weight": Row((_L + "mlp.down_proj.weight",)),
    },
    first={"embedding.word_embeddings.weight": VocabColumn(("model.embed_tokens.weight",))},
    last={"decoder.final_layernorm.weight": Replicated(("model.norm.weight",))},
)

# Qwen2: biases on q, k and v
QWEN2_TABLE = LLAMA_TABLE.extended(layer={
    "self_attention.linear_qkv.bias": FusedQKV(
        (_L + "self_attn.q_proj.bias", _L + "self_attn.k_proj.bias", _L + "self_attn.v_proj.bias")),
})

# Qwen3: RMSNorm on each query and key head (no biases)
QWEN3_TABLE = LLAMA_TABLE.extended(layer={
    "self_attention.q_layernorm.weight": Replicated((_L + "self_attn.q_norm.weight",)),
    "self_attention.k_layernorm.weight": Replicated((_L + "self_attn.k_norm.weight",)),
})


def moe_table(dense: Table, shared_expert: bool = False) -> Table:
    """A dense family's table with its MLP replaced by a Mixture-of-Experts layer (Megatron's `MoELayer` with
    `SequentialMLP` experts): the router, every routed expert's gated MLP (HF's fused `[E, 2I, H]` / `[E, H, I]`
    tensors) and, with `shared_expert`, Qwen2-MoE's shared expert and its sigmoid gate."""
    layer = {k: v for k, v in dense.layer.items() if not k.startswith("mlp.")}
    layer.update({
        "mlp.router.weight": Replicated((_L + "mlp.gate.weight",)),
        "mlp.experts.local_experts.{expert}.linear_fc1.weight": Experts((_L + "mlp.experts.gate_up_proj",),
                                                                        FusedGatedFC1(())),
        "mlp.experts.local_experts.{expert}.linear_fc2.weight": Experts((_L + "mlp.experts.down_proj",), Row(())),
    })
    if shared_expert:
        layer.update({
            "mlp.shared_experts.linear_fc1.weight": GatedFC1(
                (_L + "mlp.shared_expert.gate_proj.weight", _L + "mlp.shared_expert.up_proj.weight")),
            "mlp.shared_experts.linear_fc2.weight": Row((_L + "mlp.shared_expert.down_proj.weight",)),
            "mlp.shared_experts.gate_weight": Replicated((_L + "mlp.shared_expert_gate.weight",)),
        })
    return Table(layer, dict(dense.first), dict(dense.last))


# the heads, by role
LM_HEAD: dict[str, Mapping] = {"output_layer.weight": VocabColumn(("lm_head.weight",))}
VALUE_HEAD: dict[str, Mapping] = {"output_layer.weight": Replicated(("score.weight",))}


@dataclass(frozen=True)
class MoESpec:
    """Where a Mixture-of-Experts family's config keeps its experts (attribute names of the HF config).

    Attributes:
        experts (`str`): the number of routed experts. expert_size (`str`): one expert's MLP size.
        renormalize (`str` or `bool`): whether the top-k probabilities are renormalised (a config flag's name, or a
            constant). shared_expert_size (`str`, *optional*): the gated shared expert's MLP size.
    """

    experts: str
    expert_size: str
    renormalize: str | bool
    shared_expert_size: str | None = None


@dataclass(frozen=True)
class Family:
    """One model family.

    Attributes:
        name (`str`): the family's name. model_types (`tuple[str, ...]`): HF `config.model_type`s it covers.
        table ([`Table`]): its decoder, embedding and final-norm mappings (heads are added per role).
        qkv_bias (`bool`): q / k / v projections carry biases. qk_norm (`bool`): RMSNorm on query and key heads.
        moe ([`MoESpec`], *optional*): a Mixture-of-Experts family's expert fields (None: dense).
    """

    name: str
    model_types: tuple[str, ...]
    table: Table
    qkv_bias: bool = False
    qk_norm: bool = False
    moe: MoESpec | None = None


FAMILIES: list[Family] = [
    Family("llama", ("llama",), LLAMA_TABLE),
    Family("qwen2", ("qwen2",), QWEN2_TABLE, qkv_bias=True),
    Family("qwen3", ("qwen3",), QWEN3_TABLE, qk_norm=True),
    Family("mistral", ("mistral",), LLAMA_TABLE),  # the fourth family: Llama's table, nothing else
    Family("qwen3_moe", ("qwen3_moe",), moe_table(QWEN3_TABLE), qk_norm=True,
           moe=MoESpec("num_experts", "moe_intermediate_size", "norm_topk_prob")),
    Family("qwen2_moe", ("qwen2_moe",), moe_table(QWEN2_TABLE, shared_expert=True), qkv_bias=True,
           moe=MoESpec("num_experts", "moe_intermediate_size", "norm_topk_prob", "shared_expert_intermediate_size")),
    Family("mixtral", ("mixtral",), moe_table(LLAMA_TABLE), moe=MoESpec("num_local_experts", "intermediate_size", True)),
]

# what the bridge cannot express yet, by model_type: the refusal names the missing piece
NOT_BRIDGED = {
    "deepseek_v3": "multi-head latent attention (MLA), sigmoid routing with a score-correction bias and grouped "
                   "top-k, and dense first layers",
    "gpt_oss": "attention sinks, per-expert biases, and its clamped SwiGLU (with alpha and limit)",
}


def family_of(config: Any) -> Family:
    """The family of an HF config, or a `ValueError` listing the supported ones."""
    model_type = getattr(config, "model_type", None)
    if model_type in NOT_BRIDGED:
        raise ValueError(f"backend='megatron' cannot bridge model_type {model_type!r}: the bridge has no mapping for "
                         f"{NOT_BRIDGED[model_type]}. Train it with another backend (ddp, fsdp2, zero).")
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    known = sorted(t for f in FAMILIES for t in f.model_types)
    raise ValueError(f"backend='megatron' has no bridge table for model_type {model_type!r} (supported: {known}); "
                     "add a Family to hf_verl/parallel/megatron/families.py (docs/megatron.md, 'Adding a family'), "
                     "or train this model with another backend (ddp, fsdp2, zero).")


def table_for(family: Family, role_kind: str, tied: bool) -> Table:
    """The family's table with the head of a role kind: `"causal_lm"` (`lm_head`, none when tied to the
    embedding) or `"value"` (the `score` head)."""
    if role_kind == "value":
        return family.table.extended(last=VALUE_HEAD)
    return family.table if tied else family.table.extended(last=LM_HEAD)
