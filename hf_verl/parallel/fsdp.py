"""FSDP2 as one function over a model and a mesh, and what the engines need around it.

:func:`apply_fsdp` shards every transformer block as its own unit (the block classes are the
model's own `_no_split_modules`, which transformers declares per architecture), then the root
module, which holds what is left: embeddings, final norm and output head (tied or not, they stay in
one unit). After the root's forward FSDP2 keeps the root's parameters gathered until backward (its
default for a root), so the chunked log-prob head
(:func:`~hf_verl.algorithms.logprobs.logprobs_from_head`) can call the output-embedding module on
the final hidden states outside the model's own forward, with gradients, exactly as in an
unsharded model; reading `lm_head.weight` before any forward would see a shard. A forward without
backward (reference, old log-probs) leaves the root gathered, so the engine calls
:func:`release_root` after it.

This is the last step of :func:`hf_verl.parallel.parallelize.parallelize`, after tensor / sequence
parallelism and activation checkpointing.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)


def block_classes(model: nn.Module) -> set[type]:
    """The classes of `model`'s transformer blocks, from its `_no_split_modules` declaration.

    Raises:
        ValueError: when the model declares none (a custom model: give it `_no_split_modules`).
    """
    names = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or [])
    classes = {type(m) for m in model.modules() if type(m).__name__ in names}
    if not classes:
        raise ValueError(
            f"{type(model).__name__} declares no `_no_split_modules` (its transformer block classes), so FSDP2 "
            "cannot find the units to shard; set `model._no_split_modules = ['MyDecoderLayer']`."
        )
    return classes


def apply_fsdp(model: nn.Module, mesh, *, reshard_after_forward: bool = True, param_dtype: torch.dtype | None = None,
               reduce_dtype: torch.dtype | None = None, offload_params: bool = False) -> nn.Module:
    """Shard `model` in place with FSDP2 over `mesh` (1-D: FSDP; 2-D replicate x shard: HSDP).

    Args:
        model (`nn.Module`): a transformers model (a PEFT model works too: adapters are sharded with
            their blocks).
        mesh (`DeviceMesh`): the data-parallel mesh, from :meth:`ParallelDims.dp_mesh`.
        reshard_after_forward (`bool`): free each block's gathered parameters after its forward
            (ZeRO-3-like memory) or keep them until backward (ZeRO-2-like, less communication).
        param_dtype / reduce_dtype (`torch.dtype`, *optional*): mixed precision of compute and
            gradient reduction; default: the parameters' own dtype.
        offload_params (`bool`): keep sharded parameters and optimizer state on the CPU.

    Returns:
        `nn.Module`: the same object, now an `FSDPModule` whose parameters are `DTensor` shards.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    kwargs = {"mesh": mesh, "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)}
    if offload_params:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    classes = tuple(block_classes(model))
    blocks = [m for m in model.modules() if isinstance(m, classes)]
    for block in blocks:
        fully_shard(block, reshard_after_forward=reshard_after_forward, **kwargs)
    # the root keeps FSDP2's default (reshard_after_forward=None): it stays gathered after its forward until
    # backward, which is what lets the LM head run on the final hidden states outside the forward
    fully_shard(model, **kwargs)
    logger.info("FSDP2: %d %s blocks + root sharded over %s", len(blocks), "/".join(c.__name__ for c in classes),
                tuple(mesh.shape))
    return model


def release_root(model: nn.Module) -> None:
    """Reshard an FSDP2 root gathered by a forward that has no backward (a no-grad pass)."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        model.reshard()


def is_fsdp(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def full_state_dict(model: nn.Module, *, cpu: bool = True) -> dict[str, torch.Tensor]:
    """The unsharded state dict of an FSDP2 model (a collective: call it on every rank)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=cpu))
