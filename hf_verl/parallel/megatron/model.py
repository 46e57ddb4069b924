"""Megatron-Core models from HF configs: the architecture translation and one pipeline stage's `GPTModel`.

:func:`architecture` reads an HF config of a bridged family (:mod:`~hf_verl.parallel.megatron.families`) into
an :class:`Architecture` (the numbers both the Megatron config and the bridge need), refusing what the local
Megatron layers would compute differently (rope scaling, biases outside q/k/v, another activation), naming
the setting. :func:`build_stage` builds this rank's stage of a `GPTModel` with Megatron-Core's local layer spec
(no Transformer Engine, so the same code runs on CPU and GPU; its core attention through PyTorch's SDPA,
:mod:`~hf_verl.parallel.megatron.attention`), for a causal LM (vocabulary-parallel head, or tied
to the embedding) or a value model (a one-output head, replicated over tensor-parallel ranks).

Mixture-of-Experts families get Megatron's `MoELayer` (local `SequentialMLP` experts, no grouped GEMM, the
all-to-all token dispatcher, dropless) with the HF model's routing: softmax -> top-k, renormalised when the model
renormalises (`norm_topk_prob`; always for Mixtral) is Megatron's top-k over the logits then a softmax over the k
(`moe_router_pre_softmax=False`), and without renormalisation a softmax over every expert then top-k
(`moe_router_pre_softmax=True`). Megatron's own load-balancing loss is off: the engine computes the HF one.
At TP > 1 an MoE runs with Megatron's sequence parallelism (Megatron-Core trains an MoE under TP only so):
:class:`SequenceParallelRMSNorm` in place of its torch norm (which refuses it), the heads' input gathered by the
engine (:class:`ValueHead` here, the LM head in the engine's pre-hook).
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from hf_verl.parallel.megatron.families import Family, family_of

logger = logging.getLogger(__name__)

VOCAB_DIVISIBLE_BY = 128  # Megatron's default make_vocab_size_divisible_by


def import_megatron():
    """Import megatron.core quietly (its notices about Apex / Transformer Engine say nothing actionable here);
    a missing install is an `ImportError` naming the extra to install."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import megatron.core  # noqa: F401
            from megatron.core.models.gpt.gpt_model import GPTModel  # noqa: F401
    except ImportError as err:
        raise ImportError("backend='megatron' needs megatron-core: pip install 'hf_verl[megatron]' "
                          f"(megatron-core==0.16.1). Import error: {err}") from err
    import megatron.core

    return megatron.core


@dataclass(frozen=True)
class Architecture:
    """The numbers of a bridged model that Megatron's config and the bridge read."""

    family: Family
    num_layers: int
    hidden_size: int
    num_heads: int
    num_query_groups: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    norm_eps: float
    rope_theta: float
    max_positions: int
    tied: bool
    sliding_window: int | None
    num_experts: int = 0  # routed experts per layer (0: dense)
    top_k: int = 0
    expert_size: int = 0
    pre_softmax: bool = False  # Megatron's moe_router_pre_softmax (softmax over every expert before top-k)
    shared_expert_size: int | None = None

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def padded_vocab(self, tp: int) -> int:
        """The vocabulary padded to a multiple of `VOCAB_DIVISIBLE_BY x tp` (Megatron's rule)."""
        multiple = VOCAB_DIVISIBLE_BY * tp
        return -(-self.vocab_size // multiple) * multiple


def _rope_theta(config: Any) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    scaling = getattr(config, "rope_scaling", None) or {}
    kind = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if kind not in (None, "default"):
        raise ValueError(f"backend='megatron' bridges plain rotary embeddings; this model uses rope_type={kind!r}. "
                         "Train it with another backend (ddp, fsdp2, zero), or add the scaling to the bridge.")
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        raise ValueError("the model config names no rope_theta (rope_parameters['rope_theta']).")
    return float(theta)


def architecture(config: Any) -> Architecture:
    """The :class:`Architecture` of an HF config (a `PretrainedConfig` of a bridged family)."""
    family = family_of(config)
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"backend='megatron' bridges SwiGLU MLPs (hidden_act='silu'); this model uses {act!r}.")
    for flag in ("attention_bias", "mlp_bias"):
        if getattr(config, flag, False) and not (flag == "attention_bias" and family.qkv_bias):
            raise ValueError(f"backend='megatron': {flag}=True is not in the {family.name} bridge table (biases are "
                             "bridged on q/k/v for Qwen2 only); train this model with another backend.")
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    return Architecture(**_moe_fields(family, config),
        family=family, num_layers=config.num_hidden_layers, hidden_size=config.hidden_size, num_heads=heads,
        num_query_groups=getattr(config, "num_key_value_heads", None) or heads, head_dim=head_dim,
        ffn_hidden_size=config.intermediate_size, vocab_size=config.vocab_size, norm_eps=config.rms_norm_eps,
        rope_theta=_rope_theta(config), max_positions=config.max_position_embeddings,
        tied=bool(getattr(config, "tie_word_embeddings", False)), sliding_window=window)


