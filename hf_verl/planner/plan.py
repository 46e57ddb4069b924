"""The search over layouts: every (tp, pp, sp, dp, sharding, offload, checkpointing, micro-batch) that the model's
shape allows on `num_devices`, each rated by the memory model (must fit the device) and the step-time model
(fastest wins), returned as a :class:`Plan` that explains its choice and the alternatives it rejected.

Limits applied before any arithmetic: tensor parallelism divides the query and the key-value heads (Megatron
splits query groups) and stays within a node; the vocabulary is padded to a multiple of 128 x tp (Megatron's
padding); pipeline stages divide the layers; Ulysses SP divides the query heads (so SP <= heads) and is not
combined with the Megatron engine; expert parallelism (a Mixture-of-Experts model on the Megatron engine) divides
the data-parallel ranks and the routed experts. All roles are colocated on the same processes (hf_verl's model: the
launch's processes hold every role), so their per-rank memory adds up.

Only layouts an engine runs are offered: :data:`~hf_verl.planner.capabilities.ENGINE_FEATURES` says which engine
trains LoRA adapters, offloads to the host and runs expert parallelism (:func:`_offered`, the one rule). A LoRA
actor's reference is its base with the adapters off: its forward is counted, never a copy of its weights. Host
memory (`host_memory_gib`, per node) bounds what offloading may move there.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any

from hf_verl.planner.architectures import Architecture, resolve_architecture
from hf_verl.planner.capabilities import engine_runs
from hf_verl.planner.memory import (
    OPTIMIZERS,
    GiB,
    Layout,
    MemoryEstimate,
    Workload,
    memory_breakdown,
)
from hf_verl.planner.steptime import H100, Hardware, StepTime, step_time

logger = logging.getLogger(__name__)

__all__ = ["Plan", "RolePlan", "PlanError", "plan", "DEFAULT_ROLES"]

DEFAULT_ROLES = {"grpo": ("actor", "reference"), "ppo": ("actor", "critic", "reference"), "dpo": ("actor", "reference")}
TRAINED = ("actor", "critic")
MAX_MICRO_BATCH = 64
# a GPU rank's own host memory besides what it offloads: Python, torch, the CUDA / NCCL host libraries and pinned
# staging buffers (an assumption, not measured here: no GPU machine was measured for it)
HOST_PROCESS_BYTES = 4 * GiB


class PlanError(ValueError):
    """No layout fits: the message names the need, the devices, and what to add."""


@dataclass
class RolePlan:
    """One role's part of a plan: its layout, its memory per rank and step time."""

    role: str
    arch: Architecture
    layout: Layout
    memory: MemoryEstimate
    step: StepTime | None = None


