"""LoRA on the Megatron bridge: a PEFT LoRA model's adapters carried onto Megatron's fused, tensor-parallel linears.

The trainers wrap the actor with `peft.get_peft_model(model, peft_config)` whatever the backend; the Megatron engine
reads that `PeftModel` (:func:`read_peft`): its base weights (PEFT's `base_layer` names folded back to the HF ones,
for the bridge) and, for every HF module PEFT wrapped, its LoRA `A` / `B` as PEFT initialised them, its scaling
(`lora_alpha / r`, or `/ sqrt(r)` with `use_rslora`; `rank_pattern` / `alpha_pattern` included) and dropout. So PEFT
resolves `target_modules` ("all-linear", names, regexes) and draws the initial `A`, and the Megatron run starts where
the one-process PEFT run starts.

Each HF module keeps its own `A` and `B` (PEFT's semantics, so the export is PEFT's tensors). The HF modules map
onto Megatron's linears through the family's bridge table (:func:`linear_slots`): the fused `linear_qkv` holds q / k
/ v (three slots), `linear_fc1` holds gate / up (two), `linear_proj` and `linear_fc2` one each. A
:class:`LoraLinear` beside a Megatron linear computes `scaling * B(A(dropout(x)))` per slot and lays the slots out as
the fused linear's output is laid out on this rank (per query group `[q, k, v]`; `[gate shard; up shard]`), added to
the linear's output by a forward hook. Tensor parallelism gives one process's result:

- column-parallel (`linear_qkv`, `linear_fc1`): `A` replicated, `B` split along its rows as the linear's weight is;
  `A(x)` passes Megatron's `copy_to_tensor_model_parallel_region` before `B` (its backward all-reduces, so `A` and
  the input get the whole gradient on every rank);
- row-parallel (`linear_proj`, `linear_fc2`): `A` split along its input features as the weight is, `A(x)` summed
  over the ranks by `reduce_from_tensor_model_parallel_region`, `B` replicated.

The split halves carry Megatron's `tensor_model_parallel` / `partition_dim` attributes, so its gradient norm counts
the replicated halves once. Merged weights (:meth:`LoraLinear.delta_weight`, the weight sync) are `W + scaling * B A`
per slot in the same layout, so the bridge exports them under HF names; :meth:`LoraLinear.peft_tensors` gathers the
adapters under PEFT's names.

Dropout (`lora_dropout > 0`) draws its masks as Megatron draws its own: on a column-parallel linear's replicated
input from the default generator, the same on every TP rank (so the replicated `A` stays the same on every rank), on
a row-parallel linear's input shard from Megatron's tensor-parallel RNG tracker (another stream per TP rank); both are
restored by Megatron's activation recompute. So a TP run's masks are not one process's (the parity tests use 0). DoRA, LoRA biases, `modules_to_save`, trainable tokens and adapters on the
embedding or the head are refused, naming the fix.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from hf_verl.parallel.megatron.bridge import Column, FusedQKV, GatedFC1, Row, ShardContext, Table

logger = logging.getLogger(__name__)

PEFT_PREFIX = "base_model.model."
_KINDS = {FusedQKV: "qkv", GatedFC1: "gated", Column: "column", Row: "row"}


@dataclass(frozen=True)
class Adapter:
    """One HF module's LoRA as PEFT holds it: `A` `(r, in)`, `B` `(out, r)`, `scaling`, `dropout` (a probability)."""

    A: torch.Tensor
    B: torch.Tensor
    scaling: float
    dropout: float = 0.0


@dataclass
class PeftLora:
    """What :func:`read_peft` found: the base weights (HF names), the adapters by HF module, and PEFT's config."""

    base_state: dict[str, torch.Tensor]
    adapters: dict[str, Adapter]
    config: Any
    adapter_name: str = "default"


