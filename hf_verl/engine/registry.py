"""Per-role layouts and the engine registry: how each model role (actor, critic, reference, reward) is laid out,
and which training-engine implementation runs that layout.

A :class:`RoleLayout` is one role's placement: the backend (`BackendSpec`: plain, DDP, FSDP2, ZeRO), its
:class:`~hf_verl.parallel.dims.ParallelDims` (dp, sp, tp, pp), and whether it is colocated with the actor.
:func:`launch_role_layout` gives the default every role starts from (the launch's backend and the processes it
started); a role may be given another (a critic on FSDP2 beside a DDP actor, a Megatron actor once that engine
is registered). :func:`make_engine` picks the engine class from :data:`ENGINES` by the layout's `engine`
name, so that callers never import an implementation: adding a backend is one :func:`register_engine` call
(see docs/adding_an_engine.md).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from hf_verl.engine.base import TrainingEngine
from hf_verl.parallel.backend import BackendSpec, resolve_backend
from hf_verl.parallel.dims import ParallelDims

logger = logging.getLogger(__name__)

ROLES = ("actor", "critic", "reference", "reward", "teacher")

# engine name -> factory(model, *, role, layout, **options) -> TrainingEngine
ENGINES: dict[str, Callable[..., TrainingEngine]] = {}


@dataclass(frozen=True)
class RoleLayout:
    """Where and how one role runs.

    Args:
        backend ([`BackendSpec`]): plain, DDP, FSDP2 or DeepSpeed ZeRO.
        dims ([`ParallelDims`]): the role's mesh (dp, sp, tp, pp); its `world_size` is the processes it spans.
        engine (`str`): the registered engine that runs it (default "accelerate", which serves the four
            backends above).
        colocated (`bool`): whether it shares the actor's processes and devices (the default for every role).
    """

    backend: BackendSpec
    dims: ParallelDims
    engine: str = "accelerate"
    colocated: bool = True

    @property
    def label(self) -> str:
        """One line: engine, backend and the axes larger than 1, e.g. `accelerate fsdp2 dp_shard=2 sp=2`."""
        axes = " ".join(f"{a}={getattr(self.dims, a)}" for a in self.dims.enabled) or "one process"
        return f"{self.engine} {self.backend.label} {axes}"

    def with_backend(self, backend: BackendSpec) -> RoleLayout:
        """The same processes on another backend (the data-parallel axis becomes sharded or replicated)."""
        dims = ParallelDims.data_parallel(self.dims.world_size, self.dims.rank, shard=backend.shards,
                                          device_type=self.dims.device_type, tp=self.dims.tp, pp=self.dims.pp,
                                          sp=self.dims.sp, ep=self.dims.ep)
        return replace(self, backend=backend, dims=dims)


def launch_role_layout(num_processes: int | None = None, *, sequence_parallel_size: int = 1,
                       tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                       engine: str | None = None, expert_parallel_size: int = 1) -> RoleLayout:
    """The launch's default layout: its backend (checked against the machine) and the `ParallelDims` of the
    processes it started, with the model-parallel axes given (the processes left are data-parallel ranks).
    `engine="megatron"` lays every role out on Megatron-Core (tensor / pipeline parallel, data-parallel
    replicas with a distributed optimizer; a Mixture of Experts' experts over `expert_parallel_size` of those
    replicas) instead of the launch's DDP / FSDP2 / ZeRO.

    `num_processes` is the processes the caller's `Accelerator` sees (default: the launch's `WORLD_SIZE`). Called
    before anything formed the launch's process group (a script laying roles out by hand, docs/loading.md), it
    joins it (:func:`~hf_verl.parallel.backend.join_launch_process_group`: gloo on the CPU, adopting an accelerate
    config's `use_cpu: true`)."""
    import torch.distributed as dist

    from hf_verl.parallel.backend import join_launch_process_group
    from hf_verl.parallel.dims import _world_and_rank

    if num_processes is None:
        num_processes = int(os.environ.get("WORLD_SIZE", "1"))
    if num_processes > 1:
        join_launch_process_group()
    world, _ = _world_and_rank()
    megatron = engine == "megatron"
    if (megatron or tensor_parallel_size > 1 or pipeline_parallel_size > 1) and "megatron" not in ENGINES:
        raise ValueError(f"backend='megatron' (tensor_model_parallel_size={tensor_parallel_size}, "
                         f"pipeline_model_parallel_size={pipeline_parallel_size}) needs megatron-core, which is not "
                         "installed: pip install 'hf_verl[megatron]', or set both sizes to 1 (data, FSDP2, ZeRO and "
                         "sequence parallelism run without it).")
    if not megatron and (tensor_parallel_size > 1 or pipeline_parallel_size > 1 or expert_parallel_size > 1):
        raise ValueError("tensor_model_parallel_size / pipeline_model_parallel_size / expert_model_parallel_size above "
                         "1 need backend='megatron'.")
    if megatron:
        from hf_verl.parallel.megatron.launch import megatron_layout

        dims, backend = megatron_layout(num_processes, tensor_parallel_size, pipeline_parallel_size,
                                        sequence_parallel_size, ep=expert_parallel_size)
        return RoleLayout(backend=backend, dims=dims, engine="megatron")
    ready = dist.is_available() and dist.is_initialized()
    backend = resolve_backend(world, ready and num_processes == world)
    dims = ParallelDims.from_environment(shard=backend.shards, sp=sequence_parallel_size, tp=tensor_parallel_size,
                                         pp=pipeline_parallel_size)
    return RoleLayout(backend=backend, dims=dims)


def describe_layout(engines: dict[str, TrainingEngine | None], rollout: Any = None) -> str:
    """One line naming how each role runs, e.g. `actor: megatron tp=2 (2 processes); reference: megatron tp=2;
    rollout: TransformersEngine (replica, synced by export)`: what a user reads once per run."""
    parts = []
    for role, engine in engines.items():
        if engine is None:
            continue
        axes = " ".join(f"{a}={getattr(engine.dims, a)}" for a in engine.dims.enabled) or "one process"
        kind = "frozen" if not engine.trainable else "trained"
        parts.append(f"{role}: {engine.backend.label} {axes} ({kind})")
    if rollout is not None:
        shared = any(e is not None and e.shares_weights_with(getattr(rollout, "model", None)) for e in engines.values())
        parts.append(f"rollout: {type(rollout).__name__} ({'on the actor weights' if shared else 'own weights, synced'})")
    return "; ".join(parts)


def register_engine(name: str, factory: Callable[..., TrainingEngine]) -> None:
    """Make `factory(model, *, role, layout, **options)` the engine for layouts whose `engine` is `name`."""
    ENGINES[name] = factory


def make_engine(model: Any, role: str, layout: RoleLayout, **options: Any) -> TrainingEngine:
    """The training engine of `role` over `model` on `layout`, from the registry.

    Args:
        model: the role's model (a transformers model or a `PeftModel`), unsharded, on its device.
        role (`str`): one of :data:`ROLES`.
        layout ([`RoleLayout`]): where it runs.
        options: the engine's own options (`trainable`, `accelerator`, `bf16`, `gradient_checkpointing`, ...), and
            `seed`, the run's seed, for an engine with RNG state of its own.

    Raises:
        ValueError: an unknown role or an engine name nothing registered.
    """
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; roles are {ROLES}.")
    factory = ENGINES.get(layout.engine)
    if factory is None:
        raise ValueError(f"no engine named {layout.engine!r} for the {role} (registered: {sorted(ENGINES)}); "
                         "install the backend that provides it or choose one of those.")
    return factory(model, role=role, layout=layout, **options)


def _accelerate_engine(model: Any, *, role: str, layout: RoleLayout, seed: int | None = None,
                       **options: Any) -> TrainingEngine:
    from hf_verl.engine.accelerate_engine import AccelerateEngine

    # `seed` (the run's) is for engines with RNG state of their own; this one draws from torch's, seeded by the run
    return AccelerateEngine(model, role=role, dims=layout.dims, backend=layout.backend, **options)


register_engine("accelerate", _accelerate_engine)


def _megatron_engine(model: Any, *, role: str, layout: RoleLayout, seed: int | None = None,
                     **options: Any) -> TrainingEngine:
    from hf_verl.engine.megatron import MegatronEngine  # imported on use: an optional backend

    # Megatron seeds its model-parallel RNG (on a CPU, torch's global one): with the run's seed, not a constant, so
    # that whatever draws from it later (the shuffled data order, dropout) is what one process of the run would draw
    return MegatronEngine(model, role=role, dims=layout.dims, **options, **({} if seed is None else {"seed": seed}))


def _megatron_installed() -> bool:
    """megatron-core on the path, found without importing anything of megatron (its import prints notices)."""
    from hf_verl.parallel.megatron import megatron_core_found

    return megatron_core_found()


if _megatron_installed():
    register_engine("megatron", _megatron_engine)