@dataclass
class Plan:
    """The chosen layout per role, why, and what was rejected.

    Attributes:
        roles (`dict[str, RolePlan]`): per role (all on the same processes).
        memory_per_rank (`int`): bytes per device of all roles together (the peak the fit was judged on).
        step (`StepTime`): the trained roles' optimizer-step estimate.
        binding (`str`): the binding constraint, with the numbers.
        rejected (`list[tuple[str, str]]`): (layout, reason) for the best layout of each other family.
        notes (`list[str]`): departures from the seed article and runnability notes.
        host_per_node (`int`): host bytes per node the layout needs (offloaded terms + each rank's process).
    """

    roles: dict[str, RolePlan]
    num_devices: int
    device_memory_gib: float
    seq_len: int
    algo: str
    memory_per_rank: int
    step: StepTime
    binding: str
    rejected: list[tuple[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    hardware: Hardware = H100
    host_per_node: int = 0

    @property
    def layout(self) -> Layout:
        """The actor's layout (every role runs on it)."""
        return self.roles["actor"].layout

    def explain(self) -> str:
        """A human-readable account: choice, binding constraint, memory per rank, step time, rejections."""
        lay = self.layout
        lines = [f"hf_verl plan: {self.algo.upper()} on {self.num_devices} x {self.device_memory_gib:.3g} GiB, "
                 f"sequence {self.seq_len} tokens",
                 f"  layout (every role): {lay.label}",
                 f"  why: {self.binding}",
                 f"  memory per rank: {self.memory_per_rank / GiB:.1f} GiB of {self.device_memory_gib:.3g} GiB"]
        for name, rp in self.roles.items():
            top = sorted(((v, k) for k, v in rp.memory.components.items() if k != "runtime baseline" and v),
                         reverse=True)[:3]
            lines.append(f"    {name}: " + ", ".join(f"{k.split(' ', 1)[1]} {v / GiB:.1f} GiB" for v, k in top))
        lines.append(f"  step time (estimate, {self.hardware.name}): {self.step}")
        for note in self.notes:
            lines.append(f"  note: {note}")
        if self.rejected:
            lines.append("  rejected:")
            lines += [f"    - {label}: {reason}" for label, reason in self.rejected]
        return "\n".join(lines)

    __str__ = explain

    def config_fields(self) -> dict[str, Any]:
        """The trainer-config fields this plan sets (what `parallel="auto"` applies)."""
        lay = self.layout
        return {"backend": "megatron" if lay.megatron else None, "tensor_model_parallel_size": lay.tp,
                "pipeline_model_parallel_size": lay.pp, "sequence_parallel_size": lay.sp,
                "expert_model_parallel_size": lay.ep,
                "gradient_checkpointing": lay.activation_checkpointing,
                "per_device_train_batch_size": lay.micro_batch_size}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _padded(arch: Architecture, tp: int) -> Architecture:
    mult = 128 * tp
    vocab = -(-arch.vocab // mult) * mult
    if vocab == arch.vocab:
        return arch
    params = None if arch.num_params is None else arch.num_params + (vocab - arch.vocab) * arch.hidden * (
        1 if arch.tied else 2)
    return replace(arch, vocab=vocab, num_params=params)


def _shapes(arch: Architecture, n: int, devices_per_node: int) -> list[tuple[int, int, int, int]]:
    """(tp, pp, sp, dp) the model's shape allows on n devices."""
    out = []
    for tp in _divisors(n):
        if tp > devices_per_node or arch.heads % tp or arch.kv_heads % tp:
            continue
        for pp in _divisors(n // tp):
            if arch.layers % pp:
                continue
            for sp in _divisors(n // (tp * pp)):
                if arch.heads % sp or (sp > 1 and (tp > 1 or pp > 1)):
                    continue
                out.append((tp, pp, sp, n // (tp * pp * sp)))
    return out


def _offered(layout: Layout, arch: Architecture, lora: bool, features: Any = None) -> bool:
    """Whether hf_verl's engine for `layout` runs it (capabilities.ENGINE_FEATURES): LoRA adapters, offload,
    Ulysses SP and expert parallelism each need their engine's feature."""
    engine = layout.engine
    needs = ["lora"] if lora else []
    if layout.offload_params or layout.offload_optimizer:
        if engine == "accelerate":
            needs.append("offload")
        else:
            needs += (["offload_optimizer"] if layout.offload_optimizer else []) + (
                ["offload_params"] if layout.offload_params else [])
    if layout.sp > 1:
        needs.append("sequence")
    if layout.ep > 1:
        needs.append("expert")
    return all(engine_runs(engine, f, features) for f in needs)


def _candidates(arch: Architecture, n: int, devices_per_node: int):
    for tp, pp, sp, dp in _shapes(arch, n, devices_per_node):
        megatron = tp > 1 or pp > 1
        if megatron:
            options = [("zero1" if dp > 1 else "none", False, False)]
        else:
            options = [("none", False, False)]
            if dp > 1:
                options += [("zero2", False, False), ("zero2", True, False)]
            if dp * sp > 1:  # FSDP2 shards over dp x sp; its CPU offload moves parameters and states together
                options += [("fsdp2", False, False), ("fsdp2", True, True)]
            if dp > 1:
                options += [("zero3", False, False), ("zero3", True, False), ("zero3", True, True)]
        # expert parallelism: on the Megatron engine, ep dividing dp and the routed experts
        eps = [1]
        if arch.is_moe and sp == 1 and dp > 1:
            eps += [e for e in _divisors(dp) if e > 1 and arch.experts % e == 0]
        for ep in eps:
            opts = options if ep == 1 else [("zero1", False, False)]
            for sharding, off_opt, off_par in opts:
                for ckpt in (False, True):
                    yield Layout(dp=dp, sharding=sharding, tp=tp, pp=pp, sp=sp, megatron=megatron or ep > 1, ep=ep,
                                 offload_optimizer=off_opt, offload_params=off_par, activation_checkpointing=ckpt)


@dataclass
class _Inputs:
    archs: dict[str, Architecture]
    seq_len: int
    scored_len: int
    precision: str
    optimizer: str
    trainable_fraction: float
    global_rows: int
    rollout: bool
    hw: Hardware
    device_bytes: float
    device: str = "cuda"
    host_bytes: float | None = None
    features: Any = None
    shares_base: tuple[str, ...] = ()  # frozen roles that run on the actor's base weights (LoRA: adapters off)
    actors_model: tuple[str, ...] = ()  # frozen roles given no model of their own (the actor's)


def _role_memory(inp: _Inputs, layout: Layout) -> dict[str, MemoryEstimate]:
    out = {}
    low = inp.precision != "fp32"
    for role, base in inp.archs.items():
        arch = _padded(base, layout.tp) if layout.megatron else base
        trained = role in TRAINED
        # accelerate engines keep fp32 parameters (autocast / FSDP2 param_dtype); DeepSpeed and Megatron keep
        # low-precision parameters beside an fp32 master copy; frozen roles are loaded in the compute dtype
        wb = 4 if not low else (2 if (not trained or layout.megatron or layout.sharding.startswith("zero")) else 4)
        rows = max(1, inp.global_rows // layout.dp)
        work = Workload(seq_len=inp.seq_len, scored_len=inp.scored_len, trainable=trained, weight_bytes=wb,
                        compute_bytes=2 if low else 4, optimizer=inp.optimizer,
                        trainable_fraction=inp.trainable_fraction if role == "actor" else 1.0,
                        value_head=role in ("critic", "reward"), device=inp.device,
                        shares_weights=role in inp.shares_base,
                        rollout_weight_bytes=(2 if low else 4) if (role == "actor" and inp.rollout) else 0,
                        grad_accumulation=max(1, rows // layout.micro_batch_size),
                        loading="sharded" if inp.device != "cpu" else "full")
        frozen = layout if trained else replace(layout, activation_checkpointing=False)
        est = memory_breakdown(arch, frozen, work, role=role, baseline_bytes=0 if out else None)
        out[role] = est
    return out


def _total(mems: dict[str, MemoryEstimate]) -> MemoryEstimate:
    total = None
    for est in mems.values():
        total = est if total is None else total + est
    return total


def _host_per_node(inp: _Inputs, layout: Layout, total: MemoryEstimate) -> float:
    """Host bytes per node: each of the node's ranks holds its offloaded terms and its own process."""
    ranks = min(layout.world_size, inp.hw.devices_per_node)
    return ranks * (sum(total.host.values()) + HOST_PROCESS_BYTES)


def _fit(inp: _Inputs, layout: Layout):
    """The layout with the largest power-of-two micro-batch that fits, its memory and step; None if none fits.
    A layout whose offloaded terms exceed the host memory does not fit (the miss carries the reason)."""
    rows = max(1, inp.global_rows // layout.dp)
    best = None
    mbs = 1
    while mbs <= min(rows, MAX_MICRO_BATCH):
        if layout.pp > 1 and rows // mbs < layout.pp:
            break
        cand = replace(layout, micro_batch_size=mbs)
        mems = _role_memory(inp, cand)
        total = _total(mems)
        if total.peak_bytes > inp.device_bytes:
            return best, ((cand, total) if best is None else None)
        if inp.host_bytes is not None and inp.device != "cpu" and _host_per_node(inp, cand, total) > inp.host_bytes:
            return best, ((cand, total) if best is None else None)
        best = (cand, mems, total)
        mbs *= 2
    return best, None


def _family(layout: Layout) -> str:
    if layout.megatron:
        return "Megatron " + " x ".join(f"{a.upper()}={getattr(layout, a)}" for a in ("ep", "tp", "pp")
                                        if getattr(layout, a) > 1)
    name = {"none": "DDP" if layout.dp > 1 else "one device", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "ZeRO-3",
            "fsdp2": "FSDP2"}[layout.sharding]
    if layout.offload_optimizer:
        name += " + CPU offload"
    if layout.sp > 1:
        name += f" + Ulysses SP={layout.sp}"
    return name


def _step(inp: _Inputs, layout: Layout) -> StepTime:
    arch = inp.archs["actor"]
    st = step_time(arch, layout, seq_len=inp.seq_len, global_rows=inp.global_rows, hw=inp.hw,
                   act_bytes=2 if inp.precision != "fp32" else 4)
    for role, a in inp.archs.items():
        if role == "actor":
            continue
        other = step_time(a, layout, seq_len=inp.seq_len, global_rows=inp.global_rows, hw=inp.hw,
                          trainable=role in TRAINED)
        for k, v in other.parts.items():
            key = f"{k} ({role})"
            st.parts[key] = st.parts.get(key, 0) + v
    return st


def _states_sentence(inp: _Inputs) -> tuple[str, float]:
    """The actor's weights + gradients + optimizer states in the usual mixed-precision count (bf16 weights and
    gradients, fp32 master weights, the optimizer's states: 16 bytes a parameter with AdamW; fp32: 4 + 4 + states)."""
    arch = inp.archs["actor"]
    per = (4 + 4 if inp.precision == "fp32" else 2 + 2 + 4) + OPTIMIZERS[inp.optimizer]
    moe = (f", a Mixture-of-Experts model with {arch.active_params / 1e9:.2f}B parameters active per token "
           f"({arch.experts_per_token} of {arch.experts} routed experts)" if arch.is_moe else "")
    frozen = 4 if inp.precision == "fp32" else 2
    trained = arch.params * inp.trainable_fraction
    total = (arch.params - trained) * frozen + trained * per
    what = "full fine-tuning" if inp.trainable_fraction >= 1 else f"{inp.trainable_fraction:.1%} of it trained"
    return (f"{arch.params / 1e9:.2f}B-parameter actor ({arch.source}{moe}), {what} with {inp.optimizer} in "
            f"{inp.precision}: {_bytes(total)} of weights, gradients and optimizer states "
            f"({per} bytes a trained parameter)"), total


def _bytes(b: float) -> str:
    return f"{b / 1e12:.2f} TB" if b >= 1e12 else f"{b / 1e9:.0f} GB" if b >= 1e9 else f"{b / 2**20:.0f} MiB"


def plan(model: Any, *, num_devices: int, device_memory_gib: float, seq_len: int, algo: str = "grpo",
         roles: Any = None, global_batch: int = 256, completion_len: int | None = None, precision: str = "bf16",
         optimizer: str = "adamw", trainable_fraction: float = 1.0, rollout: bool = True,
         hardware: Hardware = H100, device: str = "cuda", allow: Any = None,
         host_memory_gib: float | None = None, features: Any = None) -> Plan:
    """Choose and explain a layout for `model` on `num_devices` devices of `device_memory_gib` each.

    Args:
        model: an `nn.Module`, a `PretrainedConfig`, a Hub id / path (config only) or a size string ("70b").
        num_devices (`int`): devices of the launch. device_memory_gib (`float`): memory per device.
        seq_len (`int`): tokens per row (prompt + completion). algo (`str`): "grpo", "ppo" or "dpo".
        roles: role names (`("actor", "reference")`) or `{role: model}` (a role's own model; `None`: the actor's);
            default by algo (`DEFAULT_ROLES`).
        global_batch (`int`): rows per optimizer step over the launch. completion_len (`int`, *optional*):
            positions scored per row; default `seq_len`. precision (`str`): "bf16" or "fp32".
        optimizer (`str`): "adamw", "adamw_8bit", "sgd", ... trainable_fraction (`float`): LoRA's share.
        rollout (`bool`): a colocated rollout engine with its own weights (GRPO / PPO).
        hardware ([`Hardware`]): the step-time model's device.
        device (`str`): "cuda" (device memory; offloading frees it) or "cpu" (this machine: host RSS per process).
        allow (`Callable[[Layout], bool]`, *optional*): only layouts it accepts are considered (what a launch can
            run, or an explicit layout whose micro-batch is to be sized).
        host_memory_gib (`float`, *optional*): host RAM per node (shared by the node's ranks): a layout that
            offloads more than it holds, with each rank's own process (`HOST_PROCESS_BYTES`), is rejected. `None`:
            not checked (the plan's note states what offloading needs).
        features (`dict[str, frozenset[str]]`, *optional*): what each engine runs, in place of
            `capabilities.ENGINE_FEATURES` (a plan for engines as they will be, e.g. the Megatron engine with "expert").

    Returns:
        [`Plan`].

    Raises:
        `PlanError`: nothing fits, naming the need and what to add (devices, offload, LoRA, a shorter sequence).
        `ValueError`: bad arguments.
    """
    if algo not in DEFAULT_ROLES:
        raise ValueError(f"algo must be one of {tuple(DEFAULT_ROLES)}, got {algo!r}.")
    for name, value in (("num_devices", num_devices), ("seq_len", seq_len), ("global_batch", global_batch)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}.")
    if not device_memory_gib or device_memory_gib <= 0:
        raise ValueError(f"device_memory_gib must be > 0, got {device_memory_gib!r}.")
    if precision not in ("bf16", "fp32"):
        raise ValueError(f"precision must be 'bf16' or 'fp32', got {precision!r}.")
    actor = resolve_architecture(model)
    roles = DEFAULT_ROLES[algo] if roles is None else roles
    named = dict(roles) if isinstance(roles, dict) else {r: None for r in roles}
    if "actor" not in named:
        named = {"actor": None, **named}
    archs = {r: actor if m is None else resolve_architecture(m) for r, m in named.items()}
    if host_memory_gib is not None and host_memory_gib <= 0:
        raise ValueError(f"host_memory_gib must be > 0 or None, got {host_memory_gib!r}.")
    lora = trainable_fraction < 1
    # a LoRA actor's reference is its own base with the adapters off: no second copy of the weights
    own = tuple(r for r, m in named.items() if r == "reference" and m is None)
    inp = _Inputs(archs, seq_len, completion_len or seq_len, precision, optimizer, trainable_fraction,
                  global_batch, rollout and algo != "dpo", hardware, device_memory_gib * GiB, device,
                  None if host_memory_gib is None else host_memory_gib * GiB, features, own if lora else (), own)
    given = allow

    def allow(lay: Layout) -> bool:  # what the engines run (capabilities), and what the caller allows
        return _offered(lay, actor, lora, features) and (given is None or given(lay))

    fits, misses = _search(inp, actor, num_devices, allow)
    if not fits:
        if not misses:
            raise PlanError(f"no layout of {actor.params / 1e9:.2f}B parameters on {num_devices} devices is allowed "
                            "(heads, layers and the launch's constraints exclude all): change the device count.")
        raise PlanError(_infeasible(inp, num_devices, misses, actor, allow))
    fits.sort(key=lambda f: (f[0].seconds, f[1][0].tp * f[1][0].pp * f[1][0].sp))
    st, (layout, mems, total) = fits[0]
    rejected = _rejections(fits, misses, st, inp)
    sentence, state_bytes = _states_sentence(inp)
    devices = f"{num_devices} x {device_memory_gib:.3g} GiB = {num_devices * device_memory_gib:.6g} GiB"
    if state_bytes > inp.device_bytes:
        need = (f"{sentence} do not fit one {device_memory_gib:.3g} GiB device ({devices}): they must be split "
                f"over the devices ({_family(layout)} chosen)")
    else:
        need = f"{sentence} fit one device ({devices}): the choice is about speed and activations"
    biggest = max((v, k) for k, v in total.components.items() if k != "runtime baseline")
    binding = (f"{need}; the largest term per rank is {biggest[1]} at {biggest[0] / GiB:.1f} GiB; of the layouts "
               f"that fit, this one has the lowest estimated step time ({st.seconds:.2f} s)")
    notes = _notes(inp, layout, mems, st, num_devices)
    roles_out = {r: RolePlan(r, archs[r], layout, mems[r], st if r == "actor" else None) for r in archs}
    result = Plan(roles_out, num_devices, device_memory_gib, seq_len, algo, total.peak_bytes, st, binding, rejected,
                  notes, hardware, int(_host_per_node(inp, layout, total)))
    return result


def _notes(inp: _Inputs, layout: Layout, mems: dict[str, MemoryEstimate], st: StepTime, n: int) -> list[str]:
    """What the chosen layout needs to run and why its MoE / LoRA / offload parts are as they are."""
    arch = inp.archs["actor"]
    notes = []
    if layout.megatron:
        notes.append("tensor / pipeline / expert parallelism runs on hf_verl's Megatron engine (backend='megatron', "
                     "needs megatron-core: pip install 'hf_verl[megatron]'); the vocabulary is padded to a multiple of "
                     f"{128 * layout.tp}")
    if arch.is_moe:
        expert_share = arch.expert_params / arch.params
        moe = (f"Mixture-of-Experts: {arch.params / 1e9:.2f}B parameters in total, {arch.active_params / 1e9:.2f}B "
               f"active per token; the {arch.experts} routed experts hold {arch.expert_params / 1e9:.2f}B "
               f"({expert_share:.0%}): memory follows the total, compute and activations the active count")
        if layout.ep > 1:
            a2a = st.parts.get("all-to-all (expert dispatch)", 0.0)
            moe += (f"; expert parallelism EP={layout.ep} puts {arch.experts // layout.ep} experts on each rank, "
                    f"dividing their weights and gradients by {layout.ep} (their optimizer states are sharded over "
                    f"dp either way), for the token dispatcher's all-to-all of {a2a:.2f} s/step")
        elif not engine_runs("megatron", "expert", inp.features):
            moe += ("; expert parallelism would divide the experts over the ranks, but hf_verl's Megatron engine does "
                    "not run it yet (capabilities.ENGINE_FEATURES['megatron'] has no 'expert'): not offered")
        else:
            moe += "; expert parallelism was considered and is not faster here (see rejected)"
        notes.append(moe)
    if inp.trainable_fraction < 1:
        if inp.shares_base:
            notes.append("LoRA: the reference is the actor's base with the adapters off (its forward counted, no "
                         "copy of its weights)")
        if not engine_runs("megatron", "lora", inp.features):
            notes.append("LoRA: hf_verl's Megatron engine does not train adapters yet (capabilities.ENGINE_FEATURES"
                         "['megatron'] has no 'lora'): Megatron layouts are not offered")
    if layout.offload_optimizer or layout.offload_params:
        host = sum(e.host.get(k, 0) for e in mems.values() for k in e.host)
        node = _host_per_node(inp, layout, _total(mems))
        ranks = min(layout.world_size, inp.hw.devices_per_node)
        what = ("parameters, gradients and optimizer states (FSDP2's CPUOffloadPolicy)" if layout.engine == "accelerate"
                else "optimizer states and gradient partitions (DeepSpeed ZeRO-Offload)" + (
                    " and parameters" if layout.offload_params else ""))
        held = ("" if inp.host_bytes is None else f" (the host's {inp.host_bytes / GiB:.0f} GiB holds it)")
        notes.append(f"offload: {what} live in host memory: {host / GiB:.0f} GiB per rank, {node / GiB:.0f} GiB "
                     f"per node of {ranks} ranks with their processes{held}"
                     + ("; host memory not given (host_memory_gib): not checked" if inp.host_bytes is None else ""))
    if inp.rollout:
        notes.append("the colocated rollout engine keeps its own copy of the actor's weights per rank (counted); "
                     "its KV cache is released while training (vLLM sleep mode) and is not counted")
    return notes


def _search(inp: _Inputs, actor: Architecture, n: int, allow: Any) -> tuple[list, list]:
    """(layouts that fit with their step time, the leanest miss of each layout that does not)."""
    fits, misses = [], []
    for layout in _candidates(actor, n, inp.hw.devices_per_node):
        if allow is not None and not allow(layout):
            continue
        best, miss = _fit(inp, layout)
        if best is None:
            misses.append(miss)
            continue
        fits.append((_step(inp, best[0]), best))
    return fits, misses


def _rejections(fits, misses, chosen: StepTime, inp: _Inputs) -> list[tuple[str, str]]:
    out, seen = [], set()
    fam_best = {}
    for st, (layout, _mems, total) in fits:
        fam = _family(layout)
        if fam not in fam_best or st.seconds < fam_best[fam][0].seconds:
            fam_best[fam] = (st, layout, total)
    chosen_family = _family(fits[0][1][0])
    for fam, (st, layout, total) in sorted(fam_best.items(), key=lambda x: x[1][0].seconds):
        if fam == chosen_family:
            continue
        seen.add(fam)
        worst = max((v, k) for k, v in st.parts.items())
        out.append((layout.label, f"fits ({total.peak_bytes / GiB:.1f} GiB) but slower: {st.seconds:.2f} s vs "
                                  f"{chosen.seconds:.2f} s (its largest cost: {worst[1]} {worst[0]:.2f} s)"))
    low = {}
    for layout, total in misses:
        fam = _family(layout)
        if fam in seen or fam == chosen_family:
            continue
        if fam not in low or total.peak_bytes < low[fam][1].peak_bytes:
            low[fam] = (layout, total)
    for fam, (layout, total) in sorted(low.items(), key=lambda x: x[1][1].peak_bytes):
        biggest = max((v, k) for k, v in total.components.items() if k != "runtime baseline")
        if total.peak_bytes <= inp.device_bytes:  # refused by the host memory its offloading needs
            out.append((layout.label, f"does not fit the host: {_host_per_node(inp, layout, total) / GiB:.0f} GiB "
                                      f"per node > host_memory_gib={inp.host_bytes / GiB:g}"))
            continue
        out.append((layout.label, f"does not fit: {total.peak_bytes / GiB:.1f} GiB per rank > "
                                  f"{inp.device_bytes / GiB:g} GiB (largest term: {biggest[1]} "
                                  f"{biggest[0] / GiB:.1f} GiB)"))
    return out[:12]


def _infeasible(inp: _Inputs, n: int, misses, actor: Architecture, allow=None) -> str:
    sentence, _ = _states_sentence(inp)
    # offloading layouts that fit the devices but not the host (host_memory_gib): the host is what binds
    host_refused = None
    if inp.host_bytes is not None and inp.device != "cpu":
        on_host = [(m[0], _host_per_node(inp, m[0], m[1]), m[1]) for m in misses
                   if m[1].peak_bytes <= inp.device_bytes]
        host_refused = min(on_host, key=lambda m: m[1], default=None)
    if host_refused is not None:
        layout, need, total = host_refused
        msg = (f"no layout fits {n} x {inp.device_bytes / GiB:.3g} GiB with {inp.host_bytes / GiB:.0f} GiB of host "
               f"memory per node: {sentence}; offloading them ({layout.label}) fits the devices "
               f"({total.peak_bytes / GiB:.1f} GiB per rank) but needs {need / GiB:.0f} GiB of host RAM per node "
               f"(the offloaded states of {min(layout.world_size, inp.hw.devices_per_node)} ranks and their "
               f"processes), more than host_memory_gib={inp.host_bytes / GiB:g}. ")
    else:
        layout, total = min(misses, key=lambda m: m[1].peak_bytes)
        msg = (f"no layout fits {n} x {inp.device_bytes / GiB:.3g} GiB: {sentence}; the leanest layout "
               f"({layout.label}) needs {total.peak_bytes / GiB:.1f} GiB per rank. ")
    hints = []
    for more in (2, 4, 8, 16, 32, 64):
        if _search(inp, actor, n * more, allow)[0]:
            hints.append(f"add devices: {n * more} fit")
            break
    # LoRA: adapters where the engine trains them, the reference as the actor's base with the adapters off
    lora_inp = replace(inp, trainable_fraction=0.01, shares_base=inp.actors_model)
    if inp.trainable_fraction >= 1 and _search(lora_inp, actor, n, lambda lay: (
            allow(lay) and _offered(lay, actor, True, inp.features)))[0]:
        hints.append("train LoRA adapters (trainable_fraction=0.01 fits)")
    acts = sum(v for k, v in total.components.items() if k.endswith(("activations", "logits")))
    if acts > 0.25 * total.peak_bytes:
        hints.append(f"a shorter sequence (activations and logits take {acts / GiB:.1f} GiB at {inp.seq_len} tokens)")
    if inp.trainable_fraction < 1 and not engine_runs("megatron", "lora", inp.features):
        hints.append("tensor / pipeline parallelism, once hf_verl's Megatron engine trains LoRA adapters (it does not "
                     "yet: capabilities.ENGINE_FEATURES['megatron'] has no 'lora', so no Megatron layout was offered)")
    if actor.is_moe and not engine_runs("megatron", "expert", inp.features):
        hints.append("expert parallelism, once hf_verl's Megatron engine runs it (capabilities.ENGINE_FEATURES"
                     "['megatron'] has no 'expert'): it would divide the routed experts' "
                     f"{actor.expert_params / 1e9:.1f}B parameters over the ranks")
    biggest = max((v, k) for k, v in total.components.items() if k != "runtime baseline")
    if biggest[1].endswith("rollout engine weights"):
        hints.append(f"a rollout engine without its own whole copy of the weights (it takes {biggest[0] / GiB:.1f} "
                     "GiB per rank on this layout: rollout=False, or a generator placed on other devices)")
    if host_refused:
        hints.append(f"more host memory: {host_refused[1] / GiB:.0f} GiB per node for {host_refused[0].label}")
    elif not any(m[0].offload_optimizer for m in misses) and inp.device != "cpu":
        hints.append("CPU offload of the optimizer states")
    return msg + "What to add: " + ("; ".join(hints) or "more or larger devices") + "."
