"""Trainer side of in-place weight sync: stream an actor's full HF-named tensors in byte buckets.

A rollout engine that holds its own copy of the policy (vLLM, an HTTP server, a second
transformers model) needs the new weights after every optimizer step. :func:`iter_weight_buckets`
walks whatever the actor is and yields lists of ``(name, tensor)`` whose total size stays under a
byte budget, so that a sender can ship one bucket at a time without ever building a second full
copy of the model. Names are exactly those of the *plain* transformers model's ``state_dict()``
(``model.layers.0.self_attn.q_proj.weight``, ...), whatever wrapping the actor has:

- a plain [`~transformers.PreTrainedModel`]: the tensors are the parameters themselves (detached
  views that share storage; zero copy) unless a ``dtype`` or ``to_cpu=True`` asks for conversion;
- ``DistributedDataParallel`` / accelerate / DeepSpeed wrappers (``.module``) and
  ``torch.compile`` (``._orig_mod``) are unwrapped;
- a PEFT [`~peft.PeftModel`] with LoRA adapters: each LoRA-wrapped layer's weight is yielded
  *merged*, ``W + get_delta_weight(adapter)`` computed for that tensor only (peft's own layer API;
  DoRA and other variants through their ``merge_safe``), under the base name (``base_model.model.``
  and ``.base_layer`` stripped, ``lora_*`` parameters skipped, ``modules_to_save`` copies of the
  active adapter yielded under the original name). The model is never modified;
- FSDP2 (parameters are ``torch.distributed.tensor.DTensor``): each tensor is gathered with
  ``.full_tensor()`` on its own, right before it joins a bucket. This is a collective: every rank
  must iterate, in the same order (the order is ``state_dict()``'s, identical on all ranks);
- DeepSpeed ZeRO-3 (partitioned parameters carry a ``ds_id``): each parameter is gathered on its
  own and copied out, under the same every-rank-iterates rule. Either way at most one bucket of
  whole tensors (plus the one being gathered) exists at a time.

Tied weights: the names and their multiplicity are whatever ``state_dict()`` of the plain model
returns (in transformers 5 a tied ``lm_head.weight`` is listed next to ``embed_tokens.weight``,
both pointing at the same storage); this module does not add or drop tied keys. Non-persistent
buffers (rotary ``inv_freq``) are not in ``state_dict()`` and so are not sent.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator

import torch
from torch import nn

logger = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 256 * 2**20

_LORA_PART = re.compile(r"(^|\.)lora_[A-Za-z_]+(\.|$)")
_MODULES_TO_SAVE = re.compile(r"\.modules_to_save\.([^.]+)\.")


def unwrap_model(model: nn.Module) -> nn.Module:
    """Strip data-parallel / compile wrappers (DDP, accelerate, DeepSpeed, `torch.compile`).

    Args:
        model (`nn.Module`): The actor as the trainer holds it.

    Returns:
        `nn.Module`: The innermost model (a `PreTrainedModel` or a `PeftModel`).
    """
    while True:
        if isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = model._orig_mod
        elif isinstance(getattr(model, "module", None), nn.Module) and not hasattr(model, "config"):
            model = model.module
        else:
            return model


def _peft_base(model: nn.Module) -> nn.Module | None:
    """The injected transformers model inside a `PeftModel`, or `None` for anything else."""
    try:
        from peft import PeftModel
    except ImportError:  # peft is optional
        return None
    return model.base_model.model if isinstance(model, PeftModel) else None


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """Gather a DTensor (FSDP2 shard) or a ZeRO-3 partition into a full tensor; plain tensors pass
    through. A collective for sharded tensors."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        return tensor.full_tensor()
    if hasattr(tensor, "ds_id"):
        from hf_verl.parallel.deepspeed import full_tensor

        return full_tensor(tensor)
    return tensor


def plain_state_items(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``model.state_dict()``'s items with every sharded tensor gathered whole, one at a time (a
    collective on sharded layouts). Keys are the model's own (PEFT adapter keys included)."""
    for name, tensor in unwrap_model(model).state_dict(keep_vars=True).items():
        yield name, _full(tensor).detach()


