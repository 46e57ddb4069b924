"""Which parallelisms can run now, with this installation and these devices, and why the others cannot.

Each entry is checked for real: the backend is imported (not just found on the path), the machine's
devices are counted, and what hf_verl has not built yet says so. :func:`parallelism_report` gives a
reason for every entry; :func:`supported_parallelisms` lists the available ones.

| name | what | needs |
|---|---|---|
| data | DDP replicas | torch.distributed; 2+ CUDA devices, or CPU processes over gloo |
| fsdp | FSDP2 sharded data parallel | `torch.distributed.fsdp.fully_shard`, as for data |
| zero | DeepSpeed ZeRO-1/2/3 | `deepspeed` importable, as for data |
| sequence | Ulysses sequence parallel | `sequence_parallel_size` > 1 over the launch's processes |
| tensor / pipeline | Megatron-Core through hf_verl's bridge (`backend="megatron"`) | `megatron.core` importable (and hf_verl's engine with it), as for data |
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass

PARALLELISMS = ("data", "fsdp", "zero", "sequence", "tensor", "pipeline")


@dataclass(frozen=True)
class Availability:
    """Whether a parallelism can run now, and why (not)."""

    available: bool
    reason: str


def _import_error(module: str) -> str | None:
    try:
        importlib.import_module(module)
    except Exception as err:  # an installed but broken backend fails here, as it would at training time
        return f"{type(err).__name__}: {err}"
    return None


def _devices() -> tuple[bool, str]:
    """Whether several data-parallel processes can run here, and on what."""
    import torch
    import torch.distributed as dist

    if not dist.is_available():
        return False, "this torch build has no torch.distributed"
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        if n < 2:
            return False, f"only {n} CUDA device: it needs 2 or more (or CPU processes over gloo: configs/accelerate/*_cpu.yaml)"
        return True, f"{n} CUDA devices (NCCL)"
    return True, "CPU processes over gloo"


@functools.lru_cache(maxsize=1)
def parallelism_report() -> dict[str, Availability]:
    """Every parallelism of :data:`PARALLELISMS` with whether it can run now and the reason."""
    ok, where = _devices()
    report = {"data": Availability(ok, where)}
    fsdp_err = _import_error("torch.distributed.fsdp")
    if fsdp_err is None:
        from torch.distributed import fsdp

        fsdp_err = None if hasattr(fsdp, "fully_shard") else "torch.distributed.fsdp has no fully_shard (torch < 2.6)"
    report["fsdp"] = Availability(ok and fsdp_err is None, fsdp_err or where)
    ds_err = _import_error("deepspeed")
    report["zero"] = Availability(
        ok and ds_err is None,
        where if ds_err is None else f"deepspeed does not import ({ds_err}): `pip install hf_verl[deepspeed]`")
    report["sequence"] = Availability(
        ok, f"Ulysses sequence parallelism (sequence_parallel_size) over {where}" if ok else where)
    mc_err = _import_error("megatron.core") or _import_error("hf_verl.engine.megatron_engine")
    for name, setting in (("tensor", "tensor_model_parallel_size"), ("pipeline", "pipeline_model_parallel_size")):
        if mc_err is not None:
            report[name] = Availability(False, f"megatron-core does not import ({mc_err}): "
                                               "`pip install hf_verl[megatron]`")
        else:
            report[name] = Availability(ok, f"Megatron-Core (backend='megatron', {setting}) over {where}"
                                        if ok else where)
    return report


def supported_parallelisms() -> list[str]:
    """The parallelisms that can run now (see :func:`parallelism_report` for why the others cannot)."""
    return [name for name, a in parallelism_report().items() if a.available]