def read_peft(model: Any) -> PeftLora | None:
    """The LoRA adapters of a `PeftModel` (None for a model without `peft_config`); refuses what the Megatron
    bridge does not carry (see the module docstring)."""
    configs = getattr(model, "peft_config", None)
    if not configs:
        return None
    from peft.tuners.lora import Linear as LoraLinearLayer
    from peft.tuners.lora import LoraLayer

    name = model.active_adapter if isinstance(model.active_adapter, str) else model.active_adapter[0]
    config = configs[name]
    if len(configs) > 1:
        raise ValueError(f"backend='megatron' trains one LoRA adapter; the model has {sorted(configs)}: delete the "
                         "others (model.delete_adapter) or merge them first.")
    if getattr(config, "peft_type", None) is None or str(config.peft_type.value) != "LORA":
        raise ValueError(f"backend='megatron' carries LoRA adapters only; peft_config is {type(config).__name__}: use "
                         "peft.LoraConfig, or another backend (ddp, fsdp2, zero) for other PEFT methods.")
    refused = [(what, on) for what, on in (
        ("use_dora", getattr(config, "use_dora", False)), ("lora_bias", getattr(config, "lora_bias", False)),
        ("bias", getattr(config, "bias", "none") != "none"), ("modules_to_save", bool(config.modules_to_save)),
        ("trainable_token_indices", bool(getattr(config, "trainable_token_indices", None)))) if on]
    if refused:
        raise ValueError(f"backend='megatron' carries plain LoRA adapters; LoraConfig sets {[w for w, _ in refused]}: "
                         "drop them, or use another backend (ddp, fsdp2, zero) for them.")
    adapters: dict[str, Adapter] = {}
    for module_name, module in model.named_modules():
        adapted = name in getattr(module, "lora_A", {}) or name in getattr(module, "lora_embedding_A", {})
        if not isinstance(module, LoraLayer) or not adapted:
            continue
        hf = module_name.removeprefix(PEFT_PREFIX)
        if not isinstance(module, LoraLinearLayer) or name not in module.lora_A:
            raise ValueError(f"backend='megatron' carries LoRA on linear layers; {hf} is a "
                             f"{type(module).__name__}: remove it from target_modules.")
        if module.merged:
            raise ValueError(f"the adapter of {hf} is merged into its weight: unmerge it (model.unmerge_adapter()) "
                             "before training on backend='megatron'.")
        drop = module.lora_dropout[name]
        adapters[hf] = Adapter(module.lora_A[name].weight.detach().to("cpu", torch.float32).clone(),
                               module.lora_B[name].weight.detach().to("cpu", torch.float32).clone(),
                               float(module.scaling[name]), float(getattr(drop, "p", 0.0)))
    if not adapters:
        raise ValueError("the PEFT model has no LoRA layer: check peft_config.target_modules against the model.")
    base = model.get_base_model().state_dict()
    base_state = {k.replace(".base_layer.", "."): v for k, v in base.items() if ".lora_" not in k}
    return PeftLora(base_state, adapters, config, name)


# ---------------------------------------------------------------------- HF modules -> Megatron linears
@dataclass(frozen=True)
class LinearSlots:
    """A Megatron linear of a decoder layer (`linear`, relative to `decoder.layers.{i}.`) and the HF modules it holds,
    in its fused order (`modules`: templates with `{layer}`), and how they are fused (`kind`: qkv, gated, column,
    row)."""

    linear: str
    kind: str
    modules: tuple[str, ...]

    @property
    def column(self) -> bool:
        return self.kind != "row"

    def slot(self, module: str) -> str:
        """The slot's key: the HF module's own name (`q_proj`)."""
        return module.rsplit(".", 1)[-1]


def linear_slots(table: Table) -> list[LinearSlots]:
    """Every adaptable linear of a family's decoder layer, from its bridge table (weights only; biases, norms and
    the vocabulary matrices are not LoRA targets)."""
    out = []
    for name, mapping in table.layer.items():
        kind = _KINDS.get(type(mapping))
        if kind is not None and name.endswith(".weight"):
            out.append(LinearSlots(name.removesuffix(".weight"), kind, tuple(h.removesuffix(".weight")
                                                                              for h in mapping.hf)))
    return out


def map_targets(modules: list[str] | set[str], table: Table, num_layers: int) -> dict[str, tuple[int, str, str]]:
    """`{HF module: (global layer, Megatron linear, slot)}` for PEFT's wrapped modules, or a `ValueError` naming the
    modules the Megatron model has no linear for."""
    index = {}
    for slots in linear_slots(table):
        for template in slots.modules:
            for layer in range(num_layers):
                index[template.format(layer=layer)] = (layer, slots.linear, slots.slot(template))
    missing = sorted(m for m in modules if m not in index)
    if missing:
        adaptable = sorted({s.slot(t) for s in linear_slots(table) for t in s.modules})
        raise ValueError(f"backend='megatron' has no LoRA-able linear for {missing[:4]}"
                         f"{' ...' if len(missing) > 4 else ''}: target the decoder's linears ({adaptable}, or "
                         "'all-linear'), or use another backend (ddp, fsdp2, zero) for these modules.")
    return {m: index[m] for m in modules}


