"""The memory model: per-rank bytes of one role layout, as pure arithmetic over an :class:`Architecture`, a
:class:`Layout` and a :class:`Workload`.

What a rank holds during a training step (each term is one line of :func:`memory_breakdown`):

- **weights**: parameters in their stored dtype, divided by the axes that split them (tp x pp always; the
  data-parallel shards under FSDP2 / ZeRO-3; a Mixture-of-Experts model's routed experts also by the expert-parallel
  degree `ep`), plus one gathered layer (two with prefetch) under FSDP2 / ZeRO-3;
- **gradients**: one per trainable parameter (fp32 under hf_verl's engines; Megatron keeps a contiguous fp32
  buffer), divided by dp under ZeRO-2/3 and FSDP2;
- **optimizer states**: AdamW's two moments (8 bytes a parameter; 2 for 8-bit AdamW, 0 for SGD) plus an fp32
  master copy where the weights are low precision, divided by dp under ZeRO-1/2/3, FSDP2 and Megatron's
  distributed optimizer; offloaded states leave the device with their gradient partition (ZeRO-Offload, FSDP2's
  CPUOffloadPolicy) and are listed in `MemoryEstimate.host` (on a CPU-only run they stay in the same RSS);
- **activations**: bytes saved for backward per token per layer (the tensors a Llama layer saves: the two norms'
  inputs and outputs, q / k / v after RoPE, the attention output and o_proj's input, the gated MLP's four
  intermediates; an MoE layer's MLP terms are those of the experts a token is routed to, plus the token dispatch's
  copies and the router's fp32 scores), divided by sp and, for the sharded linear layers, tp; with activation
  checkpointing only each
  layer's input is kept, plus one layer recomputed; a pipeline stage holds its layers' activations for `pp`
  micro-batches in flight (1F1B);
- **logits**: scored positions x vocabulary in fp32, three copies (logits, exponentials, gradient) of one chunk
  when log-probs are chunked (hf_verl's default), or of every position when not;
- **frozen roles**: a reference / reward model's weights on the same layout (no gradients, no states) and one
  layer's forward temporaries; a colocated rollout engine's own copy of the weights (per tensor-parallel group)
  and its KV cache; a LoRA actor's reference is its base with the adapters off: its forward, no weights of its own;
- **communication buckets**: DDP's gradient buckets (a copy of every gradient, torch's default), DeepSpeed's
  reduce / all-gather buckets, FSDP2's reduce-scatter buffer of one layer;
- **runtime baseline**: the process itself (Python, torch, transformers, the engine's libraries; a CUDA context
  and allocator slack on a GPU): a constant measured once, stated in :data:`RUNTIME_BASELINE_BYTES`.

A step's peak is the resident part (weights, optimizer states, frozen roles, rollout, buckets, baseline) plus the
larger of the forward / backward transient (activations + logits, as gradients replace them layer by layer,
whichever is larger) and the model's loading transient (today every rank materialises the whole model before
sharding it). This is a model of hf_verl's engines, not of every framework; docs/planner.md shows it against the
measured peak RSS of real runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hf_verl.planner.architectures import Architecture

__all__ = ["Layout", "Workload", "MemoryEstimate", "memory_breakdown", "RUNTIME_BASELINE_BYTES", "GiB", "MiB"]

MiB, GiB = 2**20, 2**30
SHARDINGS = ("none", "zero1", "zero2", "zero3", "fsdp2")
OPTIMIZERS = {"adamw": 8, "adam": 8, "adamw_8bit": 2, "sgd": 0, "adafactor": 0}  # state bytes per parameter

# The process's own resident memory, measured once on the project's CPU machine (python 3.11, torch 2.13,
# transformers 5): the peak RSS of a rank that imports the engine's stack and runs one step of a 0.1M-parameter
# model through it (benchmarks/memory_model.py --baseline: plain 446 MiB, DDP over gloo 449, ZeRO-2 516, Megatron
# TP=2 516). A GPU rank adds its CUDA context and allocator slack
# (about 1 GiB, the usual figure for a CUDA 12 context with cuBLAS / NCCL workspaces: an assumption).
RUNTIME_BASELINE_BYTES: dict[str, int] = {
    "cpu:accelerate": 446 * MiB,
    "cpu:deepspeed": 516 * MiB,
    "cpu:megatron": 516 * MiB,
    "cuda": 1 * GiB,
}


@dataclass(frozen=True)
class Layout:
    """One role's parallel layout, as the planner describes it.

    Args:
        dp (`int`): data-parallel ranks. sharding (`str`): "none" (plain / DDP), "zero1", "zero2", "zero3" or
            "fsdp2" (what the data-parallel ranks shard). tp / pp / sp (`int`): tensor, pipeline and sequence
            (Ulysses) degrees. megatron (`bool`): run by the Megatron engine (implied by tp, pp or ep above 1).
        ep (`int`): expert-parallel degree of a Mixture-of-Experts model (Megatron's `expert_model_parallel_size`):
            each routed expert lives on one of `ep` ranks carved out of the data-parallel ones (ep divides dp), the
            tokens reach it through the token dispatcher's all-to-all.
        offload_optimizer / offload_params (`bool`): optimizer states (and master weights) / parameters in host
            memory. activation_checkpointing (`bool`): recompute each layer in backward.
        micro_batch_size (`int`): rows per forward on one data-parallel rank.
    """

    dp: int = 1
    sharding: str = "none"
    tp: int = 1
    pp: int = 1
    sp: int = 1
    megatron: bool = False
    ep: int = 1
    offload_optimizer: bool = False
    offload_params: bool = False
    activation_checkpointing: bool = False
    micro_batch_size: int = 1

    def __post_init__(self) -> None:
        if self.sharding not in SHARDINGS:
            raise ValueError(f"Layout.sharding must be one of {SHARDINGS}, got {self.sharding!r}.")
        for name in ("dp", "tp", "pp", "sp", "ep", "micro_batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Layout.{name} must be an int >= 1, got {value!r}.")
        if (self.tp > 1 or self.pp > 1 or self.ep > 1) and not self.megatron:
            object.__setattr__(self, "megatron", True)
        if self.dp % self.ep:
            raise ValueError(f"Layout.ep={self.ep} must divide dp={self.dp}: expert-parallel ranks are carved out of the "
                             "data-parallel ones (Megatron's expert_model_parallel_size).")
        if self.megatron and self.sharding in ("zero2", "zero3", "fsdp2"):
            raise ValueError("a Megatron layout shards optimizer states only (sharding 'zero1', its distributed "
                             f"optimizer) or nothing; got sharding={self.sharding!r}.")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.sp

    @property
    def engine(self) -> str:
        return "megatron" if self.megatron else "deepspeed" if self.sharding.startswith("zero") else "accelerate"

    @property
    def label(self) -> str:
        parts = [f"dp={self.dp}"]
        if self.megatron:
            parts.insert(0, "megatron")
            if self.sharding == "zero1":
                parts.append("distributed optimizer")
        elif self.sharding != "none":
            parts.append({"fsdp2": "FSDP2", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "ZeRO-3"}[self.sharding])
        elif self.dp > 1:
            parts.append("DDP")
        parts += [f"{a}={getattr(self, a)}" for a in ("tp", "pp", "ep", "sp") if getattr(self, a) > 1]
        if self.offload_optimizer or self.offload_params:
            parts.append("offload " + "+".join(n for n, on in (("params", self.offload_params),
                                                                ("optimizer", self.offload_optimizer)) if on))
        if self.activation_checkpointing:
            parts.append("activation checkpointing")
        parts.append(f"micro-batch {self.micro_batch_size}")
        return ", ".join(parts)


@dataclass(frozen=True)
class Workload:
    """What one step of a role asks of memory.

    Args:
        seq_len (`int`): tokens per row (prompt + completion; a DPO pair counts its two rows).
        scored_len (`int`, *optional*): positions scored by the LM head per row (GRPO: the completion); default
            `seq_len`.
        trainable (`bool`): gradients and optimizer states (False: a frozen role, forward only).
        weight_bytes (`int`): bytes per stored parameter (4 fp32, 2 bf16). compute_bytes (`int`): bytes per
            activation element (2 under bf16 autocast / param_dtype, else 4).
        optimizer (`str`): a key of OPTIMIZERS. trainable_fraction (`float`): LoRA's share of trained parameters.
        shares_weights (`bool`): a frozen role that runs on another role's weights (a LoRA actor's reference: the
            base with the adapters off): its forward is counted, no weights of its own.
        logprob_chunk (`int`, *optional*): positions per log-prob chunk; `None` scores all positions at once.
        value_head (`bool`): a critic / reward model (a 1-wide head, no vocabulary logits).
        rollout_weight_bytes (`int`): bytes per parameter of a colocated rollout engine's own weights (0: it
            generates on the actor's tensors). kv_cache_bytes (`int`): its KV cache on this rank.
        device (`str`): "cpu" (host RSS: offloading moves nothing out) or "cuda" (device memory).
        loading (`str`): "full" (every rank materialises the whole model first, today's loading) or "sharded".
        attention (`str`, *optional*): "math" (a layer's B x H x S x S scores materialised in its backward: CPU
            SDPA) or "flash" (no scores kept); default by `device`.
        grad_accumulation (`int`): micro-batches per optimizer step (FSDP2 defers its reduce-scatter to the last
            one, holding unsharded gradients until then).
    """

    seq_len: int
    scored_len: int | None = None
    trainable: bool = True
    weight_bytes: int = 4
    compute_bytes: int = 4
    optimizer: str = "adamw"
    trainable_fraction: float = 1.0
    shares_weights: bool = False
    logprob_chunk: int | None = 1024
    value_head: bool = False
    rollout_weight_bytes: int = 0
    kv_cache_bytes: int = 0
    device: str = "cpu"
    loading: str = "full"
    grad_accumulation: int = 1
    attention: str | None = None

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"Workload.optimizer must be one of {sorted(OPTIMIZERS)}, got {self.optimizer!r}.")
        if self.seq_len < 1:
            raise ValueError(f"Workload.seq_len must be >= 1, got {self.seq_len}.")
        if self.attention is None:  # CPU SDPA materialises a layer's scores in backward; flash kernels do not
            object.__setattr__(self, "attention", "math" if self.device == "cpu" else "flash")
        if self.attention not in ("math", "flash"):
            raise ValueError(f"Workload.attention must be 'math' or 'flash', got {self.attention!r}.")


@dataclass
class MemoryEstimate:
    """Per-rank bytes of one role (or a sum of colocated roles), with the breakdown.

    Attributes:
        components (`dict[str, int]`): bytes per term (see the module docstring).
        resident (`list[str]`): the terms held through the step; the others are transients, of which the peak
            holds the largest group (`transient_groups`).
        host (`dict[str, int]`): bytes moved to host memory by offloading (device runs).
        notes (`list[str]`): how each term was counted.
    """

    components: dict[str, int] = field(default_factory=dict)
    resident: list[str] = field(default_factory=list)
    transient_groups: dict[str, list[str]] = field(default_factory=dict)
    host: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def peak_bytes(self) -> int:
        """Resident terms plus the largest transient group: the per-rank peak."""
        return sum(self.components[k] for k in self.resident) + self.transient_bytes

    @property
    def transient_bytes(self) -> int:
        groups = [sum(self.components.get(k, 0) for k in names) for names in self.transient_groups.values()]
        return max(groups, default=0)

    @property
    def binding_phase(self) -> str:
        """Which transient group sets the peak ("step" or "loading")."""
        sums = {g: sum(self.components.get(k, 0) for k in names) for g, names in self.transient_groups.items()}
        return max(sums, key=sums.get) if sums else "step"

    @property
    def total_gib(self) -> float:
        return self.peak_bytes / GiB

    def __add__(self, other: MemoryEstimate) -> MemoryEstimate:
        """Two colocated roles: resident terms add; the step transients add (a frozen role's forward runs between
        the trained roles' steps, so this over-counts a little); the baseline is counted once."""
        out = MemoryEstimate(dict(self.components), list(self.resident), {}, dict(self.host), self.notes + other.notes)
        for k, v in other.components.items():
            if k == "runtime baseline":
                continue
            out.components[k] = out.components.get(k, 0) + v
            if k in other.resident and k not in out.resident:
                out.resident.append(k)
        for g in set(self.transient_groups) | set(other.transient_groups):
            out.transient_groups[g] = sorted(set(self.transient_groups.get(g, [])) | set(other.transient_groups.get(g, [])))
        for k, v in other.host.items():
            out.host[k] = out.host.get(k, 0) + v
        return out

    def table(self) -> str:
        """The breakdown, one term a line, in MiB / GiB."""
        rows = []
        for k, v in self.components.items():
            if v:
                kind = "resident" if k in self.resident else "transient"
                rows.append(f"  {k:<34} {_fmt(v):>10}  ({kind})")
        rows.append(f"  {'peak per rank':<34} {_fmt(self.peak_bytes):>10}  ({self.binding_phase} transient binds)")
        for k, v in self.host.items():
            rows.append(f"  host: {k:<28} {_fmt(v):>10}")
        return "\n".join(rows)

    def __str__(self) -> str:
        return self.table()


def _fmt(b: float) -> str:
    return f"{b / GiB:.2f} GiB" if b >= GiB else f"{b / MiB:.1f} MiB"


def activation_elements_per_token_layer(arch: Architecture, tp: int = 1) -> float:
    """Elements a Llama-style decoder layer saves for backward per token (no checkpointing): the two RMSNorms'
    input and normalised output (4h), q and k after RoPE and v (q_dim + 2 kv_dim), the attention output and
    o_proj's contiguous input (2 q_dim), and the gated MLP's gate, silu(gate), up and product (4 i). Under tensor
    parallelism the attention and MLP terms are split over tp; the norms' are not (no sequence parallelism in the
    Megatron engine here).

    An MoE layer (the average over layers where some are dense): its MLP terms are those of the routed experts a
    token goes to and the shared experts (`4 x mlp_width_per_token`), plus the dispatch's copies of the token per
    routed expert (its gathered input and weighted output, `2 x k x h`) and the router's logits and fp32
    probabilities (`2 x experts`)."""
    if arch.is_moe:
        moe = 4 * arch.mlp_width_per_token + 2 * arch.experts_per_token * arch.hidden + 2 * arch.experts
        mlp = (arch.moe_layers * moe + (arch.layers - arch.moe_layers) * 4 * arch.intermediate) / arch.layers
    else:
        mlp = 4 * arch.intermediate
    split = (3 * arch.q_dim + 2 * arch.kv_dim + mlp) / tp
    return 4 * arch.hidden + split


def memory_breakdown(arch: Architecture, layout: Layout, work: Workload, *, baseline_bytes: int | None = None,
                     role: str = "actor") -> MemoryEstimate:
    """Per-rank bytes of `role` on `layout` for `work`: the pure arithmetic of the memory model.

    Args:
        arch ([`Architecture`]): the model's shape. layout ([`Layout`]): how it is laid out.
        work ([`Workload`]): precision, optimizer, sequence, what the step scores.
        baseline_bytes (`int`, *optional*): the runtime's own bytes; default from :data:`RUNTIME_BASELINE_BYTES`.
        role (`str`): names the terms ("actor weights", "reference weights", ...).

    Returns:
        [`MemoryEstimate`].
    """
    est = MemoryEstimate(transient_groups={"step": [], "optimizer": [], "loading": []})
    c = est.components
    P = arch.params
    mp = layout.tp * layout.pp  # model-parallel split of every parameter (stage imbalance: embeddings below)
    # the routed experts' share, split further over ep (scaled to an exact count when a module was given)
    experts = arch.expert_params * P / (arch.body_params + arch.embedding_params + arch.hidden) if arch.is_moe else 0
    ep_saved = experts * (1 - 1 / layout.ep)

    def on_rank(saved: float) -> float:
        # a pipeline's first / last stage also holds the embedding / LM head: the busiest stage
        if layout.pp > 1:
            stage_params = (arch.layers // layout.pp) * (arch.body_params - saved) / arch.layers + (
                arch.embedding_params if arch.tied else arch.embedding_params // 2)
            return stage_params / layout.tp
        return (P - saved) / mp

    local = on_rank(ep_saved)
    # Megatron's distributed optimizer shards an expert's states over the expert-data-parallel ranks (dp / ep):
    # the states per rank are those of the rank's parameters without EP, divided by dp
    state_local = on_rank(0) if layout.ep > 1 and layout.sharding != "none" else local
    shard_params = layout.sharding in ("zero3", "fsdp2")
    # FSDP2 shards over the data-parallel ranks and, with Ulysses SP, the sequence-parallel ranks too (hf_verl's
    # fsdp_mesh flattens dp_shard x sp); DeepSpeed shards over the data-parallel ranks
    shard_n = layout.dp * layout.sp if layout.sharding == "fsdp2" else layout.dp
    dp_shard = shard_n if shard_params else 1
    wb, cb = work.weight_bytes, work.compute_bytes
    on_device = work.device != "cpu"

    def put(name: str, value: float, resident: bool = True, group: str = "step", offloaded: bool = False) -> None:
        key = f"{role} {name}"
        if offloaded and on_device:
            est.host[key] = int(value)
            return
        c[key] = int(value)
        (est.resident.append(key) if resident else est.transient_groups[group].append(key))

    # ---- weights (+ one gathered layer, two with prefetch, under FSDP2 / ZeRO-3)
    if work.shares_weights:
        est.notes.append(f"{role}: runs on the actor's base weights with the adapters off (no copy)")
    else:
        put("weights", local * wb / dp_shard, offloaded=layout.offload_params)
    if shard_params and shard_n > 1:
        put("gathered layers", 2 * arch.layer_params * cb * (shard_n - 1) / shard_n, resident=False)
    if work.rollout_weight_bytes:
        put("rollout engine weights", local * work.rollout_weight_bytes)
    if work.kv_cache_bytes:
        put("rollout KV cache", work.kv_cache_bytes)

    # ---- gradients, optimizer states
    trained = local * work.trainable_fraction if work.trainable else 0
    if trained:
        grad_shard = shard_n if layout.sharding in ("zero2", "zero3", "fsdp2") else 1
        state_shard = shard_n if layout.sharding != "none" else 1
        master = 4 if wb < 4 else 0  # fp32 master weights beside low-precision parameters
        states = state_local * work.trainable_fraction * (OPTIMIZERS[work.optimizer] + master) / state_shard
        put("optimizer states", states, offloaded=layout.offload_optimizer)
        if layout.sharding == "fsdp2" and work.grad_accumulation > 1:
            grad_shard = 1  # hf_verl defers FSDP2's reduce-scatter: unsharded gradients accumulate
            est.notes.append(f"{role}: FSDP2 with gradient accumulation holds unsharded gradients until the last "
                             "micro-batch")
        grads = trained * 4 / grad_shard
        # Megatron keeps a contiguous gradient buffer; DDP's buckets hold a copy of every gradient (below), but the
        # gradients themselves are freed at zero_grad and rebuilt in backward as the activations are freed
        # offloaded optimizer states take their gradient partition along (ZeRO-Offload's fp32 gradient partition,
        # FSDP2's CPUOffloadPolicy); FSDP2's unsharded gradients under accumulation stay on the device
        grads_out = layout.offload_optimizer and layout.sharding != "none" and grad_shard == shard_n
        put("gradients", grads, resident=layout.megatron or layout.sharding in ("zero1", "zero2", "zero3"),
            offloaded=grads_out)
        if layout.dp * layout.sp > 1 and layout.sharding == "none" and not layout.megatron:
            put("DDP gradient buckets", trained * 4)  # DDP spans the sequence-parallel ranks too
        elif layout.sharding in ("zero1", "zero2", "zero3") and not layout.megatron:  # DeepSpeed's, not Megatron's
            put("ZeRO buckets", min(trained, 5e8 / max(1, layout.dp)) * 4 * 2 / max(1, layout.dp))
        elif layout.sharding == "fsdp2" and shard_n > 1:
            put("reduce-scatter buffer", arch.layer_params * 4, resident=False)
        if layout.sharding.startswith("zero") and wb == 4 and not layout.megatron:
            put("ZeRO fp32 partition", trained * 4 / state_shard)  # DeepSpeed clones its partition in fp32
        # the optimizer step's own transient: the largest parameter's update temporaries (per-tensor AdamW)
        largest = max(arch.vocab * arch.hidden, arch.hidden * arch.intermediate,
                      2 * arch.experts / layout.ep * arch.expert_intermediate * arch.hidden) / layout.tp
        put("optimizer step temporaries", 2 * largest * 4 / state_shard if OPTIMIZERS[work.optimizer] else 0,
            resident=False, group="optimizer")

    # ---- activations: rows of one micro-batch, their tokens split by sp
    tokens = layout.micro_batch_size * work.seq_len / layout.sp
    layers_here = arch.layers / layout.pp
    in_flight = layout.pp if layout.pp > 1 else 1  # 1F1B: a stage holds up to pp micro-batches
    per_layer = activation_elements_per_token_layer(arch, layout.tp) * cb
    if not work.trainable:
        acts = tokens * per_layer  # one layer's temporaries of a no-grad forward
        est.notes.append(f"{role}: forward only, one layer's temporaries")
    elif layout.activation_checkpointing:
        acts = tokens * (layers_here * in_flight * arch.hidden * cb + per_layer)
    else:
        acts = tokens * layers_here * in_flight * per_layer
    acts += tokens * arch.hidden * cb * 2  # embedding output, final norm
    put("activations", acts, resident=False)
    if arch.is_moe and trained and not layout.megatron:
        # transformers' experts loop indexes the 3-D expert tensors once per expert: autograd builds a gradient of
        # the whole tensor for each and sums it into .grad, one more copy of the experts' fp32 gradients in backward
        # (added on benchmarks/memory_heldout.py's fit set, moe-plain-256 and moe-fsdp2-256, against predictions
        # then made without the runs' checkpointing: docs/planner.md tells the order)
        put("expert gradient copies", experts * work.trainable_fraction * 4, resident=False)

    # ---- logits: scored positions x vocabulary, fp32
    if work.value_head:
        logits = 0
    else:
        scored = layout.micro_batch_size * (work.scored_len or work.seq_len) / layout.sp
        vocab = arch.vocab / layout.tp
        chunk = scored if work.logprob_chunk is None else min(scored, work.logprob_chunk,
                                                               max(1, (256 * MiB) // (4 * arch.vocab)))
        copies = 3 if work.trainable else 2
        logits = chunk * vocab * 4 * copies + scored * arch.hidden * cb
    put("logits", logits, resident=False)
    if work.attention == "math":
        # one layer's B x H x S x S attention scores, probabilities and their gradient (fp32) in its backward
        heads = arch.heads / (layout.tp * layout.sp)
        put("attention scores (one layer)", 3 * 4 * layout.micro_batch_size * heads * work.seq_len ** 2,
            resident=False)
    if trained and f"{role} gradients" in est.transient_groups["step"]:
        # gradients are freed at zero_grad and grow as the activations are freed: the backward's end and the
        # optimizer step hold them with the step's temporaries, instead of the activations
        est.transient_groups["step"].remove(f"{role} gradients")
        est.transient_groups["optimizer"].insert(0, f"{role} gradients")

    if work.device == "cpu" and shard_params and shard_n > 1:
        # the all-gathered parameters of the forward and of the backward and the unsharded gradients before the
        # reduce-scatter pass through the host heap layer by layer, and its allocator keeps them
        put("gathered parameters and gradients (host heap)", 3 * local * wb, resident=False)
    if work.device == "cpu" and layout.sharding in ("zero1", "zero2") and not layout.megatron:
        put("ZeRO flattened parameters (host heap)", local * wb)  # the copy made while flattening, kept by the heap
    if not work.trainable:
        # a frozen role's forward runs before the trained roles' step (reference / old log-probs), not during it:
        # its transients are a group of their own, which the step reuses
        est.transient_groups[f"{role} forward"] = est.transient_groups.pop("step")
        est.transient_groups["step"] = []
    if work.device == "cpu":
        # the host allocator keeps what a step frees for later reuse, so the step's transients (activations, logits,
        # gradients, the optimizer's temporaries) add up in RSS instead of replacing each other (measured:
        # docs/planner.md)
        est.transient_groups["step"] += est.transient_groups.pop("optimizer")

    # ---- loading: today every rank builds / reads the whole model before sharding it
    if work.loading == "full" and layout.megatron and work.device == "cpu":
        # the bridge reads the whole HF model on every rank to build its shards; the host heap keeps it
        put("loading (whole HF model)", P * wb)
        # Megatron's distributed optimizer moves the parameters into one contiguous buffer: the copy's old storage
        # stays in the host heap
        put("contiguous parameter buffer (host heap)", local * wb)
    elif work.loading == "full" and (shard_params or mp > 1):
        full = P * wb
        put("loading (whole model)", max(0.0, full - local * wb / dp_shard), resident=False, group="loading")

    if baseline_bytes is None:
        key = "cuda" if on_device else f"cpu:{layout.engine}"
        baseline_bytes = RUNTIME_BASELINE_BYTES[key]
    c["runtime baseline"] = int(baseline_bytes)
    est.resident.append("runtime baseline")
    return est