def _active_adapters(module: nn.Module) -> list[str]:
    active = module.active_adapters if hasattr(module, "active_adapters") else module.active_adapter
    return [active] if isinstance(active, str) else list(active)


@torch.no_grad()
def _merged(layer: nn.Module, param: str, base: torch.Tensor) -> torch.Tensor:
    """``base`` with the active LoRA adapters of ``layer`` merged in, as a new tensor.

    Mirrors ``LoraLayer.merge(safe_merge=True)`` without writing anything back.
    """
    if layer.merged or getattr(layer, "disable_adapters", False):
        return _full(base)  # already merged in place by the user, or adapters switched off
    weight = base
    for adapter in _active_adapters(layer):
        known = adapter in getattr(layer, "lora_A", {}) or adapter in getattr(layer, "lora_embedding_A", {})
        if not known:
            continue
        if param == "weight":
            if adapter in getattr(layer, "lora_variant", {}):  # DoRA & co: peft returns a new tensor
                weight = layer.lora_variant[adapter].merge_safe(layer, adapter, _full(weight).clone())
            else:
                weight = _full(weight) + _full(layer.get_delta_weight(adapter)).to(weight.dtype)
        elif param == "bias" and getattr(layer, "lora_bias", {}).get(adapter, False):
            delta = _full(layer.lora_B[adapter].bias) * layer.scaling[adapter]
            weight = _full(weight) + delta.to(weight.dtype)
    return _full(weight)


def _merged_whole(layer: nn.Module, param: str, base: torch.Tensor) -> torch.Tensor:
    """:func:`_merged` with a ZeRO-3 layer's partitioned weights (base and adapters) gathered first."""
    params = list(layer.parameters())
    if not any(hasattr(p, "ds_id") for p in params):
        return _merged(layer, param, base)
    from hf_verl.parallel.deepspeed import gathered

    with gathered(params):
        return _merged(layer, param, base.data).clone()


LORA_PARTS = ("merged", "base", "adapter")
"""What a PEFT model exports: its weights with the adapters merged (default), its base weights alone (adapters
left out), or the adapters alone (under the PEFT model's own `state_dict` names, adapter name included)."""


def _weight_sources(model: nn.Module, lora: str = "merged"
                    ) -> Iterator[tuple[str, torch.Tensor, Callable[[], torch.Tensor]]]:
    """Yield ``(hf_name, reference_tensor, materialise)`` in ``state_dict()`` order.

    ``reference_tensor`` is only read for shape and dtype; ``materialise()`` returns the full
    (gathered, merged) tensor and is called lazily, one tensor at a time. ``lora``: one of :data:`LORA_PARTS`.
    """
    if lora not in LORA_PARTS:
        raise ValueError(f"lora must be one of {LORA_PARTS}, got {lora!r}.")
    model = unwrap_model(model)
    base = _peft_base(model)
    if lora != "merged" and base is None:
        raise ValueError(f"exporting the {lora} weights of LoRA adapters needs a PEFT model; "
                         f"{type(model).__name__} has no adapters.")
    if lora == "adapter":
        for key, tensor in model.state_dict(keep_vars=True).items():
            if _LORA_PART.search(key):
                yield key, tensor, lambda t=tensor: _full(t)
        return
    if base is None:
        for name, tensor in model.state_dict(keep_vars=True).items():
            yield name, tensor, lambda t=tensor: _full(t)
        return
    for key, tensor in base.state_dict(keep_vars=True).items():
        if _LORA_PART.search(key) or ".original_module." in key:
            continue  # adapter weights, and the frozen copy a `modules_to_save` wrapper keeps
        save = _MODULES_TO_SAVE.search(key)
        if save is not None:
            wrapper = base.get_submodule(key[: save.start()])
            if save.group(1) != wrapper.active_adapter:
                continue
            yield key[: save.start()] + "." + key[save.end() :], tensor, lambda t=tensor: _full(t)
            continue
        if ".base_layer." not in key:
            yield key, tensor, lambda t=tensor: _full(t)
            continue
        prefix, _, param = key.rpartition(".base_layer.")
        name = key.replace(".base_layer", "")  # every level, should wrappers be nested
        if "." in param:  # a submodule of the wrapped layer: not a LoRA-merged tensor
            yield name, tensor, lambda t=tensor: _full(t)
            continue
        if lora == "base":
            yield name, tensor, lambda t=tensor: _full(t)
            continue
        layer = base.get_submodule(prefix)
        yield name, tensor, lambda l=layer, p=param, t=tensor: _merged_whole(l, p, t)


