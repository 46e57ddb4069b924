"""The Megatron layout of a launch: `ParallelDims` with tp / pp / ep and data-parallel replicas, and the process group.

Megatron-Core orders ranks `tp` fastest, then data parallelism, then `pp` (its default "tp-cp-ep-dp-pp"), which
is :class:`~hf_verl.parallel.dims.ParallelDims`' row-major `pp x dp x tp`: a rank's coordinates agree in both,
so hf_verl's data-parallel reductions and Megatron's groups see the same ranks. Expert parallelism (`ep`) splits
a Mixture of Experts' experts over data-parallel ranks (Megatron's expert grid, expert TP = TP): `ep` divides the
data-parallel size, and the all-to-all token dispatcher moves tokens between those ranks. A single process (plain
`python`) gets a one-process gloo group, which Megatron-Core needs even without parallelism.
"""

from __future__ import annotations

import logging
import os
import tempfile

import torch
import torch.distributed as dist

from hf_verl.parallel.backend import BackendSpec
from hf_verl.parallel.dims import ParallelDims, _world_and_rank

MEGATRON_BACKEND = BackendSpec("megatron", source="backend='megatron' (Megatron-Core tensor / pipeline parallelism)")

logger = logging.getLogger(__name__)


def ensure_process_group() -> None:
    """A process group for Megatron-Core: the launch's (joined through torchrun's environment when nothing joined it
    yet), or a one-process gloo group for a plain `python` run."""
    if dist.is_initialized():
        return
    world, _ = _world_and_rank()
    if world > 1:
        if "MASTER_ADDR" not in os.environ:
            raise RuntimeError(f"{world} processes were launched but no process group is initialised and no "
                               "rendezvous is set (MASTER_ADDR): launch with torchrun or accelerate launch.")
        cuda = torch.cuda.is_available() and os.environ.get("ACCELERATE_USE_CPU", "").lower() not in ("1", "true")
        dist.init_process_group("nccl" if cuda else "gloo")  # torchrun's env:// rendezvous
        return
    store = os.path.join(tempfile.mkdtemp(prefix="hf_verl_megatron_"), "store")
    dist.init_process_group("gloo", init_method=f"file://{store}", world_size=1, rank=0)


