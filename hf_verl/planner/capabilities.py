"""Which parallelisms can run now, with this installation and these devices, and why the others cannot.

Each entry is checked for real: the backend is imported (not just found on the path), the machine's
devices are counted, and what hf_verl has not built yet says so. :func:`parallelism_report` gives a
reason for every entry; :func:`supported_parallelisms` lists the available ones (or, with `reasons=True`, the
report's reasons: the one body behind the facade's and the trainers' `supported_parallelisms()`).

One exception keeps a run that does not use Megatron free of megatron-core: importing `megatron.core` prints
Transformer Engine / Apex notices in every process and takes seconds, so the list (`reasons=False`) finds it on
the path without importing anything of it (:func:`megatron_core_found`) unless a Megatron run already imported
it; `reasons=True` and :func:`parallelism_report` import it for real and report its import error.

| name | what | needs |
|---|---|---|
| data | DDP replicas | torch.distributed; 2+ CUDA devices, or CPU processes over gloo |
| fsdp | FSDP2 sharded data parallel | `torch.distributed.fsdp.fully_shard`, as for data |
| zero | DeepSpeed ZeRO-1/2/3 | `deepspeed` importable, as for data |
| sequence | Ulysses sequence parallel | `sequence_parallel_size` > 1 over the launch's processes |
| tensor / pipeline | Megatron-Core through hf_verl's bridge (`backend="megatron"`) | `megatron.core` importable (and hf_verl's engine with it), as for data |

What each engine implements beyond its parallel axes (LoRA adapters, CPU offload, expert parallelism) is one table,
:data:`ENGINE_FEATURES`, read through :func:`engine_runs`: the layout planner offers only what it says an engine
runs, so the day an engine gains a feature, one line here makes the planner offer it.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
from dataclasses import dataclass

from hf_verl.parallel.megatron import megatron_core_found

PARALLELISMS = ("data", "fsdp", "zero", "sequence", "tensor", "pipeline", "expert")

# engine (a planner Layout's `engine`) -> the features hf_verl's engine of that name implements:
#   "lora": trains PEFT / LoRA adapters (and runs the reference as the base with the adapters off)
#   "offload": FSDP2's CPUOffloadPolicy (parameters, gradients and optimizer states on the host, together)
#   "offload_optimizer" / "offload_params": DeepSpeed's ZeRO-Offload of the optimizer states / ZeRO-3 parameters
#   "sequence": Ulysses sequence parallelism
#   "expert": expert parallelism of a Mixture-of-Experts model (Megatron's expert_model_parallel_size)
# The Megatron engine trains LoRA adapters (engine/megatron/adapters.py, tests/test_megatron_lora.py); its
# expert-parallel axis is granted by "expert" in PARALLELISMS (engine_runs) or a line here.
ENGINE_FEATURES: dict[str, frozenset[str]] = {
    "accelerate": frozenset({"lora", "offload", "sequence"}),
    "deepspeed": frozenset({"lora", "offload_optimizer", "offload_params"}),
    "megatron": frozenset({"lora"}),
}


def engine_runs(engine: str, feature: str, features: dict[str, frozenset[str]] | None = None) -> bool:
    """Whether hf_verl's `engine` ("accelerate", "deepspeed", "megatron") implements `feature` ("lora", "offload",
    "offload_optimizer", "offload_params", "sequence", "expert"): :data:`ENGINE_FEATURES`, or `features` given in
    its place (what a plan for engines other than these would assume). "expert" is also granted where
    :data:`PARALLELISMS` names it (an expert-parallel axis added there)."""
    table = ENGINE_FEATURES if features is None else features
    if feature == "expert" and engine == "megatron" and "expert" in PARALLELISMS and features is None:
        return True
    return feature in table.get(engine, frozenset())


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


def _megatron_error(import_it: bool) -> str | None:
    """Why the Megatron engine cannot run here, or None: imported for real when `import_it` or already imported by
    a Megatron run, else found on the path only (:func:`megatron_core_found`)."""
    if import_it or "megatron.core" in sys.modules:
        return _import_error("megatron.core") or _import_error("hf_verl.engine.megatron")
    return None if megatron_core_found() else "ModuleNotFoundError: No module named 'megatron.core'"


def parallelism_report() -> dict[str, Availability]:
    """Every parallelism of :data:`PARALLELISMS` with whether it can run now and the reason (megatron-core
    imported for real)."""
    return _report(True)


@functools.lru_cache(maxsize=2)
def _report(import_megatron: bool) -> dict[str, Availability]:
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
    mc_err = _megatron_error(import_megatron)
    for name, setting in (("tensor", "tensor_model_parallel_size"), ("pipeline", "pipeline_model_parallel_size"),
                          ("expert", "expert_model_parallel_size")):
        if mc_err is not None:
            report[name] = Availability(False, f"megatron-core does not import ({mc_err}): "
                                               "`pip install hf_verl[megatron]`")
        else:
            report[name] = Availability(ok, f"Megatron-Core (backend='megatron', {setting}) over {where}"
                                        if ok else where)
    return report


def supported_parallelisms(reasons: bool = False) -> list[str] | dict[str, str]:
    """The parallelisms this installation and machine can run now: "data" (DDP), "fsdp" (FSDP2), "zero"
    (DeepSpeed), "sequence", "tensor", "pipeline", "expert"; what the facade's and the trainers'
    `supported_parallelisms(reasons=...)` answer.

    Args:
        reasons (`bool`): return `{name: reason}` for every parallelism instead (:func:`parallelism_report`), the
            reason saying what it runs on or why it cannot run (missing backend, too few devices). Without it,
            megatron-core is found on the path, not imported (:func:`megatron_core_found`).
    """
    if reasons:
        return {name: a.reason for name, a in parallelism_report().items()}
    return [name for name, a in _report(False).items() if a.available]
