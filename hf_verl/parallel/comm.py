"""Collectives over the data-parallel group of a :class:`~hf_verl.parallel.dims.ParallelDims`.

The RL pipeline needs a handful of them: gather the rewards of a round from every data-parallel
rank before group normalisation, gather ragged per-token tensors (padded to the widest rank),
sum token counts, average metrics. With one data-parallel rank every function returns its input,
so callers never branch on the world size. Tensors travel on the mesh's device (gloo takes CPU
tensors, NCCL CUDA ones) and come back on the caller's. Each collective runs under a
:func:`~hf_verl.parallel.watchdog.collective` mark, so that a hang in it names the phase, the
collective and the rank that never arrived.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hf_verl.parallel import watchdog
from hf_verl.parallel.dims import ParallelDims


def _to_comm(dims: ParallelDims, tensor: torch.Tensor) -> torch.Tensor:
    device = "cuda" if dims.device_type == "cuda" else "cpu"
    return tensor.contiguous() if tensor.device.type == device else tensor.to(device).contiguous()


def gather_rows(dims: ParallelDims, tensor: torch.Tensor) -> torch.Tensor:
    """Concatenate `tensor` of every data-parallel rank along dim 0, in rank order.

    Every rank must pass the same shape except along dim 0, which may differ.
    """
    if dims.dp_size == 1:
        return tensor
    import torch.distributed as dist

    group = dims.dp_group
    local = _to_comm(dims, tensor)
    sizes = [torch.zeros(1, dtype=torch.long, device=local.device) for _ in range(dims.dp_size)]
    with watchdog.collective("all_gather"):
        dist.all_gather(sizes, torch.tensor([local.shape[0]], device=local.device), group=group)
    rows = [int(s.item()) for s in sizes]
    width = max(rows)
    padded = F.pad(local, (0, 0) * (local.dim() - 1) + (0, width - local.shape[0])) if local.shape[0] < width else local
    parts = [torch.empty_like(padded) for _ in range(dims.dp_size)]
    with watchdog.collective("all_gather"):
        dist.all_gather(parts, padded, group=group)
    return torch.cat([p[:n] for p, n in zip(parts, rows)]).to(tensor.device)


def gather_objects(dims: ParallelDims, items: list) -> list:
    """The picklable `items` of every data-parallel rank concatenated in rank order (logging only: slow)."""
    if dims.dp_size == 1:
        return list(items)
    import torch.distributed as dist

    parts: list = [None] * dims.dp_size
    with watchdog.collective("all_gather_object"):
        dist.all_gather_object(parts, list(items), group=dims.dp_group)
    return [x for part in parts for x in part]


def gather_ragged(dims: ParallelDims, values: torch.Tensor) -> torch.Tensor:
    """The 1-D `values` of every data-parallel rank concatenated (rank order), whatever their lengths."""
    if dims.dp_size == 1:
        return values
    padded = gather_padded(dims, values.float().unsqueeze(0), dim=1, pad_value=float("nan"))
    return padded[~padded.isnan()]


def gather_padded(dims: ParallelDims, tensor: torch.Tensor, dim: int = 1, pad_value: float = 0) -> torch.Tensor:
    """:func:`gather_rows` of a `(rows, width, ...)` tensor whose `width` differs between ranks: each
    rank's tensor is right-padded along `dim` with `pad_value` to the widest one first."""
    if dims.dp_size == 1:
        return tensor
    width = int(reduce(dims, torch.tensor([tensor.shape[dim]], dtype=torch.float64), "max").item())
    missing = width - tensor.shape[dim]
    if missing:
        pad = [0, 0] * (tensor.dim() - 1 - dim) + [0, missing]
        tensor = F.pad(tensor, pad, value=pad_value)
    return gather_rows(dims, tensor)


def reduce(dims: ParallelDims, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """All-reduce `tensor` over the data-parallel ranks with `op` in ("sum", "mean", "max", "min")."""
    if dims.dp_size == 1:
        return tensor
    import torch.distributed as dist

    ops = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    if op not in ops:
        raise ValueError(f"reduce op must be one of {tuple(ops)}, got {op!r}.")
    out = _to_comm(dims, tensor.clone())
    with watchdog.collective("all_reduce"):
        dist.all_reduce(out, op=ops[op], group=dims.dp_group)
    if op == "mean":
        out = out / dims.dp_size
    return out.to(tensor.device)


def broadcast_replica(dims: ParallelDims, obj):
    """`obj` as the first rank of this rank's data-parallel replica holds it, on every rank of the replica (its
    sequence-, tensor- and pipeline-parallel peers; any picklable object; one process per replica: `obj`
    itself). The ranks of one replica train on the same rows, so a rollout generated and scored there is handed
    to its peers rather than sampled again."""
    if dims.replica_size == 1:
        return obj
    import torch.distributed as dist

    group = dims.replica_group
    source = dist.get_global_rank(group, 0) if group is not dist.group.WORLD else 0
    box = [obj]
    with watchdog.collective("broadcast"):
        dist.broadcast_object_list(box, src=source, group=group)
    return box[0]


def local_rows(dims: ParallelDims, gathered: torch.Tensor, rows: int) -> torch.Tensor:
    """This rank's slice of a tensor gathered with :func:`gather_rows` when every rank sent `rows` rows."""
    start = dims.dp_rank * rows
    return gathered[start : start + rows]


def barrier(dims: ParallelDims) -> None:
    """Wait for every process of the world (not only data-parallel peers)."""
    if dims.world_size == 1:
        return
    import torch.distributed as dist

    with watchdog.collective("barrier"):
        dist.barrier()


def leave_together() -> None:
    """End a multi-process run: wait for every rank, then destroy the process group.

    Runs by itself at interpreter exit once a trainer or the facade has started (see
    :func:`hf_verl.parallel.watchdog.leave_together`, which this is); calling it last in a script is harmless.
    """
    watchdog.leave_together()
