"""`estimate_memory(model, args, layout=None)`: the memory model applied to a run as a user describes it: a model,
a trainer config (GRPOConfig / PPOConfig / DPOConfig or the facade's TrainerConfig) and a layout (default: the
current launch's, read from the environment accelerate / torchrun set).

The config gives the workload: rows per micro-batch (`per_device_train_batch_size`; DPO: two rows a pair; the
facade: `rollout_batch_size x num_generations`), tokens per row (prompt + completion lengths; DPO `max_length`),
checkpointing, bf16, the optimizer (`optim`), the log-prob chunk and the roles (a reference when GRPO's `beta` /
the facade's `beta` is above 0, always for PPO and DPO unless reference-free / precomputed; PPO's critic; a
colocated rollout engine with its own weights under `use_vllm` colocate, or a replica when the actor's
parameters are partitioned).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from hf_verl.planner.architectures import resolve_architecture, whole_numel
from hf_verl.planner.memory import Layout, MemoryEstimate, Workload, memory_breakdown

__all__ = ["estimate_memory", "layout_from_launch", "workload_from_args"]

logger = logging.getLogger(__name__)

_OPTIM = {"sgd": "sgd", "adafactor": "adafactor"}


def _optimizer(args: Any) -> str:
    name = str(getattr(getattr(args, "optim", "adamw_torch"), "value", getattr(args, "optim", "adamw_torch")))
    if "8bit" in name:
        return "adamw_8bit"
    return _OPTIM.get(name, "adamw")


def workload_from_args(args: Any) -> dict[str, Any]:
    """The workload a config asks for: `{"rows", "seq_len", "scored_len", "checkpointing", "bf16", "optimizer",
    "chunk", "reference", "critic", "vllm_colocate", "grad_accumulation"}`.

    Raises:
        `TypeError`: not a trainer config or the facade's config.
    """
    name = type(args).__name__
    chunk = getattr(args, "logprob_chunk_size", 1024)
    out = {"checkpointing": bool(getattr(args, "gradient_checkpointing", False)), "bf16": bool(getattr(args, "bf16", False)),
           "optimizer": _optimizer(args), "chunk": chunk, "critic": False, "vllm_colocate": False,
           "grad_accumulation": int(getattr(args, "gradient_accumulation_steps", 1) or 1)}
    if name == "TrainerConfig":  # the facade: one micro-batch of a whole rollout per rank
        prompt = args.max_prompt_length or 512
        out.update(rows=args.rollout_batch_size * args.num_generations, seq_len=prompt + args.max_completion_length,
                   scored_len=args.max_completion_length, reference=args.beta > 0, grad_accumulation=1)
    elif name == "DPOConfig":
        length = args.max_length or 1024
        out.update(rows=2 * _mbs(args), seq_len=length, scored_len=length,
                   reference=not (getattr(args, "reference_free", False) or args.precompute_ref_log_probs))
    elif name in ("GRPOConfig", "PPOConfig"):
        completion = getattr(args, "max_completion_length", None) or getattr(args, "response_length", 256)
        prompt = getattr(args, "max_prompt_length", None) or 512
        out.update(rows=_mbs(args), seq_len=prompt + completion, scored_len=completion,
                   reference=name == "PPOConfig" or getattr(args, "beta", 0.0) > 0, critic=name == "PPOConfig",
                   vllm_colocate=bool(getattr(args, "use_vllm", False)) and getattr(args, "vllm_mode", "") == "colocate")
    else:
        raise TypeError(f"estimate_memory takes a GRPOConfig, PPOConfig, DPOConfig or the facade's TrainerConfig as "
                        f"args, got {name}.")
    return out


def _mbs(args: Any) -> int:
    mbs = getattr(args, "per_device_train_batch_size", 1)
    return mbs if isinstance(mbs, int) else 1  # "auto": sized by the planner; estimate one row


def layout_from_launch(args: Any = None, micro_batch_size: int = 1) -> Layout:
    """The planner's [`Layout`] of the current launch: its process count (`WORLD_SIZE`), the backend its accelerate
    config asks for (:func:`~hf_verl.parallel.backend.requested_backend`) and the config's sp / tp / pp / ep."""
    from hf_verl.parallel.backend import requested_backend

    world = int(os.environ.get("WORLD_SIZE", "1"))
    tp = getattr(args, "tensor_model_parallel_size", 1) or 1
    pp = getattr(args, "pipeline_model_parallel_size", 1) or 1
    sp = getattr(args, "sequence_parallel_size", 1) or 1
    ep = getattr(args, "expert_model_parallel_size", 1) or 1
    megatron = getattr(args, "backend", None) == "megatron" or tp * pp * ep > 1
    spec = requested_backend(world)
    return _from_spec(spec, world, tp, pp, sp, megatron, micro_batch_size,
                      bool(getattr(args, "gradient_checkpointing", False)), ep)


def _from_spec(spec, world: int, tp: int, pp: int, sp: int, megatron: bool, mbs: int, ckpt: bool,
               ep: int = 1) -> Layout:
    if world % (tp * pp * sp):
        raise ValueError(f"tp={tp} x pp={pp} x sp={sp} does not divide the {world} launched processes.")
    dp = world // (tp * pp * sp)
    if megatron:
        return Layout(dp=dp, sharding="zero1" if dp > 1 else "none", tp=tp, pp=pp, ep=ep, megatron=True,
                      activation_checkpointing=ckpt, micro_batch_size=mbs)
    sharding = {"fsdp2": "fsdp2", "deepspeed": f"zero{spec.zero_stage}" if spec.zero_stage else "none"}.get(spec.kind,
                                                                                                           "none")
    return Layout(dp=dp, sharding=sharding, sp=sp, offload_optimizer=spec.offload_optimizer,
                  offload_params=spec.offload_params, activation_checkpointing=ckpt, micro_batch_size=mbs)