def _moe_fields(family: Family, config: Any) -> dict[str, Any]:
    """The expert fields of an :class:`Architecture` (none for a dense family); refuses what Megatron's MoE layer
    would compute differently (dense layers between sparse ones, top-1 renormalised routing, router noise)."""
    spec = family.moe
    if spec is None:
        return {}
    sparse_step = getattr(config, "decoder_sparse_step", 1) or 1
    if getattr(config, "mlp_only_layers", None) or sparse_step != 1:
        raise ValueError("backend='megatron' bridges Mixture-of-Experts models whose every layer is sparse; this model "
                         f"has mlp_only_layers={getattr(config, 'mlp_only_layers', None)}, decoder_sparse_step="
                         f"{sparse_step}. Train it with another backend (ddp, fsdp2, zero).")
    if getattr(config, "router_jitter_noise", 0.0):
        raise ValueError("backend='megatron' does not bridge router_jitter_noise; set it to 0.")
    renorm = spec.renormalize if isinstance(spec.renormalize, bool) else bool(getattr(config, spec.renormalize))
    top_k = config.num_experts_per_tok
    if renorm and top_k == 1:
        raise ValueError("top-1 routing with renormalised probabilities (every weight 1) has no Megatron router "
                         "setting; train this model with another backend.")
    shared = getattr(config, spec.shared_expert_size) if spec.shared_expert_size else None
    return dict(num_experts=getattr(config, spec.experts), top_k=top_k, expert_size=getattr(config, spec.expert_size),
                pre_softmax=not renorm, shared_expert_size=shared or None)


def check_layout(arch: Architecture, tp: int, pp: int, ep: int = 1) -> None:
    """Refuse a TP / PP / EP degree the model cannot be split by, naming what divides."""
    if ep > 1 and not arch.is_moe:
        raise ValueError(f"expert_model_parallel_size={ep} needs a Mixture-of-Experts model; the "
                         f"{arch.family.name} model is dense: set expert_model_parallel_size=1.")
    if arch.is_moe:
        if arch.num_experts % ep:
            raise ValueError(f"expert_model_parallel_size={ep} must divide the model's {arch.num_experts} experts.")
        if arch.expert_size % tp or (arch.shared_expert_size or 0) % tp:
            raise ValueError(f"tensor_model_parallel_size={tp} must divide the expert MLP size {arch.expert_size}"
                             + (f" and the shared expert's {arch.shared_expert_size}." if arch.shared_expert_size
                                else "."))
    if arch.num_query_groups % tp or arch.num_heads % tp:
        raise ValueError(f"tensor_model_parallel_size={tp} must divide the model's {arch.num_heads} attention heads and "
                         f"{arch.num_query_groups} key-value heads.")
    if arch.ffn_hidden_size % tp and not arch.is_moe:
        raise ValueError(f"tensor_model_parallel_size={tp} must divide the MLP size {arch.ffn_hidden_size}.")
    if arch.num_layers % pp:
        raise ValueError(f"pipeline_model_parallel_size={pp} must divide the model's {arch.num_layers} layers.")


def transformer_config(arch: Architecture, *, tp: int, pp: int, dtype: torch.dtype, gradient_checkpointing: bool,
                       sequence_parallel: bool = False, ep: int = 1):
    """Megatron's `TransformerConfig` for the architecture on a `tp x pp` layout (experts over `ep` ranks; dropout
    off: RL log-probs)."""
    import_megatron()
    from megatron.core.transformer.transformer_config import TransformerConfig

    from hf_verl.parallel.megatron.compat import QUIET

    recompute = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1} \
        if gradient_checkpointing else {}
    with warnings.catch_warnings():
        for category, message in QUIET:
            warnings.filterwarnings("ignore", message=message, category=category)
        warnings.filterwarnings("ignore", message=r"When using expert parallelism and tensor parallelism")
        return _transformer_config(TransformerConfig, arch, tp, pp, dtype, sequence_parallel,
                                   {**recompute, **_moe_config(arch, ep)})


def _moe_config(arch: Architecture, ep: int) -> dict[str, Any]:
    """Megatron's MoE settings for the architecture's routing (see the module docstring); none for a dense one."""
    if not arch.is_moe:
        return {}
    shared = {"moe_shared_expert_intermediate_size": arch.shared_expert_size, "moe_shared_expert_gate": True} \
        if arch.shared_expert_size else {}
    return dict(num_moe_experts=arch.num_experts, moe_router_topk=arch.top_k, moe_ffn_hidden_size=arch.expert_size,
                moe_router_pre_softmax=arch.pre_softmax, moe_router_score_function="softmax",
                moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_grouped_gemm=False,
                # Megatron's own routing replay (each router gets a RouterReplay; idle until given indices): what
                # hf_verl's router_replay drives (hf_verl.engine.megatron.scoring)
                moe_enable_routing_replay=True,
                expert_model_parallel_size=ep, **shared)


