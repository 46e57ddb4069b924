"""DeepSpeed ZeRO as one function over a model: the config, `initialize`, and gathering.

:func:`deepspeed_config` builds the DeepSpeed config of one model role from the run's
:class:`~hf_verl.parallel.backend.BackendSpec` and training knobs (a JSON config given to
`accelerate launch` is the starting point when there is one; its "auto" values are filled in).
:func:`initialize` wraps a model in a `DeepSpeedEngine`: with a client optimizer for a trained role
(a plain `torch.optim` optimizer, so no fused-Adam extension is compiled), without one for a frozen
role under ZeRO-3 (its parameters are then partitioned too, and gathered layer by layer in forward).

Under ZeRO-3 a parameter outside its module's forward is an empty placeholder; :func:`gathered`
makes a list of them whole for the duration of a `with` block (a collective: every rank enters
it, in the same order), which is how full weights are exported and saved.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from hf_verl.parallel.backend import BackendSpec

logger = logging.getLogger(__name__)


def _fill_auto(config: dict, values: dict[str, Any]) -> dict:
    out = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out[key] = _fill_auto(value, values.get(key, {}) if isinstance(values.get(key), dict) else {})
        elif value == "auto":
            if key not in values:
                raise ValueError(f"the DeepSpeed config sets {key!r} to 'auto' but hf_verl has no value for it; "
                                 "give a number in the JSON config.")
            out[key] = values[key]
        else:
            out[key] = value
    return out


def deepspeed_config(spec: BackendSpec, *, micro_batch_size: int, gradient_accumulation_steps: int,
                     max_grad_norm: float | None, bf16: bool = False, fp16: bool = False,
                     trainable: bool = True) -> dict:
    """The DeepSpeed config of one role.

    Args:
        spec (`BackendSpec`): the run's backend (ZeRO stage, offload, an optional JSON config file).
        micro_batch_size (`int`): rows per forward on one rank (`train_micro_batch_size_per_gpu`).
        gradient_accumulation_steps (`int`): micro-steps per optimizer step.
        max_grad_norm (`float`, *optional*): gradient clipping; None or 0 disables it.
        bf16 / fp16 (`bool`): mixed precision.
        trainable (`bool`): False for a frozen role (reference, reward model): no optimizer settings.
    """
    zero: dict[str, Any] = {"stage": spec.zero_stage}
    if spec.offload_optimizer and trainable:
        zero["offload_optimizer"] = {"device": "cpu"}
    if spec.offload_params and spec.zero_stage == 3:
        zero["offload_param"] = {"device": "cpu"}
    auto = {"train_micro_batch_size_per_gpu": micro_batch_size,
            "gradient_accumulation_steps": gradient_accumulation_steps,
            "gradient_clipping": float(max_grad_norm or 0.0),
            "zero_optimization": zero, "bf16": {"enabled": bf16}, "fp16": {"enabled": fp16}}
    if spec.config_file:
        with open(spec.config_file) as f:
            config = _fill_auto(json.load(f), auto)
        for key in ("optimizer", "scheduler"):
            if key in config:
                raise ValueError(
                    f"the DeepSpeed config {spec.config_file} has an {key!r} section; hf_verl gives DeepSpeed the "
                    f"trainer's own optimizer and schedule (learning_rate, lr_scheduler_type): remove {key!r}."
                )
    else:
        config = dict(auto)
    config.setdefault("steps_per_print", 2**31 - 1)
    config.setdefault("wall_clock_breakdown", False)
    if not trainable:
        config.pop("gradient_clipping", None)
    return config


def initialize(model: nn.Module, config: dict, optimizer: torch.optim.Optimizer | None = None):
    """`deepspeed.initialize` of one role; returns the `DeepSpeedEngine` (its `.module` is `model`)."""
    import deepspeed

    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def is_zero3_param(tensor: Any) -> bool:
    """Whether `tensor` is a ZeRO-3 partitioned parameter (it carries a DeepSpeed id)."""
    return hasattr(tensor, "ds_id")


@contextlib.contextmanager
def gathered(params: Iterable[torch.Tensor]) -> Iterator[None]:
    """Make the ZeRO-3 parameters among `params` whole inside the block (read-only); a no-op for
    other tensors. Collective: every rank must enter with the same parameters."""
    params = [p for p in params if is_zero3_param(p)]
    if not params:
        yield
        return
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters

    with GatheredParameters(params, modifier_rank=None):
        yield


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A whole copy of a ZeRO-3 parameter (collective), or `tensor` itself."""
    if not is_zero3_param(tensor):
        return tensor
    with gathered([tensor]):
        return tensor.data.detach().clone()
