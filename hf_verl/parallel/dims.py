"""`ParallelDims`: every mesh axis of a run in one validated dataclass.

It is the only place where code learns a data-parallel rank or size, or reaches a process group
or a device mesh: trainers, the facade, the rollout pipeline and the engines ask it, never
`process_index` / `world_size` arithmetic of their own, so that adding a sequence, tensor or
pipeline axis changes one class, not a dozen call sites.

The world is laid out as a row-major mesh over the axes, outermost first,
``pp x dp_replicate x dp_shard x sp x tp`` (torchtitan's order: tensor-parallel ranks are
neighbours, which keeps their traffic on one node). Data parallelism is the product
``dp_replicate x dp_shard``: DDP replicates (``dp_replicate``), FSDP2 and ZeRO shard
(``dp_shard``), HSDP does both. The dataclass itself is pure (no process group is needed to build
or validate it); :attr:`ParallelDims.mesh` builds the `DeviceMesh` on first use.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

AXES = ("pp", "dp_replicate", "dp_shard", "sp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    """The parallel layout of a run: one size per mesh axis, the world and this process's rank.

    Args:
        dp_replicate (`int`): data-parallel replicas (DDP, or the replica axis of HSDP).
        dp_shard (`int`): data-parallel shards (FSDP2, DeepSpeed ZeRO).
        tp (`int`): tensor-parallel degree. pp (`int`): pipeline stages. sp (`int`): sequence-parallel
            (Ulysses) degree.
        ep (`int`): expert-parallel degree (Megatron Mixture-of-Experts): not a mesh axis of its own, the routed
            experts are split over `ep` data-parallel ranks (Megatron-Core's expert grid with expert TP = `tp`),
            so it must divide the data-parallel size.
        world_size (`int`): number of processes; must equal the product of the axes.
        rank (`int`): this process's global rank.
        device_type (`str`): "cpu" or "cuda"; the device kind of the mesh (gloo or NCCL).

    Example:
        ```python
        dims = ParallelDims(dp_shard=2, world_size=2, rank=1)
        dims.dp_rank, dims.dp_size      # (1, 2)
        ```
    """

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    sp: int = 1
    ep: int = 1
    world_size: int = 1
    rank: int = 0
    device_type: str = "cpu"
    _groups: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for axis in AXES:
            value = getattr(self, axis)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ParallelDims.{axis} must be an int >= 1, got {value!r}.")
        product = math.prod(getattr(self, a) for a in AXES)
        if product != self.world_size:
            sizes = " x ".join(f"{a}={getattr(self, a)}" for a in AXES)
            raise ValueError(
                f"the parallel layout {sizes} = {product} processes does not match the {self.world_size} launched; "
                "change the launch's process count or the parallel sizes so that their product is the world size."
            )
        if not isinstance(self.ep, int) or isinstance(self.ep, bool) or self.ep < 1:
            raise ValueError(f"ParallelDims.ep must be an int >= 1, got {self.ep!r}.")
        if (self.dp_replicate * self.dp_shard) % self.ep:
            raise ValueError(f"expert_model_parallel_size={self.ep} must divide the data-parallel size "
                             f"{self.dp_replicate * self.dp_shard} (the processes left after tp x pp x sp): experts "
                             "are split over data-parallel ranks; launch more processes or lower it.")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside a world of {self.world_size} processes.")

    # ------------------------------------------------------------------ construction
    @classmethod
    def data_parallel(cls, world_size: int, rank: int, *, shard: bool, device_type: str = "cpu",
                      tp: int = 1, pp: int = 1, sp: int = 1, ep: int = 1) -> ParallelDims:
        """The layout where every process not used by tp / pp / sp is a data-parallel rank,
        replicated (DDP, `shard=False`) or sharded (FSDP2 / ZeRO, `shard=True`); `ep` splits experts over them."""
        model_parallel = tp * pp * sp
        if world_size % model_parallel:
            raise ValueError(
                f"{world_size} processes cannot be split into tensor x pipeline x sequence parallel groups of "
                f"{tp} x {pp} x {sp} = {model_parallel}; launch a multiple of {model_parallel} processes."
            )
        dp = world_size // model_parallel
        return cls(dp_replicate=1 if shard else dp, dp_shard=dp if shard else 1, tp=tp, pp=pp, sp=sp, ep=ep,
                   world_size=world_size, rank=rank, device_type=device_type)

    @classmethod
    def from_environment(cls, *, shard: bool = False, tp: int = 1, pp: int = 1, sp: int = 1) -> ParallelDims:
        """The layout of this process, from the initialised process group if there is one, else from
        the launcher's `WORLD_SIZE` / `RANK` (a single process when neither is set). `sp` left at 1 takes the
        `accelerate launch` config's `parallelism_config` sp_size
        (:func:`~hf_verl.parallel.backend.resolve_sequence_parallel_size`); the device is CUDA where one is visible
        and `ACCELERATE_USE_CPU` (set by the launch, or adopted from its config) does not ask for the CPU."""
        import torch

        from hf_verl.parallel.backend import resolve_sequence_parallel_size

        world, rank = _world_and_rank()
        device = "cuda" if torch.cuda.is_available() and os.environ.get("ACCELERATE_USE_CPU", "").lower() not in (
            "1", "true", "yes") else "cpu"
        sp = resolve_sequence_parallel_size(sp)
        return cls.data_parallel(world, rank, shard=shard, device_type=device, tp=tp, pp=pp, sp=sp)

    # ------------------------------------------------------------------ coordinates
    @cached_property
    def coordinates(self) -> dict[str, int]:
        """This rank's index along every axis."""
        out, rest = {}, self.rank
        for axis in reversed(AXES):
            size = getattr(self, axis)
            out[axis] = rest % size
            rest //= size
        return out

    @property
    def dp_size(self) -> int:
        """Number of data-parallel ranks (replicas x shards): how many different batches a step sees."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_rank(self) -> int:
        """This process's data-parallel rank in `[0, dp_size)`: which slice of a global batch it holds."""
        c = self.coordinates
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"]

    @property
    def sp_rank(self) -> int:
        """This process's rank in its sequence-parallel group: which shard of a packed sequence it holds."""
        return self.coordinates["sp"]

    @property
    def replica_size(self) -> int:
        """Processes of one data-parallel replica (`sp x tp x pp`): they hold one copy of the data, train on one
        rollout, and count as one copy for the sampler."""
        return self.sp * self.tp * self.pp

    @property
    def replica_rank(self) -> int:
        """This rank's index within its data-parallel replica (0: the rank whose rollout the replica trains on)."""
        c = self.coordinates
        return (c["pp"] * self.sp + c["sp"]) * self.tp + c["tp"]

    @property
    def is_main(self) -> bool:
        """Rank 0: the process that logs, saves and talks to a shared rollout server."""
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def enabled(self) -> list[str]:
        """The axes larger than 1, outermost first."""
        return [a for a in AXES if getattr(self, a) > 1]

    # ------------------------------------------------------------------ groups and meshes
    @cached_property
    def mesh(self):
        """The `DeviceMesh` over all axes (named as in :data:`AXES`), with the flattened data-parallel
        axis "dp" (replicate x shard). Needs an initialised process group."""
        from torch.distributed.device_mesh import init_device_mesh

        _require_process_group()
        mesh = init_device_mesh(self.device_type, tuple(getattr(self, a) for a in AXES), mesh_dim_names=AXES)
        mesh["dp_replicate", "dp_shard"]._flatten("dp")
        if self.sp > 1:
            mesh["dp_shard", "sp"]._flatten("dp_shard_sp")
        return mesh

    def fsdp_mesh(self):
        """The mesh FSDP2 shards (and averages gradients) over: :meth:`dp_mesh`, or with sequence parallelism
        the data-parallel shard axis and the `sp` axis flattened ("dp_shard_sp"; x `dp_replicate` for HSDP),
        so that the ranks of one sequence-parallel group share the parameter shards of one data-parallel rank
        and their partial gradients meet in FSDP2's reduce-scatter."""
        if self.sp == 1:
            return self.dp_mesh()
        if self.dp_replicate > 1:
            return self.mesh["dp_replicate", "dp_shard_sp"]
        return self.mesh["dp_shard_sp"]

    def dp_mesh(self):
        """The mesh FSDP2 shards over: 1-D `dp_shard`, or 2-D (`dp_replicate`, `dp_shard`) for HSDP."""
        if self.dp_replicate > 1 and self.dp_shard > 1:
            return self.mesh["dp_replicate", "dp_shard"]
        return self.mesh["dp_shard"] if self.dp_shard > 1 else self.mesh["dp_replicate"]

    @property
    def dp_group(self) -> Any:
        """The process group of this rank's data-parallel peers (`None`: a single process)."""
        if self.dp_size == 1:
            return None
        if self.dp_size == self.world_size:
            _require_process_group()
            import torch.distributed as dist

            return dist.group.WORLD
        if "dp" not in self._groups:
            self._groups["dp"] = self.mesh["dp"].get_group()
        return self._groups["dp"]

    @property
    def sp_group(self) -> Any:
        """The process group of this rank's sequence-parallel (Ulysses) peers, which hold the shards of one
        packed sequence (`None`: no sequence parallelism). Its rank order is :attr:`sp_rank`."""
        if self.sp == 1:
            return None
        _require_process_group()
        if self.sp == self.world_size:
            import torch.distributed as dist

            return dist.group.WORLD
        if "sp" not in self._groups:
            self._groups["sp"] = self.mesh["sp"].get_group()
        return self._groups["sp"]


    @property
    def replica_group(self) -> Any:
        """The process group of this rank's data-parallel replica (its sp, tp and pp peers; `None`: one process
        per replica). Its rank order is :attr:`replica_rank`."""
        if self.replica_size == 1:
            return None
        if self.tp == self.pp == 1:
            return self.sp_group
        _require_process_group()
        if self.replica_size == self.world_size:
            import torch.distributed as dist

            return dist.group.WORLD
        if "replica" not in self._groups:
            self._groups["replica"] = self.mesh["pp", "sp", "tp"]._flatten("replica").get_group()
        return self._groups["replica"]


def _world_and_rank() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))


def _require_process_group() -> None:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "this needs an initialised torch.distributed process group: launch with `accelerate launch` or "
            "`torchrun` (on a CPU machine with a `use_cpu: true` accelerate config such as "
            "configs/accelerate/ddp_cpu.yaml, or use_cpu=True, so that gloo is used)."
        )
