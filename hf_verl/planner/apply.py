"""`parallel="auto"` and `per_device_train_batch_size="auto"`: the plan applied to a launch, before anything is
loaded.

The user's launch (`accelerate launch` / `torchrun` / `python`) gives the processes; the plan gives the layout
(tp / pp on the Megatron engine, Ulysses sp, FSDP2 sharding, activation checkpointing) and the micro-batch, with
gradient accumulation set to keep the requested global batch. What a launch or a config states explicitly wins:
a config's `backend="megatron"` / tp / pp / sp above 1, or an accelerate config that asks for FSDP, DeepSpeed,
Megatron-LM or a `parallelism_config` sp_size, is kept as it is, the log says so, and only an "auto" micro-batch is
sized for it. The plan is logged once per process (rank 0 only).

FSDP2 is applied the way an FSDP2 accelerate config would ask for it (`ACCELERATE_USE_FSDP=true`,
`FSDP_VERSION=2` in this process, and `FSDP_OFFLOAD_PARAMS=true` for its CPU offload; hf_verl's engine shards, as it
does for that config); DeepSpeed ZeRO layouts are not chosen automatically (they need a DeepSpeed config of the
launch's own). Expert parallelism is chosen only where the config has `expert_model_parallel_size`. Host memory
bounds offloading: the config's `host_memory_gib` where it has one, else the machine's RAM on a GPU machine.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from hf_verl.planner.memory import GiB, Layout

logger = logging.getLogger(__name__)

__all__ = ["apply_parallel_plan", "explicit_layout", "auto_plan"]

_LOGGED: set[str] = set()
DEFAULT_MICRO_BATCH = 8  # TrainingArguments' per_device_train_batch_size default


def _log_once(message: str) -> None:
    if message in _LOGGED or os.environ.get("RANK", "0") != "0":
        return
    _LOGGED.add(message)
    logger.info(message)


def explicit_layout(config: Any) -> str | None:
    """What states a layout explicitly (config fields or the launch), in words; `None` when nothing does."""
    said = []
    if getattr(config, "backend", None) == "megatron":
        said.append("backend='megatron'")
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "sequence_parallel_size",
                 "expert_model_parallel_size"):
        if (getattr(config, name, 1) or 1) > 1:
            said.append(f"{name}={getattr(config, name)}")
    env = os.environ
    for var, what in (("ACCELERATE_USE_FSDP", "an FSDP accelerate config"),
                      ("ACCELERATE_USE_DEEPSPEED", "a DeepSpeed accelerate config"),
                      ("ACCELERATE_USE_MEGATRON_LM", "a MEGATRON_LM accelerate config")):
        if env.get(var, "").strip().lower() in ("1", "true", "yes", "on") and not env.get("HF_VERL_PLANNED"):
            said.append(what)
    if int(env.get("PARALLELISM_CONFIG_SP_SIZE", "1") or 1) > 1 or int(env.get("HF_VERL_LAUNCH_SP_SIZE", "1") or 1) > 1:
        said.append("the launch's parallelism_config sp_size")
    return ", ".join(said) or None


def _host_memory_gib(config: Any, device: str) -> float | None:
    """Host RAM per node for offloading: the config's `host_memory_gib`, else this machine's (GPU runs; on a CPU
    run the host is the device memory already)."""
    given = getattr(config, "host_memory_gib", None)
    if given is not None or device != "cuda":
        return given
    import psutil

    return psutil.virtual_memory().total / GiB


def _device_memory_gib(world: int) -> tuple[float, str]:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory / GiB, "cuda"
    import psutil

    return psutil.virtual_memory().total / GiB / max(1, world), "cpu"


def _workload(config: Any) -> tuple[str, int, int]:
    name = type(config).__name__
    if name == "DPOConfig":
        return "dpo", config.max_length or 1024, config.max_length or 1024
    completion = getattr(config, "max_completion_length", None) or getattr(config, "response_length", 256)
    prompt = getattr(config, "max_prompt_length", None) or 512
    return ("ppo" if name == "PPOConfig" else "grpo"), prompt + completion, completion


def auto_plan(config: Any, model: Any, *, world: int, global_batch: int, allow: Any = None):
    """The plan for `config`'s workload on this launch's `world` processes (device memory read from the machine)."""
    from hf_verl.planner.plan import plan

    memory, device = _device_memory_gib(world)
    algo, seq_len, scored = _workload(config)
    bf16 = bool(getattr(config, "bf16", False)) and device == "cuda"
    roles = ("actor", "reference") if algo == "dpo" or getattr(config, "beta", 0.0) > 0 else ("actor",)
    if algo == "ppo":
        roles = ("actor", "critic", "reference")
    return plan(model, num_devices=world, device_memory_gib=memory, seq_len=seq_len, algo=algo, roles=roles,
                global_batch=global_batch, completion_len=scored, precision="bf16" if bf16 else "fp32",
                device=device, allow=allow, rollout=bool(getattr(config, "use_vllm", False)),
                host_memory_gib=_host_memory_gib(config, device))


def _runnable(layout: Layout, config: Any = None) -> bool:
    """What `parallel="auto"` can apply by itself: not DeepSpeed (it needs the launch's own config), expert
    parallelism only where the config has its field."""
    if layout.sharding.startswith("zero"):
        return False  # DeepSpeed needs the launch's own config
    if layout.ep > 1 and not hasattr(config, "expert_model_parallel_size"):
        return False
    if layout.megatron:
        from hf_verl.engine.registry import ENGINES

        return "megatron" in ENGINES
    return True


def apply_parallel_plan(config: Any, model: Any, owner: str) -> None:
    """Apply `parallel="auto"` / `per_device_train_batch_size="auto"` to a trainer config in place.

    Args:
        config: a GRPOConfig / PPOConfig / DPOConfig (before `TrainingArguments.__post_init__`) or an object with
            the same fields. model: what the plan sizes (`model_size`: a size string, a config, a path / Hub id).
        owner (`str`): the config's name, quoted in messages.

    Raises:
        `ValueError`: `parallel` not in (None, "manual", "auto"); "auto" without a model to size; no layout fits
            (the planner's message naming what to add).
    """
    parallel = getattr(config, "parallel", None)
    if parallel not in (None, "manual", "auto"):
        raise ValueError(f"{owner}.parallel must be None, 'manual' or 'auto', got {parallel!r}.")
    auto_batch = getattr(config, "per_device_train_batch_size", None) == "auto"
    if parallel != "auto" and not auto_batch:
        return
    if model is None:
        raise ValueError(f"{owner}: parallel='auto' / per_device_train_batch_size='auto' size the layout from the "
                         f"model before it is loaded: set {owner}.model_size (a size string like '7b', a parameter "
                         "count, or the model's local path / Hub id for its config).")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    accum = int(getattr(config, "gradient_accumulation_steps", 1) or 1)
    mbs = DEFAULT_MICRO_BATCH if auto_batch else config.per_device_train_batch_size
    global_batch = mbs * accum * world
    explicit = explicit_layout(config) if parallel == "auto" else "parallel is not 'auto'"

    def runnable(layout: Layout) -> bool:
        return _runnable(layout, config)

    if explicit:
        fixed = _explicit_filter(config)
        result = auto_plan(config, model, world=world, global_batch=global_batch, allow=fixed)
        if parallel == "auto":
            _log_once(f"{owner}: parallel='auto', but the explicit layout ({explicit}) wins: no plan applied "
                      f"(the planner would choose: {auto_plan(config, model, world=world, global_batch=global_batch, allow=runnable).layout.label})")
    else:
        result = auto_plan(config, model, world=world, global_batch=global_batch, allow=runnable)
        lay = result.layout
        if lay.megatron:
            config.backend = "megatron"
        config.tensor_model_parallel_size, config.pipeline_model_parallel_size = lay.tp, lay.pp
        config.sequence_parallel_size = lay.sp
        if lay.ep > 1:
            config.expert_model_parallel_size = lay.ep
        config.gradient_checkpointing = lay.activation_checkpointing
        _apply_fsdp(lay)
        _log_once(f"{owner}: parallel='auto' on {world} process(es):\n{result.explain()}")
    lay = result.layout
    if auto_batch or not explicit:
        dp = lay.dp
        new_mbs = lay.micro_batch_size
        while new_mbs > 1 and global_batch % (new_mbs * dp):
            new_mbs //= 2
        if global_batch % (new_mbs * dp):
            raise ValueError(f"{owner}: the global batch of {global_batch} rows does not split over {dp} "
                             "data-parallel ranks: change gradient_accumulation_steps or the process count.")
        config.per_device_train_batch_size = new_mbs
        config.gradient_accumulation_steps = global_batch // (new_mbs * dp)
        _log_once(f"{owner}: micro-batch {new_mbs} per rank (the largest that fits: "
                  f"{result.memory_per_rank / GiB:.2f} GiB per rank of {result.device_memory_gib:.1f}), "
                  f"gradient_accumulation_steps={config.gradient_accumulation_steps} to keep the global batch of "
                  f"{global_batch} rows")


def _apply_fsdp(lay: Layout) -> None:
    """FSDP2 (and its CPU offload) as an FSDP2 accelerate config would ask for it."""
    if lay.sharding == "fsdp2":
        os.environ.update(ACCELERATE_USE_FSDP="true", FSDP_VERSION="2", HF_VERL_PLANNED="1")
        if lay.offload_params:
            os.environ["FSDP_OFFLOAD_PARAMS"] = "true"


def _explicit_filter(config: Any):
    tp = getattr(config, "tensor_model_parallel_size", 1) or 1
    pp = getattr(config, "pipeline_model_parallel_size", 1) or 1
    sp = getattr(config, "sequence_parallel_size", 1) or 1
    megatron = getattr(config, "backend", None) == "megatron" or tp * pp > 1
    from hf_verl.parallel.backend import requested_backend

    spec = requested_backend(int(os.environ.get("WORLD_SIZE", "1")))
    sharding = {"fsdp2": "fsdp2", "deepspeed": f"zero{spec.zero_stage}"}.get(spec.kind, "none")
    if megatron:
        sharding = None
    ckpt = bool(getattr(config, "gradient_checkpointing", False))
    ep = getattr(config, "expert_model_parallel_size", 1) or 1
    # what the launch offloads: FSDP2's CPU offload moves parameters and optimizer states together
    offload_params = bool(spec.offload_params) and not megatron
    offload_optimizer = bool(spec.offload_optimizer or (offload_params and sharding == "fsdp2")) and not megatron

    def allow(layout: Layout) -> bool:
        return ((layout.tp, layout.pp, layout.sp, layout.ep, layout.megatron) == (tp, pp, sp, ep, megatron or ep > 1)
                and (sharding is None or layout.sharding == sharding)
                and layout.activation_checkpointing == ckpt
                and layout.offload_params == offload_params and layout.offload_optimizer == offload_optimizer)

    return allow


def apply_facade_plan(config: Any, model: Any):
    """The facade's `parallel="auto"` / `model_size`: plan for this launch and write tp / pp / sp / backend into the
    facade's `TrainerConfig` (a rollout is one micro-batch there, so no micro-batch or checkpointing is chosen).

    Returns:
        [`Plan`], or `None` when an explicit layout wins.
    """
    from hf_verl.planner.plan import plan

    world = int(os.environ.get("WORLD_SIZE", "1"))
    explicit = explicit_layout(config)
    memory, device = _device_memory_gib(world)
    rows = config.rollout_batch_size * config.num_generations
    prompt = config.max_prompt_length or 512
    roles = ("actor", "reference") if config.beta > 0 else ("actor",)

    def allow(layout: Layout) -> bool:
        return _runnable(layout, config) and not layout.activation_checkpointing

    from hf_verl.planner.plan import PlanError

    try:
        result = plan(model, num_devices=world, device_memory_gib=memory,
                      seq_len=prompt + config.max_completion_length, completion_len=config.max_completion_length,
                      roles=roles, global_batch=rows * world, device=device, allow=allow,
                      host_memory_gib=_host_memory_gib(config, device),
                      precision="fp32" if device == "cpu" or config.dtype == "float32" else "bf16")
    except PlanError as err:
        if not explicit:
            raise
        result, why = None, str(err)
    if explicit:
        planned = result.layout.label if result is not None else f"none fits: {why}"
        _log_once(f"TrainerConfig: the explicit layout ({explicit}) wins over the planner's ({planned}); no plan "
                  "applied")
        return None
    lay = result.layout
    config.backend = "megatron" if lay.megatron else config.backend
    config.tensor_model_parallel_size, config.pipeline_model_parallel_size = lay.tp, lay.pp
    config.sequence_parallel_size = lay.sp
    if lay.ep > 1:
        config.expert_model_parallel_size = lay.ep
    _apply_fsdp(lay)
    _log_once(f"TrainerConfig: parallel layout planned for {config.model_size or model} on {world} process(es):\n"
              f"{result.explain()}")
    return result
