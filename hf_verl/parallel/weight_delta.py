"""Delta weight sync: send only what changed since the last sync, at the receiver's dtype, exactly.

A sync normally streams every weight. Between two syncs most weights change in few of their elements once cast to
the rollout engine's dtype (a bf16 server, a small learning rate, frozen embeddings, a LoRA actor merged into
unchanged base weights), so the trainer keeps what it last sent (one copy of the model at the receiver's dtype, in
host memory) and, per tensor, sends the cheaper of

- nothing, when no element changed;
- a sparse delta: the flat indices of the changed elements and their new values, as two tensors named
  `<name>#delta_index` / `<name>#delta_value` in the same safetensors bucket stream;
- the whole tensor, when the sparse form is not smaller.

"Changed" compares bits at the receiver's dtype, so after the receiver applies the stream its weights equal the
trainer's cast to that dtype, bit for bit. A failed sync forgets every copy: the next sync is full.

Pure tensor functions and the per-receiver state (:class:`DeltaTracker`); no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

DELTA_INDEX = "#delta_index"
DELTA_VALUE = "#delta_value"

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def changed_elements(new: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """Flat indices of the elements whose bits differ (NaN payloads and signed zeros compare as bits do)."""
    width = new.element_size()
    a = new.detach().contiguous().reshape(-1).view(_BITS[width])
    b = last.detach().contiguous().reshape(-1).view(_BITS[width])
    return torch.nonzero(a != b, as_tuple=False).reshape(-1)


def encode_tensor(name: str, new: torch.Tensor, last: torch.Tensor | None) -> list[tuple[str, torch.Tensor]]:
    """The wire entries that bring a receiver holding `last` to `new` (both at the receiver's dtype): `[]` when
    equal, the sparse pair when smaller than the tensor, else `[(name, new)]`."""
    if last is None or last.shape != new.shape or last.dtype != new.dtype:
        return [(name, new)]
    index = changed_elements(new, last)
    count = index.numel()
    if count == 0:
        return []
    index_dtype = torch.int32 if new.numel() < 2**31 else torch.int64
    sparse = count * (torch.empty((), dtype=index_dtype).element_size() + new.element_size())
    if sparse >= new.numel() * new.element_size():
        return [(name, new)]
    return [(name + DELTA_INDEX, index.to(index_dtype)), (name + DELTA_VALUE, new.reshape(-1)[index])]


def split_entries(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor],
                                                              dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """A received stream as `(whole tensors, {name: (flat indices, values)})`.

    Raises:
        ValueError: a delta index without its values (or the reverse), lengths that differ, or an index that is
            not an integer tensor.
    """
    whole, sparse = {}, {}
    for key, tensor in tensors.items():
        if key.endswith(DELTA_INDEX) or key.endswith(DELTA_VALUE):
            continue
        whole[key] = tensor
    for key, index in tensors.items():
        if not key.endswith(DELTA_INDEX):
            continue
        name = key[: -len(DELTA_INDEX)]
        values = tensors.get(name + DELTA_VALUE)
        if values is None:
            raise ValueError(f"delta for {name!r} has indices but no {name + DELTA_VALUE!r}.")
        if index.is_floating_point() or index.dim() != 1 or values.dim() != 1 or index.numel() != values.numel():
            raise ValueError(f"delta for {name!r}: indices must be a 1-D integer tensor as long as the 1-D values, got "
                             f"{tuple(index.shape)} {index.dtype} and {tuple(values.shape)}.")
        sparse[name] = (index, values)
    orphans = [k for k in tensors if k.endswith(DELTA_VALUE) and k[: -len(DELTA_VALUE)] not in sparse]
    if orphans:
        raise ValueError(f"delta values without indices: {orphans[:3]}.")
    return whole, sparse


def apply_sparse(target: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> None:
    """`target`'s elements at flat `index` set to `values` (cast to its dtype), in place.

    Raises:
        ValueError: an index outside the tensor.
    """
    if index.numel() and (int(index.min()) < 0 or int(index.max()) >= target.numel()):
        raise ValueError(f"delta index out of range for a tensor of {target.numel()} elements.")
    flat = target.data.view(-1) if target.is_contiguous() else None
    if flat is None:
        raise ValueError("a sparse delta needs a contiguous target tensor.")
    flat[index.to(device=target.device, dtype=torch.long)] = values.to(device=target.device, dtype=target.dtype)


class DeltaTracker:
    """What one receiver was last sent, at its dtype, and the encoding of the next sync against it.

    Attributes:
        stats (`dict`): of the last :meth:`encode` stream: `bytes` sent, `full_bytes` a full sync would send,
            `tensors`, `skipped`, `sparse`, `whole`.
    """

    def __init__(self) -> None:
        self.last: dict[str, torch.Tensor] = {}
        self.stats: dict[str, int] = {}

    def encode(self, pairs: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None
               ) -> Iterator[tuple[str, torch.Tensor]]:
        """The wire entries of a sync of `pairs` (HF name, full tensor); `dtype`: the receiver's floating dtype
        (None: as given). The copies are updated as the stream is consumed: call :meth:`forget` if it fails."""
        stats = dict.fromkeys(("bytes", "full_bytes", "tensors", "skipped", "sparse", "whole"), 0)
        self.stats = stats
        first = None
        for name, tensor in pairs:
            new = tensor.detach()
            if dtype is not None and new.is_floating_point():
                new = new.to(dtype)
            new = new.to("cpu").contiguous()
            entries = encode_tensor(name, new, self.last.get(name))
            stats["tensors"] += 1
            stats["full_bytes"] += new.numel() * new.element_size()
            stats["bytes"] += sum(t.numel() * t.element_size() for _, t in entries)
            kind = "skipped" if not entries else "whole" if entries[0][0] == name else "sparse"
            stats[kind] += 1
            self.last[name] = new.clone() if new.data_ptr() == tensor.data_ptr() else new
            first = first or (name, new)
            yield from entries
        if first is not None and stats["skipped"] == stats["tensors"]:
            # nothing changed: one empty delta keeps the stream non-empty (the receiver still bumps its version)
            name, new = first
            yield name + DELTA_INDEX, torch.empty(0, dtype=torch.int32)
            yield name + DELTA_VALUE, torch.empty(0, dtype=new.dtype)

    def forget(self) -> None:
        """Drop every copy (a sync failed midway: the receiver's state is unknown); the next sync is full."""
        self.last.clear()