def megatron_layout(num_processes: int, tp: int, pp: int, sp: int = 1,
                    ep: int = 1) -> tuple[ParallelDims, BackendSpec]:
    """`(dims, backend)` of a Megatron launch of `num_processes` processes at `tp x pp` (the rest data-parallel,
    experts over `ep` of them)."""

    if sp > 1:
        raise ValueError("sequence_parallel_size > 1 (Ulysses) does not combine with backend='megatron'; use "
                         "tensor_model_parallel_size, or another backend for Ulysses.")
    world, rank = _world_and_rank()
    if world % (tp * pp):
        raise ValueError(f"tensor_model_parallel_size={tp} x pipeline_model_parallel_size={pp} = {tp * pp} does not "
                         f"divide the {world} launched processes: launch a multiple of {tp * pp} processes.")
    ensure_process_group()
    use_cuda = torch.cuda.is_available() and os.environ.get("ACCELERATE_USE_CPU", "").lower() not in ("1", "true")
    if ep > 1 and (world // (tp * pp)) % ep:
        raise ValueError(f"expert_model_parallel_size={ep} must divide the {world // (tp * pp)} data-parallel ranks "
                         f"left by tensor_model_parallel_size={tp} x pipeline_model_parallel_size={pp} over {world} "
                         f"processes (Megatron splits experts over data-parallel ranks): launch {tp * pp * ep} "
                         "processes or a multiple, or lower it.")
    dims = ParallelDims.data_parallel(world, rank, shard=False, device_type="cuda" if use_cuda else "cpu", tp=tp,
                                      pp=pp, ep=ep)
    logger.info("Megatron layout: tp=%d, pp=%d, ep=%d, dp=%d over %d processes%s", tp, pp, ep, dims.dp_size, world,
                "" if use_cuda else " (CPU, gloo; Megatron-Core through hf_verl's CPU layer)")
    return dims, MEGATRON_BACKEND


LAUNCH_MARK = "HF_VERL_MEGATRON_LAUNCH"


def take_over_megatron_launch() -> tuple[int, int] | None:
    """`(tp, pp)` of an accelerate `MEGATRON_LM` launch (`ACCELERATE_USE_MEGATRON_LM`, `MEGATRON_LM_TP_DEGREE`,
    `MEGATRON_LM_PP_DEGREE`), or None. hf_verl's engine runs it, so accelerate's own Megatron-LM plugin (which
    expects the Megatron-LM training scripts) is switched off: `ACCELERATE_USE_MEGATRON_LM` is removed before an
    `Accelerator` is built, and the request kept for the rest of the process."""
    if os.environ.get("ACCELERATE_USE_MEGATRON_LM", "false").lower() in ("1", "true", "yes"):
        launch = (int(os.environ.get("MEGATRON_LM_TP_DEGREE", "1") or 1),
                  int(os.environ.get("MEGATRON_LM_PP_DEGREE", "1") or 1))
        os.environ.pop("ACCELERATE_USE_MEGATRON_LM", None)
        os.environ[LAUNCH_MARK] = f"{launch[0]},{launch[1]}"
        return launch
    if os.environ.get(LAUNCH_MARK):
        tp, pp = os.environ[LAUNCH_MARK].split(",")
        return int(tp), int(pp)
    return None


EXPERT_LAUNCH_VAR = "MEGATRON_LM_EXPERT_MODEL_PARALLEL_SIZE"  # accelerate's export of megatron_lm_config's
# megatron_lm_expert_model_parallel_size (accelerate 1.15's launcher; its MegatronLMPlugin reads the same variable)


def resolve_expert_parallel_size(owner: str, backend: str | None, ep: int) -> int:
    """`expert_model_parallel_size` after an accelerate `MEGATRON_LM` launch's request (`megatron_lm_config`'s
    `megatron_lm_expert_model_parallel_size`, exported as `MEGATRON_LM_EXPERT_MODEL_PARALLEL_SIZE`), checked: above 1
    it needs `backend="megatron"` (call after :func:`resolve_megatron_settings`), and a config that disagrees with
    the launch is an error naming both."""
    launched = os.environ.get(LAUNCH_MARK) and os.environ.get(EXPERT_LAUNCH_VAR)
    if launched:
        asked = int(os.environ[EXPERT_LAUNCH_VAR] or 1)
        if ep not in (1, asked):
            raise ValueError(f"the accelerate MEGATRON_LM launch asks for expert_model_parallel_size={asked} but "
                             f"{owner} sets expert_model_parallel_size={ep}: keep one of the two.")
        ep = asked
    if ep > 1 and backend != "megatron":
        raise ValueError(f"{owner}: expert_model_parallel_size={ep} needs backend='megatron' (or an accelerate "
                         "MEGATRON_LM launch config).")
    return ep


def resolve_megatron_settings(owner: str, backend: str | None, tp: int, pp: int,
                              sp: int = 1) -> tuple[str | None, int, int]:
    """`(backend, tp, pp)` after the launch's request (see :func:`take_over_megatron_launch`), checked: sizes above
    1 need `backend="megatron"`, a config that disagrees with the launch is an error naming both, and Ulysses does
    not combine with Megatron."""
    if backend not in (None, "auto", "megatron"):
        raise ValueError(f"{owner}.backend must be None, 'auto' or 'megatron', got {backend!r} (DDP, FSDP2 and ZeRO "
                         "come from the accelerate launch config).")
    launch = take_over_megatron_launch()
    if launch is not None:
        if backend == "megatron" and (tp, pp) != (1, 1) and (tp, pp) != launch:
            raise ValueError(f"the accelerate MEGATRON_LM launch asks for tp={launch[0]}, pp={launch[1]} but "
                             f"{owner} sets tensor_model_parallel_size={tp}, pipeline_model_parallel_size={pp}: keep "
                             "one of the two.")
        backend, (tp, pp) = "megatron", launch
    if backend != "megatron" and (tp > 1 or pp > 1):
        raise ValueError(f"{owner}: tensor_model_parallel_size={tp} / pipeline_model_parallel_size={pp} need "
                         "backend='megatron' (or an accelerate MEGATRON_LM launch config).")
    if backend == "megatron" and sp > 1:
        raise ValueError("sequence_parallel_size > 1 (Ulysses) does not combine with backend='megatron'; use "
                         "tensor_model_parallel_size to split long sequences' activations, or another backend.")
    return backend, tp, pp