def _transformer_config(TransformerConfig, arch, tp, pp, dtype, sequence_parallel, recompute):
    """The `TransformerConfig` itself (see :func:`transformer_config`)."""
    return TransformerConfig(
        num_layers=arch.num_layers, hidden_size=arch.hidden_size, num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_query_groups, kv_channels=arch.head_dim, ffn_hidden_size=arch.ffn_hidden_size,
        normalization="RMSNorm", layernorm_epsilon=arch.norm_eps, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, add_qkv_bias=arch.family.qkv_bias,
        qk_layernorm=arch.family.qk_norm, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, sequence_parallel=sequence_parallel,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        use_cpu_initialization=True, perform_initialization=False, variable_seq_lengths=True,
        bias_dropout_fusion=False, apply_rope_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False,
        moe_token_dispatcher_type="alltoall",  # MoE over gloo (dense: the default refuses variable_seq_lengths)
        **recompute)


class ValueHead(torch.nn.Module):
    """A critic's one-output head in the place of `GPTModel.output_layer` (called as Megatron calls its output
    layer, returning `(output, bias)`); replicated over tensor-parallel ranks. Under sequence parallelism its input
    (each TP rank's slice of the sequence) is gathered first; every rank then computes every value."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype))
        self.sequence_parallel = sequence_parallel

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output: Any = None):
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        return torch.nn.functional.linear(hidden, self.weight), None


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """PyTorch's RMSNorm built as Megatron builds a norm (`config, hidden_size, eps`), for sequence parallelism:
    Megatron's torch-norm wrapper refuses it, and the weight is marked `sequence_parallel` so that Megatron sums its
    gradient over the tensor-parallel ranks (each normalises its slice of the sequence)."""

    marks_sequence_parallel = True

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> None:
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        self.weight.sequence_parallel = config.sequence_parallel and self.marks_sequence_parallel


class HeadRMSNorm(SequenceParallelRMSNorm):
    """The same norm on each query / key head (Qwen3's q/k norms): the heads see the whole sequence; Megatron sums
    their weights' gradients over the TP ranks by name (each rank holds other heads)."""

    marks_sequence_parallel = False


def build_stage(arch: Architecture, config: Any, *, role_kind: str, pre_process: bool, post_process: bool,
                tp: int):
    """This rank's pipeline stage of a `GPTModel` (call inside :func:`~.compat.cpu_compat` on a CPU machine)."""
    import_megatron()
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    if arch.is_moe:
        from hf_verl.parallel.megatron.compat import define_te_fallbacks

        define_te_fallbacks()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Apex is not installed. Falling back to Torch Norm": expected here
        spec = get_gpt_layer_local_spec(num_experts=arch.num_experts or None, moe_grouped_gemm=False,
                                        qk_layernorm=arch.family.qk_norm, normalization="RMSNorm")
        from hf_verl.parallel.megatron.attention import SDPAttention

        spec.submodules.self_attention.submodules.core_attention = SDPAttention  # PyTorch's fused kernels
        block = spec
        if config.sequence_parallel:  # the layers' and the final norm: norms that take sequence parallelism
            from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

            spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = SequenceParallelRMSNorm
            if arch.family.qk_norm:
                attention = spec.submodules.self_attention.submodules
                attention.q_layernorm = attention.k_layernorm = HeadRMSNorm
            block = TransformerBlockSubmodules(layer_specs=[spec] * (arch.num_layers // config.pipeline_model_parallel_size),
                                               layer_norm=SequenceParallelRMSNorm)
        tied = arch.tied and role_kind == "causal_lm"
        model = GPTModel(config=config, transformer_layer_spec=block, vocab_size=arch.padded_vocab(tp),
                         max_sequence_length=arch.max_positions, pre_process=pre_process, post_process=post_process,
                         share_embeddings_and_output_weights=tied, position_embedding_type="rope",
                         rotary_base=int(arch.rope_theta) if float(arch.rope_theta).is_integer() else arch.rope_theta,
                         parallel_output=True)
    if role_kind == "value" and post_process:
        model.output_layer = ValueHead(arch.hidden_size, config.params_dtype, config.sequence_parallel)
    elif post_process and config.sequence_parallel:
        model.output_layer.sequence_parallel = False  # the engine's pre-hook gathers the sequence for the LM head
    return model