def _nbytes(tensor: torch.Tensor, dtype: torch.dtype | None) -> int:
    numel = getattr(tensor, "ds_numel", None) or tensor.numel()  # a ZeRO-3 placeholder is empty
    return numel * (dtype or tensor.dtype).itemsize


def bucket_plan(
    model: nn.Module, bucket_bytes: int = DEFAULT_BUCKET_BYTES, dtype: torch.dtype | None = None
) -> list[int]:
    """Bytes in each bucket [`iter_weight_buckets`] would yield, without materialising any tensor.

    Args:
        model (`nn.Module`): The actor (plain, wrapped, PEFT or FSDP2-sharded).
        bucket_bytes (`int`): Byte budget per bucket.
        dtype (`torch.dtype`, *optional*): The dtype the tensors would be cast to.

    Returns:
        `list[int]`: One entry per bucket, in order.
    """
    sizes: list[int] = []
    current = 0
    for _, tensor, _ in _weight_sources(model):
        n = _nbytes(tensor, dtype)
        if current and current + n > bucket_bytes:
            sizes.append(current)
            current = 0
        current += n
    if current:
        sizes.append(current)
    return sizes


def iter_weight_buckets(
    model: nn.Module,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    dtype: torch.dtype | None = None,
    to_cpu: bool = False,
    lora: str = "merged",
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Stream the actor's full weights, HF-named, in buckets of at most ``bucket_bytes``.

    Args:
        model (`nn.Module`): The actor: a `PreTrainedModel`, its DDP / accelerate / compile wrapper,
            a `PeftModel` with LoRA adapters (yielded merged, model untouched), or an FSDP2 model.
        bucket_bytes (`int`, defaults to 256 MiB): Byte budget per bucket (after the ``dtype``
            cast). A single tensor larger than the budget is yielded alone in its own bucket.
        dtype (`torch.dtype`, *optional*): Cast every tensor to this dtype (e.g. the engine's).
        to_cpu (`bool`, defaults to `False`): Move the tensors to CPU.
        lora (`str`, defaults to `"merged"`): a PEFT model's part (:data:`LORA_PARTS`): merged weights, the base
            weights alone, or the adapters alone (adapter-only weight sync).

    Yields:
        `list[tuple[str, torch.Tensor]]`: Detached ``(name, tensor)`` pairs, names as in the plain
        model's ``state_dict()``. Without ``dtype``/``to_cpu``, unmerged plain tensors share storage
        with the parameters; do not write into them.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    bucket: list[tuple[str, torch.Tensor]] = []
    current = n_buckets = total = 0
    for name, ref, materialise in _weight_sources(model, lora):
        n = _nbytes(ref, dtype)
        if bucket and current + n > bucket_bytes:
            n_buckets, total = n_buckets + 1, total + current
            yield bucket
            bucket, current = [], 0
        tensor = materialise().detach()
        if dtype is not None:
            tensor = tensor.to(dtype)
        if to_cpu:
            tensor = tensor.to("cpu")
        bucket.append((name, tensor))
        current += n
    if bucket:
        n_buckets, total = n_buckets + 1, total + current
        yield bucket
    logger.debug("weight sync: %d buckets, %d bytes (bucket limit %d)", n_buckets, total, bucket_bytes)