# ---------------------------------------------------------------------- the module
class LoraLinear(torch.nn.Module):
    """The LoRA branches of one Megatron linear on this rank, one `(lora_A, lora_B)` pair per targeted HF module
    (see the module docstring).

    Args:
        slots ([`LinearSlots`]): the linear and its HF modules. layer (`int`): its global layer.
        adapters (`dict[str, Adapter]`): PEFT's adapters by HF module name (those of other linears are ignored).
        ctx ([`ShardContext`]): this rank's TP geometry. out_features (`int`): the linear's whole output size
            (row-parallel) or one slot's (column). dtype (`torch.dtype`): the parameters' dtype.
        tp_group: the tensor-parallel process group (None at `tp=1`).
    """

    def __init__(self, slots: LinearSlots, layer: int, adapters: dict[str, Adapter], ctx: ShardContext,
                 dtype: torch.dtype, tp_group: Any = None) -> None:
        super().__init__()
        self.slots, self.ctx, self.tp_group = slots, ctx, tp_group
        self.enabled = True
        self.lora_A = torch.nn.ParameterDict()
        self.lora_B = torch.nn.ParameterDict()
        self.hf_modules: dict[str, str] = {}
        self.scaling: dict[str, float] = {}
        self.dropout: dict[str, float] = {}
        for template in slots.modules:
            module = template.format(layer=layer)
            if module not in adapters:
                continue
            key, adapter = slots.slot(template), adapters[module]
            a, b = self._shard(adapter.A, adapter.B)
            self.lora_A[key] = torch.nn.Parameter(a.to(dtype))
            self.lora_B[key] = torch.nn.Parameter(b.to(dtype))
            split = self.lora_B[key] if slots.column else self.lora_A[key]
            split.tensor_model_parallel, split.partition_dim, split.partition_stride = True, 0 if slots.column else 1, 1
            self.hf_modules[key], self.scaling[key], self.dropout[key] = module, adapter.scaling, adapter.dropout
        self._widths = {slots.slot(t): self._width(slots.slot(t)) for t in slots.modules} if self.hf_modules else {}

    # -------------------------------------------------------------- shards
    def _shard(self, A: torch.Tensor, B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tp, rank = self.ctx.tp_size, self.ctx.tp_rank
        if self.slots.column:
            return A.clone(), torch.chunk(B, tp, 0)[rank].contiguous()
        return torch.chunk(A, tp, 1)[rank].contiguous(), B.clone()

    def _width(self, key: str) -> int:
        """A slot's output width on this rank (for an untargeted slot's zeros), from the geometry."""
        ctx = self.ctx
        if key in self.lora_B:
            return self.lora_B[key].shape[0]
        groups = ctx.num_query_groups // ctx.tp_size
        if self.slots.kind == "qkv":
            per_group = ctx.num_heads // ctx.num_query_groups
            return groups * ctx.head_dim * (per_group if key == self.slots.slot(self.slots.modules[0]) else 1)
        other = next(iter(self.lora_B.values()))
        return other.shape[0]  # gate and up have the same width

    # -------------------------------------------------------------- forward
    def _layout(self, parts: dict[str, torch.Tensor | None], like: torch.Tensor) -> torch.Tensor:
        """Slot outputs (last dim) laid out as the fused linear's output on this rank."""
        keys = [self.slots.slot(t) for t in self.slots.modules]
        filled = [parts[k] if parts.get(k) is not None else like.new_zeros(*like.shape[:-1], self._widths[k])
                  for k in keys]
        if self.slots.kind != "qkv":
            return torch.cat(filled, -1)
        groups = self.ctx.num_query_groups // self.ctx.tp_size
        lead = filled[0].shape[:-1]
        grouped = [f.reshape(*lead, groups, f.shape[-1] // groups) for f in filled]
        return torch.cat(grouped, -1).reshape(*lead, -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`sum over slots of scaling * B(A(dropout(x)))`, laid out as the linear's output on this rank."""
        from megatron.core.tensor_parallel import (copy_to_tensor_model_parallel_region,
                                                   reduce_from_tensor_model_parallel_region)

        parts, like = {}, None
        for key in self.lora_A:
            h = self._dropout(x, self.dropout[key])
            z = F.linear(h.to(self.lora_A[key].dtype), self.lora_A[key])
            if self.ctx.tp_size > 1:
                z = (copy_to_tensor_model_parallel_region(z, group=self.tp_group) if self.slots.column
                     else reduce_from_tensor_model_parallel_region(z, group=self.tp_group))
            parts[key] = like = F.linear(z, self.lora_B[key]) * self.scaling[key]
        return self._layout(parts, like)

    def _dropout(self, x: torch.Tensor, p: float) -> torch.Tensor:
        if not p or not self.training:
            return x
        if self.slots.column or self.ctx.tp_size == 1:
            return F.dropout(x, p, True)
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        with get_cuda_rng_tracker().fork():
            return F.dropout(x, p, True)

    def hook(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        """The forward hook on the Megatron linear: its `(output, bias)` with the adapters' output added."""
        if not self.enabled or not len(self.lora_A):
            return output
        x = args[0] if args else kwargs["input_"]
        out, bias = output
        return out + self(x).to(out.dtype), bias

    # -------------------------------------------------------------- weights out
    @torch.no_grad()
    def delta_weight(self) -> torch.Tensor:
        """`scaling * B A` per slot, laid out as this rank's shard of the linear's weight `(out, in)`."""
        parts = {k: (self.lora_B[k].float() @ self.lora_A[k].float() * self.scaling[k]).T for k in self.lora_A}
        return self._layout(parts, next(iter(parts.values()))).T

    @torch.no_grad()
    def peft_tensors(self, gather: Callable[[torch.Tensor, int], torch.Tensor],
                     adapter_name: str | None = None) -> list[tuple[str, torch.Tensor]]:
        """This linear's adapters under PEFT's names (`base_model.model.<module>.lora_A[.<adapter>].weight`), whole:
        `gather(tensor, dim)` concatenates every TP rank's shard along `dim` (a collective)."""
        tag = f".{adapter_name}" if adapter_name else ""
        out = []
        for key in self.lora_A:
            a, b = self.lora_A[key].detach(), self.lora_B[key].detach()
            if self.ctx.tp_size > 1:
                a, b = (a, gather(b, 0)) if self.slots.column else (gather(a, 1), b)
            name = PEFT_PREFIX + self.hf_modules[key]
            out += [(f"{name}.lora_A{tag}.weight", a), (f"{name}.lora_B{tag}.weight", b)]
        return out


def attach(stage: torch.nn.Module, peft: PeftLora, table: Table, *, ctx: ShardContext, layer_offset: int,
           num_layers: int, total_layers: int, dtype: torch.dtype, tp_group: Any = None) -> dict[str, LoraLinear]:
    """Freeze `stage` and give every targeted linear of its layers a :class:`LoraLinear` (its `lora` child, hooked
    on its forward); returns them by Megatron linear name. Call before Megatron's DDP wraps the stage."""
    targets = map_targets(set(peft.adapters), table, total_layers)
    if getattr(getattr(stage, "config", None), "sequence_parallel", False):
        raise ValueError("LoRA on backend='megatron' runs without Megatron's sequence parallelism.")
    stage.requires_grad_(False)
    attached: dict[str, LoraLinear] = {}
    modules = dict(stage.named_modules())
    for local in range(num_layers):
        layer = layer_offset + local
        for slots in linear_slots(table):
            if not any(targets.get(t.format(layer=layer)) for t in slots.modules):
                continue
            name = f"decoder.layers.{local}.{slots.linear}"
            linear = modules[name]
            lora = LoraLinear(slots, layer, peft.adapters, ctx, dtype, tp_group).to(linear.weight.device)
            linear.lora = lora  # a child: the stage's parameters, state dict and checkpoints carry it
            linear.register_forward_hook(lora.hook, with_kwargs=True)
            attached[name] = lora
    if not attached:
        logger.warning("no LoRA target on this pipeline stage (layers %d-%d): it trains nothing",
                       layer_offset, layer_offset + num_layers - 1)
    return attached