def _to_layout(layout: Any, args: Any, rows: int, ckpt: bool) -> Layout:
    if layout is None:
        return layout_from_launch(args, rows)
    if isinstance(layout, Layout):
        return layout
    dims = getattr(layout, "dims", layout)  # a RoleLayout, or ParallelDims
    backend = getattr(layout, "backend", None)
    if not hasattr(dims, "dp_size"):
        raise TypeError(f"layout must be a planner Layout, a RoleLayout or ParallelDims, got {type(layout).__name__}.")
    from hf_verl.parallel.backend import BackendSpec

    spec = backend or BackendSpec("fsdp2" if dims.dp_shard > 1 else "ddp" if dims.world_size > 1 else "plain")
    return _from_spec(spec, dims.world_size, dims.tp, dims.pp, dims.sp, spec.kind == "megatron", rows, ckpt,
                      getattr(dims, "ep", 1) or 1)


ROLES = ("actor", "reference", "critic")


def estimate_memory(model: Any, args: Any, layout: Any = None, *, device: str | None = None,
                    role: str | None = None) -> MemoryEstimate:
    """Per-rank bytes of a run, with the breakdown by role and term.

    Args:
        model: an `nn.Module` (a `PeftModel` counts its trainable share, and its reference as the base with the
            adapters off: no copy of the weights), a `PretrainedConfig`, a Hub id / local
            path (config only, offline) or a size string ("7b": :data:`REFERENCE_ARCHITECTURES`).
        args: a `GRPOConfig`, `PPOConfig`, `DPOConfig` or the facade's `TrainerConfig`.
        layout: a planner [`Layout`], a [`RoleLayout`] or [`ParallelDims`]; default: the current launch.
        device (`str`, *optional*): "cpu" (host RSS) or "cuda" (device memory); default: "cuda" where a GPU is
            visible.
        role (`str`, *optional*): one role alone, `model` being that role's model: "actor" (trained, with the
            rollout engine's own weights where the config implies them), "reference" (frozen) or "critic" (trained,
            a value head); what the facade's `placement()` reports per role. Default: every role the config
            implies, colocated on `layout` (the run's per-rank peak).

    Returns:
        [`MemoryEstimate`]: `peak_bytes`, `components` (`"actor weights"`, `"reference weights"`, ...), `table()`.

    Raises:
        `TypeError` / `ValueError`: an unknown args type, a model whose shape cannot be read, a layout that does not
        divide the launch, an unknown role.

    Example:
        ```python
        from hf_verl import GRPOConfig
        from hf_verl.planner import estimate_memory
        est = estimate_memory("7b", GRPOConfig(output_dir="out", bf16=True), layout=Layout(dp=8, sharding="fsdp2"))
        print(est.peak_bytes / 2**30, est.table())
        ```
    """
    if role is not None and role not in ROLES:
        raise ValueError(f"role must be one of {ROLES} or None (every role of the run), got {role!r}.")
    arch = resolve_architecture(model)
    w = workload_from_args(args)
    lay = _to_layout(layout, args, w["rows"], w["checkpointing"])
    if isinstance(layout, Layout) and layout.activation_checkpointing != w["checkpointing"]:
        # a given Layout wins, but a config that checkpoints (DPOConfig's default) against a layout that does not is
        # the easy mistake: the activations differ by the layer count
        logger.warning("estimate_memory: the layout says activation_checkpointing=%s but %s.gradient_checkpointing=%s; "
                       "the layout's is used (set Layout(activation_checkpointing=...) to match the run).",
                       layout.activation_checkpointing, type(args).__name__, w["checkpointing"])
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    fraction = 1.0
    if hasattr(model, "parameters") and hasattr(model, "peft_config"):
        params = list(model.parameters())
        fraction = sum(whole_numel(p) for p in params if p.requires_grad) / max(1, sum(whole_numel(p) for p in params))
    low = w["bf16"] and device != "cpu"
    wb = 2 if (low and (lay.megatron or lay.sharding.startswith("zero"))) else 4
    partitioned = lay.megatron or lay.sharding in ("zero3", "fsdp2")
    rollout_bytes = (2 if low else 4) if (w["vllm_colocate"] or (partitioned and "DPO" not in type(args).__name__)) else 0
    common = dict(seq_len=w["seq_len"], scored_len=w["scored_len"], compute_bytes=2 if low else 4,
                  logprob_chunk=w["chunk"], device=device, grad_accumulation=w["grad_accumulation"])
    frozen = Layout(**{**lay.__dict__, "activation_checkpointing": False})
    parts = {
        "actor": lambda: memory_breakdown(arch, lay, Workload(
            weight_bytes=wb, optimizer=w["optimizer"], trainable_fraction=fraction, rollout_weight_bytes=rollout_bytes,
            **common), role="actor"),
        # a LoRA actor's reference is its base with the adapters off (hf_verl's trainers): no copy of the weights
        "reference": lambda: memory_breakdown(arch, frozen, Workload(trainable=False, weight_bytes=2 if low else 4,
                                                                     shares_weights=fraction < 1, **common),
                                              role="reference"),
        "critic": lambda: memory_breakdown(arch, lay, Workload(weight_bytes=wb, optimizer=w["optimizer"],
                                                               value_head=True, **common), role="critic"),
    }
    if role is not None:
        return parts[role]()
    est = parts["actor"]()
    for name in ("reference", "critic"):
        if w[name]:
            est = est + parts[name]()
    return est
