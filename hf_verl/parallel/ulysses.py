"""Ulysses sequence parallelism over a padding-free packed batch.

The `sp` ranks of a sequence-parallel group (:attr:`ParallelDims.sp_group`) each hold one contiguous
shard of a packed sequence (:mod:`hf_verl.data.packing`) and run the whole model on it. Everything
but attention is per token, so only attention needs the other shards: the registered attention
function all-to-alls q / k / v from (local sequence, all heads) to (whole sequence, `heads / sp`
heads), attends with the block-diagonal causal mask of the packing (no attention across rows), and
all-to-alls the output back (DeepSpeed-Ulysses, Jacobs et al. 2023). Both all-to-alls are autograd
functions whose backward is the reverse all-to-all, so backward is exact.

Pieces, in the order an engine uses them:

1. :func:`apply_sequence_parallel` (model, dims): checks the head counts against `dims.sp` up front
   and switches the model to the ``"hf_verl_ulysses"`` attention (registered through
   `transformers.AttentionInterface` and `AttentionMaskInterface`; no transformers module is patched).
   Without a sequence shard in the forward's kwargs the function is plain sdpa, so the same model
   still generates and runs padded batches.
2. :func:`shard_sequence` (packed, dims): this rank's :class:`SequenceShard`; its
   :meth:`~SequenceShard.model_inputs` are the forward's kwargs (local ids and positions, and the shard
   itself, which transformers passes down to the attention function, also when gradient
   checkpointing recomputes a layer in backward).
3. :func:`shard_token_stats` / :func:`shard_values`: log-probs, entropy or critic values on the local
   shard, with labels from the *global* packed sequence (the label of a shard's last token is the next
   shard's first token); :func:`gather_sequence` concatenates the shards (autograd: each rank keeps the
   gradient of its own slice) where whole rows are needed; :func:`packed_logprobs` and
   :func:`packed_values` do all of it and return the trainers' `(B, C)` layout.
4. Gradients: each rank's parameter gradients cover its own tokens, and the single-process gradient
   is their **sum** over the sp group (:func:`sum_gradients_over_sp` for replicated parameters; a
   data-parallel wrapper that *averages* over dp x sp ranks needs the loss multiplied by `sp`).

Heads: `sp` must divide the query heads (any other degree is refused up front by
:func:`kv_head_repeats`, naming the numbers and the degrees that work). Key/value heads are split
when `sp` divides them and otherwise replicated just enough that every rank gets the KV heads of its
query heads (GQA with few KV heads: 4 query heads, 1 KV head, sp=2 sends each rank a copy).
The attention inside is `torch.nn.functional.scaled_dot_product_attention`, causal, once per packed row
(:func:`segment_attention`: no `T x T` mask); a varlen flash-attention kernel over `cu_seqlens` would
make it one call and is not wired in yet. Sliding-window layers are refused.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from hf_verl.algorithms.logprobs import logprobs_from_head
from hf_verl.data.packing import PackedBatch, block_causal_mask
from hf_verl.parallel.dims import ParallelDims

logger = logging.getLogger(__name__)

ATTENTION = "hf_verl_ulysses"


# ---------------------------------------------------------------------- heads
def kv_head_repeats(num_heads: int, num_kv_heads: int, sp: int) -> int:
    """How many times each key/value head is replicated before the all-to-all (1: the KV heads are split).

    Rank `i` gets query heads `[i * Hq / sp, (i + 1) * Hq / sp)`. With each KV head repeated
    `r = sp / gcd(Hkv, sp)` times, the `Hkv * r` heads split evenly over the ranks and each rank's share are
    exactly the KV heads of its query heads (`r` divides the group size `Hq / Hkv` whenever `sp` divides `Hq`).
    So `r = 1` when `sp` divides the KV heads, `sp / Hkv` when `sp` is a multiple of them, and in between
    otherwise (6 query / 3 KV heads at sp=2: each KV head twice, 3 per rank).

    Raises:
        ValueError: `sp` does not divide the query heads (the message lists the degrees that work), or the
            query heads are not a multiple of the KV heads.
    """
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads cannot be grouped over {num_kv_heads} key/value heads.")
    if sp < 1 or num_heads % sp:
        valid = [d for d in range(1, num_heads + 1) if num_heads % d == 0]
        raise ValueError(
            f"sequence parallelism of degree {sp} gives each rank num_attention_heads / {sp} query heads, but the "
            f"model has {num_heads} query heads, which {sp} does not divide; choose sequence_parallel_size in "
            f"{valid}.")
    return sp // math.gcd(num_kv_heads, sp)


def check_model(config: Any, sp: int) -> int:
    """Check that a model (its config) can run sequence parallel of degree `sp`; returns
    :func:`kv_head_repeats`. Raises `ValueError` naming the numbers otherwise."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    repeats = kv_head_repeats(heads, kv_heads, sp)
    if "sliding_attention" in (getattr(text, "layer_types", None) or ()):
        raise ValueError("sequence parallelism does not support sliding-window attention layers (config.layer_types "
                         "has 'sliding_attention'); use a model without them or sequence_parallel_size=1.")
    if not getattr(text, "is_causal", True):
        raise ValueError("sequence parallelism supports causal (decoder) attention only.")
    return repeats


