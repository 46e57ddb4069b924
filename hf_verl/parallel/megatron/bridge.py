"""The HF <-> Megatron-Core weight bridge: one model-agnostic mechanism over per-family mapping tables.

Model knowledge is data (:mod:`hf_verl.parallel.megatron.families`): for each Megatron parameter, which HF
tensors it is made of and how (a :class:`Mapping`). This module is the mechanism, the same for every family:

- :class:`Replicated`: the same tensor on every tensor-parallel rank (norms, a value head);
- :class:`Column` / :class:`Row`: split along the output (dim 0) / input (dim 1) features over TP ranks;
- :class:`VocabColumn`: a vocabulary-sized matrix padded to the Megatron vocabulary (a multiple of
  `make_vocab_size_divisible_by x tp`) with zero rows, then split along the vocabulary;
- :class:`FusedQKV`: HF's separate q / k / v projections (weights or biases) fused per query group, as
  Megatron's `linear_qkv` holds them (`[q heads of group g, k_g, v_g]` for each group), then split over TP by
  groups;
- :class:`GatedFC1`: HF's `gate_proj` and `up_proj` fused into Megatron's `linear_fc1`, each TP rank holding
  `[its gate shard; its up shard]`; :class:`FusedGatedFC1`: the same from one HF tensor `[gate; up]` (an expert's
  slice of `gate_up_proj`);
- :class:`Experts`: a Mixture-of-Experts layer's fused 3-D HF tensor (`mlp.experts.gate_up_proj [E, 2I, H]`,
  `mlp.experts.down_proj [E, H, I]`) as Megatron's per-expert parameters (`local_experts.{expert}`): the experts
  split over the expert-parallel (EP) ranks, each expert's slice through an inner mapping over the expert
  tensor-parallel ranks (Megatron's `expert_tensor_parallel_size`, the TP degree by default).

Every mapping has `shard(hf_tensors, ctx) -> this rank's tensor` (loading) and `merge(per_rank_shards, ctx) ->
HF tensors` (export); the two are exact inverses (a round trip is bit-exact). An :class:`Experts` mapping shards
into this rank's list of local experts and merges a list (every expert, in order) of lists (its expert-TP shards).

:class:`Bridge` applies a family's table to a pipeline stage: global parameters (embedding on the first stage;
final norm and head on the last), and per-layer parameters with the stage's local layer index mapped to the
global one. `load` builds a stage's Megatron state dict from HF tensors; `export` turns the TP-gathered Megatron
tensors of a stage back into HF-named ones, one parameter at a time (the engine streams them in buckets).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace

import torch


@dataclass(frozen=True)
class ShardContext:
    """What a mapping needs to know of the layout and the model.

    Attributes:
        tp_size / tp_rank (`int`): the tensor-parallel degree and this rank.
        num_heads / num_query_groups / head_dim (`int`): attention geometry (query heads, key-value heads).
        vocab_size / padded_vocab_size (`int`): the HF vocabulary and Megatron's padded one.
        num_experts (`int`): routed experts per MoE layer (0: a dense model). ep_size / ep_rank (`int`): the
            expert-parallel degree and this rank. etp_size / etp_rank (`int`, *optional*): the expert
            tensor-parallel degree and rank (default: the TP ones, Megatron's default).
    """

    tp_size: int
    tp_rank: int
    num_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int
    padded_vocab_size: int
    num_experts: int = 0
    ep_size: int = 1
    ep_rank: int = 0
    etp_size: int | None = None
    etp_rank: int | None = None

    def expert_ctx(self) -> ShardContext:
        """The context of one expert's slice: its tensor-parallel split is the expert TP one."""
        etp = self.tp_size if self.etp_size is None else self.etp_size
        return replace(self, tp_size=etp, tp_rank=self.tp_rank if self.etp_rank is None else self.etp_rank)

    @property
    def local_experts(self) -> range:
        """The global indices of this EP rank's experts (Megatron's `local_experts.{j}` is expert `start + j`)."""
        if self.num_experts % self.ep_size:
            raise ValueError(f"expert_model_parallel_size={self.ep_size} must divide the model's {self.num_experts} "
                             "experts.")
        per = self.num_experts // self.ep_size
        return range(self.ep_rank * per, (self.ep_rank + 1) * per)


def _split(t: torch.Tensor, ctx: ShardContext, dim: int) -> torch.Tensor:
    if t.shape[dim] % ctx.tp_size:
        raise ValueError(f"a dimension of {t.shape[dim]} does not split over tensor_model_parallel_size="
                         f"{ctx.tp_size}; choose a degree that divides the model's heads and feature sizes.")
    return torch.chunk(t, ctx.tp_size, dim=dim)[ctx.tp_rank].contiguous()


@dataclass(frozen=True)
class Mapping:
    """How one Megatron parameter is made of HF tensors (`hf`: name templates, `{layer}` the global layer)."""

    hf: tuple[str, ...]

    def shard(self, tensors: list[torch.Tensor], ctx: ShardContext) -> torch.Tensor:
        raise NotImplementedError

    def merge(self, shards: list[torch.Tensor], ctx: ShardContext) -> list[torch.Tensor]:
        raise NotImplementedError

    @property
    def tensor_parallel(self) -> bool:
        """Whether ranks hold different parts (the export gathers them over the TP group)."""
        return True

    @property
    def partition_dim(self) -> int:
        """The dimension split over TP ranks (Megatron's `partition_dim` attribute of the parameter)."""
        return 0


@dataclass(frozen=True)
class Replicated(Mapping):
    def shard(self, tensors, ctx):
        return tensors[0].clone()

    def merge(self, shards, ctx):
        return [shards[0]]

    @property
    def tensor_parallel(self) -> bool:
        return False


@dataclass(frozen=True)
class Column(Mapping):
    def shard(self, tensors, ctx):
        return _split(tensors[0], ctx, 0)

    def merge(self, shards, ctx):
        return [torch.cat(shards, 0)]


@dataclass(frozen=True)
class Row(Mapping):
    @property
    def partition_dim(self) -> int:
        return 1

    def shard(self, tensors, ctx):
        return _split(tensors[0], ctx, 1)

    def merge(self, shards, ctx):
        return [torch.cat(shards, 1)]


@dataclass(frozen=True)
class VocabColumn(Mapping):
    def shard(self, tensors, ctx):
        t = tensors[0]
        if t.shape[0] != ctx.vocab_size:
            raise ValueError(f"{self.hf[0]} has {t.shape[0]} rows, the model's vocabulary is {ctx.vocab_size}.")
        pad = ctx.padded_vocab_size - t.shape[0]
        if pad:
            t = torch.cat([t, t.new_zeros(pad, *t.shape[1:])], 0)
        return _split(t, ctx, 0)

    def merge(self, shards, ctx):
        return [torch.cat(shards, 0)[: ctx.vocab_size]]


@dataclass(frozen=True)
class FusedQKV(Mapping):
    """`hf = (q, k, v)` (weights `(out, hidden)` or biases `(out,)`)."""

    def shard(self, tensors, ctx):
        q, k, v = tensors
        groups, d = ctx.num_query_groups, ctx.head_dim
        per_group = ctx.num_heads // groups
        tail = q.shape[1:]
        fused = torch.cat([q.reshape(groups, per_group * d, *tail), k.reshape(groups, d, *tail),
                           v.reshape(groups, d, *tail)], 1)
        if groups % ctx.tp_size:
            raise ValueError(f"{groups} key-value heads do not split over tensor_model_parallel_size={ctx.tp_size}; "
                             "choose a degree that divides the model's num_key_value_heads.")
        return torch.chunk(fused, ctx.tp_size, 0)[ctx.tp_rank].reshape(-1, *tail).contiguous()

    def merge(self, shards, ctx):
        groups, d = ctx.num_query_groups, ctx.head_dim
        per_group = ctx.num_heads // groups
        tail = shards[0].shape[1:]
        fused = torch.cat(shards, 0).reshape(groups, (per_group + 2) * d, *tail)
        q, k, v = torch.split(fused, [per_group * d, d, d], 1)
        return [q.reshape(-1, *tail).contiguous(), k.reshape(-1, *tail).contiguous(), v.reshape(-1, *tail).contiguous()]


@dataclass(frozen=True)
class GatedFC1(Mapping):
    """`hf = (gate, up)`: each TP rank holds `[gate shard; up shard]`."""

    def shard(self, tensors, ctx):
        gate, up = tensors
        return torch.cat([_split(gate, ctx, 0), _split(up, ctx, 0)], 0)

    def merge(self, shards, ctx):
        halves = [torch.chunk(s, 2, 0) for s in shards]
        return [torch.cat([h[0] for h in halves], 0), torch.cat([h[1] for h in halves], 0)]


@dataclass(frozen=True)
class FusedGatedFC1(Mapping):
    """`hf = (gate_up,)`, one tensor `[gate; up]` (`[2I, H]`): each TP rank holds `[gate shard; up shard]`."""

    def shard(self, tensors, ctx):
        return GatedFC1(()).shard(list(torch.chunk(tensors[0], 2, 0)), ctx)

    def merge(self, shards, ctx):
        return [torch.cat(GatedFC1(()).merge(shards, ctx), 0)]


@dataclass(frozen=True)
class Experts(Mapping):
    """`hf = (fused,)`: an HF `[E, ...]` tensor of every routed expert of a layer; Megatron's names carry
    `{expert}` (the local index). `inner` maps one expert's slice (`fused[e]`) over the expert-TP ranks."""

    inner: Mapping = field(default_factory=lambda: Replicated(()))

    def shard(self, tensors, ctx):
        """This EP rank's experts, in local order: a list of tensors."""
        fused, ectx = tensors[0], ctx.expert_ctx()
        if fused.shape[0] != ctx.num_experts:
            raise ValueError(f"{self.hf[0]} holds {fused.shape[0]} experts, the model config {ctx.num_experts}.")
        return [self.inner.shard([fused[e]], ectx) for e in ctx.local_experts]

    def merge(self, shards, ctx):
        """`shards[e]`: expert `e`'s expert-TP shards, for every expert of the layer."""
        ectx = ctx.expert_ctx()
        return [torch.stack([self.inner.merge(s, ectx)[0] for s in shards], 0)]

    @property
    def tensor_parallel(self) -> bool:
        return self.inner.tensor_parallel

    @property
    def partition_dim(self) -> int:
        return self.inner.partition_dim


@dataclass(frozen=True)
class Table:
    """A family's mapping table: Megatron name -> mapping. `layer` names are relative to
    `decoder.layers.{i}.`; `first` / `last` are the first / last pipeline stage's global parameters."""

    layer: dict[str, Mapping]
    first: dict[str, Mapping] = field(default_factory=dict)
    last: dict[str, Mapping] = field(default_factory=dict)

    def extended(self, layer: dict[str, Mapping] | None = None, first: dict[str, Mapping] | None = None,
                 last: dict[str, Mapping] | None = None) -> Table:
        """This table with more (or replaced) entries: how a family derives from another."""
        return Table({**self.layer, **(layer or {})}, {**self.first, **(first or {})}, {**self.last, **(last or {})})


class Bridge:
    """A family's table applied to one pipeline stage (see the module docstring).

    Args:
        table ([`Table`]): the family's mappings (the head entry already chosen for the role).
        ctx ([`ShardContext`]): the layout and geometry.
        layer_offset (`int`): the global index of the stage's first layer. num_layers (`int`): its layers.
        first_stage / last_stage (`bool`): whether the stage holds the embedding / the final norm and head.
    """

    def __init__(self, table: Table, ctx: ShardContext, *, layer_offset: int, num_layers: int,
                 first_stage: bool, last_stage: bool) -> None:
        self.table, self.ctx = table, ctx
        self.layer_offset, self.num_layers = layer_offset, num_layers
        self.first_stage, self.last_stage = first_stage, last_stage

    def entries(self) -> Iterator[tuple[str, Mapping, tuple[str, ...]]]:
        """`(megatron name, mapping, HF names)` of every parameter of the stage, in a fixed order."""
        if self.first_stage:
            for name, m in self.table.first.items():
                yield name, m, m.hf
        for local in range(self.num_layers):
            layer = self.layer_offset + local
            for name, m in self.table.layer.items():
                yield f"decoder.layers.{local}.{name}", m, tuple(h.format(layer=layer) for h in m.hf)
        if self.last_stage:
            for name, m in self.table.last.items():
                yield name, m, m.hf

    def parameters(self) -> Iterator[tuple[str, Mapping]]:
        """`(megatron name, mapping)` of every parameter of the stage, expert templates expanded over this rank's
        local experts (the mapping of an expert parameter is its per-expert `inner` one)."""
        for name, m, _ in self.entries():
            if isinstance(m, Experts):
                for j in range(len(self.ctx.local_experts)):
                    yield name.format(expert=j), m.inner
            else:
                yield name, m

    def hf_names(self) -> list[str]:
        """Every HF tensor name this stage reads or writes."""
        return [h for _, _, names in self.entries() for h in names]

    def load(self, get: Callable[[str], torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's Megatron tensors of the stage, from HF tensors fetched by name with `get`."""
        out = {}
        for name, m, names in self.entries():
            if isinstance(m, Experts):
                for j, t in enumerate(m.shard([get(h) for h in names], self.ctx)):
                    out[name.format(expert=j)] = t
            else:
                out[name] = m.shard([get(h) for h in names], self.ctx)
        return out

    def export(self, gather: Callable[[str, torch.Tensor, Mapping], list[torch.Tensor]],
               params: dict[str, torch.Tensor],
               gather_experts: Callable[[str, list[list[torch.Tensor]], Experts], list[list[torch.Tensor]]]
               | None = None) -> Iterable[tuple[str, torch.Tensor]]:
        """HF `(name, tensor)` pairs of the stage, one Megatron parameter at a time: `gather(name, tensor,
        mapping)` returns every TP rank's shard of a tensor-parallel parameter (a collective) and `[tensor]` for
        a replicated one. An expert parameter's local experts are gathered each over the expert-TP ranks with
        `gather` (given the expert's `inner` mapping), then `gather_experts(name, per_local_expert_shards,
        mapping)` returns every EP rank's, in global expert order (a collective; None: one EP rank)."""
        for name, m, names in self.entries():
            if isinstance(m, Experts):
                local = [gather(name.format(expert=j), params[name.format(expert=j)], m.inner)
                         for j in range(len(self.ctx.local_experts))]
                shards = local if gather_experts is None else gather_experts(name, local, m)
            else:
                shards = gather(name, params[name], m)
            yield from zip(names, m.merge(shards, self.ctx))