# ---------------------------------------------------------------------- the shard of a packed sequence
class SequenceShard:
    """This rank's contiguous shard of a packed sequence, and its sequence-parallel group.

    Passed to the model as the `sequence_shard` keyword of the forward (see :meth:`model_inputs`),
    it reaches the attention function; `size == 1` is a whole packed sequence in one process. A plain
    class, not a dataclass, so that wrappers which rebuild dataclasses among a forward's inputs (FSDP2's
    input casting under mixed precision) pass this very object through.

    Args:
        packed ([`PackedBatch`]): the whole packed sequence (every rank holds its metadata).
        group: the sequence-parallel process group (`None` when `size == 1`).
        size (`int`): the sequence-parallel degree. rank (`int`): this rank's shard.
    """

    def __init__(self, packed: PackedBatch, group: Any, size: int, rank: int) -> None:
        self.packed, self.group, self.size, self.rank = packed, group, size, rank
        self.attention_calls = 0  # counted by the attention function: proof that the shards met
        self._masks: dict[str, torch.Tensor] = {}

    def __repr__(self) -> str:
        return f"SequenceShard(rank={self.rank}, size={self.size}, length={self.length} of {self.packed.length})"

    @property
    def length(self) -> int:
        """Tokens per shard."""
        return self.packed.length // self.size

    @property
    def start(self) -> int:
        return self.rank * self.length

    def local(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """This shard's slice of a whole-sequence tensor along `dim`."""
        return tensor.narrow(dim, self.start, self.length)

    @property
    def input_ids(self) -> torch.Tensor:
        return self.local(self.packed.input_ids)

    @property
    def position_ids(self) -> torch.Tensor:
        return self.local(self.packed.position_ids)

    @property
    def labels(self) -> torch.Tensor:
        """Next-token labels of the local positions, from the global sequence."""
        return self.local(self.packed.labels)

    @property
    def loss_mask(self) -> torch.Tensor:
        return self.local(self.packed.loss_mask)

    def model_inputs(self) -> dict[str, Any]:
        """The forward's keyword arguments for this shard (no attention mask: the packing defines it)."""
        return {"input_ids": self.input_ids, "position_ids": self.position_ids, "use_cache": False,
                "sequence_shard": self}

    def attention_mask(self, device: torch.device) -> torch.Tensor:
        """The whole sequence's `(1, 1, T, T)` block-diagonal causal mask, built once per device."""
        key = str(device)
        if key not in self._masks:
            self._masks[key] = block_causal_mask(self.packed.segment_ids.to(device))
        return self._masks[key]


def shard_sequence(packed: PackedBatch, dims: ParallelDims) -> SequenceShard:
    """This rank's shard of `packed` along `dims`' sequence-parallel axis.

    Raises:
        ValueError: the packed length is not a multiple of `dims.sp` (pack with `multiple_of=dims.sp`).
    """
    if packed.length % dims.sp:
        raise ValueError(f"the packed sequence has {packed.length} tokens, not a multiple of the sequence-parallel "
                         f"degree {dims.sp}; pack it with multiple_of={dims.sp}.")
    return SequenceShard(packed=packed, group=dims.sp_group, size=dims.sp, rank=dims.sp_rank)


# ---------------------------------------------------------------------- collectives with autograd
def _all_to_all(x: torch.Tensor, group: Any, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    import torch.distributed as dist

    world = dist.get_world_size(group)
    inputs = [t.contiguous() for t in x.chunk(world, dim=scatter_dim)]
    outputs = [torch.empty_like(t) for t in inputs]
    dist.all_to_all(outputs, inputs, group=group)
    return torch.cat(outputs, dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    """Split `scatter_dim` over the group, concatenate what arrives along `gather_dim`; backward is the reverse."""

    @staticmethod
    def forward(ctx, x, group, scatter_dim, gather_dim):
        ctx.group, ctx.scatter_dim, ctx.gather_dim = group, scatter_dim, gather_dim
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.group, ctx.gather_dim, ctx.scatter_dim), None, None, None


def all_to_all(x: torch.Tensor, group: Any, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Autograd-correct all-to-all: chunk `scatter_dim` over the group's ranks (chunk `j` to rank `j`) and
    concatenate the chunks received, in rank order, along `gather_dim`."""
    return _AllToAll.apply(x, group, scatter_dim, gather_dim)


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, rank):
        import torch.distributed as dist

        ctx.dim, ctx.rank, ctx.length = dim, rank, x.shape[dim]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        return grad.narrow(ctx.dim, ctx.rank * ctx.length, ctx.length).contiguous(), None, None, None


def gather_sequence(x: torch.Tensor, shard: SequenceShard, dim: int = -1) -> torch.Tensor:
    """The shards of every rank of `shard`'s group concatenated along `dim` (the whole sequence).

    Backward keeps the gradient of this rank's own slice only: every rank computes the same loss from the
    gathered tensor, and it counts once (the ranks' parameter gradients then sum to the single-process one).
    """
    if shard.size == 1:
        return x
    return _GatherSequence.apply(x, shard.group, dim % x.dim(), shard.rank)


# ---------------------------------------------------------------------- the attention function
def ulysses_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              attention_mask: torch.Tensor | None, dropout: float = 0.0,
                              scaling: float | None = None, sequence_shard: SequenceShard | None = None,
                              **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Attention over a sequence-parallel shard (transformers' attention-function signature).

    q `(B, Hq, L, D)`, k / v `(B, Hkv, L, D)` for the local `L` tokens; returns `((B, L, Hq, D), None)`.
    Without `sequence_shard` it is transformers' sdpa attention, unchanged (generation, padded batches).
    """
    if sequence_shard is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if kwargs.get("sliding_window") is not None:
        raise ValueError("sequence parallelism does not support sliding-window attention layers.")
    shard = sequence_shard
    shard.attention_calls += 1
    if query.shape[2] != shard.length or key.shape[2] != shard.length:
        raise ValueError(f"the attention got {query.shape[2]} query and {key.shape[2]} key positions for a shard of "
                         f"{shard.length}: pass SequenceShard.model_inputs() (no KV cache) to the forward.")
    repeats = kv_head_repeats(query.shape[1], key.shape[1], shard.size)
    if repeats > 1:
        key, value = key.repeat_interleave(repeats, dim=1), value.repeat_interleave(repeats, dim=1)
    if shard.size > 1:  # (B, H, L, D) -> (B, H / sp, T, D)
        query, key, value = (all_to_all(t, shard.group, scatter_dim=1, gather_dim=2) for t in (query, key, value))
    out = segment_attention(query, key, value, shard.packed.cu_seqlens.tolist(), dropout=dropout, scaling=scaling)
    if shard.size > 1:  # (B, H / sp, T, D) -> (B, H, L, D)
        out = all_to_all(out, shard.group, scatter_dim=2, gather_dim=1)
    return out.transpose(1, 2).contiguous(), None


def segment_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: list[int], *,
                      dropout: float = 0.0, scaling: float | None = None) -> torch.Tensor:
    """Causal attention within each packed segment `[cu_seqlens[i], cu_seqlens[i + 1])` of `(B, H, T, D)` q / k / v,
    `(B, H, T, D)` out: the block-diagonal causal mask without materialising it. Each segment runs sdpa with
    `is_causal=True`, which takes the memory-efficient (flash) kernels, so memory grows with T, not T^2."""
    gqa = query.shape[1] != key.shape[1]  # grouped key/value heads: sdpa reads each for its query group
    if len(cu_seqlens) == 2:  # one segment
        return F.scaled_dot_product_attention(query, key, value, dropout_p=dropout, scale=scaling, is_causal=True,
                                              enable_gqa=gqa)
    parts = [F.scaled_dot_product_attention(query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], dropout_p=dropout,
                                            scale=scaling, is_causal=True, enable_gqa=gqa)
             for s, e in zip(cu_seqlens[:-1], cu_seqlens[1:]) if e > s]
    return torch.cat(parts, dim=2)


def register_attention() -> str:
    """Register the attention function and its mask function under :data:`ATTENTION` (idempotent).

    The mask function is transformers' sdpa mask: padding masks for padded batches, and the block-diagonal
    causal mask transformers derives from restarting position ids for a packed batch in one process. Under
    a sequence shard the model only sees its local length, so the attention function uses the packing's
    whole-sequence mask (:meth:`SequenceShard.attention_mask`) instead.
    """
    AttentionInterface.register(ATTENTION, ulysses_attention_forward)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
    return ATTENTION


register_attention()


def packing_unsupported(model: torch.nn.Module) -> str | None:
    """Why `model`'s rows cannot be packed padding-free on one process, or `None` when they can: the model
    must attend through sdpa (switching an eager, flash or flex model would change its numerics or its
    kernels) with no sliding-window layers (the segment attention is full causal)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    if config is None or not hasattr(base, "set_attn_implementation"):
        return f"{type(base).__name__} is not a transformers model"
    impl = getattr(config, "_attn_implementation", None)
    if impl not in ("sdpa", ATTENTION):
        return f"it attends with {impl!r}; packing runs on the 'sdpa' implementation"
    layer_types = getattr(config, "layer_types", None) or []
    windowed = "sliding_attention" in layer_types or (
        getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True)
        and not layer_types)
    if windowed:
        return "it has sliding-window attention layers"
    return None


def use_segment_attention(model: torch.nn.Module) -> None:
    """Switch `model` (a transformers model, PEFT-wrapped or not) to the :data:`ATTENTION` implementation, which is
    transformers' sdpa for ordinary batches and per-segment causal attention for a packed sequence (a
    :class:`SequenceShard`, at any degree): packed rows then cost what they would padded, without a `T x T` mask."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if getattr(base.config, "_attn_implementation", None) != ATTENTION:
        base.set_attn_implementation(register_attention())


def apply_sequence_parallel(model: torch.nn.Module, dims: ParallelDims) -> torch.nn.Module:
    """Prepare `model` for sequence parallelism of degree `dims.sp`: check its heads, switch it to the
    :data:`ATTENTION` implementation. A no-op when `dims.sp == 1`. Apply it after tensor parallelism and
    before activation checkpointing and FSDP (the composition order of `hf_verl.parallel`).

    Raises:
        ValueError: the model's heads do not fit `dims.sp` (see :func:`kv_head_repeats`).
    """
    if dims.sp == 1:
        return model
    config = model.config
    repeats = check_model(config, dims.sp)
    model.set_attn_implementation(register_attention())
    logger.info("sequence parallel: degree %d, key/value heads %s", dims.sp,
                "split" if repeats == 1 else f"replicated x{repeats}")
    return model


# ---------------------------------------------------------------------- per-token outputs on a shard
def _hidden(module: torch.nn.Module, shard: SequenceShard, **extra: Any) -> torch.Tensor:
    calls = shard.attention_calls
    out = module(**shard.model_inputs(), output_hidden_states=True, **extra)
    if shard.size > 1 and shard.attention_calls == calls:
        raise ValueError(f"the model did not run the {ATTENTION!r} attention, so its shards never met: call "
                         "apply_sequence_parallel(model, dims) before the forward.")
    return out.hidden_states[-1][0]


def shard_token_stats(module: torch.nn.Module, head: torch.nn.Module, shard: SequenceShard, *,
                      temperature: float = 1.0, chunk_size: int = 1024, with_entropy: bool = False,
                      with_mean_logit: bool = False):
    """Log-probs of the labels (and entropy) at this shard's positions, `(L,)` each, 0 off the loss mask; with
    `with_mean_logit` a third `(L,)` tensor, the mean logit over the vocabulary (no gradient).

    Args:
        module: the module forwards run through (the model, or its DDP / FSDP2 / DeepSpeed wrapper).
        head: the LM head module (`model.get_output_embeddings()`), called on the scored positions only.
        shard ([`SequenceShard`]): this rank's shard.
    """
    hidden = _hidden(module, shard, logits_to_keep=1)
    select = shard.loss_mask[0]
    logp, entropy, mean_logit = logprobs_from_head(hidden[select], head, shard.labels[0][select],
                                                   temperature=temperature, chunk_size=chunk_size,
                                                   with_entropy=with_entropy, with_mean_logit=with_mean_logit)
    zeros = hidden.new_zeros(shard.length, dtype=torch.float32)
    out = (zeros.masked_scatter(select, logp), zeros.masked_scatter(select, entropy) if with_entropy else None)
    if with_mean_logit:
        out += (zeros.masked_scatter(select, mean_logit.float().detach()),)
    return out


def shard_values(module: torch.nn.Module, head: torch.nn.Module, shard: SequenceShard) -> torch.Tensor:
    """A value model's output (its one-output `score` `head`) at this shard's scored positions, `(L,)`, 0 elsewhere."""
    hidden = _hidden(module, shard)
    select = shard.loss_mask[0]
    values = head(hidden[select])
    if values.shape[-1] != 1:
        raise ValueError(f"the value head has {values.shape[-1]} outputs; it needs one (num_labels=1).")
    return hidden.new_zeros(shard.length, dtype=torch.float32).masked_scatter(select, values.squeeze(-1).float())


def packed_logprobs(module: torch.nn.Module, head: torch.nn.Module, packed: PackedBatch, dims: ParallelDims, *,
                    temperature: float = 1.0, chunk_size: int = 1024, with_entropy: bool = False,
                    with_mean_logit: bool = False):
    """`(B, C)` log-probs (and entropy) of the completion tokens of a packed batch, 0 on padding, on every
    rank of the sequence-parallel group (`dims.sp == 1`: one process over the packed sequence); with
    `with_mean_logit` a third `(B, C)` tensor of mean logits (no gradient)."""
    shard = shard_sequence(packed, dims)
    stats = shard_token_stats(module, head, shard, temperature=temperature, chunk_size=chunk_size,
                              with_entropy=with_entropy, with_mean_logit=with_mean_logit)
    logp = packed.unpack(gather_sequence(stats[0], shard))
    out = (logp, packed.unpack(gather_sequence(stats[1], shard)) if with_entropy else None)
    if with_mean_logit:
        out += (packed.unpack(gather_sequence(stats[2], shard)),)
    return out


def packed_values(module: torch.nn.Module, head: torch.nn.Module, packed: PackedBatch,
                  dims: ParallelDims) -> torch.Tensor:
    """`(B, C)` critic values of the states before each completion token of a packed batch, 0 on padding."""
    shard = shard_sequence(packed, dims)
    return packed.unpack(gather_sequence(shard_values(module, head, shard), shard))


def sum_gradients_over_sp(parameters, dims: ParallelDims) -> None:
    """All-reduce (sum) the gradients of `parameters` over the sequence-parallel group, for parameters that
    every sp rank holds whole (no data-parallel wrapper reducing over the sp ranks already)."""
    if dims.sp == 1:
        return
    import torch.distributed as dist

    group = dims.sp_group
    for p in parameters:
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
